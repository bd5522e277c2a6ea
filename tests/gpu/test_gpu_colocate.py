"""GPU check: colocate offload -> onload of the trainer's actor (bf16, distributed optimizer) to pinned
host memory: bit-exact round trip, and the device memory the training state held is freed meanwhile."""
import pytest
import torch

from _gpu_common import ON_GPU, run_config


def _state(actor) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in actor.model.parameters()]
    tensors += [p.main_grad.clone() for p in actor.model.parameters()]
    for member in actor.optimizer.chained_optimizers:
        for state in member.optimizer.state.values():
            tensors += [v.clone() for v in state.values() if torch.is_tensor(v)]
    return tensors


@pytest.mark.gpu
def test_offload_to_pinned_memory_round_trip(runtime, tiny_llama, report):
    from megarlhf.rollout.colocate import OffloadedModel
    from megarlhf.learner import ExperienceBatch, actor_update, build_actor

    config = run_config(tiny_llama, "bfloat16", "optim.use_distributed_optimizer=true")
    actor = build_actor(config, runtime)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, actor.vocab_size, (8,), generator=gen).tolist() for _ in range(4)]
    responses = [torch.randint(0, actor.vocab_size, (24,), generator=gen).tolist() for _ in range(4)]
    batch = ExperienceBatch.from_sequences(prompts, responses, device=runtime.device)
    shape = batch.input_ids.shape
    batch = batch.replace(old_logprobs=torch.full(shape, -5.0, device=runtime.device),
                          advantages=torch.randn(shape, generator=gen).to(runtime.device))
    actor_update(actor, batch, config)  # creates grads and Adam state
    before = _state(actor)
    allocated = torch.cuda.memory_allocated() if ON_GPU else 0
    offloaded = OffloadedModel.of(actor)
    moved = offloaded.offload()
    during = torch.cuda.memory_allocated() if ON_GPU else 0
    pinned = all(phase.buffer.is_pinned() for phase in offloaded.phases) if ON_GPU else True
    offloaded.onload()
    after = _state(actor)
    exact = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    report("colocate offload: bytes moved", moved / 2**20, "MiB", f"pinned host buffer: {pinned}")
    report("colocate offload: device memory", f"{allocated / 2**20:.1f}->{during / 2**20:.1f}", "MiB",
           f"round trip bit-exact: {exact}")
    assert exact and pinned
    if ON_GPU:  # what is left is activations' caches and the rotary tables, not training state
        assert moved > 0 and during <= allocated - 0.95 * moved
