"""Helpers shared by the built-in passes: leafwise maps, the global norm,
per-pass random streams and argument checks."""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

import optree
import torch

from ..adjoint import NAMESPACE, AdjointState, fold_in


def map_costate(fn: Callable[[torch.Tensor], torch.Tensor], adj: AdjointState) -> Any:
    """``fn`` applied to every tensor leaf of the costate (``None`` leaves stay ``None``)."""
    return optree.tree_map(fn, adj.value, namespace=NAMESPACE)


def map_costate_random(fn: Callable[[torch.Tensor, torch.Generator], torch.Tensor], adj: AdjointState) -> Any:
    """``fn(leaf, generator)`` on every tensor leaf, each leaf with its own stream.

    Leaf i draws from ``fold_in(fold_in(adj.key, len(adj.history)), i)``: the same
    key gives the same draws, and two random passes at one boundary (their
    positions in the history differ) never share draws.
    """
    leaves, spec = optree.tree_flatten(adj.value, namespace=NAMESPACE)
    stream = fold_in(adj.key, len(adj.history))
    return spec.unflatten([fn(t, torch.Generator(device=t.device).manual_seed(fold_in(stream, i)))
                           for i, t in enumerate(leaves)])


def global_norm(tensors: list) -> torch.Tensor:
    """``sqrt(sum_i |t_i|^2)`` over all tensors, in float32 (float64 stays float64)."""
    norms = [torch.linalg.vector_norm(t.float() if t.dtype != torch.float64 else t) for t in tensors]
    if not norms:
        return torch.zeros(())
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack([n.double() for n in norms]))


def check_real(pass_name: str, arg: str, value: Any, *, low: float | None = None, low_open: bool = False,
               high: float | None = None) -> float:
    """``value`` as a float, or a ``ValueError`` naming the pass and the expected range."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        expected = ["a finite number"]
        if low is not None:
            expected.append(f"{'>' if low_open else '>='} {low:g}")
        if high is not None:
            expected.append(f"<= {high:g}")
        raise ValueError(f"{pass_name}: {arg} must be {' and '.join(expected)}, got {value!r}")
    return float(value)


def check_ratio(pass_name: str, ratio: Any) -> float:
    return check_real(pass_name, "ratio", ratio, low=0.0, low_open=True, high=1.0)


def named(label: str) -> Callable:
    """Give a pass function a readable ``__name__`` (shown by ``repr(compose(...))``)."""
    def rename(fn: Callable) -> Callable:
        fn.__name__ = fn.__qualname__ = label
        return fn
    return rename
