"""Argument checks shared by the passes and the wire codecs: a bad argument gets a
``ValueError`` naming its owner and the expected range."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_ratio", "check_real"]


def check_real(
    pass_name: str, arg: str, value: Any, *, low: float | None = None, low_open: bool = False, high: float | None = None
) -> float:
    """``value`` as a float, or a ``ValueError`` naming the pass and the expected range."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    number = float(value) if ok else math.nan  # the value returned is the one checked
    if ok and low is not None:
        ok = number > low if low_open else number >= low
    if ok and high is not None:
        ok = number <= high
    if not ok:
        expected = ["a finite number"]
        if low is not None:
            expected.append(f"{'>' if low_open else '>='} {low:g}")
        if high is not None:
            expected.append(f"<= {high:g}")
        raise ValueError(f"{pass_name}: {arg} must be {' and '.join(expected)}, got {value!r}")
    return number


def check_ratio(pass_name: str, ratio: Any) -> float:
    return check_real(pass_name, "ratio", ratio, low=0.0, low_open=True, high=1.0)
