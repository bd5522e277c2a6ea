"""Colocate offload -> onload with the trainer's own actor (Megatron DDP + Megatron optimizer) and a
reference model. Usage: _worker_colocate_trainer.py MODEL_DIR OUT_DIR (any number of DP ranks).

For each of {distributed optimizer, plain Megatron optimizer} x {float32, bfloat16}: two identical
actors take one actor_update; one goes through ColocateScheduler.enter_rollout / exit_rollout (recording
engine and sync stand-ins), the twin does not; then both take a second actor_update. Records: the
offloaded bytes vs the sum of unique storages of the state enumerated here from Megatron's own
attributes; whether those storages were freed (size 0) during the rollout and which were resident at
sync time; bit-equality of every state tensor after the trip; whether params, main_grads and optimizer
shards still alias DDP's buffers; and the second update's metrics, params and state vs the twin's.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from megarlhf.config.model import ModelConfig
from megarlhf.config.train import OptimConfig, TrainConfig
from megarlhf.config.schema import RunConfig
from megarlhf.config.data import DataConfig
from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel

CASES = [(True, "float32"), (True, "bfloat16"), (False, "float32"), (False, "bfloat16")]


class RecordingEngine:
    def wake_up(self, tags):
        pass

    def sleep(self):
        pass


class RecordingSync:
    """Records, when the sync reads the actor, which storages are resident (size > 0)."""

    def __init__(self, groups: dict[str, list[torch.Tensor]]):
        self.groups, self.seen = groups, {}

    def sync(self):
        self.seen = {name: [t.untyped_storage().nbytes() > 0 for t in ts] for name, ts in self.groups.items()}
        return {}


def batch_for(rank: int, step: int, vocab: int):
    from megarlhf.learner import ExperienceBatch

    g = torch.Generator().manual_seed(100 * rank + step)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (6, 4, 8, 5)]
    batch = ExperienceBatch.from_sequences(prompts, responses, device=torch.device("cpu"))
    shape = batch.input_ids.shape
    return batch.replace(old_logprobs=-2.0 + 0.3 * torch.randn(shape, generator=g),
                         ref_logprobs=-2.0 + 0.3 * torch.randn(shape, generator=g),
                         advantages=torch.randn(shape, generator=g))


def state_tensors(train_model) -> dict[str, torch.Tensor]:
    """Every tensor of the actor's training state, from Megatron's attributes."""
    ddp, out = train_model.model, {}
    for n, p in ddp.module.named_parameters():
        out[f"param:{n}"], out[f"main_grad:{n}"] = p, p.main_grad
    for i, b in enumerate(ddp.buffers):
        if b.param_data is not None:
            out[f"buffer{i}.param_data"] = b.param_data
        out[f"buffer{i}.grad_data"] = b.grad_data
    for j, member in enumerate(train_model.optimizer.chained_optimizers):
        opt = member.optimizer
        for g, group in enumerate(opt.param_groups):
            for k, p in enumerate(group["params"]):
                out[f"opt{j}.{g}.{k}"] = p
                out.update({f"opt{j}.{g}.{k}.{key}": v for key, v in opt.state[p].items()})
    return out


def unique_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def inside(tensor: torch.Tensor, outer: torch.Tensor) -> bool:
    start = outer.untyped_storage().data_ptr()
    return (tensor.untyped_storage().data_ptr() == start
            and start <= tensor.data_ptr() < start + outer.untyped_storage().nbytes())


def aliasing(actor, dist_opt: bool, dtype: str) -> dict[str, bool]:
    ddp = actor.model
    buffer = ddp.buffers[0]
    params = list(ddp.module.parameters())
    found = {"main_grad_in_grad_buffer": all(inside(p.main_grad, buffer.grad_data) for p in params)}
    if dist_opt:
        found["param_in_param_buffer"] = all(inside(p, buffer.param_data) for p in params)
    opt_params = [p for g in actor.optimizer.chained_optimizers[0].optimizer.param_groups for p in g["params"]]
    if dist_opt and dtype == "float32":  # the optimizer's shards are views of the param buffer
        found["opt_param_in_param_buffer"] = all(inside(p, buffer.param_data) for p in opt_params)
    if not dist_opt and dtype == "float32":  # the optimizer steps the model's own params
        found["opt_param_is_param"] = all(any(p is q for q in params) for p in opt_params)
    if dtype == "bfloat16":  # fp32 main params: storages of their own
        model_storages = {t.untyped_storage().data_ptr() for t in [*params, buffer.grad_data]}
        found["opt_param_fp32_copy"] = all(p.dtype == torch.float32 and p.untyped_storage().data_ptr()
                                           not in model_storages for p in opt_params)
    return found


def counts(actor, reference) -> dict[str, int]:
    """Element and byte counts for the test's hand-written total of the offloaded bytes."""
    params, buffer = list(actor.model.module.parameters()), actor.model.buffers[0]
    param_data = buffer.param_data
    return {"param_elements": sum(p.numel() for p in params), "param_tensors": len(params),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "param_buffer_bytes": 0 if param_data is None else param_data.numel() * param_data.element_size(),
            "grad_buffer_bytes": buffer.grad_data.numel() * buffer.grad_data.element_size(),
            "reference_bytes": sum(p.numel() * p.element_size() for p in reference.model.parameters())}


