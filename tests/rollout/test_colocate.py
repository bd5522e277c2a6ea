"""Colocate-and-offload: the state machine's order and illegal transitions, bit-exact offload -> onload of
params, grads and optimizer state (here on plain modules with recording stand-ins for engine and sync,
and in the torchrun layouts with the real engine and Megatron), and equal losses with and without the
round trip."""
from __future__ import annotations

import pytest
import torch

from megarlhf.rollout.colocate import ColocateScheduler, ColocateStateError, OffloadedModel, Residency


class RecordingEngine:
    def __init__(self, log):
        self.log = log

    def wake_up(self, tags):
        self.log.append(("wake", tuple(tags)))

    def sleep(self):
        self.log.append(("sleep",))


class RecordingSync:
    """Records what the actor looked like when the sync read it; can be told to fail."""

    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail

    def sync(self, model):
        self.log.append(("sync", all(p.numel() > 0 for p in model.parameters()),
                         all(p.grad is None for p in model.parameters())))
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
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item()


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
    n_params = sum(p.numel() for p in actor.parameters()) + sum(p.numel() for p in critic.parameters())
    sched = ColocateScheduler(RecordingEngine(log), RecordingSync(log), OffloadedModel("actor", actor, [opt]),
                              [OffloadedModel("critic", critic, [critic_opt])])
    metrics = sched.enter_rollout()
    # the sync saw the actor's params resident and its grads already offloaded; then the params went too
    assert log == [("wake", ("weights",)), ("sync", True, True), ("wake", ("kv_cache",))]
    assert sched.state is Residency.ENGINE_RESIDENT
    assert all(p.numel() == 0 and p.grad is None for m in (actor, critic) for p in m.parameters())
    assert all(v is None for s in opt.state.values() for v in s.values())
    # fp64 params, grads, exp_avg, exp_avg_sq, plus one fp32 Adam step per parameter tensor (4 per model)
    assert metrics["colocate/offload_bytes"] == 8 * 4 * n_params + 4 * 8
    with pytest.raises(ColocateStateError, match="cannot enter_rollout while engine_resident"):
        sched.enter_rollout()
    sched.exit_rollout()
    assert log[-1] == ("sleep",) and sched.state is Residency.TRAINER_RESIDENT
    with pytest.raises(ColocateStateError, match="cannot exit_rollout while trainer_resident"):
        sched.exit_rollout()
    assert_same(before, state_of(actor, opt))
    assert_same(critic_before, state_of(critic, critic_opt))
    after_trip = [step(actor, opt) for _ in range(2)]
    reference, ref_opt = trained(0)
    assert after_trip == [step(reference, ref_opt) for _ in range(2)]
    assert_same(state_of(reference, ref_opt), state_of(actor, opt))


def test_failed_sync_leaves_the_trainer_whole():
    log = []
    actor, opt = trained(0)
    before = state_of(actor, opt)
    sched = ColocateScheduler(RecordingEngine(log), RecordingSync(log, fail=True),
                              OffloadedModel("actor", actor, [opt]))
    with pytest.raises(RuntimeError, match="sync failed"):
        sched.enter_rollout()
    assert sched.state is Residency.TRAINER_RESIDENT and log[-1] == ("sleep",)
    assert_same(before, state_of(actor, opt))


def test_offload_twice_and_non_optimizer_are_refused():
    actor, opt = trained(0)
    model = OffloadedModel("actor", actor, [opt])
    model.offload()
    with pytest.raises(ColocateStateError, match="already offloaded"):
        model.offload()
    with pytest.raises(TypeError, match="not a torch optimizer"):
        OffloadedModel("x", actor, [object()]).offload(params=False)


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_round_trip_with_megatron_and_vllm(rollout_run, layout):
    for rank in rollout_run(layout):
        c = rank["colocate"]
        assert c["state_in_rollout"] == "engine_resident" and c["state_after"] == "trainer_resident"
        assert c["actor_params_freed"] and c["grads_freed"] and c["reference_freed"]
        assert c["rollout_tokens"] > 0 and c["enter"]["weight_sync/probe_max_abs_diff"] <= 1e-4
        assert "cannot enter_rollout while engine_resident" in c["illegal_enter"]
        assert "cannot exit_rollout while trainer_resident" in c["illegal_exit"]
        assert c["round_trip_equal"] and c["reference_equal"]
        assert c["losses_after_trip"] == c["losses_without_trip"]
        assert c["enter"]["colocate/offload_bytes"] == c["exit"]["colocate/onload_bytes"] > 0
