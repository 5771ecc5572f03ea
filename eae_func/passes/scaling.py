"""Clipping (by global norm, by value), constant scaling and additive gaussian noise."""

from __future__ import annotations

import torch

from ..adjoint import AdjointState
from ..checks import check_real
from ..lazy import Lazy
from .base import Pass, global_norm, map_costate, map_costate_random, stateless, valued

__all__ = ["clip_by_global_norm", "clip_by_value", "gaussian_noise", "scale"]


@valued
def clip_by_global_norm(max_norm: float) -> Pass:
    """``p <- p * max_norm / (|p| + 1e-6)`` when ``|p| > max_norm``, else ``p``.

    ``|p|`` is the 2-norm over all the costate's tensors (in float32), the formula
    of eae-runtime's ``ClipPass``. Records ``clip_norm`` (before), ``clip_scale``
    and ``clipped``, read lazily (no host sync in the sweep).
    """
    max_norm = check_real("clip_by_global_norm", "max_norm", max_norm, low=0.0, low_open=True)

    def clip_pass(adj: AdjointState) -> AdjointState:
        norm = global_norm(adj.value)
        clipped = norm > max_norm
        scale = torch.where(clipped, max_norm / (norm + 1e-6), 1.0)
        value = map_costate(lambda t: t * scale.to(t.dtype), adj)  # t * 1 is t, bit for bit
        return adj.applied("clip", value, clip_norm=Lazy.of(norm), clip_scale=Lazy.of(scale), clipped=Lazy.of(clipped))

    return stateless(clip_pass, f"clip_by_global_norm({max_norm:g})")


@valued
def clip_by_value(limit: float) -> Pass:
    """Element-wise ``p <- clamp(p, -limit, limit)``. Records ``clipped_fraction`` (entries changed)."""
    limit = check_real("clip_by_value", "limit", limit, low=0.0, low_open=True)

    def clip_value_pass(adj: AdjointState) -> AdjointState:
        counts = []

        def clamp(t: torch.Tensor) -> torch.Tensor:
            counts.append(
                torch.stack([(t.abs() > limit).sum(), torch.full((), t.numel(), dtype=torch.int64, device=t.device)])
            )
            return t.clamp(-limit, limit)

        value = map_costate(clamp, adj)
        if not counts:
            return adj.applied("clip_by_value", value, clipped_fraction=0.0)
        changed, total = torch.stack(counts).sum(0)
        fraction = torch.where(total > 0, changed / total.clamp(min=1), torch.zeros((), device=total.device))
        return adj.applied("clip_by_value", value, clipped_fraction=Lazy.of(fraction))

    return stateless(clip_value_pass, f"clip_by_value({limit:g})")


@valued
def scale(factor: float) -> Pass:
    """``p <- factor * p`` (eae-runtime's ``RegularizationPass(s)`` is ``scale(1 - s)``)."""
    factor = check_real("scale", "factor", factor)

    def scale_pass(adj: AdjointState) -> AdjointState:
        return adj.applied("scale", map_costate(lambda t: t * factor, adj))

    return stateless(scale_pass, f"scale({factor:g})")


@valued
def gaussian_noise(std: float) -> Pass:
    """``p <- p + std * z``, ``z ~ N(0, I)`` drawn from the boundary's key (same key, same noise)."""
    std = check_real("gaussian_noise", "std", std, low=0.0)

    def add_noise(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        z = torch.randn(
            t.shape, generator=generator, device=t.device, dtype=torch.promote_types(t.dtype, torch.float32)
        )
        return t + (std * z).to(t.dtype)

    def gaussian_noise_pass(adj: AdjointState) -> AdjointState:
        return adj.applied("gaussian_noise", map_costate_random(add_noise, adj))

    return stateless(gaussian_noise_pass, f"gaussian_noise({std:g})")
