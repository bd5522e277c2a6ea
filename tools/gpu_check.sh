#!/usr/bin/env bash
# The GPU check: megarlhf's CUDA paths on one GPU, one table of figures at the end.
#
# Runs tests/gpu (marker `gpu`): HF <-> Megatron parity in fp32 and bf16; SFT steps; GRPO and PPO steps
# through the real driver with the transformers rollout engine (vLLM is not needed); mixture-of-experts
# parity, a bf16 MoE SFT step with router losses and MoE GRPO steps (EP 1: one GPU); colocate offload
# to pinned memory; the Triton log-prob kernel vs the torch op in bf16; the planner vs
# torch.cuda.max_memory_allocated; train-step TFLOP/s and MFU; a checkpoint written in the background
# (checkpoint.async_save) from device tensors holds the weights of the moment of the save.
#
# The GPU machine this targets has Python 3.12, torch and Triton but no megatron-core and no network.
# What it lacks travels as wheels in .whl/ beside the repo (ignored by git). Prepare that folder on a
# machine with a package index (the device tool carries it with `carry: [".whl"]`):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl megatron-core==0.19.2
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl math-verify==0.9.0 \
#       latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
#
# (`bash tools/gpu_check.sh --prepare` runs exactly that.) Then, on the GPU machine:
#   bash tools/gpu_check.sh            # installs .whl/*.whl into a private target dir, runs the check
# Extra arguments go to pytest. GPU_CHECK_REPORT=file.json also writes the table as JSON.
# MEGARLHF_GPU_CHECK_CPU=1 runs the same code paths on CPU at small sizes (a dry run of the check).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
PY=${PYTHON:-python3}
if [ "${1:-}" = "--prepare" ]; then
  mkdir -p "$WHEELS"
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$WHEELS" megatron-core==0.19.2
  $PY -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" math-verify==0.9.0 \
      latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
  ls -la "$WHEELS"
  exit 0
fi
if ! $PY -c "import megatron.core" 2>/dev/null; then
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "gpu_check: megatron-core is not importable and $WHEELS/ holds no wheels; run 'bash tools/gpu_check.sh --prepare' where a package index is reachable" >&2; exit 2; }
  SITE=${GPU_CHECK_SITE:-/tmp/megarlhf-gpu-site}
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
$PY - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}",
      f"({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "")
PY
exec $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rs "$@"
