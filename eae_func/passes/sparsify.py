"""Sparsifying compressors: keep the largest entries, or a random subset rescaled to stay unbiased."""

from __future__ import annotations

import math

import torch

from ..adjoint import AdjointState
from ._common import check_ratio, map_costate, map_costate_random, named


def _kept(ratio: float, n: int) -> int:
    """``k = ceil(ratio * n)`` entries of ``n`` (at least one of a non-empty tensor)."""
    return min(n, max(1, math.ceil(ratio * n - 1e-9)))


def _keep(t: torch.Tensor, index: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    """A tensor shaped like ``t``: ``factor * t`` at the flat ``index``, zero elsewhere."""
    flat = t.reshape(-1)
    return torch.zeros_like(flat).index_copy(0, index, flat[index] * factor).view(t.shape)


def topk(ratio: float):
    """Top-k sparsification per tensor: keep the ``k = ceil(ratio * n)`` entries of largest ``|p|``,
    zero the rest (biased; pair it with ``error_feedback``). Records ``topk_kept`` (fraction of
    entries kept) and ``topk_energy`` (``|sent|^2 / |p|^2``)."""
    ratio = check_ratio("topk", ratio)

    @named(f"topk({ratio:g})")
    def topk_pass(adj: AdjointState) -> AdjointState:
        kept, energy = [], []

        def sparsify(t: torch.Tensor) -> torch.Tensor:
            if t.numel() == 0:
                return t
            k = _kept(ratio, t.numel())
            kept.append((k, t.numel()))
            top = t.reshape(-1).float().abs().topk(k, sorted=False)
            energy.append(torch.stack([top.values.square().sum(), t.float().square().sum()]))
            return _keep(t, top.indices)

        value = map_costate(sparsify, adj)
        sent, total = torch.stack(energy).sum(0).tolist() if energy else (0.0, 0.0)
        return adj.applied("topk", value, topk_kept=_fraction(kept),
                           topk_energy=sent / total if total > 0 else 1.0)

    return topk_pass


def randk(ratio: float):
    """Random-k sparsification per tensor: keep ``k = ceil(ratio * n)`` entries chosen uniformly
    without replacement (from the boundary's key), scaled by ``n / k`` (``~ 1 / ratio``), so
    ``E[sent] = p``. Records ``randk_kept``."""
    ratio = check_ratio("randk", ratio)

    @named(f"randk({ratio:g})")
    def randk_pass(adj: AdjointState) -> AdjointState:
        kept = []

        def sparsify(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
            n = t.numel()
            if n == 0:
                return t
            k = _kept(ratio, n)
            kept.append((k, n))
            index = torch.randperm(n, generator=generator, device=t.device)[:k]
            return _keep(t, index, n / k)

        return adj.applied("randk", map_costate_random(sparsify, adj), randk_kept=_fraction(kept))

    return randk_pass


def _fraction(kept: list) -> float:
    n = sum(n for _, n in kept)
    return sum(k for k, _ in kept) / n if n else 1.0
