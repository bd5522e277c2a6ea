"""The GPU check (``tools/gpu_check.sh``): fixtures, the skip without CUDA, and the one table it prints.

Every test here is marked ``gpu`` and skipped where CUDA is absent, unless ``MEGARLHF_GPU_CHECK_CPU=1``
asks for a dry run of the same code paths on CPU at small sizes (what the CPU machines can check:
imports, shapes, the plumbing; not the CUDA-only measurements, which those tests skip). A test records
its figures with the ``report`` fixture; the session prints them as one table at the end and, when
``GPU_CHECK_REPORT`` names a file, writes them there as JSON.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from _gpu_common import DRY_RUN, ON_GPU

_ROWS: list[dict] = []


def pytest_collection_modifyitems(config, items):
    if ON_GPU or DRY_RUN:
        return
    skip = pytest.mark.skip(reason="needs CUDA: run tools/gpu_check.sh on a GPU machine")
    for item in items:  # the hook sees the whole session's items: only the gpu-marked ones are skipped
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def report():
    """``report(check, value, unit, note)``: one row of the final table."""
    def add(check: str, value, unit: str = "", note: str = "") -> None:
        _ROWS.append({"check": check, "value": value, "unit": unit, "note": note})
    return add


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def pytest_terminal_summary(terminalreporter):
    if not _ROWS:
        return
    device = torch.cuda.get_device_name(0) if ON_GPU else "cpu (dry run)"
    write = terminalreporter.write_line
    write("")
    write(f"megarlhf GPU check on {device}, torch {torch.__version__}")
    width = max(len(r["check"]) for r in _ROWS)
    for row in _ROWS:
        write(f"  {row['check']:<{width}}  {_fmt(row['value']):>12} {row['unit']:<10} {row['note']}")
    out = os.environ.get("GPU_CHECK_REPORT")
    if out:
        Path(out).write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": _ROWS}, indent=1))


@pytest.fixture(scope="session")
def runtime():
    """This process as a one-rank job (nccl on the GPU)."""
    from megarlhf.config.parallel import ParallelConfig
    from parallel.runtime import init_parallel

    return init_parallel(ParallelConfig(), seed=0)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from model_providers.tiny_models import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("gpu_models") / "llama", seed=0)


@pytest.fixture(scope="session")
def task(tmp_path_factory) -> Path:
    from megarlhf.data.synthetic import write_arithmetic_task

    root = tmp_path_factory.mktemp("gpu_task")
    write_arithmetic_task(root, n_train=64, n_heldout=8, seed=0, max_steps=1, instruction=None)
    return root
