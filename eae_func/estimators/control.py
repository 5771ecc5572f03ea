"""A physical stage's twin as a control variate for zbp's probes (docs/estimators.md):

    ĝ = β s + (1/n) Σ_i u_i (u_i·g − β u_i·s)        (scalars per probe and batch position)

``u_i·g`` is measured exactly as the wrapped zbp measures it (the same probes, rows and calls),
``s = J_twinᵀ p`` is the twin's vjp of the costate at the stage's measured input, and ``u_i·s`` is
``<u_i, s>`` (``twin_directional="exact"``) or the twin's own directional derivative measured as
zbp measures the stage's (``"fd"``: central differences at the same ±εu, whose truncation then
cancels the stage's where the twin is close). ``E[u uᵀ] = I`` makes ĝ unbiased for every β that
does not depend on the probes, and ``E‖ĝ − g‖² = (d ± 1)/n · ‖g − β s‖²`` (− rademacher and
sphere, + gaussian): zbp's error with ``g − β s`` in place of ``g``.

β:  a number: 1 trusts the twin's scale, 0 is zbp itself;
    ``"xfit"``: the probes split into two halves (by index parity; by pairs with antithetic
    probes), each half's β = <ĝ_other, s> / ‖s‖² from the other half's plain projection ĝ_other,
    so it is independent of the probes it weighs;
    ``"ema"``: β = N / D from sums over earlier steps, ``N ← λN + <ĝ, s>``, ``D ← λD + ‖s‖²``
    (λ = ``decay``). The sums are a value: ``cv = cv.observe(res)`` after a sweep returns the
    estimator with them updated from ``res.stats`` (β = 1 before any); the estimator never
    changes during a sweep, so every microbatch of a step uses the β of earlier steps.

Parameters of a physical stage: method "jvp" gives them the exact local vjp (as zbp); "fd"
applies the same control variate to the probed parameter directions, ``s_W`` the twin's
parameter vjp. ``res.stats[stage]``, per space (the input; ``param_`` for the parameters), pooled
over microbatches: ``beta`` (the mean β), ``cv_residual`` ``‖u·g − β u·s‖ / ‖u·g‖`` and
``twin_error`` ``‖u·g − u·s‖ / ‖u·g‖``, an estimate of ``‖g − s‖ / ‖g‖`` (``E (u·v)² = ‖v‖²``),
both over all probes and positions, and ``beta_fit`` ``<ĝ, s> / ‖s‖²`` (what "ema" averages);
``twin_calls``: one vjp of the twin per call.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Callable, Iterator, Mapping
from itertools import repeat
from types import MappingProxyType
from typing import Any

import optree
import torch

from .. import boundary as B
from ..chain import Chain
from ..lazy import Ratio
from ..tree import NAMESPACE
from .base import Problem
from .local import Flat, exact_param_grads, param_directional, param_leaves, unflatten_params, where
from .twin import Twins, twin_vjp
from .zbp import ZBP

BETAS = ("ema", "xfit")
DIRECTIONAL = ("exact", "fd")
PREFIX = {"input": "", "params": "param_"}


class ControlVariate:
    """zbp with the stage's twin as a control variate (see module doc)."""

    scope = "stage"

    def __init__(
        self,
        estimator: ZBP,
        twin: Callable | Mapping[str, Callable],
        beta: float | str = 1.0,
        twin_directional: str = "exact",
        decay: float = 0.9,
    ):
        if not isinstance(estimator, ZBP):
            raise TypeError(f"control_variate: wraps a stage-level E.zbp(...), got {type(estimator).__name__}")
        self.twins = Twins("control_variate", twin)
        if beta not in BETAS and not (
            isinstance(beta, numbers.Real) and not isinstance(beta, bool) and abs(float(beta)) < float("inf")
        ):
            raise ValueError(f"control_variate: beta must be a finite number, 'ema' or 'xfit', got {beta!r}")
        if twin_directional not in DIRECTIONAL:
            raise ValueError(
                f"control_variate: twin_directional must be one of {DIRECTIONAL}, got {twin_directional!r}"
            )
        if not isinstance(decay, numbers.Real) or isinstance(decay, bool) or not 0 <= decay <= 1:
            raise ValueError(f"control_variate: decay must be a number in [0, 1], got {decay!r}")
        probes = estimator.probes
        if beta == "xfit" and (probes.kind == "orthogonal" or probes.n < (4 if probes.antithetic else 2)):
            raise ValueError(
                "control_variate: beta='xfit' fits each half of the probes on the other, so it needs two "
                f"non-empty halves of independent probes, got {probes!r}; use another kind or more probes"
            )
        self.estimator, self.beta, self.twin_directional, self.decay = estimator, beta, twin_directional, float(decay)
        self.state: Mapping[tuple[str, str], tuple] = MappingProxyType({})

    @property
    def differentiates(self) -> bool:
        return self.estimator.differentiates

    def __repr__(self) -> str:
        return (
            f"control_variate({self.estimator!r}, {self.twins!r}, beta={self.beta!r}, "
            f"twin_directional={self.twin_directional!r}, decay={self.decay:g})"
        )

    def observe(self, res: Any) -> ControlVariate:
        """This estimator with its running sums (what ``beta="ema"`` reads) updated from the
        ``beta_fit`` of every physical stage in ``res.stats``, a sweep's result; ``self`` unchanged."""
        state = dict(self.state)
        for name, entry in res.stats.items():
            for space, prefix in PREFIX.items():
                fit = entry.get(f"{prefix}beta_fit") if isinstance(entry, Mapping) else None
                if isinstance(fit, Ratio):
                    num, den = state.get((name, space), (0.0, 0.0))
                    state[(name, space)] = (self.decay * num + fit.num, self.decay * den + fit.den)
        new = copy.copy(self)
        new.state = MappingProxyType(state)
        return new

    def check(self, chain: Chain, physical: tuple[int, ...]) -> None:
        self.twins.check(chain, physical)

    def prepare(self, problem: Problem) -> Any:
        return self.estimator.prepare(problem)

    def stage_vjp(self, problem: Problem, prepared: Any, i: int, h_in: Any, costate: Any):
        zbp, fn, name = self.estimator, self.twins.of(problem, i), problem.chain.names[i]
        twin_grads, twin_in = twin_vjp(problem, i, h_in, costate, fn)
        floats, _, costate_like = B.split(h_in, f"input of {where(problem, i)}")
        flat = Flat(floats, zbp.probes.batch_dims, f"input of {where(problem, i)}")
        cost: dict = {"queries": 2 * zbp.probes.n, "twin_calls": 1}
        estimate = []
        if flat.d:
            twin = zbp.directional(problem, i, h_in, costate, fn) if self.twin_directional == "fd" else None
            s = flat.vector(optree.tree_leaves(twin_in, namespace=NAMESPACE))
            total, stats = self.controlled(name, "input", zbp.directional(problem, i, h_in, costate), twin, s)
            estimate = flat.leaves(total)
            cost.update(stats)
        leaves = param_leaves(problem.params[i])[0]
        if zbp.method == "jvp":
            grads, param_cost = exact_param_grads(problem, i, h_in, costate)
        elif not leaves:
            grads, param_cost = problem.params[i], {}
        else:
            probing = (zbp.probes, zbp.eps)
            twin = param_directional(problem, i, h_in, costate, *probing, fn) if self.twin_directional == "fd" else None
            s = Flat(leaves, 0, f"params of {where(problem, i)}").vector(
                optree.tree_leaves(twin_grads, namespace=NAMESPACE)
            )
            total, param_cost = self.controlled(
                name, "params", param_directional(problem, i, h_in, costate, *probing), twin, s
            )
            grads = unflatten_params(problem, i, total)
            param_cost["param_queries"] = 2 * zbp.probes.n
        return grads, costate_like(estimate), {**cost, **param_cost}

    def controlled(
        self, name: str, space: str, measured: Iterator, twin: Iterator | None, s: torch.Tensor
    ) -> tuple[torch.Tensor, dict]:
        """ĝ from the chunks ``(u, u·g)`` of ``measured`` (and ``(u, u·s)`` of ``twin``, else
        ``u·s = <u, s>``), and its stats. With per-half weights β_h (one half unless "xfit"):
        ``ĝ = β̄ s + (a − Σ_h β_h b_h) / n``, ``a = Σ_i u_i (u_i·g)`` summed as zbp sums it,
        ``b_h = Σ_{i in h} u_i (u_i·s)``, ``β̄ = Σ_h n_h β_h / n``. A fit of β on probes i is
        ``<g̃, s> / ‖s‖²`` with ``g̃ = s + (1/|i|) Σ_i u_i (u_i·g − u_i·s)``, zbp's error at ``g − s``."""
        probes, halves = self.estimator.probes, 2 if self.beta == "xfit" else 1
        a, b = torch.zeros_like(s), [torch.zeros_like(s) for _ in range(halves)]
        # per half: Σ (u·g)², Σ e², Σ e (u·s), Σ (u·s)², with e = u·g − u·s
        sums = torch.zeros(halves, 4, dtype=torch.float64, device=s.device)
        counts, start = [0] * halves, 0
        for (u, ug), paired in zip(measured, repeat(None) if twin is None else twin):
            us = (u * s).sum(-1) if paired is None else paired[1]
            a += (u * ug.unsqueeze(-1)).sum(0)
            index = torch.arange(start, start + len(u), device=u.device)
            half = (index // 2 if probes.antithetic else index) % 2
            for h in range(halves):
                uh, gh, sh = (u, ug, us) if halves == 1 else (u[half == h], ug[half == h], us[half == h])
                b[h] += (uh * sh.unsqueeze(-1)).sum(0)
                gh, sh = gh.double(), sh.double()
                e = gh - sh
                sums[h] += torch.stack([(gh * gh).sum(), (e * e).sum(), (e * sh).sum(), (sh * sh).sum()])
                counts[h] += len(uh)
            start += len(u)
        norm = (s.double() ** 2).sum()
        if self.beta == "xfit":  # each half weighed by the other's fit
            betas = [fitted(norm + sums[1 - h, 2] / counts[1 - h], norm).to(s.dtype) for h in range(2)]
        elif self.beta == "ema":
            past = self.state.get((name, space))
            betas = [1.0 if past is None else fitted(*past).to(s.dtype)]
        else:
            betas = [float(self.beta)]
        n = probes.n
        if halves == 1:
            beta = betas[0]
            estimate = beta * s + (a - beta * b[0]) / n
        else:
            beta = sum(c * bh for c, bh in zip(counts, betas)) / n
            estimate = beta * s + (a - sum(bh * b_h for bh, b_h in zip(betas, b))) / n
        gg, ee, es, ss = sums.unbind(-1)
        off = 1 - torch.stack([torch.as_tensor(bh, dtype=torch.float64, device=s.device) for bh in betas])
        prefix = PREFIX[space]
        return estimate, {
            f"{prefix}beta": Ratio(torch.as_tensor(beta, dtype=torch.float64), 1.0),
            f"{prefix}cv_residual": Ratio((ee + 2 * off * es + off**2 * ss).sum(), gg.sum(), 0.5),
            f"{prefix}twin_error": Ratio(ee.sum(), gg.sum(), 0.5),
            f"{prefix}beta_fit": Ratio(norm + es.sum() / n, norm),
        }


def fitted(num: Any, den: Any) -> torch.Tensor:
    """``num / den`` as a tensor, 1 where ``den`` is 0 (a zero twin: β multiplies nothing)."""
    num, den = torch.as_tensor(num, dtype=torch.float64), torch.as_tensor(den, dtype=torch.float64)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 1.0)


def control_variate(
    estimator: ZBP,
    twin: Callable | Mapping[str, Callable],
    beta: float | str = 1.0,
    twin_directional: str = "exact",
    decay: float = 0.9,
) -> ControlVariate:
    """``ĝ = β s + (1/n) Σ u_i (u_i·g − β u_i·s)``: zbp's probes (``estimator``, an ``E.zbp``) with
    the twin's vjp ``s`` as a control variate; unbiased, with zbp's error at ``‖g − β s‖`` in place
    of ``‖g‖``. ``twin``: ``fn(params, h)`` for every physical stage, or a mapping from stage name
    to function; ``beta``: a number, ``"xfit"`` (cross-fitted halves) or ``"ema"`` (from earlier
    steps: thread it with ``cv = cv.observe(res)``; decay ``decay``); ``twin_directional``:
    ``"exact"`` (``<u, s>``) or ``"fd"`` (the twin measured like the stage, at the same ±εu).
    See the module doc for the stats it records."""
    return ControlVariate(estimator, twin, beta, twin_directional, decay)
