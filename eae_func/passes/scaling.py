"""Norm clipping, constant scaling and additive gaussian noise."""

from __future__ import annotations

import torch

from ..adjoint import AdjointState
from ._common import check_real, global_norm, map_costate, map_costate_random, named


def clip(max_norm: float):
    """Global-norm clipping: ``p <- p * max_norm / (|p| + 1e-6)`` when ``|p| > max_norm``, else ``p``.

    ``|p|`` is the 2-norm over all the costate's tensors (in float32), the formula
    of eae-runtime's ``ClipPass``. Records ``clip_norm`` (before), ``clip_scale``
    and ``clipped``.
    """
    max_norm = check_real("clip", "max_norm", max_norm, low=0.0, low_open=True)

    @named(f"clip({max_norm:g})")
    def clip_pass(adj: AdjointState) -> AdjointState:
        norm = global_norm(adj.tensors())
        if not norm > max_norm:
            return adj.applied("clip", adj.value, clip_norm=norm.item(), clip_scale=1.0, clipped=False)
        scale = max_norm / (norm + 1e-6)
        value = map_costate(lambda t: t * scale.to(t.dtype), adj)
        return adj.applied("clip", value, clip_norm=norm.item(), clip_scale=scale.item(), clipped=True)

    return clip_pass


def scale(factor: float):
    """``p <- factor * p`` (eae-runtime's ``RegularizationPass(s)`` is ``scale(1 - s)``)."""
    factor = check_real("scale", "factor", factor)

    @named(f"scale({factor:g})")
    def scale_pass(adj: AdjointState) -> AdjointState:
        return adj.applied("scale", map_costate(lambda t: t * factor, adj))

    return scale_pass


def gaussian_noise(std: float):
    """``p <- p + std * z``, ``z ~ N(0, I)`` drawn from the boundary's key (same key, same noise)."""
    std = check_real("gaussian_noise", "std", std, low=0.0)

    def add_noise(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        z = torch.randn(t.shape, generator=generator, device=t.device,
                        dtype=torch.promote_types(t.dtype, torch.float32))
        return t + (std * z).to(t.dtype)

    @named(f"gaussian_noise({std:g})")
    def gaussian_noise_pass(adj: AdjointState) -> AdjointState:
        return adj.applied("gaussian_noise", map_costate_random(add_noise, adj))

    return gaussian_noise_pass
