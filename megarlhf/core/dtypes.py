"""The floating-point dtypes megarlhf trains and rolls out in: the one table every layer reads.

``float32`` and ``bfloat16``. ``float16`` is refused everywhere: training in it needs dynamic loss
scaling, which megarlhf does not implement, and its narrow exponent range overflows in RL log-ratios.
The recipe keys that name a dtype (``model.dtype``, ``rollout.dtype``) are validated against this
table; the trainer, the rollout engines, the planner and the verification gates convert through it.
The table is names and sizes, not torch objects: the config package and the reward and tool worker
processes (a fresh interpreter after every timeout) read it without importing torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2}  # name -> bytes per element


def check_dtype_name(name: str, key: str) -> None:
    """Raises a ValueError naming ``key`` unless ``name`` is a supported dtype."""
    if name not in DTYPES:
        extra = " (float16 needs loss scaling, which megarlhf does not implement)" if name == "float16" else ""
        raise ValueError(f"{key}={name!r} is not a supported dtype; supported: {', '.join(DTYPES)}{extra}")


def torch_dtype(name: str, key: str = "dtype") -> torch.dtype:
    """The torch dtype of a supported dtype name (errors name ``key``)."""
    check_dtype_name(name, key)
    import torch

    return getattr(torch, name)


def dtype_bytes(name: str) -> int:
    check_dtype_name(name, "dtype")
    return DTYPES[name]


# coarsest first: a comparison of two dtypes' results is as exact as the coarser one
_COARSENESS = ("bfloat16", "float32")


def coarser_dtype(*names: str) -> str:
    """The coarsest of the dtype names (the one whose rounding dominates a comparison)."""
    return next(name for name in _COARSENESS if name in names)
