"""tools/newcomer_session.py: it finds the README's commands as a reader pastes them, tells the ones with
placeholders apart, and (slow: ~3 min of CLI launches) every newcomer mistake it makes exits with one clear
line while the user's directory keeps its file."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "newcomer_session.py"
spec = importlib.util.spec_from_file_location("newcomer_session", TOOL)
newcomer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(newcomer)


def test_the_readmes_commands_are_found_whole():
    commands = newcomer.readme_commands()
    assert commands[:2] == ["make demo", "make test"]
    grpo = next(c for c in commands if "smollm2_grpo_arithmetic.yaml" in c and " train " in c)
    assert grpo.endswith("data.eval_path=data/smollm2_sums/heldout.jsonl")  # continuation lines joined
    assert "\\" not in grpo and "  " not in grpo
    with_placeholders = [c for c in commands if newcomer.PLACEHOLDER.search(c)]
    assert any("HF_DIR" in c for c in with_placeholders) and any("RECIPE.yaml" in c for c in with_placeholders)
    assert not any(newcomer.PLACEHOLDER.search(c) for c in commands if "smollm2" in c and "HF_DIR" not in c
                   and "SFT_DIR" not in c)


def test_a_readme_command_with_a_placeholder_is_skipped_not_run(capsys):
    number = next(i for i, c in enumerate(newcomer.readme_commands()) if "HF_DIR" in c)
    assert newcomer.run_readme([number]) == 0
    assert "skipped (a placeholder to fill in)" in capsys.readouterr().out


@pytest.mark.slow  # ~20 launches of the CLI (~3 min on 2 cores): make test-slow
def test_every_newcomer_mistake_is_one_clear_line_and_loses_nothing(tmp_path):
    proc = subprocess.run([sys.executable, str(TOOL), "--bad-inputs", "--work", str(tmp_path)], capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "FAIL" not in proc.stdout and " cases behave" in proc.stdout, proc.stdout
