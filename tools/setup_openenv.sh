#!/usr/bin/env bash
# Creates .venv-openenv, the environment OpenEnv servers run from (examples/openenv, tests/envs/test_openenv.py),
# idempotently. OpenEnv does not install into .venv: it needs httpx >= 0.28.1 and nemo_run's leptonai pins
# httpx 0.27.2. megarlhf itself never imports openenv; it talks to the servers over their WebSocket protocol.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${OPENENV_VENV:-.venv-openenv}
STAMP="$VENV/.megarlhf-installed"
LOCK=requirements/openenv-lock.txt
LOCK_HASH=$(cat tools/setup_openenv.sh "$LOCK" | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$LOCK_HASH" ]; then
  exit 0
fi
PY=${PYTHON:-python3.11}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -U pip==25.3
"$VENV/bin/python" -m pip install -q --no-deps -r "$LOCK"
echo "$LOCK_HASH" > "$STAMP"
