"""The exact local vjp as an estimator: the reference every estimator is measured against."""

from __future__ import annotations

from typing import Any

from ..core.problem import Problem
from ..program.physical import rows_of
from .local import exact_vjp

__all__ = ["exact"]


class Exact:
    """``(grad W_i, p_i) = vjp(h_i, (W_i, x_i))(p_{i+1})``: what the sweep does for a digital stage."""

    scope = "stage"
    differentiates = True

    def prepare(self, problem: Problem) -> None:
        return None

    def stage_vjp(self, problem: Problem, prepared: None, i: int, h_in: Any, costate: Any):
        problem.charge(i, rows_of(h_in))
        problem.charge(i, 0, "backward_calls")
        return (*exact_vjp(problem, i, h_in, costate), {})

    def __repr__(self) -> str:
        return "exact()"


def exact() -> Exact:
    """An estimator that differentiates physical stages exactly (a sanity check: equals no estimator)."""
    return Exact()
