"""Runs a Python file under ``torchrun`` on this machine and returns what it wrote.

Multi-rank tests write a small worker script, launch it with :func:`run_torchrun` (gloo, one process
per rank) and compare the JSON results the workers leave in ``out_dir``; :func:`train_with_cli` runs
``megarlhf train`` as a user does and returns what the run logged.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_torchrun(script: str | Path, nproc: int, args: list[str] | None = None,
                 timeout_s: float = 600.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Launches ``script`` on ``nproc`` local ranks; raises with the ranks' output if any rank fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--standalone", str(script), *(args or [])]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=full_env)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun {script} failed (exit {proc.returncode}):\n"
                           f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def read_rank_results(out_dir: str | Path, nproc: int) -> list[dict]:
    """Reads ``rank{r}.json`` for every rank, as written by :func:`write_rank_result`."""
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(nproc)]


def write_rank_result(out_dir: str | Path, rank: int, result: dict) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def train_with_cli(recipe: str | Path, run_dir: str | Path, overrides: list[str] | None = None,
                   nproc: int = 2) -> tuple[list[dict], list[dict]]:
    """Runs ``megarlhf train --nproc-per-node nproc recipe overrides`` (its run directory ``run_dir``); raises
    with its output if it fails. Returns the run's training samples (``samples.jsonl``) and metric records."""
    cmd = [sys.executable, "-m", "megarlhf", "train", "--nproc-per-node", str(nproc), str(recipe), *(overrides or [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"megarlhf train failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    run = Path(run_dir)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [s for s in samples if s["kind"] == "train"], metrics
