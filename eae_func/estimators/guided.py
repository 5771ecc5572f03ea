"""Twin-guided probes for zbp, np and direct: the direction the twin's costate points is measured
exactly, the rest isotropically, so the probes are spent where the twin may be wrong:

    ŝ = s / ‖s‖ per scalar                 ũ_0 = √n ŝ,    ũ_i = √(n/(n−1)) (u_i − ŝ (ŝ·u_i))  (i ≥ 1)

``u_i`` are the wrapped estimator's own probes and "per scalar" is what one measured scalar sums
over: a position's features for zbp; a position's (oracle) or a sample's (jvp, fd) for direct; a
sample's over every physical stage for np, so there ŝ and the projection are joint across the
stages. The wrapped estimator runs unchanged on ũ, so with ``u⊥ = u − ŝ(ŝ·u)``

    ĝ = (1/n) Σ_i ũ_i (ũ_i·g) = ŝ (ŝ·g) + (1/(n−1)) Σ_{i≥1} u⊥_i (u⊥_i·g)

``E[u⊥ u⊥ᵀ] = I − ŝŝᵀ`` makes ĝ unbiased, with error ``d/(n−1) ‖g − ŝ(ŝ·g)‖²`` per scalar
(gaussian; d the dimension it sums over) where the estimator's own is ``(d+1)/n ‖g‖²``: guidance
pays as far as the twin's costate is aligned with the exact one, whatever its length
(cos² > 1 − (n−1)(d+1)/(n d), about 1/n); a twin unrelated to the stage costs the estimator's error
times n d / ((n−1)(d+1)). ``s``: for zbp the twin's vjp of the costate at the stage's measured
input; for np and direct the input costates of a reverse sweep through the twins at the states the
estimator measured (as ``E.control_variate`` takes them). The same rows and calls as the wrapped
estimator, and one twin vjp (zbp) or twin sweep (np, direct); where ``s`` is zero, that scalar's
probes are all isotropic. Under fd the probed parameter directions (one vector for the batch) are
guided alike, along the twin's parameter gradient (one more twin vjp per stage for np and direct),
and with ``history=k`` along the stage's last k parameter estimates too: each of them
(``combine="span"``, as guided evolution strategies guide by past gradients) or their mean
(``"mean"``, one direction whose noise the averaging shrinks). With ``q_0..q_{m−1}`` the orthonormal
basis the m guides span (Gram–Schmidt, the twin's first), ``ũ_j = √n q_j`` for j < m and
``ũ_i = √(n/(n−m)) (I − QQᵀ) u_i`` for the rest, so again ``E[(1/n) Σ ũũᵀ] = QQᵀ + (I − QQᵀ) = I``
and the error is ``(d−m+1)/(n−m) ‖(I − QQᵀ) g‖²`` (gaussian). The estimates are threaded as the
control variate's β is: ``guided = guided.observe(res)`` after each sweep keeps the last k that
``res.stats[stage]["param_estimate"]`` holds (the estimate as one vector, summed over
microbatches). They are earlier steps' draws, independent of this step's probes, so the estimate
stays unbiased. A costate cannot be guided by its history: it is per sample, and the earlier
steps' costates are other samples'.

With the control variate, ``E.control_variate(E.guided(estimator, twin), twin)``: exact twin
directional derivatives give ŝ·(g − βs) + ŝ·βs = ŝ·g and u⊥·s = 0, so at λ = 1 it is the guided
estimate itself, whatever β; what it adds is ``shrink=`` (and ``twin_directional="fd"``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import optree
import torch

from ..core import boundary as B
from ..core.problem import Problem
from ..program.chain import Chain
from ..tree import NAMESPACE
from .local import Flat, param_leaves, param_vector, where
from .model_level import ModelLevel, Prepared
from .probes import Probes, guide
from .twin import Twins, twin_costates, twin_network, twin_vjp
from .zbp import ZBP

__all__ = ["Guided", "guided", "guided_draw"]


class Guided:
    """zbp, np or direct with one probe along the twins' costates and the others orthogonal to
    them (module doc)."""

    def __init__(
        self,
        estimator: ZBP | ModelLevel,
        twin: Callable[..., Any] | Mapping[str, Callable[..., Any]],
        history: int = 0,
        combine: str = "span",
    ):
        if isinstance(estimator, Guided) or not isinstance(estimator, ZBP | ModelLevel):
            raise TypeError(
                "guided: wraps E.zbp(...), E.node_perturbation(...) or E.direct(...) (for the control "
                f"variate too, wrap it around: E.control_variate(E.guided(...), twin)), got {type(estimator).__name__}"
            )
        probes = estimator.probes
        if probes.n < 2 or probes.kind not in ("gaussian", "rademacher") or probes.antithetic:
            raise ValueError(
                f"guided: needs n >= 2 independent gaussian or rademacher probes (one goes along the twin's "
                f"costate), got {probes!r}"
            )
        if isinstance(history, bool) or not isinstance(history, int) or history < 0:
            raise ValueError(f"guided: history is how many earlier estimates guide, an int >= 0, got {history!r}")
        if combine not in ("span", "mean"):
            raise ValueError(f"guided: combine is 'span' or 'mean' (how the last estimates guide), got {combine!r}")
        if history and not estimator.fd:
            raise ValueError(
                f"guided: history={history} guides the probed parameter directions, which only fd probes "
                f"(method='fd' or form='fd'); a costate's history is other samples' and cannot guide it"
            )
        guides = 1 + (history if combine == "span" else min(history, 1))
        if probes.n < guides + 1:
            raise ValueError(
                f"guided: history={history}, combine={combine!r} takes {guides} of the n probes along the twin "
                f"and the last estimates, and leaves at least one isotropic: needs n >= {guides + 1}, got {probes!r}"
            )
        self.estimator, self.twins, self.scope = estimator, Twins("guided", twin), estimator.scope
        self.history, self.combine = history, combine
        self.past: Mapping[str, tuple[torch.Tensor, ...]] = MappingProxyType({})

    @property
    def differentiates(self) -> bool:
        return self.estimator.differentiates

    def __repr__(self) -> str:
        history = f", history={self.history}, combine={self.combine!r}" if self.history else ""
        return f"guided({self.estimator!r}, {self.twins!r}{history})"

    def observe(self, res: Any) -> Guided:
        """This estimator with each physical stage's ``param_estimate`` in ``res.stats`` (a sweep's
        result) first among its last ``history`` estimates; ``self`` unchanged."""
        past = dict(self.past)
        for name, entry in res.stats.items():
            estimate = entry.get("param_estimate") if isinstance(entry, Mapping) else None
            if estimate is not None:
                past[name] = (estimate, *past.get(name, ()))[: self.history]
        new = copy.copy(self)
        new.past = MappingProxyType(past)
        return new

    def past_guides(self, name: str) -> tuple[torch.Tensor, ...]:
        """The directions stage ``name``'s last estimates guide along after the twin's: each of them
        (newest first; ``combine="span"``) or their mean (``"mean"``)."""
        past = self.past.get(name, ())
        return (torch.stack(past).mean(0),) if past and self.combine == "mean" else past

    def param_draw(self, problem: Problem, i: int, twin_grads: Any) -> Callable[..., Iterator[torch.Tensor]]:
        """Stage i's probed parameter directions, guided along the twin's parameter gradient
        ``twin_grads`` and then ``past_guides``."""
        past = self.past_guides(problem.chain.names[i])
        return guided_draw(self.estimator.probes, param_vector(problem, i, twin_grads), past)

    def recorded(self, problem: Problem, i: int, grads: Any) -> dict[Any, Any]:
        """What ``observe`` reads: stage i's parameter estimate ``grads`` as one vector (with history)."""
        return {"param_estimate": param_vector(problem, i, grads)} if self.history else {}

    def check(self, chain: Chain, physical: tuple[int, ...]) -> None:
        self.twins.check(chain, physical)

    def guides(self, problem: Problem) -> Callable[[Any], dict[Any, Any]]:
        """``guide(run)``: the twins' input costates at the states a model-level ``run`` measured."""
        return lambda run: twin_costates(problem, run, twin_network(problem, run, self.twins))

    def prepare(self, problem: Problem) -> Prepared | None:
        if isinstance(self.estimator, ZBP):
            return None
        return self.estimator.prepare(problem, guide=self.guides(problem))

    def stage_vjp(self, problem: Problem, prepared: Any, i: int, h_in: Any, costate: Any):
        wrapped, probes = self.estimator, self.estimator.probes
        floats, _, _ = B.split(h_in, f"input of {where(problem, i)}")
        flat = Flat(floats, probes.batch_dims, f"input of {where(problem, i)}")
        probing = wrapped.fd and bool(param_leaves(problem.params[i])[0])  # probed parameter directions
        guiding = probing or (isinstance(wrapped, ZBP) and flat.d > 0)
        twin = twin_vjp(problem, i, h_in, costate, self.twins.of(problem, i)) if guiding else None
        param_draw = self.param_draw(problem, i, twin[0]) if twin is not None and probing else None
        if isinstance(wrapped, ModelLevel):
            grads, input_costate, cost = wrapped.stage_vjp(problem, prepared, i, h_in, costate, param_draw)
            cost = {**cost, "twin_calls": 1 + probing}
        else:
            draw = None
            if twin is not None and flat.d:
                draw = guided_draw(probes, flat.vector(optree.tree_leaves(twin[1], namespace=NAMESPACE)))
            grads, input_costate, cost = wrapped.stage_vjp(problem, prepared, i, h_in, costate, draw, param_draw)
            cost = {**cost, "twin_calls": int(guiding)}
        return grads, input_costate, {**cost, **(self.recorded(problem, i, grads) if probing else {})}


