"""Reduced-precision round trips: float16 / bfloat16 casts, scaled float8, int8 fake quantisation
(the math lives in ``eae_func.quantise``, shared with the wire codecs)."""

from __future__ import annotations

from typing import Any

import torch

from .. import quantise as Q
from ..adjoint import AdjointState
from ..lazy import Lazy
from .base import Pass, map_costate, map_costate_random, stateless, valued

__all__ = ["cast", "fp8", "int8"]


_CASTS = (torch.float16, torch.bfloat16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _max_of(values: list[Any]) -> Lazy | float:
    """The largest of a list of scalar tensors, read lazily; 0.0 when empty."""
    if len(values) <= 1:
        return Lazy.of(values[0]) if values else 0.0
    return Lazy.of(torch.stack([v.double() for v in values]).max())


@valued
def cast(dtype: torch.dtype) -> Pass:
    """``p <- dtype(p)`` cast back to p's dtype (float16 or bfloat16), as eae-runtime's ``FP16Pass``.

    Records ``cast_overflow``: how many finite entries became infinite (float16 saturates at 65504).
    """
    if dtype not in _CASTS:
        raise ValueError(
            f"cast: dtype must be torch.float16 or torch.bfloat16, got {dtype!r} "
            f"(use fp8(...) for float8 and int8(...) for int8)"
        )

    def cast_pass(adj: AdjointState) -> AdjointState:
        overflows = []

        def round_trip(t: torch.Tensor) -> torch.Tensor:
            out = t.to(dtype).to(t.dtype)
            overflows.append((torch.isinf(out) & torch.isfinite(t)).sum())
            return out

        value = map_costate(round_trip, adj)
        overflow = Lazy.of(torch.stack(overflows).sum()) if overflows else 0
        return adj.applied("cast", value, cast_overflow=overflow)

    return stateless(cast_pass, f"cast({dtype})")


@valued
def fp8(dtype: torch.dtype = torch.float8_e4m3fn) -> Pass:
    """Scaled float8 round trip, per tensor: ``s = max|p| / finfo(dtype).max``,
    ``p <- float(dtype(clamp(p / s))) * s``, through the real float8 dtype; zero tensors unchanged.

    Computed in float32 (float64 for a float64 costate). Records ``fp8_scale`` (the largest over
    the costate's tensors).
    """
    if dtype not in _FP8:
        raise ValueError(f"fp8: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype!r}")

    def fp8_pass(adj: AdjointState) -> AdjointState:
        scales = []

        def round_trip(t: torch.Tensor) -> torch.Tensor:
            if t.numel() == 0:
                return t
            q, s = Q.fp8_encode(t, dtype)
            scales.append(s)
            return Q.fp8_decode(q, Q.safe(s), t.dtype)

        value = map_costate(round_trip, adj)
        return adj.applied("fp8", value, fp8_scale=_max_of(scales))

    return stateless(fp8_pass, f"fp8({dtype})")


@valued
def int8(per: str = "tensor", stochastic: bool = False) -> Pass:
    """Symmetric int8 fake quantisation: ``s = max|p| / 127``, ``q = clamp(round(p / s), -127, 127)``,
    ``p <- q * s``, computed in float32 (float64 for a float64 costate) and cast back
    (eae-runtime's ``Int8QuantizationPass``).

    per="tensor": one scale per tensor of the costate. per="channel": one scale per index
    of the last dimension (the feature / channel dimension of a ``(..., D)`` costate),
    the max taken over all other dimensions. All-zero tensors (channels) stay zero.
    stochastic=True rounds ``floor(p / s + u)``, ``u ~ U[0, 1)`` from the boundary's key,
    which is unbiased: ``E[q * s] = p``. Deterministic rounding errs by at most ``s / 2``.
    Records ``int8_scale`` (the largest scale over tensors and channels).
    """
    if per not in ("tensor", "channel"):
        raise ValueError(f"int8: per must be 'tensor' or 'channel', got {per!r}")
    if not isinstance(stochastic, bool):
        raise TypeError(f"int8: stochastic must be a bool, got {type(stochastic).__name__}")

    def quantise(t: torch.Tensor, generator: torch.Generator | None, scales: list[Any]) -> torch.Tensor:
        if t.numel() == 0:
            return t
        q, s = Q.int8_encode(t, per == "channel", generator)
        scales.append(s.amax() if s.ndim else s)
        return Q.int8_decode(q, s, t.dtype)

    def int8_pass(adj: AdjointState) -> AdjointState:
        scales = []
        if stochastic:
            value = map_costate_random(lambda t, g: quantise(t, g, scales), adj)
        else:
            value = map_costate(lambda t: quantise(t, None, scales), adj)
        return adj.applied("int8", value, int8_scale=_max_of(scales))

    return stateless(int8_pass, f"int8(per={per!r}, stochastic={stochastic})")
