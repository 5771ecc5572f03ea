"""Twin-guided probes for zbp: the direction the twin's costate points is measured exactly, the rest
isotropically, so probes are spent where the twin may be wrong:

    ŝ = s / ‖s‖ per position       s: the twin's vjp of the costate at the stage's measured input
    ĝ = ŝ <J ŝ, p> + (1/(n−1)) Σ_i u⊥_i <J u⊥_i, p>,      u⊥ = u − ŝ (ŝ·u),  u gaussian or rademacher

One of the n probes is ŝ itself, which gives ŝ·g (up to fd's truncation); the other n − 1 are
isotropic probes with their ŝ component removed, so ``E[u⊥ u⊥ᵀ] = I − ŝŝᵀ`` and the second term is
an unbiased estimate of g's part orthogonal to ŝ: ĝ is unbiased, with error
``d/(n−1) ‖g − ŝ(ŝ·g)‖²`` per position (gaussian) where zbp's is ``(d+1)/n ‖g‖²``. Guidance pays as
far as the twin's costate is aligned with the exact one (cos² > 1 − (n−1)(d+1)/(n d), about 1/n):
at d = 64, n = 8 and a twin 44% off (cos ≈ 0.9), a fifth of zbp's error; a twin unrelated to the
stage costs zbp's error times n d / ((n−1)(d+1)). The same rows and calls as zbp, and one twin vjp;
where ``s`` is zero at a position, that position's probes are all isotropic.
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
from .local import Flat, exact_param_grads, fd_param_grads, where
from .probes import Probes
from .twin import Twins, twin_vjp
from .zbp import ZBP

__all__ = ["Guided", "guided"]


class Guided:
    """zbp with one probe along the twin's costate and the others orthogonal to it (module doc)."""

    scope = "stage"

    def __init__(self, estimator: ZBP, twin: Callable | Mapping[str, Callable]):
        if not isinstance(estimator, ZBP):
            raise TypeError(f"guided: wraps E.zbp(...), got {type(estimator).__name__}")
        probes = estimator.probes
        if probes.n < 2 or probes.kind not in ("gaussian", "rademacher") or probes.antithetic:
            raise ValueError(
                f"guided: needs n >= 2 independent gaussian or rademacher probes (one goes along the twin's "
                f"costate), got {probes!r}"
            )
        self.estimator, self.twins = estimator, Twins("guided", twin)
        rest = Probes(probes.n - 1, probes.kind, probes.chunk, probes.batch_dims)
        self.rest = ZBP(rest, estimator.method, estimator.eps)

    @property
    def differentiates(self) -> bool:
        return self.estimator.differentiates

    def __repr__(self) -> str:
        return f"guided({self.estimator!r}, {self.twins!r})"

    def check(self, chain: Chain, physical: tuple[int, ...]) -> None:
        self.twins.check(chain, physical)

    def prepare(self, problem: Problem) -> None:
        return None

    def stage_vjp(self, problem: Problem, prepared: None, i: int, h_in: Any, costate: Any):
        floats, _, costate_like = B.split(h_in, f"input of {where(problem, i)}")
        flat = Flat(floats, self.estimator.probes.batch_dims, f"input of {where(problem, i)}")
        estimate = []
        if flat.d:
            s = flat.vector(optree.tree_leaves(twin_vjp(problem, i, h_in, costate, self.twins.of(problem, i))[1],
                                               namespace=NAMESPACE))  # fmt: skip
            norm = s.norm(dim=-1, keepdim=True)
            guide = torch.where(norm > 0, s / torch.where(norm > 0, norm, 1.0), 0.0)

            def along(seed: int, batch_shape: Any, d: int, dtype: Any, device: Any) -> Iterator[torch.Tensor]:
                yield guide.to(dtype).unsqueeze(0)

            def across(seed: int, batch_shape: Any, d: int, dtype: Any, device: Any) -> Iterator[torch.Tensor]:
                for u in self.rest.probes.chunks(seed, batch_shape, d, dtype, device):
                    yield u - guide * (u * guide).sum(-1, keepdim=True)

            total = torch.zeros_like(flat.vector(floats))
            for u, slopes in self.estimator.directional(problem, i, h_in, costate, draw=along):
                total += (u * slopes.unsqueeze(-1)).sum(0)
            for u, slopes in self.estimator.directional(problem, i, h_in, costate, draw=across):
                total += (u * slopes.unsqueeze(-1)).sum(0) / self.rest.probes.n
            estimate = flat.leaves(total)
        if self.estimator.method == "jvp":
            grads, param_cost = exact_param_grads(problem, i, h_in, costate)
        else:
            grads, param_cost = fd_param_grads(problem, i, h_in, costate, self.estimator.probes, self.estimator.eps)
        return grads, costate_like(estimate), {"queries": 2 * self.estimator.probes.n, "twin_calls": 1, **param_cost}


def guided(estimator: ZBP, twin: Callable | Mapping[str, Callable]) -> Guided:
    """zbp whose probes are guided by ``twin`` (``fn(params, h)``, or one per stage name): one along the
    twin's costate, measured exactly, the other n − 1 isotropic and orthogonal to it; unbiased, and
    better than zbp as far as the twin points the right way (module doc)."""
    return Guided(estimator, twin)
