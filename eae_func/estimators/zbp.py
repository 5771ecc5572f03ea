"""Chained zeroth-order backprop (ZBP): each physical stage estimates its own
input costate from the costate at its output,

    p_in ≈ (1/n) Σ_i u_i <J u_i, p_out>      (inner product per batch position)

with ``J u`` from ``torch.func.jvp`` (method "jvp", vmapped over a chunk of
probes) or from central differences ``(h(x+εu) − h(x−εu)) / 2ε`` of the black
box (method "fd": the stage is called on plain tensors, the chunk's ± copies
folded into the leading batch dim, never under torch.func). Errors compound
along the chain. Taking the scalar per batch position is unbiased when the
stage does not mix those positions (``batch_dims=1``: samples); for a stage that
mixes tokens, use ``batch_dims=1`` so the scalar sums over the whole sample.

Parameters of a physical stage: exact local vjp ("jvp"), or probed parameter
directions ("fd"). Cost per physical stage: ``queries = 2n`` stage forwards per
sample (the black-box price of the input costate), ``param_queries = 2n`` when
"fd" probes parameters; the rows and calls actually run are counted by ``problem.charge``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.func import jvp, vmap

from ..core import boundary as B
from ..core.problem import Problem
from ..program.physical import rows_of
from .local import (
    Flat,
    OutputLeaves,
    check_eps,
    check_probes,
    exact_param_grads,
    fd_param_grads,
    fold,
    forward_mode,
    inner,
    perturb_folded,
    unfold,
    where,
)
from .probes import Probes

__all__ = ["ZBP", "zbp"]


METHODS = ("jvp", "fd")


class ZBP:
    """Chained ZBP with ``probes``, directional derivatives by ``method`` ("jvp" | "fd"), step ``eps``."""

    scope = "stage"

    @property
    def differentiates(self) -> bool:
        return self.method == "jvp"

    @property
    def fd(self) -> bool:
        """Whether it measures by central differences (and probes the stage's parameters)."""
        return self.method == "fd"

    def __init__(self, probes: Probes, method: str = "jvp", eps: float = 1e-3):
        self.probes = check_probes("zbp", probes)
        if method not in METHODS:
            raise ValueError(f"zbp: unknown method {method!r}; expected one of {METHODS}")
        if method == "fd" and probes.batch_dims < 1:
            raise ValueError(
                "zbp: method 'fd' folds probes into the leading batch dim, so it needs "
                f"Probes(batch_dims >= 1), got batch_dims={probes.batch_dims}"
            )
        self.method, self.eps = method, check_eps("zbp", eps)

    def __repr__(self) -> str:
        return f"zbp({self.probes!r}, method={self.method!r}, eps={self.eps:g})"

    def prepare(self, problem: Problem) -> None:
        return None

    def stage_vjp(
        self,
        problem: Problem,
        prepared: None,
        i: int,
        h_in: Any,
        costate: Any,
        draw: Callable[..., Any] | None = None,
        param_draw: Callable[..., Any] | None = None,
    ):
        """The reverse step of physical stage i; ``draw`` as in ``directional``, ``param_draw`` the
        parameter directions' (``local.param_directional``)."""
        floats, _, costate_like = B.split(h_in, f"input of {where(problem, i)}")
        flat = Flat(floats, self.probes.batch_dims, f"input of {where(problem, i)}")
        estimate = []
        if flat.d:
            total = torch.zeros_like(flat.vector(floats))
            for u, slopes in self.directional(problem, i, h_in, costate, draw=draw):
                total += (u * slopes.unsqueeze(-1)).sum(0)
            estimate = flat.leaves(total / self.probes.n)
        if self.method == "jvp":
            grads, param_cost = exact_param_grads(problem, i, h_in, costate)
        else:
            grads, param_cost = fd_param_grads(problem, i, h_in, costate, self.probes, self.eps, param_draw)
        return (
            grads,
            costate_like(estimate),
            {"queries": 2 * self.probes.n, **param_cost},
        )

    def directional(
        self,
        problem: Problem,
        i: int,
        h_in: Any,
        costate: Any,
        fn: Callable[..., Any] | None = None,
        draw: Callable[..., Any] | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(u, <J u, p>)`` chunk by chunk: stage i's input probes ``u: (k, *batch_shape, d)`` (its
        ``"input"`` stream) and the directional derivatives of its output along them against the
        costate ``p``, per batch position ``(k, *batch_shape)``, measured by ``method``; with
        ``fn(params, h)`` in place of the stage (a twin: the same probes and ±εu, not a call of the
        stage); with ``draw(seed, batch_shape, d, dtype, device)``, the chunks of directions it yields
        in place of the probes'. Nothing when the input has no differentiable leaf."""
        floats, rebuild, _ = B.split(h_in, f"input of {where(problem, i)}")
        flat = Flat(floats, self.probes.batch_dims, f"input of {where(problem, i)}")
        if not flat.d:
            return
        x = flat.vector(floats)
        stage = OutputLeaves(problem, i, fn)
        for u in (draw or self.probes.chunks)(problem.probe_seed(i), flat.batch_shape, flat.d, x.dtype, x.device):
            k = u.shape[0]
            if self.method == "jvp":
                if fn is None:
                    problem.charge(i, k * rows_of(h_in), "jvp_calls")

                def directional(t: torch.Tensor) -> list[Any]:
                    return jvp(lambda f: stage(problem.params[i], rebuild(f)), (floats,), (flat.leaves(t),))[1]

                with forward_mode():
                    slopes = vmap(directional)(u)
            else:
                if fn is None:
                    problem.charge(i, 2 * k * rows_of(h_in))
                with torch.no_grad():
                    shifted = perturb_folded(
                        fold(h_in, 2 * k), 2 * k, flat, self.eps * torch.cat([u, -u]), f"input of {where(problem, i)}"
                    )
                    out = stage(problem.params[i], shifted)
                    stage_out = unfold(out, 2 * k, f"output of {where(problem, i)}")
                    slopes = [(t[:k] - t[k:]) / (2 * self.eps) for t in stage_out]
            s = inner(slopes, stage.costates(costate), flat.batch_dims, f"output of {where(problem, i)}")
            if s.shape[1:] != flat.batch_shape:
                raise ValueError(
                    f"output of {where(problem, i)}: zbp takes <J u, p> per batch position, but the "
                    f"output's batch dims {tuple(s.shape[1:])} differ from the input's "
                    f"{tuple(flat.batch_shape)}; use fewer batch_dims"
                )
            yield u, s


def zbp(probes: Probes, method: str = "jvp", eps: float = 1e-3) -> ZBP:
    """Chained ZBP: every physical stage estimates ``p_in ≈ (1/n) Σ u_i <J u_i, p_out>`` (see module doc)."""
    return ZBP(probes, method, eps)
