"""Reverse steps for a physical stage that query nothing: a differentiable twin, or none.

    twin:    (grad W, p_in) = vjp(twin_fn at (W, x_measured))(p_out)    (one twin_fn, or one per stage name)
             physics-aware training (Wright et al., Nature 2022): the forward runs on the black
             box, so x_measured (the stage's input) and every state downstream, hence p_out, are
             the physical ones; only the Jacobian comes from the twin, evaluated where the
             hardware actually was. Exact when the twin equals the black box.
    frozen:  (grad W, p_in) = (0, 0): nothing passes upstream of the stage (the readout-only
             baseline: only stages after it learn), its own parameters untouched.

Neither runs the black box in the reverse sweep: its rows are the forward's only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch

from ..core import boundary as B
from ..core.problem import Problem
from ..program.chain import Chain, stage
from ..tree import NAMESPACE
from .local import exact_vjp, where

__all__ = ["Twins", "frozen", "twin", "twin_costates", "twin_network", "twin_vjp"]


class Twins:
    """The twin of every physical stage: one ``fn(params, h)`` for all, or a mapping from stage name
    to function (``entry`` names the estimator in errors)."""

    def __init__(self, entry: str, twin: Callable[..., Any] | Mapping[str, Callable[..., Any]]):
        if not callable(twin) and not (
            isinstance(twin, Mapping) and all(isinstance(k, str) and callable(f) for k, f in twin.items())
        ):
            raise TypeError(
                f"{entry}: expected a differentiable function twin(params, h), or a mapping from stage name "
                f"to one, got {type(twin).__name__}"
            )
        self.entry, self.twin = entry, twin

    def __repr__(self) -> str:
        if isinstance(self.twin, Mapping):
            return "{" + ", ".join(f"{k!r}: {name_of(f)}" for k, f in self.twin.items()) + "}"
        return name_of(self.twin)

    def check(self, chain: Chain, physical: tuple[int, ...]) -> None:
        """Refuse a mapping that misses a physical stage."""
        if isinstance(self.twin, Mapping):
            missing = [chain.names[i] for i in physical if chain.names[i] not in self.twin]
            if missing:
                raise ValueError(
                    f"{self.entry}: no twin for the physical stage(s) {missing}; the mapping names {list(self.twin)}"
                )

    def of(self, problem: Problem, i: int) -> Callable[..., Any]:
        """Stage i's twin."""
        return self.twin[problem.chain.names[i]] if isinstance(self.twin, Mapping) else self.twin


def name_of(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def twin_network(problem: Problem, run: Any, twins: Twins) -> Callable[..., Any]:
    """``call(i, params, h)``: digital stages as the forward ran them, each physical stage as its
    twin shifted to the output a model-level estimator's ``run`` measured at its measured input
    (the states are the hardware's, only the Jacobians the twins')."""
    offsets = {}
    with torch.no_grad():
        for i in problem.physical:
            out = twins.of(problem, i)(problem.params[i], run.boundaries[i])
            offsets[i] = optree.tree_map(torch.sub, run.outputs[i], out, namespace=NAMESPACE)

    def call(i: int, params: Any, h: Any) -> Any:
        if i not in offsets:
            return problem.call(i, params, h)
        out = twins.of(problem, i)(params, h)
        return optree.tree_map(tiled_add, out, offsets[i], namespace=NAMESPACE)

    return call


def twin_costates(problem: Problem, run: Any, call: Callable[..., Any]) -> dict[Any, Any]:
    """``s_l``: the input costate ``(*batch_shape, d_l)`` of every probed physical stage of ``run``
    from a reverse sweep through ``call`` (``twin_network``), times the microbatch's loss share."""
    assert problem.exact_trace is not None  # checked by the model-level estimator's measurements
    trace = {a.index: a.value for a in problem.exact_trace(network(problem.chain, call))}
    return {
        i: run.flats[i].vector(optree.tree_leaves(trace[i], namespace=NAMESPACE)) * problem.loss_scale
        for i in run.probed
    }


def tiled_add(out: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``out + offset``, the offset repeated over copies folded into the leading dim of ``out``."""
    if out.ndim and out.shape[0] != offset.shape[0]:
        offset = offset.repeat(out.shape[0] // offset.shape[0], *[1] * (offset.ndim - 1))
    return out + offset


def network(chain: Chain, call: Callable[..., Any]) -> Chain:
    """``chain`` with every stage i run as ``call(i, params, h)``."""
    return Chain([stage(lambda p, h, i=i: call(i, p, h), name=n) for i, n in enumerate(chain.names)], loss=chain.loss)


def twin_vjp(problem: Problem, i: int, h_in: Any, costate: Any, fn: Callable[..., Any]) -> tuple[Any, Any]:
    """``(J_W(fn)ᵀ p, J_x(fn)ᵀ p)`` at stage i's params and measured input ``h_in``: the twin's
    parameter gradients and its input costate (mirroring ``h_in``)."""
    want = [
        None if p is None else tuple(p.shape)
        for p in optree.tree_leaves(costate, none_is_leaf=True, namespace=NAMESPACE)
    ]

    def twin(params: Any, h: Any) -> Any:
        out = fn(params, h)
        got = [tuple(t.shape) for t in optree.tree_leaves(out, namespace=NAMESPACE)]
        if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
            raise ValueError(f"twin of {where(problem, i)}: its output has shapes {got}, the stage's {want}")
        return out

    return exact_vjp(problem, i, h_in, costate, twin)


class Twin:
    """Physics-aware training: the vjp of the stage's twin ``fn(params, h)`` at its measured input."""

    scope = "stage"
    differentiates = False  # the twin is differentiated, never the black box

    def __init__(self, twin_fn: Callable[..., Any] | Mapping[str, Callable[..., Any]]):
        self.twins = Twins("twin", twin_fn)

    def __repr__(self) -> str:
        return f"twin({self.twins!r})"

    def check(self, chain: Chain, physical: tuple[int, ...]) -> None:
        self.twins.check(chain, physical)

    def prepare(self, problem: Problem) -> None:
        return None

    def stage_vjp(self, problem: Problem, prepared: None, i: int, h_in: Any, costate: Any):
        grads, input_costate = twin_vjp(problem, i, h_in, costate, self.twins.of(problem, i))
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


def twin(twin_fn: Callable[..., Any] | Mapping[str, Callable[..., Any]]) -> Twin:
    """Physics-aware training: forward on the black box, reverse through its twin's vjp at the black
    box's measured input (see module doc). ``twin_fn(params, h)`` serves every physical stage; a
    mapping from stage name to function gives each its own."""
    return Twin(twin_fn)


def frozen() -> Frozen:
    """The readout-only baseline: no costate passes upstream of the physical stage; its params and
    those upstream get no gradient (``None``)."""
    return Frozen()
