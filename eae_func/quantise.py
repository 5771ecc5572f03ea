"""Quantiser math, the one home of the encode / decode round trips used by the passes
(``eae_func.passes``) and the wire codecs (``eae_func.distributed.codecs``).

    int8:  s = max|t| / 127,  q = clamp(round(t / s), -127, 127),  t' = q s
    fp8:   s = max|t| / finfo(d).max,  q = d(clamp(t / s)),  t' = float(q) s
    top-k: the k = ceil(ratio n) entries of largest |t| (at least one of a non-empty tensor)

Scales are computed in float32, or float64 for a float64 tensor (so a float64 value
beyond float32's range stays finite); all-zero tensors (channels) stay zero.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["fp8_decode", "fp8_encode", "int8_decode", "int8_encode", "kept", "safe", "scatter", "topk_indices"]


INT8_MAX = 127.0


def work_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype quantisers compute in: float64 for float64, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def safe(scale: torch.Tensor) -> torch.Tensor:
    """The scale with zeros replaced by ones (a zero tensor divides by 1 and stays zero)."""
    return torch.where(scale > 0, scale, 1.0)


def int8_encode(
    t: torch.Tensor, per_channel: bool = False, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``: q int8 of t's shape, s the scale ``max|t| / 127`` (per tensor, or per index of the
    last dim, the max over all other dims, broadcastable against t). With a ``generator`` the rounding
    is stochastic, ``floor(t / s + u)``, u ~ U[0, 1): unbiased, ``E[q s] = t``."""
    x = t.to(work_dtype(t))
    if per_channel and x.ndim > 1:
        amax = x.abs().amax(dim=tuple(range(x.ndim - 1)), keepdim=True)
    elif per_channel:
        amax = x.abs()
    else:
        amax = x.abs().amax() if x.numel() else x.new_zeros(())
    s = amax / INT8_MAX
    y = x / safe(s)
    if generator is None:  # |t / s| <= 127 up to an ulp, so round() never leaves [-127, 127]
        return torch.round(y).to(torch.int8), s
    q = torch.floor(y + torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype))
    return torch.clamp(q, -INT8_MAX, INT8_MAX).to(torch.int8), s


def int8_decode(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q s`` in ``dtype``."""
    return (q.to(s.dtype) * s).to(dtype)


def fp8_encode(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``: q in float8 ``dtype``, s = ``max|t| / finfo(dtype).max`` (per tensor)."""
    fmax = torch.finfo(dtype).max
    x = t.to(work_dtype(t))
    s = (x.abs().amax() if x.numel() else x.new_zeros(())) / fmax
    return (x / safe(s)).clamp(-fmax, fmax).to(dtype), s


def fp8_decode(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``float(q) s`` in ``dtype``."""
    return (q.to(s.dtype) * s).to(dtype)


def kept(ratio: float, n: int) -> int:
    """``k = ceil(ratio * n)`` entries of ``n`` (at least one of a non-empty tensor)."""
    return min(n, max(1, math.ceil(ratio * n - 1e-9))) if n else 0


def topk_indices(t: torch.Tensor, k: int) -> torch.Tensor:
    """Flat indices of the ``k`` entries of largest ``|t|``."""
    return t.reshape(-1).to(work_dtype(t)).abs().topk(k, sorted=False).indices


def scatter(index: torch.Tensor, values: torch.Tensor, shape: tuple[Any, ...]) -> torch.Tensor:
    """A tensor of ``shape``: ``values`` at the flat ``index``, zero elsewhere."""
    return (
        torch.zeros(math.prod(shape), dtype=values.dtype, device=values.device)
        .index_copy(0, index.long(), values)
        .view(shape)
    )