def run_case(model_dir: str, dist_opt: bool, dtype: str, runtime) -> dict:
    from megarlhf.rollout.colocate import ColocateScheduler, OffloadedModel
    from megarlhf.learner import actor_update, build_actor, build_frozen

    config = RunConfig(model=ModelConfig(path=model_dir, dtype=dtype), data=DataConfig(train_path="unused.jsonl"),
                       optim=OptimConfig(lr=1e-3, clip_grad=1.0, use_distributed_optimizer=dist_opt),
                       train=TrainConfig(micro_batch_tokens=24, mini_batches=2))
    actor, twin = build_actor(config, runtime), build_actor(config, runtime)
    reference = build_frozen(config, runtime, "reference")
    rank = runtime.launch.rank
    vocab = actor.vocab_size
    first = [actor_update(m, batch_for(rank, 0, vocab), config) for m in (actor, twin)]
    state = state_tensors(actor)
    aliasing_before = aliasing(actor, dist_opt, dtype)
    before = {k: v.detach().clone() for k, v in state.items()}
    ref_params = list(reference.model.parameters())
    ref_before = [p.detach().clone() for p in ref_params]
    param_keys = {k for k in state if k.startswith("param:") or k.endswith("param_data")}
    sync = RecordingSync({"params": [state[k] for k in param_keys],
                          "grads": [v for k, v in state.items() if "grad" in k],
                          "opt_state": [v for k, v in state.items() if k.startswith("opt") and k.count(".") == 3],
                          "reference": ref_params})
    sched = ColocateScheduler(RecordingEngine(), sync, OffloadedModel.of(actor, skip_host_storages=False),
                              [OffloadedModel.of(reference, skip_host_storages=False)])
    enter = sched.enter_rollout()
    freed = all(t.untyped_storage().nbytes() == 0 for t in [*state.values(), *ref_params])
    exit_ = sched.exit_rollout()
    after = state_tensors(actor)
    changed = [k for k in before if not (after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]))]
    views = aliasing(actor, dist_opt, dtype)
    second = [actor_update(m, batch_for(rank, 1, vocab), config) for m in (actor, twin)]
    twin_state = state_tensors(twin)
    return {
        "first_equal": first[0] == first[1],
        "offload_bytes": enter["colocate/offload_bytes"], "onload_bytes": exit_["colocate/onload_bytes"],
        "expected_bytes": unique_bytes(state.values()) + unique_bytes(ref_params),
        "param_phase_bytes": unique_bytes(state[k] for k in param_keys),
        "freed_during_rollout": freed,
        "resident_at_sync": {k: all(v) for k, v in sync.seen.items()},
        "freed_at_sync": {k: not any(v) for k, v in sync.seen.items()},
        "same_keys": list(after) == list(before),
        "changed_by_trip": changed,
        "reference_bit_exact": all(torch.equal(a, b) for a, b in zip(ref_before, ref_params)),
        "aliasing_before": aliasing_before, "aliasing_after": views,
        "second_metrics": second[0], "second_metrics_twin": second[1],
        "second_moved_params": all(not torch.equal(v, before[k]) for k, v in state_tensors(actor).items()
                                   if k.startswith("param:")),
        "second_state_diff": [k for k, v in state_tensors(actor).items() if not torch.equal(v, twin_state[k])],
        "counts": counts(actor, reference),
    }


def main() -> None:
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    runtime = init_parallel(ParallelConfig(), seed=1234)
    result = {"world": runtime.launch.world_size}
    for dist_opt, dtype in CASES:
        result[f"{'dist' if dist_opt else 'plain'}-{dtype}"] = run_case(model_dir, dist_opt, dtype, runtime)
    write_rank_result(out_dir, dist.get_rank(), result)


if __name__ == "__main__":
    main()
