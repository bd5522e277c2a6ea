"""HF checkpoints in, TP=2 Megatron-Core, HF out: parity with transformers for every supported architecture.

For each supported architecture it makes a tiny random HF checkpoint with a locally trained tokenizer,
then launches 2 ranks with torchrun that load it straight into a tensor-parallel (TP=2) Megatron-Core
GPTModel, compare its logits with HF transformers on the same prompts, export it back to an HF
directory, and check the exported tensors are bit-identical to the originals.

    python examples/parity_demo.py [--out runs/parity]
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
WORKER = Path(__file__).with_name("parity_demo_worker.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/parity", help="where the checkpoints and exports go")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (= number of ranks)")
    args = parser.parse_args()

    from model_providers.tiny_models import make_tiny_model

    start = time.time()
    out = Path(args.out)
    for arch in ARCHS:
        make_tiny_model(arch, out / "hf" / arch, seed=0)
    print(f"made tiny {', '.join(ARCHS)} checkpoints under {out / 'hf'} ({time.time() - start:.1f} s)", flush=True)

    from parallel.runtime import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.tp),
           "--master-port", str(free_port()), str(WORKER), str(out), "--tp", str(args.tp), *ARCHS]
    # Megatron/torch deprecation warnings and transformers' progress bars would bury the result table.
    quiet = {"PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    subprocess.run(cmd, check=True, env={**os.environ, **quiet})
    print(f"demo finished in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
