"""The run directory's record of how its model was trained: ``config.yaml``, written once.

:func:`record_run_config` is called when a run has started successfully (its models built and its
checkpoint, if any, loaded), so a command that fails before that (a misspelt data path, a refused resume)
leaves the record as it was. The first successful start writes ``config.yaml``; a later start with the same
config as the latest start's writes nothing; one with a different config (a resume with another learning
rate, a longer schedule) keeps the records and writes its own as ``config.step-N.yaml`` (N: the step it
starts from), and the difference from the latest start's is returned for the log. Every record is
redacted (:mod:`megarlhf.config.redact`) and gets the modes the umask gives.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from megarlhf.config.loader import save_yaml, to_dict
from megarlhf.config.redact import redact

RECORD = "config.yaml"
MAX_CHANGES_SHOWN = 6


def flat_items(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"optim.lr": 1e-5, ...}`` from nested dicts (lists are values)."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree} if prefix else {}
    flat = {}
    for key, value in tree.items():
        flat.update(flat_items(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def config_changes(before: Any, after: Any) -> list[str]:
    """``["optim.lr: 0.0003 -> 0.0001", ...]`` between two plain-data configs, sorted by key."""
    old, new = flat_items(before), flat_items(after)
    missing = object()
    return [f"{key}: {json.dumps(old.get(key, missing)) if key in old else '(absent)'} -> "
            f"{json.dumps(new[key]) if key in new else '(absent)'}"
            for key in sorted(old.keys() | new.keys()) if old.get(key, missing) != new.get(key, missing)]


def _read_record(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None  # unreadable: it differs from anything, and stays as it is


def newest_record(run_dir: Path) -> Path | None:
    """The config of a run directory's latest start: the ``config.step-N[.k].yaml`` of the largest N (and k),
    else ``config.yaml``; None when it has neither."""
    def order(path: Path) -> tuple[int, int]:
        parts = path.name.removeprefix("config.step-").removesuffix(".yaml").split(".")
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 1

    later = [p for p in run_dir.glob("config.step-*.yaml") if re.fullmatch(r"config\.step-\d+(\.\d+)?\.yaml", p.name)]
    if later:
        return max(later, key=order)
    record = run_dir / RECORD
    return record if record.is_file() else None


def record_run_config(config: Any, run_dir: Path, first_step: int) -> str | None:
    """Writes the run's record (see the module docstring); returns a line for the log when this start's
    config differs from ``config.yaml`` (None otherwise)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tree = redact(to_dict(config))
    record = run_dir / RECORD
    if not record.exists():
        save_yaml(tree, record)
        return None
    latest = newest_record(run_dir)  # the previous start's config
    recorded = _read_record(latest)
    if redact(recorded) == tree:
        return None
    path, n = run_dir / f"config.step-{first_step}.yaml", 1
    while path.exists() and redact(_read_record(path)) != tree:
        n += 1
        path = run_dir / f"config.step-{first_step}.{n}.yaml"
    if not path.exists():
        save_yaml(tree, path)
    changes = config_changes(recorded, tree)
    shown = "; ".join(changes[:MAX_CHANGES_SHOWN]) + (f"; and {len(changes) - MAX_CHANGES_SHOWN} more"
                                                     if len(changes) > MAX_CHANGES_SHOWN else "")
    return (f"this start's config differs from {latest} (kept as it was); it is in {path.name}. "
            f"Changed: {shown or 'unreadable record'}")
