#!/usr/bin/env bash
# One node, one rank per GPU (torchrun's standalone rendezvous on localhost).
#   examples/torchrun/single_node.sh RECIPE.yaml [key=value ...]
# Environment: NPROC (ranks; default: the GPUs nvidia-smi lists, else 1), COMMAND (train | sft | eval;
# default train), PYTHON (default: .venv/bin/python of this checkout if present, else python).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RECIPE="${1:?usage: $0 RECIPE.yaml [key=value ...]}"; shift
PYTHON="${PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python)}"
if [ -z "${NPROC:-}" ]; then
  NPROC=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$NPROC" -ge 1 ] || NPROC=1
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PYTHON" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$NPROC" \
  -m megarlhf "${COMMAND:-train}" "$RECIPE" "$@"
