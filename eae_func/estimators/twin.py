"""Reverse steps for a physical stage that query nothing: a differentiable twin, or none.

    twin:    (grad W, p_in) = vjp(twin_fn at (W, x_measured))(p_out)
             physics-aware training (Wright et al., Nature 2022): the forward runs on the black
             box, so x_measured (the stage's input) and every state downstream, hence p_out, are
             the physical ones; only the Jacobian comes from the twin, evaluated where the
             hardware actually was. Exact when the twin equals the black box.
    frozen:  (grad W, p_in) = (0, 0): nothing passes upstream of the stage (the readout-only
             baseline: only stages after it learn), its own parameters untouched.

Neither runs the black box in the reverse sweep: its rows are the forward's only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

from .. import boundary as B
from ..tree import NAMESPACE
from .base import Problem
from .local import exact_vjp, where


class Twin:
    """Physics-aware training: the vjp of ``twin_fn(params, h)`` at the physical stage's measured input."""

    scope = "stage"
    differentiates = False  # the twin is differentiated, never the black box

    def __init__(self, twin_fn: Callable):
        if not callable(twin_fn):
            raise TypeError(
                f"twin: expected a differentiable function twin_fn(params, h), got {type(twin_fn).__name__}"
            )
        self.twin_fn = twin_fn

    def __repr__(self) -> str:
        return f"twin({getattr(self.twin_fn, '__name__', type(self.twin_fn).__name__)})"

    def prepare(self, problem: Problem) -> None:
        return None

    def stage_vjp(self, problem: Problem, prepared: None, i: int, h_in: Any, costate: Any):
        want = [
            None if p is None else tuple(p.shape)
            for p in optree.tree_leaves(costate, none_is_leaf=True, namespace=NAMESPACE)
        ]

        def twin(params: Any, h: Any) -> Any:
            out = self.twin_fn(params, h)
            got = [tuple(t.shape) for t in optree.tree_leaves(out, namespace=NAMESPACE)]
            if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
                raise ValueError(f"twin of {where(problem, i)}: its output has shapes {got}, the stage's {want}")
            return out

        grads, input_costate = exact_vjp(problem, i, h_in, costate, twin)
        return grads, input_costate, {"twin_calls": 1}


class Frozen:
    """No costate upstream of the physical stage and no gradients for its parameters or any upstream
    (``None``, as autograd gives behind a ``detach``)."""

    scope = "stage"
    differentiates = False

    def __repr__(self) -> str:
        return "frozen()"

    def prepare(self, problem: Problem) -> None:
        return None

    def stage_vjp(self, problem: Problem, prepared: None, i: int, h_in: Any, costate: Any):
        floats, _, costate_like = B.split(h_in, f"input of {where(problem, i)}")
        grads = optree.tree_map(lambda t: None, problem.params[i], namespace=NAMESPACE)
        return grads, costate_like([None] * len(floats)), {}


def twin(twin_fn: Callable) -> Twin:
    """Physics-aware training: forward on the black box, reverse through ``twin_fn(params, h)``'s vjp
    at the black box's measured input (see module doc)."""
    return Twin(twin_fn)


def frozen() -> Frozen:
    """The readout-only baseline: no costate passes upstream of the physical stage; its params and
    those upstream get no gradient (``None``)."""
    return Frozen()
