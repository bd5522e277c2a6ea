"""Edits of Megatron module-spec trees (``ModuleSpec`` / ``...Submodules`` dataclasses, lists of them): the one
walk that the spec swaps of :mod:`parallel.context_parallel` and :mod:`parallel.sequence_parallel` share."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

# (field name, value) -> the value's replacement, or None to keep it (and look inside it)
Replacer = Callable[[str, Any], Any]


def replace_in_spec(node: Any, replace: Replacer, field: str = "") -> tuple[Any, int]:
    """A copy of the spec tree ``node`` with every field value ``replace`` gives a replacement for replaced;
    and the number of replacements. Unchanged subtrees are shared, not copied."""
    new = replace(field, node)
    if new is not None:
        return new, 1
    if isinstance(node, (list, tuple)):
        swapped = [replace_in_spec(item, replace, field) for item in node]
        return type(node)(item for item, _ in swapped), sum(n for _, n in swapped)
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return node, 0
    changes, count = {}, 0
    for f in dataclasses.fields(node):
        value, n = replace_in_spec(getattr(node, f.name), replace, f.name)
        if n:
            changes[f.name], count = value, count + n
    return (dataclasses.replace(node, **changes) if changes else node), count
