"""Script for tests/rollout/test_moe_engines.py: one engine backend on the three tiny MoE models.
Usage: _moe_engine_check.py BACKEND MODELS_DIR SCRATCH MODEL... -> prints one JSON line per model (a directory
of MODELS_DIR).

For each model: greedy tokens vs transformers' generate; then an in-place load of perturbed weights (named
as the checkpoint names them), after which the engine's parameter fingerprints must equal the weight sync's
prediction from the tensors sent and the engine's placement, and its prompt log-probs transformers' on the
perturbed checkpoint."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from megarlhf.config.rollout import RolloutConfig
from megarlhf.rollout.engines.sampling import SamplingConfig
from megarlhf.rollout.engines import EngineConfig, build_engine
from megarlhf.rollout.sync.weights import ExpectedFingerprints, compare_fingerprints
from model_providers import get_provider

PROMPTS = [[(7 * i + 13 * j) % 380 + 3 for j in range(9 + 3 * i)] for i in range(3)]


def hf_logprobs(model, sequences):
    out = []
    for s in sequences:
        logp = model(input_ids=torch.tensor([s])).logits[0].log_softmax(-1)
        out.append(logp[:-1].gather(-1, torch.tensor(s[1:])[:, None]).squeeze(-1))
    return out


@torch.no_grad()
def check(backend: str, source: Path, scratch: Path) -> dict:
    config = EngineConfig.from_rollout(RolloutConfig(kv_cache_mb=64, max_new_tokens=12, backend=backend),
                                       model_dtype="float32", seed=0, max_prompt_length=96)
    engine = build_engine(str(source), config, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    greedy = engine.generate(PROMPTS, SamplingConfig(n=1, temperature=0.0, max_new_tokens=10, seed=1, ignore_eos=True))
    reference = [hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, len(p):].tolist()
                 for p in PROMPTS]
    tensors = load_file(str(source / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()}
    shapes = get_provider(source).hf_tensor_shapes()
    expected = ExpectedFingerprints(engine.placement(shapes), torch.float32)
    for name, tensor in perturbed.items():
        expected.add(name, tensor)
    report = engine.load_weights(iter(perturbed.items()))
    target = scratch / source.name
    shutil.copytree(source, target)
    save_file(perturbed, str(target / "model.safetensors"))
    reloaded = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    gaps = [float((a - torch.tensor(b)).abs().max()) for a, b in zip(hf_logprobs(reloaded, PROMPTS),
                                                                        engine.prompt_logprobs(PROMPTS))]
    return {"greedy_equal": [list(r) for r in greedy.response_ids] == reference,
            "fingerprint_problems": compare_fingerprints(expected.result(), report),
            # expert tensors the engine keeps stacked: placed inside another parameter, or reported on their
            # own as the engine's slice of one (vLLM, whose kernel pads and prepacks the stack)
            "experts_placed": sum(".experts." in n and (place[0] != n or n in report["processed"])
                                  for n, place in engine.placement(shapes).items()),
            "logprob_gap_after_load": max(gaps)}


def main() -> None:
    backend, models, scratch = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    for name in sys.argv[4:]:
        print(json.dumps({"arch": name, **check(backend, models / name, scratch)}), flush=True)


if __name__ == "__main__":
    main()
