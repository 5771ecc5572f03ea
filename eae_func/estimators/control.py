"""A physical stage's twin as a control variate for the probe estimators (docs/estimators.md):

    ĝ = β s + (1/n) Σ_i u_i (u_i·g − β u_i·s)

``u_i·g`` is the scalar the wrapped estimator measures, exactly as it measures it (the same
probes, rows and calls): zbp's ``<J u_i, p>`` per batch position, direct's per stage, np's
``D_i`` per sample (shared by the physical stages). ``s`` is the twin's costate: at the stage
level the twin's vjp of the costate at the stage's measured input; at the model level the
input costates of a reverse sweep through the twins (digital stages exact) at the states the
wrapped estimator's forward measured (each twin shifted to the stage's measured output, so the
states are the hardware's and only the Jacobians the twins'). ``u_i·s`` is the same scalar of
``s``: ``<u_i, s>`` per position or summed as the wrapped estimator sums (np: over the physical
stages) for ``twin_directional="exact"``; for ``"fd"`` the twin's own directional derivative,
measured as the wrapped estimator measures the stage's (zbp: central differences of the twin at
the same ±εu; np and direct: of the network of twins; their oracle form: exact), so central
differences' truncation cancels where the twin is close. ``E[u uᵀ] = I`` makes ĝ unbiased for
every β that does not depend on the probes, and, per stage, ``E‖ĝ − g‖² = (d ± 1)/n · ‖g − βs‖²``
(− rademacher and sphere, + gaussian; np: its cross-stage formula with ``g − βs``).

β:  a number: 1 trusts the twin's scale, 0 is the wrapped estimator itself;
    ``"xfit"``: the probes split into two halves (by index parity; by pairs with antithetic
    probes), each half weighed by the β fitted on the other, so β never depends on the probes it
    weighs;
    ``"ema"``: β = N / D from sums over earlier steps, ``N ← λN + <g̃, s>``, ``D ← λD + ‖s‖²``
    (λ = ``decay``). The sums are a value: ``cv = cv.observe(res)`` after a sweep returns the
    estimator with them updated from ``res.stats`` (β = 1 before any); a sweep never changes the
    estimator, so every microbatch of a step uses the β of earlier steps.
Shrinkage (``shrink=``), for an estimator allowed a little bias:

    ĝ_λ = β s + λ (1/n) Σ_i u_i (u_i·g − β u_i·s)

λ = 1 is the control variate above, λ = 0 the twin alone (β s; with β = 1, ``E.twin``'s costate).
Its bias is (1 − λ)(g − βs) and its variance λ² v ‖g − βs‖², v the wrapped estimator's error factor
((d + 1)/n gaussian, (d − 1)/n rademacher and sphere, d/n − 1 orthogonal, n halved for antithetic
pairs; d the dimension one scalar probes: a position's features for zbp and direct, a sample's
coordinates over every physical stage for np). Training averages the variance over the optimizer's
horizon of h steps (h ≈ 1/(1 − momentum)) but never the bias, so the error of the averaged estimate
is (1 − λ)² + λ² v / h times ‖g − βs‖², least at λ* = h / (h + v) (= n h / (n h + d ± 1)): ``"auto"``
takes that λ*, from the probe kind, n and d, with ``horizon=h`` (1: one step's error). ``shrink``
is stated in the stats as ``shrink``, with the estimated ``shrink_bias`` (1 − λ)² ρ² and
``shrink_variance`` λ² v ρ² / h, ρ² the ``cv_residual`` squared: shares of ‖g‖².

A fit of β on a set of probes is ``<g̃, s> / ‖s‖²``, ``g̃ = s + (1/m) Σ u_i (u_i·g − u_i·s)`` (the
β = 1 estimate from those m probes); an exact twin fits 1.

Parameters of a physical stage: the exact local vjp where the wrapped estimator gives it (zbp
"jvp", np and direct "oracle" and "jvp"); under fd the same control variate on the probed
parameter directions, ``s_W`` the twin's parameter vjp. ``res.stats[stage]``, per space (the
input; ``param_`` for the parameters), ratios pooled over probes, positions and microbatches:
``beta`` (the mean β), ``cv_residual`` ``‖u·g − β u·s‖ / ‖u·g‖``, ``twin_error``
``‖u·g − u·s‖ / ‖u·g‖`` (an estimate of ``‖g − s‖ / ‖g‖``, as ``E (u·v)² = ‖v‖²``; np: of all
the physical stages together) and ``beta_fit`` (what "ema" averages); ``twin_calls``: the
twin's vjps.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Callable, Mapping
from itertools import repeat
from types import MappingProxyType
from typing import Any

import optree
import torch

from ..core import boundary as B
from ..core.problem import Problem
from ..lazy import Ratio
from ..program.chain import Chain
from ..tree import NAMESPACE
from .guided import Guided, guided_draw
from .local import (
    Flat,
    exact_param_grads,
    param_directional,
    param_leaves,
    param_vector,
    per_position,
    unflatten_params,
    where,
)
from .model_level import ModelLevel, NodePerturbation, Prepared
from .sums import Sums
from .twin import Twins, twin_costates, twin_network, twin_vjp
from .zbp import ZBP

__all__ = ["ControlVariate", "control_variate"]


BETAS = ("ema", "xfit")
DIRECTIONAL = ("exact", "fd")
PREFIX = {"input": "", "params": "param_"}


class ControlVariate:
    """A probe estimator with the twins as a control variate (see module doc)."""

    def __init__(
        self,
        estimator: ZBP | ModelLevel | Guided,
        twin: Callable[..., Any] | Mapping[str, Callable[..., Any]],
        beta: float | str = 1.0,
        twin_directional: str = "exact",
        decay: float = 0.9,
        shrink: float | str | None = None,
        horizon: float = 1.0,
    ):
        base = estimator.estimator if isinstance(estimator, Guided) else estimator
        if not isinstance(base, ZBP | ModelLevel):
            raise TypeError(
                "control_variate: wraps E.zbp(...) (stage level), E.node_perturbation(...) or E.direct(...) "
                f"(model level), or E.guided(...) of one, got {type(estimator).__name__}"
            )
        self.base, self.guided = base, (estimator if isinstance(estimator, Guided) else None)
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
        if (
            shrink is not None
            and shrink != "auto"
            and not (isinstance(shrink, numbers.Real) and not isinstance(shrink, bool) and 0 <= float(shrink) <= 1)
        ):
            raise ValueError(f"control_variate: shrink must be None, a number in [0, 1] or 'auto', got {shrink!r}")
        if isinstance(horizon, bool) or not isinstance(horizon, numbers.Real) or not 1 <= horizon < float("inf"):
            raise ValueError(f"control_variate: horizon must be a finite number of steps >= 1, got {horizon!r}")
        if horizon != 1 and shrink != "auto":
            raise ValueError("control_variate: horizon= sets shrink='auto''s lambda; give shrink='auto' with it")
        probes = base.probes
        if beta == "xfit" and (probes.kind == "orthogonal" or probes.n < (4 if probes.antithetic else 2)):
            raise ValueError(
                "control_variate: beta='xfit' fits each half of the probes on the other, so it needs two "
                f"non-empty halves of independent probes, got {probes!r}; use another kind or more probes"
            )
        if beta == "xfit" and self.guided is not None:
            raise ValueError(
                "control_variate: beta='xfit' needs halves of probes of one law, but guided probes are "
                "not (the first goes along the twin's costate); use a number or 'ema'"
            )
        self.estimator, self.beta, self.twin_directional, self.decay = estimator, beta, twin_directional, float(decay)
        self.shrink, self.horizon = (shrink if shrink in (None, "auto") else float(shrink)), float(horizon)
        self.scope = base.scope
        self.state: Mapping[tuple[str, str], tuple[Any, ...]] = MappingProxyType({})

    @property
    def differentiates(self) -> bool:
        return self.base.differentiates

    @property
    def fd(self) -> bool:
        """Whether the wrapped estimator measures by central differences (and probes parameters)."""
        return self.base.fd

    def __repr__(self) -> str:
        shrink = "" if self.shrink is None else f", shrink={self.shrink!r}, horizon={self.horizon:g}"
        return (
            f"control_variate({self.estimator!r}, {self.twins!r}, beta={self.beta!r}, "
            f"twin_directional={self.twin_directional!r}, decay={self.decay:g}{shrink})"
        )

    def observe(self, res: Any) -> ControlVariate:
        """This estimator with its running sums (what ``beta="ema"`` reads) updated from the
        ``beta_fit`` of every physical stage in ``res.stats``, a sweep's result (and guided probes'
        last parameter estimates, ``Guided.observe``); ``self`` unchanged."""
        state = dict(self.state)
        for name, entry in res.stats.items():
            for space, prefix in PREFIX.items():
                fit = entry.get(f"{prefix}beta_fit") if isinstance(entry, Mapping) else None
                if isinstance(fit, Ratio):
                    num, den = state.get((name, space), (0.0, 0.0))
                    state[(name, space)] = (self.decay * num + fit.num, self.decay * den + fit.den)
        new = copy.copy(self)
        new.state = MappingProxyType(state)
        if self.guided is not None:  # and the guide's last parameter estimates
            new.estimator = new.guided = self.guided.observe(res)
        return new

    def check(self, chain: Chain, physical: tuple[int, ...]) -> None:
        self.twins.check(chain, physical)

    @property
    def own_guides(self) -> bool:
        """Whether guided probes follow other twins than this estimator's (their own twin sweep)."""
        return self.guided is not None and self.guided.twins.twin is not self.twins.twin

    def sums(self, s: torch.Tensor) -> Sums:
        return Sums(s, 2 if self.beta == "xfit" else 1, self.base.probes.antithetic)

    def variance_factor(self, d: int, guides: int = 0) -> float:
        """v: the wrapped estimator's ``E‖ĝ − g‖² / ‖g‖²`` for one scalar over dimension ``d``, with
        ``guides`` of the probes measuring guide directions exactly (the others probe the other d − m)."""
        probes = self.base.probes
        n = probes.n / 2 if probes.antithetic else probes.n  # a pair is one independent direction
        n, d = n - guides, d - guides
        if probes.kind == "orthogonal":
            return max(d / n - 1, 0.0)
        return (d + 1) / n if probes.kind == "gaussian" else (d - 1) / n

    def estimate(self, sums: Sums, name: str, space: str, d: int | None = None) -> tuple[torch.Tensor, dict[Any, Any]]:
        """The estimate from ``sums``; ``d``: the dimension one scalar probes (default: ``s``'s last)."""
        shrink = None
        if self.shrink is not None:
            guides = 0
            if self.guided is not None:  # the twin's direction, and the parameters' last estimates
                guides = 1 + (len(self.guided.past_guides(name)) if space == "params" else 0)
            v = self.variance_factor(sums.s.shape[-1] if d is None else d, guides)
            lam = self.horizon / (self.horizon + v) if self.shrink == "auto" else float(self.shrink)
            shrink = (lam, v, self.horizon)
        return sums.estimate(self.beta, self.state.get((name, space)), self.base.probes.n, PREFIX[space], shrink)

    def prepare(self, problem: Problem) -> Any:
        wrapped = self.base
        if isinstance(wrapped, ZBP):
            return wrapped.prepare(problem)
        measured: dict[Any, Any] = {}

        def costates(run: Any) -> dict[Any, Any]:
            measured["call"] = twin_network(problem, run, self.twins)
            measured["s"] = twin_costates(problem, run, measured["call"])
            return measured["s"]

        guide = None
        if self.guided is not None:  # the guides are this estimator's twins' costates unless other twins guide
            guide = costates if not self.own_guides else self.guided.guides(problem)
        run, chunks = wrapped.measurements(problem, guide=guide)
        s = measured["s"] if "s" in measured else costates(run)
        twin_call = measured["call"]
        twin = None
        if self.twin_directional == "fd" and wrapped.form != "oracle":  # the network of twins, probed alike
            twin = wrapped.measurements(dataclasses.replace(problem, run=twin_call, meter=None), states=run)[1]
        sums: dict[Any, Any] = {}
        for chunk, paired in zip(chunks, repeat(None) if twin is None else twin):
            shared = None
            for i, (u, ug) in chunk.items():
                if paired is not None:
                    us = paired[i][1]
                else:  # the scalar of s summed as the wrapped estimator sums (np: over the stages)
                    shared = (
                        shared
                        if shared is not None
                        else sum(per_position(v * s[j], ug.ndim - 1) for j, (v, _) in chunk.items())
                    )
                    us = shared
                if i not in sums:
                    sums[i] = self.sums(s[i])
                sums[i].add(u, ug, us)
        costs, estimates = wrapped.costs(problem), {}
        # the dimension one scalar probes: np's is a sample's over every probed stage, direct's a position's
        per_sample = sum(s[j][(0,) * (s[j].ndim - 1)].numel() * positions(s[j]) for j in s)
        for i, acc in sums.items():
            d = per_sample if isinstance(wrapped, NodePerturbation) else None
            estimates[i], stats = self.estimate(acc, problem.chain.names[i], "input", d)
            costs[i] = {**costs[i], **stats}
        return Prepared(estimates, costs)

    def stage_vjp(self, problem: Problem, prepared: Any, i: int, h_in: Any, costate: Any):
        wrapped, fn = self.base, self.twins.of(problem, i)
        floats, _, costate_like = B.split(h_in, f"input of {where(problem, i)}")
        flat = Flat(floats, wrapped.probes.batch_dims, f"input of {where(problem, i)}")
        probing = self.fd and bool(param_leaves(problem.params[i])[0])
        if isinstance(wrapped, ZBP):
            twin_grads, twin_in = twin_vjp(problem, i, h_in, costate, fn)
            cost: dict[Any, Any] = {"queries": 2 * wrapped.probes.n, "twin_calls": 1}
            guide = self.guide_vjp(problem, i, h_in, costate, (twin_grads, twin_in), cost)
            estimate = []
            if flat.d:
                s = flat.vector(optree.tree_leaves(twin_in, namespace=NAMESPACE))
                draw = None
                if guide is not None:
                    draw = guided_draw(wrapped.probes, flat.vector(optree.tree_leaves(guide[1], namespace=NAMESPACE)))
                twin = (
                    wrapped.directional(problem, i, h_in, costate, fn, draw=draw)
                    if self.twin_directional == "fd"
                    else None
                )
                sums = self.sums(s)
                for (u, ug), paired in zip(
                    wrapped.directional(problem, i, h_in, costate, draw=draw), repeat(None) if twin is None else twin
                ):
                    sums.add(u, ug, per_position(u * s, ug.ndim - 1) if paired is None else paired[1])
                total, stats = self.estimate(sums, problem.chain.names[i], "input")
                estimate = flat.leaves(total)
                cost.update(stats)
        else:  # estimated in prepare; the twin's vjp here only for probed parameters
            twin_grads = twin_vjp(problem, i, h_in, costate, fn)[0] if probing else None
            cost = {**prepared.costs[i], "twin_calls": 1 + probing + self.own_guides}
            guide = self.guide_vjp(problem, i, h_in, costate, (twin_grads, None), cost) if probing else None
            estimate = flat.leaves(prepared.costates[i]) if flat.d else []
        if probing:
            draw = None if self.guided is None or guide is None else self.guided.param_draw(problem, i, guide[0])
            grads, param_cost = self.param_grads(problem, i, h_in, costate, fn, twin_grads, draw)
            if self.guided is not None:
                param_cost.update(self.guided.recorded(problem, i, grads))
        elif self.fd:  # no parameters: the (empty) tree is its own gradient
            grads, param_cost = problem.params[i], {}
        else:
            grads, param_cost = exact_param_grads(problem, i, h_in, costate)
        return grads, costate_like(estimate), {**cost, **param_cost}

    def guide_vjp(
        self, problem: Problem, i: int, h_in: Any, costate: Any, twin: tuple[Any, ...], cost: dict[Any, Any]
    ) -> tuple[Any, ...] | None:
        """The guiding twin's ``(parameter gradients, input costate)`` at stage i: ``twin`` (this
        estimator's twin's) where the same twin guides, else its own vjp (one more twin call in
        ``cost``); ``None`` unguided."""
        if self.guided is None:
            return None
        other = self.guided.twins.of(problem, i)
        if other is self.twins.of(problem, i):
            return twin
        cost["twin_calls"] += 1
        return twin_vjp(problem, i, h_in, costate, other)

    def param_grads(
        self,
        problem: Problem,
        i: int,
        h_in: Any,
        costate: Any,
        fn: Callable[..., Any],
        twin_grads: Any,
        draw: Callable[..., Any] | None,
    ) -> tuple[Any, dict[Any, Any]]:
        """The control variate on stage i's probed parameter directions (``draw``: guided ones), ``s_W``
        the twin's parameter vjp ``twin_grads``."""
        wrapped = self.base
        probing = (wrapped.probes, wrapped.eps)
        s = param_vector(problem, i, twin_grads)
        twin = (
            param_directional(problem, i, h_in, costate, *probing, fn, draw) if self.twin_directional == "fd" else None
        )
        sums = self.sums(s)
        for (v, vg), paired in zip(
            param_directional(problem, i, h_in, costate, *probing, draw=draw), repeat(None) if twin is None else twin
        ):
            sums.add(v, vg, (v * s).sum(-1) if paired is None else paired[1])
        total, cost = self.estimate(sums, problem.chain.names[i], "params")
        return unflatten_params(problem, i, total), {**cost, "param_queries": 2 * wrapped.probes.n}


