"""Rank script for tests/planner/test_measured.py: the trainer phase of one RL step, its memory measured.

Runs the real trainer functions (build_actor / build_frozen / build_critic, score, compute_advantages,
actor_update, critic_update) on a fake rollout batch, twice in this process:

1. with a negligible model (``BASE``): warms up the runtime (allocator, autograd, gloo, oneDNN), then
   everything is dropped; the RSS left afterwards is the *baseline*: Python + torch + Megatron runtime,
   which is not model memory and which the planner does not predict;
2. with the measured model (``MODEL``): the peak RSS of the phase (``VmHWM`` after resetting it through
   ``/proc/self/clear_refs``) minus the baseline is the measured model memory.

It also counts the activation bytes exactly: every tensor autograd saves for backward during the actor
update (``saved_tensors_hooks``), deduplicated by storage, minus parameter storages.
Run with ``MALLOC_MMAP_THRESHOLD_`` set (the test does) so that freed tensors go back to the OS and RSS
follows the live tensors.
"""
import gc
import sys

import torch

from megarlhf.config import RunConfig, load_config
from megarlhf.testing.launch import write_rank_result
from megarlhf.loops.experience import compute_advantages, score
from megarlhf.learner import ExperienceBatch, actor_update, build_actor, build_critic, build_frozen, critic_update
from parallel.runtime import init_parallel
from megarlhf.algorithms.advantages import estimator_needs

PROMPT_LEN, RESPONSE_LEN, SEQUENCES = 32, 96, 16


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _fake_batch(vocab: int, seed: int) -> tuple[ExperienceBatch, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab, (SEQUENCES, PROMPT_LEN), generator=gen).tolist()
    responses = torch.randint(1, vocab, (SEQUENCES, RESPONSE_LEN), generator=gen).tolist()
    logprobs = [[-1.0] * RESPONSE_LEN for _ in range(SEQUENCES)]
    batch = ExperienceBatch.from_sequences(prompts, responses, device=torch.device("cpu"), rollout_logprobs=logprobs,
                                           group_ids=[i // 4 for i in range(SEQUENCES)])
    return batch, torch.rand(SEQUENCES, generator=gen).tolist()


class SavedBytes:
    """Bytes of distinct storages autograd saves for backward, parameters excluded."""

    def __init__(self, model: torch.nn.Module):
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def trainer_phase(config: RunConfig, runtime, count_saved: bool = False) -> dict:
    actor = build_actor(config, runtime)
    uses_ref = config.algorithm.uses_reference
    reference = build_frozen(config, runtime, "reference") if uses_ref else None
    critic = build_critic(config, runtime) if estimator_needs(config.algorithm.estimator).critic else None
    batch, rewards = _fake_batch(actor.vocab_size, config.seed)
    batch, _ = score(batch, config, actor, reference, critic)
    batch, _ = compute_advantages(batch, rewards, config, runtime)
    saved = SavedBytes(actor.model)
    # Two updates: Adam allocates its state in the first optimizer step, after that step's backward, so
    # only from the second update on is the steady state (state + activations at once) reached.
    for update in range(2):
        hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
        with hooks if count_saved and update == 1 else _nothing():
            actor_update(actor, batch, config, on_nonfinite="abort")
        if critic is not None:
            critic_update(critic, batch, config, on_nonfinite="abort")
    del actor, reference, critic, batch
    gc.collect()
    return {"saved_activation_bytes": saved.total}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    out_dir, base_recipe, recipe, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    base = load_config(RunConfig, base_recipe, overrides)
    config = load_config(RunConfig, recipe, overrides)
    runtime = init_parallel(config.parallel, seed=config.seed)
    launch = runtime.launch
    torch.set_num_threads(1)
    trainer_phase(base, runtime)
    baseline = _rss_kib("VmRSS")
    _reset_peak()
    result = trainer_phase(config, runtime, count_saved=True)
    peak = _rss_kib("VmHWM")
    write_rank_result(out_dir, launch.rank, {"baseline_kib": baseline, "peak_kib": peak,
                                             "model_peak_bytes": (peak - baseline) * 1024, **result})


if __name__ == "__main__":
    main()
