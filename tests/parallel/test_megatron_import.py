"""parallel.megatron_import: importing Megatron-Core (through megarlhf's packages) does not import wandb, which
its timers module did (0.45 s of every rank's start-up, two temporary directories); wandb still imports after."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_megatron_loads_without_wandb_and_wandb_still_imports():
    script = textwrap.dedent("""
        import json, sys
        import parallel  # noqa: F401 - installs the import hooks, as megarlhf's packages do
        import megatron.core, megatron.core.timers as timers
        after_megatron = "wandb" in sys.modules
        import wandb
        print(json.dumps({"after_megatron": after_megatron, "timers_wandb": timers.wandb is None,
                          "wandb_imported": hasattr(wandb, "init")}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"after_megatron": False, "timers_wandb": True, "wandb_imported": True}
