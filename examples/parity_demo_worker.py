"""Rank script of examples/parity_demo.py: load each HF checkpoint at TP=N, compare with HF, export, verify."""
import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file

from model_providers.hf_checkpoint import export_hf_checkpoint, load_hf_model
from parallel.config import ParallelConfig
from parallel.runtime import init_parallel, shutdown

PROMPTS = ["The answer to 12 plus 30 is", "Reinforcement learning from verifiable rewards"]


def hf_logits(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def megatron_logits(model, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, positions, None)
    return gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]


def tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("archs", nargs="+")
    args = parser.parse_args()
    launch = init_parallel(ParallelConfig(tensor_model_parallel_size=args.tp), seed=0)
    out = Path(args.out)
    rows = []
    for arch in args.archs:
        src = out / "hf" / arch
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(src)
        ids = torch.tensor([tok(p)["input_ids"][:8] for p in PROMPTS])
        provider, model = load_hf_model(src)
        model.eval()
        diff = (megatron_logits(model, ids, provider.hf_config.vocab_size) - hf_logits(src, ids)).abs().max().item()
        exported = export_hf_checkpoint(model, provider, out / "export" / arch, source_dir=src, overwrite=True)
        original, roundtrip = tensors(src), tensors(exported)
        exact = original.keys() == roundtrip.keys() and all(torch.equal(original[k], roundtrip[k]) for k in original)
        params = sum(t.numel() for t in original.values())
        rows.append((arch, params, diff, exact))
    if launch.rank == 0:
        print(f"\nHF transformers vs Megatron-Core at TP={args.tp} ({launch.world_size} ranks, fp32):")
        print(f"{'arch':<8} {'params':>8} {'max |logit diff|':>17} {'HF->Megatron->HF bit-exact':>27}")
        for arch, params, diff, exact in rows:
            print(f"{arch:<8} {params:>8} {diff:>17.2e} {str(exact):>27}")
        if not all(r[3] and r[2] <= 1e-4 for r in rows):
            raise SystemExit("parity check FAILED")
    shutdown()


if __name__ == "__main__":
    main()
