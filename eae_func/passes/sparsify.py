"""Sparsifying compressors: keep the largest entries, or a random subset rescaled to stay unbiased."""

from __future__ import annotations

from typing import Any

import torch

from .. import quantise as Q
from ..adjoint import AdjointState
from ..checks import check_ratio
from ..lazy import Lazy
from .base import Pass, map_costate, map_costate_random, stateless, valued

__all__ = ["randk", "topk"]


@valued
def topk(ratio: float) -> Pass:
    """Top-k sparsification per tensor: keep the ``k = ceil(ratio * n)`` entries of largest ``|p|``,
    zero the rest (biased; pair it with ``error_feedback``). Records ``topk_kept`` (fraction of
    entries kept) and ``topk_energy`` (``|sent|^2 / |p|^2``, 1 for a zero costate; computed on the
    device in float64 and read lazily: no host sync in the sweep)."""
    ratio = check_ratio("topk", ratio)

    def topk_pass(adj: AdjointState) -> AdjointState:
        kept, energy = [], []

        def sparsify(t: torch.Tensor) -> torch.Tensor:
            if t.numel() == 0:
                return t
            k = Q.kept(ratio, t.numel())
            kept.append((k, t.numel()))
            index = Q.topk_indices(t, k)
            values = t.reshape(-1)[index]
            energy.append(torch.stack([values.double().square().sum(), t.double().square().sum()]))
            return Q.scatter(index, values, t.shape)

        value = map_costate(sparsify, adj)
        if not energy:
            return adj.applied("topk", value, topk_kept=_fraction(kept), topk_energy=1.0)
        sent, total = torch.stack(energy).sum(0)
        fraction = torch.where(total > 0, sent / total, torch.ones_like(total))
        return adj.applied("topk", value, topk_kept=_fraction(kept), topk_energy=Lazy.of(fraction))

    return stateless(topk_pass, f"topk({ratio:g})")


@valued
def randk(ratio: float) -> Pass:
    """Random-k sparsification per tensor: keep ``k = ceil(ratio * n)`` entries chosen uniformly
    without replacement (from the boundary's key), scaled by ``n / k`` (``~ 1 / ratio``), so
    ``E[sent] = p``. Records ``randk_kept``."""
    ratio = check_ratio("randk", ratio)

    def randk_pass(adj: AdjointState) -> AdjointState:
        kept = []

        def sparsify(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
            n = t.numel()
            if n == 0:
                return t
            k = Q.kept(ratio, n)
            kept.append((k, n))
            index = torch.randperm(n, generator=generator, device=t.device)[:k]
            return Q.scatter(index, t.reshape(-1)[index] * (n / k), t.shape)

        return adj.applied("randk", map_costate_random(sparsify, adj), randk_kept=_fraction(kept))

    return stateless(randk_pass, f"randk({ratio:g})")


def _fraction(kept: list[Any]) -> float:
    n = sum(n for _, n in kept)
    return sum(k for k, _ in kept) / n if n else 1.0