def guided_draw(
    probes: Probes, s: torch.Tensor, past: Sequence[torch.Tensor] = ()
) -> Callable[..., Iterator[torch.Tensor]]:
    """A ``draw`` of ``probes`` guided along ``s``, one scalar per batch position: ``(*batch_shape, d)``
    for zbp's input directions, ``(d,)`` for fd's parameter directions; these are then guided along
    each of ``past`` (``(d,)`` each) in turn: probes j.. along the j-th of them made orthogonal to ``s``
    and the earlier ones, as ``guide`` guides n − j probes (the module doc's ``ũ_j = √n q_j``)."""
    directions = [s, *orthogonalized(s, past)]

    def draw(seed: int, batch_shape: Any, d: int, dtype: Any, device: Any) -> Iterator[torch.Tensor]:
        first = 0
        for u in probes.chunks(seed, batch_shape, d, dtype, device):
            for j, q in enumerate(directions):
                start = max(j - first, 0)  # the chunk's first probe that is j or later
                if start < len(u):
                    tail = guide({0: u[start:]}, {0: q}, max(first - j, 0), probes.n - j, len(batch_shape))[0]
                    # guide gives √(n−j) q_j; the tail's weight so far, √(n/(n−j)), makes it √n q_j
                    if first <= j and j:
                        tail = torch.cat([tail[:1] * math.sqrt(probes.n / (probes.n - j)), tail[1:]])
                    u = torch.cat([u[:start], tail]) if start else tail
            yield u
            first += len(u)

    return draw


