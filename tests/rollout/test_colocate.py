"""Colocate-and-offload: the state machine's order and illegal transitions, and bit-exact offload ->
onload of storages (params, grads, optimizer state) with equal losses with and without the round trip:
on plain modules with recording stand-ins for engine and sync; with the trainer's own Megatron actor
(DDP buffers, plain / distributed optimizer, fp32 / bf16 with fp32 main params) in one torchrun launch
per world size; and in the torchrun layouts with the real engine."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megarlhf.rollout.colocate import ColocateScheduler, ColocateStateError, OffloadedModel, Residency
from megarlhf.testing.launch import read_rank_results, run_torchrun

TRAINER_WORKER = Path(__file__).with_name("_worker_colocate_trainer.py")
CASES = ["dist-float32", "dist-bfloat16", "plain-float32", "plain-bfloat16"]


def moving(name, module, optimizers=()) -> OffloadedModel:
    """An OffloadedModel that moves host storages too: the copy path, tested on CPU."""
    return OffloadedModel(name, module, list(optimizers), skip_host_storages=False)


def freed(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() == 0


class RecordingEngine:
    def __init__(self, log):
        self.log = log

    def wake_up(self, tags):
        self.log.append(("wake", tuple(tags)))

    def sleep(self):
        self.log.append(("sleep",))


class RecordingSync:
    """Records what the actor looked like when the sync read it (params resident, grads freed); can fail."""

    def __init__(self, log, model, fail=False):
        self.log, self.model, self.fail = log, model, fail

    def sync(self):
        model = self.model
        self.log.append(("sync", not any(freed(p) for p in model.parameters()),
                         all(freed(p.grad) for p in model.parameters())))
        if self.fail:
            raise RuntimeError("sync failed")
        return {"time/weight_sync_s": 0.0}


def trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt)
    return model, opt


def step(model, opt) -> float:
    x = torch.linspace(-1, 1, 24, dtype=torch.float64).view(3, 8)
    opt.zero_grad(set_to_none=False)  # keep the grad tensors: the trip must preserve them in place
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item()


def live(model, opt):
    return list(model.parameters()) + [p.grad for p in model.parameters()] + [
        v for s in opt.state.values() for v in s.values()]


def state_of(model, opt):
    return ([p.detach().clone() for p in model.parameters()], [p.grad.clone() for p in model.parameters()],
            [{k: v.clone() for k, v in s.items()} for s in opt.state.values()])


def assert_same(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert x.dtype == y.dtype and torch.equal(x, y)
    for s, t in zip(a[2], b[2]):
        assert s.keys() == t.keys() and all(torch.equal(s[k], t[k]) for k in s)


def test_round_trip_is_bit_exact_and_order_is_explicit():
    log = []
    actor, opt = trained(0)
    critic, critic_opt = trained(1)
    before, critic_before = state_of(actor, opt), state_of(critic, critic_opt)
    tensors = live(actor, opt) + live(critic, critic_opt)
    shapes = [t.shape for t in tensors]
    n_params = sum(p.numel() for p in actor.parameters()) + sum(p.numel() for p in critic.parameters())
    sched = ColocateScheduler(RecordingEngine(log), RecordingSync(log, actor), moving("actor", actor, [opt]),
                              [moving("critic", critic, [critic_opt])])
    metrics = sched.enter_rollout()
    # the sync saw the actor's params resident and its grads already offloaded; then the params went too
    assert log == [("wake", ("weights",)), ("sync", True, True), ("wake", ("kv_cache",))]
    assert sched.state is Residency.ENGINE_RESIDENT
    # every storage is freed; the tensors (and their shapes) stay the same objects
    assert all(freed(t) for t in tensors) and [t.shape for t in tensors] == shapes
    # fp64 params, grads, exp_avg, exp_avg_sq, plus one fp32 Adam step per parameter tensor (4 per model)
    assert metrics["colocate/offload_bytes"] == 8 * 4 * n_params + 4 * 8
    with pytest.raises(ColocateStateError, match="cannot enter_rollout while engine_resident"):
        sched.enter_rollout()
    assert sched.exit_rollout()["colocate/onload_bytes"] == metrics["colocate/offload_bytes"]
    assert log[-1] == ("sleep",) and sched.state is Residency.TRAINER_RESIDENT
    with pytest.raises(ColocateStateError, match="cannot exit_rollout while trainer_resident"):
        sched.exit_rollout()
    assert_same(before, state_of(actor, opt))
    assert_same(critic_before, state_of(critic, critic_opt))
    after_trip = [step(actor, opt) for _ in range(2)]
    reference, ref_opt = trained(0)
    assert after_trip == [step(reference, ref_opt) for _ in range(2)]
    assert_same(state_of(reference, ref_opt), state_of(actor, opt))


def test_views_share_one_storage_and_stay_views():
    # a DDP-like layout: params and grads are views of two flat buffers, the optimizer holds the params
    flat, grad_flat = torch.arange(12, dtype=torch.float32), torch.linspace(0, 1, 12)
    module = torch.nn.Module()
    module.a, module.b = torch.nn.Parameter(flat[:8].view(2, 4)), torch.nn.Parameter(flat[8:])
    module.a.grad, module.b.grad = grad_flat[:8].view(2, 4), grad_flat[8:]
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    opt.step()
    before = [t.clone() for t in (flat, grad_flat, opt.state[module.a]["momentum_buffer"])]
    model = moving("m", module, [opt])
    assert model.offload(params=False) == 12 * 4 + 8 * 4 + 4 * 4  # grad buffer + two momentum buffers
    assert not freed(flat) and freed(grad_flat) and freed(module.b.grad)
    assert model.offload(params=True, rest=False) == 12 * 4  # one storage behind both params
    assert freed(flat) and freed(module.a)
    assert model.onload() == 12 * 4 + 8 * 4 + 4 * 4 + 12 * 4
    assert module.a.data_ptr() == flat.data_ptr() and module.b.grad.data_ptr() == grad_flat.data_ptr() + 32
    assert all(torch.equal(x, y) for x, y in zip(before, (flat, grad_flat, opt.state[module.a]["momentum_buffer"])))
    flat.add_(1.0)  # still one storage: the params see a write to the buffer
    assert torch.equal(module.b, before[0][8:] + 1.0)


def test_failed_sync_leaves_the_trainer_whole():
    log = []
    actor, opt = trained(0)
    before = state_of(actor, opt)
    sched = ColocateScheduler(RecordingEngine(log), RecordingSync(log, actor, fail=True),
                              moving("actor", actor, [opt]))
    with pytest.raises(RuntimeError, match="sync failed"):
        sched.enter_rollout()
    assert sched.state is Residency.TRAINER_RESIDENT and log[-1] == ("sleep",)
    assert_same(before, state_of(actor, opt))


def test_offload_twice_non_optimizer_and_fixed_storage_are_refused():
    actor, opt = trained(0)
    model = moving("actor", actor, [opt])
    model.offload(params=False)
    with pytest.raises(ColocateStateError, match="state of actor are already offloaded"):
        model.offload(params=False)
    model.offload(params=True, rest=False)
    with pytest.raises(ColocateStateError, match="params of actor are already offloaded"):
        model.offload()
    model.onload()
    with pytest.raises(TypeError, match="not a torch optimizer"):
        moving("x", actor, [object()]).offload(params=False)
    borrowed = torch.nn.Linear(2, 2)
    borrowed.weight.data = torch.from_numpy(np.ones((2, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="storage.*of borrowed cannot be resized"):
        moving("borrowed", borrowed).offload()
    assert not freed(borrowed.bias)  # refused before anything was freed


def test_host_resident_state_is_left_in_place():
    """By default offload skips storages already in host memory (on CPU it would copy host to host and
    free nothing); the state machine and its checks run all the same."""
    log = []
    actor, opt = trained(0)
    before = state_of(actor, opt)
    sched = ColocateScheduler(RecordingEngine(log), RecordingSync(log, actor), OffloadedModel("actor", actor, [opt]))
    metrics = sched.enter_rollout()
    assert metrics["colocate/offload_bytes"] == 0 and not any(freed(t) for t in live(actor, opt))
    assert log == [("wake", ("weights",)), ("sync", True, False), ("wake", ("kv_cache",))]
    with pytest.raises(ColocateStateError, match="cannot enter_rollout while engine_resident"):
        sched.enter_rollout()
    with pytest.raises(ColocateStateError, match="params of actor are already offloaded"):
        sched.actor.offload()
    assert sched.exit_rollout()["colocate/onload_bytes"] == 0
    assert_same(before, state_of(actor, opt))


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    from model_providers.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("colocate_trainer")
    model_dir = make_tiny_model("llama", root / "llama", seed=0)
    results = {}
    for nproc in (1, 2):
        out = root / f"out{nproc}"
        out.mkdir()
        run_torchrun(TRAINER_WORKER, nproc, [str(model_dir), str(out)], timeout_s=600)
        results[nproc] = read_rank_results(out, nproc)
    return results


def hand_bytes(case: str, c: dict) -> int:
    """The state a world-size-1 actor offloads, by hand: param storage(s), the fp32 grad buffer, fp32 main
    params for bf16, Adam's exp_avg and exp_avg_sq (fp32), one fp32 step per tensor; plus the reference."""
    params = c["param_buffer_bytes"] if case.startswith("dist") else c["param_bytes"]
    main = 4 * c["param_elements"] if case.endswith("bfloat16") else 0
    return (params + c["grad_buffer_bytes"] + main + 8 * c["param_elements"] + 4 * c["param_tensors"]
            + c["reference_bytes"])


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_round_trip_with_the_trainers_megatron_actor(trainer_runs, nproc, case):
    for rank in trainer_runs[nproc]:
        assert rank["world"] == nproc
        r = rank[case]
        assert r["first_equal"]  # the twin is a valid reference
        assert r["offload_bytes"] == r["onload_bytes"] == r["expected_bytes"] > r["param_phase_bytes"] > 0
        if nproc == 1:
            assert r["expected_bytes"] == hand_bytes(case, r["counts"])
        assert r["freed_during_rollout"]
        # at sync time the params were resident; grads, optimizer state and the reference were freed
        assert r["resident_at_sync"]["params"]
        assert r["freed_at_sync"] == {"params": False, "grads": True, "opt_state": True, "reference": True}
        assert r["same_keys"] and r["changed_by_trip"] == [] and r["reference_bit_exact"]
        assert r["aliasing_after"] == r["aliasing_before"] and all(r["aliasing_before"].values())
        assert len(r["aliasing_before"]) >= 2
        assert r["second_moved_params"]
        assert r["second_metrics"] == r["second_metrics_twin"] and r["second_state_diff"] == []


@pytest.mark.slow  # ~40 s per layout; the RL driver tests run colocated vLLM engines by default
@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_round_trip_with_megatron_and_vllm(rollout_run, layout):
    for rank in rollout_run(layout):
        c = rank["colocate"]
        assert c["state_in_rollout"] == "engine_resident" and c["state_after"] == "trainer_resident"
        assert c["rollout_tokens"] > 0 and c["enter"]["weight_sync/probe_max_abs_diff"] <= 1e-4
        assert "cannot enter_rollout while engine_resident" in c["illegal_enter"]
        assert "cannot exit_rollout while trainer_resident" in c["illegal_exit"]
        assert c["actor_params_freed"] and c["grads_freed"] and c["reference_freed"]
        assert c["round_trip_equal"] and c["reference_equal"]
        assert c["losses_after_trip"] == c["losses_without_trip"]
        assert c["enter"]["colocate/offload_bytes"] == c["exit"]["colocate/onload_bytes"] > 0