def positions(s: torch.Tensor) -> int:
    """Positions per sample of a ``(batch, *positions, d)`` costate vector (1 without positions)."""
    return int(torch.Size(s.shape[1:-1]).numel()) if s.ndim > 2 else 1


def control_variate(
    estimator: ZBP | ModelLevel,
    twin: Callable[..., Any] | Mapping[str, Callable[..., Any]],
    beta: float | str = 1.0,
    twin_directional: str = "exact",
    decay: float = 0.9,
    shrink: float | str | None = None,
    horizon: float = 1.0,
) -> ControlVariate:
    """``ĝ = β s + (1/n) Σ u_i (u_i·g − β u_i·s)``: a probe estimator (``E.zbp`` at the stage level,
    ``E.node_perturbation`` or ``E.direct`` at the model level) with the twins' costates ``s`` as a
    control variate; unbiased, with the wrapped estimator's error at ``g − βs`` in place of ``g``.
    ``twin``: ``fn(params, h)`` for every physical stage, or a mapping from stage name to function;
    ``beta``: a number, ``"xfit"`` (cross-fitted halves) or ``"ema"`` (from earlier steps: thread
    it with ``cv = cv.observe(res)``; decay ``decay``); ``twin_directional``: ``"exact"`` or ``"fd"``
    (the twin measured as the stage is, at the same ±εu); ``shrink``: ``None`` (unbiased), λ in [0, 1]
    (``β s + λ (ĝ − β s)``: 0 is the twin, 1 the control variate) or ``"auto"`` (λ* = h / (h + v) for
    ``horizon=h`` steps); see the module doc for the math and its stats."""
    return ControlVariate(estimator, twin, beta, twin_directional, decay, shrink, horizon)