def orthogonalized(s: torch.Tensor, past: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each of ``past`` minus its part along ``s`` and the ones before it (Gram–Schmidt, twice for
    rounding); zero where under 1e-6 of it is left (it adds no direction)."""
    basis = [s / s.norm()] if bool(s.norm() > 0) else []
    out = []
    for v in past:
        w = v.to(s.dtype)
        for _ in range(2):
            for q in basis:
                w = w - q * (q @ w)
        if bool(w.norm() > 1e-6 * v.norm()):
            basis.append(w / w.norm())
            out.append(w)
        else:
            out.append(torch.zeros_like(w))
    return out


def guided(
    estimator: ZBP | ModelLevel,
    twin: Callable[..., Any] | Mapping[str, Callable[..., Any]],
    history: int = 0,
    combine: str = "span",
) -> Guided:
    """zbp, np or direct whose probes are guided by ``twin`` (``fn(params, h)``, or one per stage
    name): one along the twin's costate, measured exactly, the other n − 1 isotropic and orthogonal
    to it; unbiased, and better than the estimator alone as far as the twin points the right way.
    ``history=k`` (fd): the probed parameter directions also along the stage's last k estimates
    (``combine="span"``: each, as guided evolution strategies; ``"mean"``: their mean, one probe),
    threaded with ``guided = guided.observe(res)`` (module doc)."""
    return Guided(estimator, twin, history, combine)
