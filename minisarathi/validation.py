"""Checks of user-given numbers, with one wording for every error: the field's name, the rule, the value."""

from __future__ import annotations

import math

# a request's priority: a 32-bit int, as vLLM's and the doors' wire types (a bigger one would overflow the
# scheduler's float queue key)
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


def check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """value, if it is an int (not a bool) within [lo, hi]; else ValueError naming `name` and the rule."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = ("a positive integer" if lo == 1 else f">= {lo}") if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def check_float(name: str, value) -> float:
    """value, if it is a finite int or float (not a bool); else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value
