"""Choosing the finite-difference step of a noisy black box from its measured noise.

A central difference ``(f(x+εu) − f(x−εu)) / 2ε`` of outputs with independent noise of std σ
has, per output element, noise of std σ / (√2 ε) on a slope whose typical size is the gain
g = rms(J u). ``suggest_eps`` measures σ from repeated queries at the same input and g from
central differences with a wide step, and suggests ε = factor · σ / g (noise at most
1 / (√2 · factor) of the slope, 7% for the default 10; for a gain near 1 that is ε ≈ 10 σ), never
below √(machine ε) · rms(x), where rounding would dominate. A larger ε costs truncation bias
O(ε²); averaging r repeated queries (``ef.black_box(..., repeats=r)``) divides σ by √r.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..program.chain import Stage

__all__ = ["NoiseEstimate", "suggest_eps"]


@dataclasses.dataclass(frozen=True)
class NoiseEstimate:
    """noise: the output's noise std σ per element; gain: rms of J u per element; eps: the suggested step."""

    noise: float
    gain: float
    eps: float


def suggest_eps(
    stage: Stage | Callable[..., Any],
    params: Any,
    x: torch.Tensor,
    repeats: int = 8,
    factor: float = 10.0,
    key: int = 0,
) -> NoiseEstimate:
    """σ from ``repeats`` queries of ``stage`` (a ``Stage`` or ``fn(params, x)``) at ``x``, the gain from
    two more at ``x ± δu`` (u rademacher drawn from ``key``, δ = 0.1 · rms(x)), and ε = factor · σ / gain."""
    if repeats < 2:
        raise ValueError(f"suggest_eps: repeats must be >= 2 to measure noise, got {repeats!r}")
    if isinstance(stage, Stage):
        call = stage.call

        def run(h: torch.Tensor) -> torch.Tensor:
            return call(params, {}, h)[0].detach()
    else:
        fn = stage

        def run(h: torch.Tensor) -> torch.Tensor:
            return fn(params, h).detach()

    with torch.no_grad():
        outs = torch.stack([run(x) for _ in range(repeats)]).to(torch.float64)
        noise = outs.var(0, unbiased=True).mean().sqrt().item()
        scale = x.to(torch.float64).square().mean().sqrt().item() or 1.0
        u = torch.randint(0, 2, x.shape, generator=torch.Generator().manual_seed(key)).to(x.dtype) * 2 - 1
        delta = 0.1 * scale
        slope = (run(x + delta * u) - run(x - delta * u)).to(torch.float64) / (2 * delta)
        gain_sq = slope.square().mean().item() - noise**2 / (2 * delta**2)
    gain = max(gain_sq, 0.0) ** 0.5
    floor = torch.finfo(x.dtype).eps ** 0.5 * scale
    eps = max(factor * noise / gain, floor) if gain > 0 else floor
    return NoiseEstimate(noise, gain, eps)
