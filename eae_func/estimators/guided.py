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
guided alike, along the twin's parameter gradient (one more twin vjp per stage for np and direct).

With the control variate, ``E.control_variate(E.guided(estimator, twin), twin)``: exact twin
directional derivatives give ŝ·(g − βs) + ŝ·βs = ŝ·g and u⊥·s = 0, so at λ = 1 it is the guided
estimate itself, whatever β; what it adds is ``shrink=`` (and ``twin_directional="fd"``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import optree
import torch

from .. import boundary as B
from ..chain import Chain
from ..tree import NAMESPACE
from .base import Problem
from .local import Flat, param_leaves, param_vector, where
from .model_level import ModelLevel, Prepared
from .probes import Probes, guide
from .twin import Twins, twin_costates, twin_network, twin_vjp
from .zbp import ZBP

__all__ = ["Guided", "guided", "guided_draw"]


class Guided:
    """zbp, np or direct with one probe along the twins' costates and the others orthogonal to
    them (module doc)."""

    def __init__(self, estimator: ZBP | ModelLevel, twin: Callable | Mapping[str, Callable]):
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
        self.estimator, self.twins, self.scope = estimator, Twins("guided", twin), estimator.scope

    @property
    def differentiates(self) -> bool:
        return self.estimator.differentiates

    def __repr__(self) -> str:
        return f"guided({self.estimator!r}, {self.twins!r})"

    def check(self, chain: Chain, physical: tuple[int, ...]) -> None:
        self.twins.check(chain, physical)

    def guides(self, problem: Problem) -> Callable[[Any], dict]:
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
        param_draw = guided_draw(probes, param_vector(problem, i, twin[0])) if twin is not None and probing else None
        if isinstance(wrapped, ModelLevel):
            grads, input_costate, cost = wrapped.stage_vjp(problem, prepared, i, h_in, costate, param_draw)
            return grads, input_costate, {**cost, "twin_calls": 1 + probing}
        draw = None
        if twin is not None and flat.d:
            draw = guided_draw(probes, flat.vector(optree.tree_leaves(twin[1], namespace=NAMESPACE)))
        grads, input_costate, cost = wrapped.stage_vjp(problem, prepared, i, h_in, costate, draw, param_draw)
        return grads, input_costate, {**cost, "twin_calls": int(guiding)}


def guided_draw(probes: Probes, s: torch.Tensor) -> Callable[..., Iterator[torch.Tensor]]:
    """A ``draw`` of ``probes`` guided along ``s``, one scalar per batch position: ``(*batch_shape, d)``
    for zbp's input directions, ``(d,)`` for fd's parameter directions."""

    def draw(seed: int, batch_shape: Any, d: int, dtype: Any, device: Any) -> Iterator[torch.Tensor]:
        first = 0
        for u in probes.chunks(seed, batch_shape, d, dtype, device):
            yield guide({0: u}, {0: s}, first, probes.n, len(batch_shape))[0]
            first += len(u)

    return draw


def guided(estimator: ZBP | ModelLevel, twin: Callable | Mapping[str, Callable]) -> Guided:
    """zbp, np or direct whose probes are guided by ``twin`` (``fn(params, h)``, or one per stage
    name): one along the twin's costate, measured exactly, the other n − 1 isotropic and orthogonal
    to it; unbiased, and better than the estimator alone as far as the twin points the right way
    (module doc)."""
    return Guided(estimator, twin)
