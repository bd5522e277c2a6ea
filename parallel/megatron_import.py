"""Megatron-Core's import, adjusted module by module: :class:`ImportHook` loads one named module inside a
context manager; this module uses it on every device, :mod:`parallel.cpu_compat` (patch 8) on CPU.

Here: ``megatron.core.timers`` imports ``wandb`` when it is installed, to write Megatron's timers there;
megarlhf reports through its own trackers (:mod:`megarlhf.records.tracking`). That import took 0.45 s of every
rank's start-up and made two temporary directories (``tmp*wandb-media``, ``tmp*wandb-artifacts``) that a
rank killed by the launcher leaves behind. While that one module loads, ``wandb`` is unimportable
(``sys.modules["wandb"] = None``: ``import wandb`` raises ImportError, as when it is not installed, and the
module keeps ``wandb = None``); the entry is removed right after, so megarlhf's W&B tracker imports wandb as
usual. Nothing changes when wandb is already imported.

:func:`install` is called by ``parallel/__init__`` (before anything imports Megatron).
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from typing import Callable, ContextManager

TIMERS = "megatron.core.timers"


class _LoaderWithin(importlib.abc.Loader):
    """Runs the wrapped loader's ``exec_module`` inside ``within()``."""

    def __init__(self, loader, within: Callable[[], ContextManager]):
        self._loader, self._within = loader, within

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        with self._within():
            self._loader.exec_module(module)


class ImportHook(importlib.abc.MetaPathFinder):
    """Finds module ``name`` once (then leaves ``sys.meta_path``) and has it loaded inside ``within()``."""

    def __init__(self, name: str, within: Callable[[], ContextManager]):
        self.name, self.within = name, within

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderWithin(spec.loader, self.within)
        return spec

    @classmethod
    def install(cls, name: str, within: Callable[[], ContextManager]) -> None:
        """The hook for ``name``, unless that module is loaded already or has a hook."""
        if name in sys.modules or any(isinstance(f, cls) and f.name == name for f in sys.meta_path):
            return
        sys.meta_path.insert(0, cls(name, within))


@contextlib.contextmanager
def _without_wandb():
    blocked = "wandb" not in sys.modules
    if blocked:
        sys.modules["wandb"] = None
    try:
        yield
    finally:
        if blocked and sys.modules.get("wandb", False) is None:
            del sys.modules["wandb"]


def install() -> None:
    """Megatron's timers load without wandb (module docstring)."""
    ImportHook.install(TIMERS, _without_wandb)
