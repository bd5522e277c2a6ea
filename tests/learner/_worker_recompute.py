"""Rank script for tests/learner/test_recompute.py: one actor update with and without Megatron's full
activation recomputation (``train.recompute``). Usage: _worker_recompute.py MODEL_DIR OUT_DIR (one rank).

For each setting, on the same batch and initial weights: the update's metrics, the parameters after it,
and the peak bytes of tensors saved for backward that are alive at once (``saved_tensors_hooks`` packing
tracked with weak references, deduplicated by storage, parameters excluded), i.e. the activation memory
the planner predicts.
"""
import sys
import weakref

import torch

from megarlhf.config import RunConfig, load_config
from megarlhf.testing.launch import write_rank_result
from parallel.runtime import init_parallel

SETTINGS = {"none": [], "uniform1": ["train.recompute.granularity=full"],
            "uniform2": ["train.recompute.granularity=full", "train.recompute.num_layers=2"],
            "block1": ["train.recompute.granularity=full", "train.recompute.method=block"]}
SEQUENCES, PROMPT_LEN, RESPONSE_LEN = 4, 16, 48  # 4 x 64 tokens = one 256-token micro-batch


class PeakSaved:
    """Peak bytes of distinct live storages saved for backward (parameters excluded)."""

    def __init__(self, model):
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, tuple[int, list]] = {}  # storage pointer -> (bytes, weak refs to its tensors)
        self.peak = 0

    def pack(self, tensor):
        key = tensor.untyped_storage().data_ptr()
        if key not in self.skip:
            nbytes, refs = self.live.setdefault(key, (tensor.untyped_storage().nbytes(), []))
            refs.append(weakref.ref(tensor))
            self.live = {k: (n, [r for r in rs if r() is not None]) for k, (n, rs) in self.live.items()}
            self.live = {k: v for k, v in self.live.items() if v[1]}
            self.peak = max(self.peak, sum(n for n, _ in self.live.values()))
        return tensor


def batch(vocab: int, device):
    from megarlhf.learner import ExperienceBatch

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (SEQUENCES, PROMPT_LEN), generator=gen).tolist()
    responses = torch.randint(0, vocab, (SEQUENCES, RESPONSE_LEN), generator=gen).tolist()
    b = ExperienceBatch.from_sequences(prompts, responses, device=device)
    shape = b.input_ids.shape
    return b.replace(old_logprobs=-3.0 + 0.2 * torch.randn(shape, generator=gen),
                     advantages=torch.randn(shape, generator=gen))


def run(recipe: str, overrides: list[str], runtime) -> dict:
    from megarlhf.learner import actor_update, build_actor

    config = load_config(RunConfig, recipe, overrides)
    torch.manual_seed(0)
    actor = build_actor(config, runtime)
    peak = PeakSaved(actor.model)
    with torch.autograd.graph.saved_tensors_hooks(peak.pack, lambda t: t):
        metrics = actor_update(actor, batch(actor.vocab_size, runtime.device), config)
    return {"metrics": metrics, "peak_saved_bytes": peak.peak,
            "params": [p.detach().clone() for p in actor.model.parameters()],
            "recompute_config": actor.model.module.config.recompute_granularity}


def main() -> None:
    recipe, out_dir = sys.argv[1], sys.argv[2]
    runtime = init_parallel(load_config(RunConfig, recipe).parallel, seed=0)
    torch.set_num_threads(1)
    runs = {name: run(recipe, overrides, runtime) for name, overrides in SETTINGS.items()}
    reference = runs["none"]["params"]
    write_rank_result(out_dir, 0, {name: {
        "metrics": r["metrics"], "peak_saved_bytes": r["peak_saved_bytes"], "granularity": r["recompute_config"],
        "param_max_diff": max(float((a - b).abs().max()) for a, b in zip(r["params"], reference))}
        for name, r in runs.items()})


if __name__ == "__main__":
    main()
