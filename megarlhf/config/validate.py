"""The checks the settings dataclasses share: each raises ValueError naming the field (the loader adds the
key path)."""
from __future__ import annotations

import math
from typing import Any


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def positive_ints(owner: object, *names: str, where: str = "") -> None:
    """Each field ``names`` of ``owner`` is an int >= 1 (a bool is not)."""
    for name in names:
        value = getattr(owner, name)
        check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
              f"{where or type(owner).__name__}.{name} must be an int >= 1, got {value!r}")


MAX_TIMEOUT_S = 3600.0  # the longest per-call limit a config may set (threading refuses past TIMEOUT_MAX)


def check_timeout(value: Any, key: str) -> None:
    """Raises ValueError naming ``key`` unless ``value`` is a finite number of seconds in (0, MAX_TIMEOUT_S]."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0 < value <= MAX_TIMEOUT_S):
        raise ValueError(f"{key} must be a finite number in (0, {MAX_TIMEOUT_S:g}] seconds, got {value!r}")
