"""Named registries: advantage estimators, policy losses, KL estimators, rewards, model providers.

Every registry maps a name to an entry with one call signature (stated by the registry's owner); the
registry itself only stores, lists and looks up, and an unknown name is an error listing the known ones.
Where users may bring their own entry (reward functions, environments) it is named by a dotted path
``pkg.module:name`` instead: :func:`is_dotted_path` and :func:`load_object`.
"""
from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Generic, Iterator, TypeVar

from megarlhf.core.errors import ConfigError

_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*([:.][A-Za-z_][\w]*)$")

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> entry table. Use :meth:`register` as a decorator; :meth:`get` raises on unknown names."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise KeyError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def check_name(self, name: str, key: str, dotted_path: bool = False) -> None:
        """Raises a ConfigError naming the config ``key`` unless ``name`` is registered (or, with
        ``dotted_path``, names user code as ``pkg.module:name``)."""
        if name in self._entries or (dotted_path and is_dotted_path(name)):
            return
        known = ", ".join(sorted(self._entries)) or "(none)"
        raise ConfigError(f"{key}: unknown {self.kind} {name!r}; known: {known}"
                          + (", or a dotted path 'pkg.module:name'" if dotted_path else ""))

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def is_dotted_path(name: str) -> bool:
    """True for ``pkg.mod:obj`` or ``pkg.mod.obj`` (at least one separator), the forms users name code by."""
    return ("." in name or ":" in name) and bool(_DOTTED.match(name))


def load_object(path: str, what: str) -> Any:
    """Imports ``pkg.mod:obj`` or ``pkg.mod.obj``; errors name ``what``, the path and what failed."""
    if not is_dotted_path(path):
        raise ConfigError(f"{what} path {path!r} must look like 'pkg.module:name' or 'pkg.module.name'")
    module_name, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is reported with the path
        raise ConfigError(f"{what} {path!r}: cannot import module {module_name!r}: "
                          f"{type(exc).__name__}: {exc}") from exc
    if not hasattr(module, attr):
        raise ConfigError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)
