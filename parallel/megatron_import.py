"""Megatron-Core's import without an integration megarlhf does not use (on every device).

``megatron.core.timers`` imports ``wandb`` when it is installed, to write Megatron's timers there; megarlhf
reports through its own trackers (:mod:`megarlhf.records.tracking`). That import took 0.45 s of every
rank's start-up and made two temporary directories (``tmp*wandb-media``, ``tmp*wandb-artifacts``) that a
rank killed by the launcher leaves behind. While that one module loads, ``wandb`` is unimportable
(``sys.modules["wandb"] = None``: ``import wandb`` raises ImportError, as when it is not installed, and the
module keeps ``wandb = None``); the entry is removed right after, so megarlhf's W&B tracker imports wandb as
usual. Nothing changes when wandb is already imported.

:func:`install` is called by ``parallel/__init__`` (before anything imports Megatron).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TIMERS = "megatron.core.timers"


class _WithoutWandb(importlib.abc.Loader):
    """Runs the wrapped loader with ``wandb`` unimportable (when it is not imported already)."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        blocked = "wandb" not in sys.modules
        if blocked:
            sys.modules["wandb"] = None
        try:
            self._loader.exec_module(module)
        finally:
            if blocked and sys.modules.get("wandb", False) is None:
                del sys.modules["wandb"]


class _TimersFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.timers`` once, with :class:`_WithoutWandb` as its loader."""

    def find_spec(self, name, path=None, target=None):
        if name != TIMERS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _WithoutWandb(spec.loader)
        return spec


def install() -> None:
    """The finder above, unless Megatron's timers are loaded already or it is installed."""
    if TIMERS in sys.modules or any(isinstance(finder, _TimersFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _TimersFinder())
