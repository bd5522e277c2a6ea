#!/usr/bin/env bash
# Several nodes, one rank per GPU, c10d rendezvous. Run the same line on every node:
#   NNODES=4 RDZV_HOST=node0 examples/torchrun/multi_node.sh RECIPE.yaml [key=value ...]
# Environment: NNODES (required), RDZV_HOST (a host every node reaches; required), RDZV_PORT (29400),
# RDZV_ID (the job's id, the same on every node; default megarlhf), NPROC (ranks per node; default: the
# GPUs nvidia-smi lists), COMMAND (train | sft | eval; default train), PYTHON.
# torchrun assigns node ranks at the rendezvous; megarlhf reads RANK / WORLD_SIZE / MASTER_ADDR from it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RECIPE="${1:?usage: NNODES=N RDZV_HOST=host $0 RECIPE.yaml [key=value ...]}"; shift
: "${NNODES:?set NNODES (number of nodes)}" "${RDZV_HOST:?set RDZV_HOST (rendezvous host)}"
PYTHON="${PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python)}"
if [ -z "${NPROC:-}" ]; then
  NPROC=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$NPROC" -ge 1 ] || NPROC=1
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:${RDZV_PORT:-29400}" --rdzv-id "${RDZV_ID:-megarlhf}" \
  --max-restarts 0 -m megarlhf "${COMMAND:-train}" "$RECIPE" "$@"
