"""The running sums of a control-variate estimate over its probes, and the estimate and the stats
they give:

    ĝ = β̄ s + λ (a − Σ_h β_h b_h) / n,    a = Σ u (u·g),  b_h = Σ_{u in half h} u (u·s)

(the math and the stats: ``control.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..lazy import Ratio

__all__ = ["Sums", "ratio"]


class Sums:
    """The running sums of one control-variate estimate (one stage's input or parameters) in
    ``halves`` halves: ``a = Σ u (u·g)`` summed as the wrapped estimator sums it, per half
    ``a_h``, ``b_h = Σ u (u·s)``, the probe count and ``Σ (u·g)², Σ e², Σ e (u·s), Σ (u·s)²``
    with ``e = u·g − u·s``. Scalars are ``(k, *lead)``, ``lead`` a prefix of the probes' batch
    shape (per position, or per sample)."""

    def __init__(self, s: torch.Tensor, halves: int, antithetic: bool):
        self.s, self.halves, self.antithetic = s, halves, antithetic
        self.a = torch.zeros_like(s)
        self.parts = [torch.zeros_like(s) for _ in range(halves)] if halves > 1 else [self.a]
        self.b = [torch.zeros_like(s) for _ in range(halves)]
        self.sums = torch.zeros(halves, 4, dtype=torch.float64, device=s.device)
        self.counts, self.seen = [0] * halves, 0

    def add(self, u: torch.Tensor, ug: torch.Tensor, us: torch.Tensor) -> None:
        def lead(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(*t.shape, *[1] * (u.ndim - t.ndim))

        self.a += (u * lead(ug)).sum(0)
        if self.halves > 1:  # probe i's half: the parity of i (of its pair, for antithetic probes)
            index = torch.arange(self.seen, self.seen + len(u), device=u.device)
            half = (index // 2 if self.antithetic else index) % 2
        self.seen += len(u)
        for h in range(self.halves):
            uh, gh, sh = (u, ug, us) if self.halves == 1 else (u[half == h], ug[half == h], us[half == h])
            if self.halves > 1:
                self.parts[h] += (uh * lead(gh)).sum(0)
            self.b[h] += (uh * lead(sh)).sum(0)
            gh, sh = gh.double(), sh.double()
            e = gh - sh
            self.sums[h] += torch.stack([(gh * gh).sum(), (e * e).sum(), (e * sh).sum(), (sh * sh).sum()])
            self.counts[h] += len(uh)

    def fit(self, a: torch.Tensor, b: torch.Tensor, count: int) -> torch.Tensor:
        """``<g̃, s>`` for ``g̃ = s + (a − b) / count``, in float64."""
        s = self.s.double()
        return (s * (s + (a.double() - b.double()) / count)).sum()

    def estimate(
        self,
        beta: Any,
        past: tuple[Any, ...] | None,
        n: int,
        prefix: str,
        shrink: tuple[float, float, float] | None = None,
    ) -> tuple[torch.Tensor, dict[Any, Any]]:
        """``ĝ = β̄ s + λ (a − Σ_h β_h b_h) / n`` (``β̄ = Σ_h n_h β_h / n``) for ``beta`` (a number,
        "xfit", or "ema" with the running sums ``past``) and ``shrink = (λ, v, h)`` (``None``: λ = 1),
        and its stats."""
        s, norm = self.s, (self.s.double() ** 2).sum()
        if beta == "xfit":  # each half weighed by the other's fit
            betas = [ratio(self.fit(self.parts[1 - h], self.b[1 - h], self.counts[1 - h]), norm) for h in range(2)]
            betas = [b.to(s.dtype) for b in betas]
        elif beta == "ema":
            betas = [1.0 if past is None else ratio(*past).to(s.dtype)]
        else:
            betas = [float(beta)]
        lam = 1.0 if shrink is None else shrink[0]
        if self.halves == 1:
            mean = betas[0]
            residual = self.a - mean * self.b[0]
        else:
            mean = sum(c * bh for c, bh in zip(self.counts, betas)) / n
            residual = self.a - sum(bh * b_h for bh, b_h in zip(betas, self.b))
        estimate = mean * s + (residual / n if lam == 1.0 else residual * (lam / n))
        gg, ee, es, ss = self.sums.unbind(-1)
        off = 1 - torch.stack([torch.as_tensor(bh, dtype=torch.float64, device=s.device) for bh in betas])
        rho2 = (ee + 2 * off * es + off**2 * ss).sum()
        stats = {
            f"{prefix}beta": Ratio(torch.as_tensor(mean, dtype=torch.float64), 1.0),
            f"{prefix}cv_residual": Ratio(rho2, gg.sum(), 0.5),
            f"{prefix}twin_error": Ratio(ee.sum(), gg.sum(), 0.5),
            f"{prefix}beta_fit": Ratio(self.fit(self.a, torch.stack(self.b).sum(0), n), norm),
        }
        if shrink is not None:
            lam, v, h = shrink
            stats[f"{prefix}shrink"] = Ratio(lam, 1.0)
            stats[f"{prefix}shrink_bias"] = Ratio((1 - lam) ** 2 * rho2, gg.sum())
            stats[f"{prefix}shrink_variance"] = Ratio(lam**2 * v / h * rho2, gg.sum())
        return estimate, stats


def ratio(num: Any, den: Any) -> torch.Tensor:
    """``num / den`` as a float64 tensor, 1 where ``den`` is 0 (a zero twin: β multiplies nothing)."""
    num, den = torch.as_tensor(num, dtype=torch.float64), torch.as_tensor(den, dtype=torch.float64)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 1.0)
