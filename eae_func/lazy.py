"""Numbers the device computes and the host reads later.

A pass's measurements (a norm, a scale, a count) and a CUDA stage's seconds are tensors or
event pairs on the device; turning one into a Python number waits for the device (on a GPU,
``.item()`` stalls the stream). ``Lazy`` holds such a value unread: it is read once, when it
is used as a number (``float``, ``int``, ``bool``, a comparison, arithmetic with a number,
formatting, ``repr``). A sum of ``Lazy`` values stays lazy, so counters can add them up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Lazy", "Ratio", "event_seconds"]


class Lazy:
    """A number ``read()`` returns, called at most once, when first needed."""

    __slots__ = ("_read", "_value")

    def __init__(self, read: Callable[[], Any]):
        self._read, self._value = read, None

    @staticmethod
    def of(t: torch.Tensor) -> Lazy:
        """The value of a one-element tensor (a bool tensor reads as a bool)."""
        return Lazy((t.detach() if t.requires_grad else t).item)

    @staticmethod
    def each(t: torch.Tensor) -> list[Any]:
        """One ``Lazy`` per entry of a 1-dim tensor, all read by one transfer."""
        t, values = t.detach(), []

        def read_all() -> list[Any]:
            if not values:
                values.extend(t.tolist())
            return values

        return [Lazy(lambda j=j: read_all()[j]) for j in range(t.numel())]

    @property
    def value(self) -> Any:
        if self._read is not None:
            self._value, self._read = self._read(), None
        return self._value

    def __float__(self) -> float:
        return float(self.value)

    def __int__(self) -> int:
        return int(self.value)

    def __bool__(self) -> bool:
        return bool(self.value)

    def __index__(self) -> int:
        return int(self.value)

    def __add__(self, other: Any) -> Any:
        if isinstance(other, Lazy):
            return Lazy(lambda: self.value + other.value)
        if isinstance(other, (int, float)) and not isinstance(other, bool) and other == 0:
            return self
        return self.value + other

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        return self.value - _number(other)

    def __rsub__(self, other: Any) -> Any:
        return _number(other) - self.value

    def __mul__(self, other: Any) -> Any:
        return self.value * _number(other)

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> Any:
        return self.value / _number(other)

    def __rtruediv__(self, other: Any) -> Any:
        return _number(other) / self.value

    def __neg__(self) -> Any:
        return -self.value

    def __abs__(self) -> Any:
        return abs(self.value)

    def __lt__(self, other: Any) -> bool:
        return self.value < _number(other)

    def __le__(self, other: Any) -> bool:
        return self.value <= _number(other)

    def __gt__(self, other: Any) -> bool:
        return self.value > _number(other)

    def __ge__(self, other: Any) -> bool:
        return self.value >= _number(other)

    def __eq__(self, other: Any) -> bool:
        return self.value == _number(other)

    def __hash__(self) -> int:
        return hash(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)

    def __reduce__(self):
        return known, (self.value,)  # pickled as the number it reads


class Ratio(Lazy):
    """``(num / den) ** power`` (NaN where ``den`` is 0), read when used; ``num`` and ``den`` are
    one-element tensors or numbers. Adding two ratios of the same power pools them into
    ``(num + num') / (den + den')``, so a ratio summed over microbatches is that of the pooled sums."""

    __slots__ = ("num", "den", "power")

    def __init__(self, num: Any, den: Any, power: float = 1.0):
        super().__init__(self._ratio)
        self.num, self.den, self.power = num, den, power

    def _ratio(self) -> float:
        num, den = float(self.num), float(self.den)
        if not den:
            return math.nan
        return num / den if self.power == 1 else max(num / den, 0.0) ** self.power

    def __add__(self, other: Any) -> Any:
        if isinstance(other, Ratio) and other.power == self.power:
            return Ratio(self.num + other.num, self.den + other.den, self.power)
        return super().__add__(other)

    __radd__ = __add__


def known(value: Any) -> Lazy:
    """A ``Lazy`` whose value is already on the host."""
    return Lazy(lambda: value)


def _number(x: Any) -> Any:
    return x.value if isinstance(x, Lazy) else x


def event_seconds(start: Any, end: Any) -> Lazy:
    """The seconds between two recorded CUDA events, read when needed."""

    def read() -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    return Lazy(read)
