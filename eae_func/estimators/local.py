"""What every estimator does with one stage: its input as a flat probe space,
black-box calls with probes folded into the batch, exact local vjps, and
parameter gradients from probed parameter directions."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..core import boundary as B
from ..core import vjp as V
from ..core.problem import Problem
from ..program.physical import rows_of
from ..tree import NAMESPACE
from .probes import Probes

__all__ = [
    "Flat",
    "OutputLeaves",
    "call",
    "check_eps",
    "check_probes",
    "exact_param_grads",
    "exact_vjp",
    "fd_param_grads",
    "fold",
    "forward_mode",
    "inner",
    "param_directional",
    "param_leaves",
    "param_vector",
    "per_position",
    "perturb_folded",
    "unflatten_params",
    "unfold",
    "where",
]


def where(problem: Problem, i: int) -> str:
    return f"stage {i} ({problem.chain.stages[i].name!r})"


def check_eps(estimator: str, eps: Any) -> float:
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not float(eps) > 0 or eps == float("inf"):
        raise ValueError(f"{estimator}: eps must be a finite number > 0, got {eps!r}")
    return float(eps)


def check_probes(estimator: str, probes: Any) -> Probes:
    if not isinstance(probes, Probes):
        raise TypeError(f"{estimator}: expected a Probes(n, kind, ...) as probes, got {type(probes).__name__}")
    return probes


def forward_mode():
    """Context for forward-mode AD: the math SDPA backend (the fused kernels have no forward AD)."""
    return sdpa_kernel(SDPBackend.MATH)


class Flat:
    """The differentiable leaves of a boundary state as one tensor ``(*batch_shape, d)``:
    ``batch_shape`` the first ``batch_dims`` dims (shared by all leaves), ``d`` the rest of every
    leaf flattened and concatenated."""

    def __init__(self, floats: list[Any], batch_dims: int, context: str):
        for t in floats:
            if t.ndim < batch_dims:
                raise ValueError(
                    f"{context}: batch_dims={batch_dims} exceeds the rank of an input leaf of shape {tuple(t.shape)}"
                )
        shapes = [tuple(t.shape) for t in floats]
        batch_shapes = {s[:batch_dims] for s in shapes}
        if len(batch_shapes) > 1:
            raise ValueError(f"{context}: input leaves disagree on their first {batch_dims} (batch) dims: {shapes}")
        self.batch_dims, self.shapes = batch_dims, shapes
        self.batch_shape = batch_shapes.pop() if batch_shapes else ()
        self.sizes = [int(torch.Size(s[batch_dims:]).numel()) for s in shapes]
        self.d = sum(self.sizes)

    def vector(self, floats: list[Any]) -> torch.Tensor:
        """``(*batch_shape, d)`` from the leaves."""
        return torch.cat([t.reshape(*self.batch_shape, -1) for t in floats], dim=-1)

    def leaves(self, v: torch.Tensor) -> list[Any]:
        """The leaves from ``v: (*lead, *batch_shape, d)``, each ``(*lead, *leaf_shape)``."""
        lead = v.shape[: v.ndim - len(self.batch_shape) - 1]
        return [piece.reshape((*lead, *shape)) for piece, shape in zip(v.split(self.sizes, dim=-1), self.shapes)]


def per_position(v: torch.Tensor, batch_dims: int, lead: int = 1) -> torch.Tensor:
    """Sum of ``v`` over every dim after its first ``lead + batch_dims``."""
    return v.reshape(*v.shape[: lead + batch_dims], -1).sum(-1)


def inner(tangents: list[Any], costates: list[Any], batch_dims: int, where: str) -> torch.Tensor:
    """``Σ_leaves <tangent, costate>`` per probe and batch position: tangents ``(k, *leaf_shape)``."""
    total = None
    for t, p in zip(tangents, costates):
        if p is None:
            continue
        if t.shape[1 : 1 + batch_dims] != tangents[0].shape[1 : 1 + batch_dims]:
            raise ValueError(f"{where}: output leaves disagree on their first {batch_dims} (batch) dims")
        term = per_position(t * p, batch_dims)
        total = term if total is None else total + term
    if total is None:
        raise ValueError(f"{where}: the stage output has no costate to probe against")
    return total


def fold(h: Any, k: int) -> Any:
    """``k`` copies of the boundary state ``h`` stacked into its leading (batch) dim: ``(k·B, ...)``."""
    return optree.tree_map(
        lambda t: t.expand(k, *t.shape).reshape(k * t.shape[0], *t.shape[1:]), h, namespace=NAMESPACE
    )


def perturb_folded(h: Any, k: int, flat: Flat, delta: torch.Tensor, where: str) -> Any:
    """The folded state ``h`` (``k`` copies) with copy j's differentiable leaves shifted by ``delta[j]``."""
    floats, rebuild, _ = B.split(h, where)
    shifted = []
    for t, dt in zip(floats, flat.leaves(delta)):
        if t.ndim == 0 or t.shape[0] != k * dt.shape[1]:
            raise ValueError(
                f"{where}: cannot fold {k} probe copies into the leading dim of a leaf of shape "
                f"{tuple(t.shape)}; finite differences need a batch dim first (batch_dims >= 1)"
            )
        shifted.append((t.view(k, *dt.shape[1:]) + dt).view(t.shape))
    return rebuild(shifted)


def unfold(out: Any, k: int, where: str) -> list[Any]:
    """Differentiable leaves of a folded output, each ``(k, B, ...)``."""
    floats, _, _ = B.split(out, where)
    result = []
    for t in floats:
        if t.ndim == 0 or t.shape[0] % k:
            raise ValueError(
                f"{where}: output leaf of shape {tuple(t.shape)} lost the {k} folded probe copies; "
                "the stage must keep its leading (batch) dim"
            )
        result.append(t.view(k, t.shape[0] // k, *t.shape[1:]))
    return result


class OutputLeaves:
    """Stage i (or ``fn(params, h)`` in its place) as ``f(params, h) -> [differentiable output
    leaves]``; ``mask`` records which output leaves those are (set on the first call), to pair
    them with the costate's leaves."""

    def __init__(self, problem: Problem, i: int, fn: Callable[..., Any] | None = None):
        self.problem, self.i, self.fn = problem, i, fn
        self.mask: list[bool] = []

    def __call__(self, params: Any, h: Any) -> list[Any]:
        out = call(self.problem, self.i, params, h) if self.fn is None else self.fn(params, h)
        flat = B.leaves(out, f"output of {where(self.problem, self.i)}")[0]
        self.mask = [B.is_differentiable(t) for t in flat]
        return [t for t, m in zip(flat, self.mask) if m]

    def costates(self, costate: Any) -> list[Any]:
        """The costate at each differentiable output leaf (``None`` where it has none)."""
        leaves = optree.tree_leaves(costate, none_is_leaf=True, namespace=NAMESPACE)
        return [p for p, m in zip(leaves, self.mask) if m]


def call(problem: Problem, i: int, params: Any, h: Any) -> Any:
    """Stage i's output on ``h`` as the sweep's forward computed it (``Problem.call``)."""
    return problem.call(i, params, h)


def param_leaves(params: Any) -> tuple[list[Any], Any]:
    return optree.tree_flatten(params, namespace=NAMESPACE)


def param_vector(problem: Problem, i: int, grads: Any) -> torch.Tensor:
    """Stage i's parameter gradient tree ``grads`` as one flat vector ``(d,)``."""
    leaves = optree.tree_leaves(grads, namespace=NAMESPACE)
    return Flat(param_leaves(problem.params[i])[0], 0, f"params of {where(problem, i)}").vector(leaves)


def exact_param_grads(problem: Problem, i: int, h_in: Any, costate: Any) -> tuple[Any, dict[Any, Any]]:
    """``J_W(h_i)ᵀ p`` by one local vjp w.r.t. the parameters only (``dense``)."""
    params = problem.params[i]
    if not param_leaves(params)[0]:
        return params, {}  # no parameters: the (empty) tree is its own gradient
    problem.charge(i, rows_of(h_in))
    out, pullback = V.local_vjp(lambda p, h: call(problem, i, p, h), params, [], lambda _: h_in)
    problem.charge(i, 0, "backward_calls")
    grads, _ = pullback(cotangent(problem, i, costate, out), inputs_too=False)
    return dense(grads, params), {}


def exact_vjp(
    problem: Problem, i: int, h_in: Any, costate: Any, fn: Callable[..., Any] | None = None
) -> tuple[Any, Any]:
    """``(J_W(h_i)ᵀ p, J_x(h_i)ᵀ p)`` by one local vjp (``dense``), the input costate mirroring ``h_in``;
    with ``fn(params, h)`` the vjp is ``fn``'s, at stage i's input and params (a twin's)."""
    floats, rebuild, costate_like = B.split(h_in, f"input of {where(problem, i)}")
    stage = (lambda p, h: call(problem, i, p, h)) if fn is None else fn
    out, pullback = V.local_vjp(stage, problem.params[i], floats, rebuild)
    grads, g_in = pullback(cotangent(problem, i, costate, out))
    return dense(grads, problem.params[i]), costate_like(g_in)


def cotangent(problem: Problem, i: int, costate: Any, out: Any) -> list[Any]:
    """The costate at stage i's output ``out`` as the cotangent of its differentiable leaves."""
    leaves, spec = B.leaves(out, f"output of {where(problem, i)}")
    return V.cotangent(B.flat(costate, none_is_leaf=True), B.Layout.of_leaves(leaves, spec))


def dense(grads: Any, params: Any) -> Any:
    """``grads`` with zeros where a differentiable parameter has ``None`` (the stage does not read it):
    the estimators' parameter vectors are dense."""
    return optree.tree_map(
        lambda g, p: torch.zeros_like(p) if g is None and B.is_differentiable(p) else g,
        grads,
        params,
        none_is_leaf=True,
        namespace=NAMESPACE,
    )


def fd_param_grads(
    problem: Problem,
    i: int,
    h_in: Any,
    costate: Any,
    probes: Probes,
    eps: float,
    draw: Callable[..., Any] | None = None,
) -> tuple[Any, dict[Any, Any]]:
    """Parameter gradient from probed parameter directions v (shared by the whole batch):
    ``ĝ_W = (1/n) Σ_i v_i <(h(W+εv_i, x) − h(W−εv_i, x)) / 2ε, p>``, the black box only run forward
    (``draw`` as in ``param_directional``).

    A black box takes one parameter setting per call, so each probe costs two calls on the whole
    batch (a loop over parameter probes, inherent to the hardware, not over samples)."""
    leaves = param_leaves(problem.params[i])[0]
    if not leaves:
        return problem.params[i], {}  # no parameters: the (empty) tree is its own gradient
    estimate = torch.zeros_like(Flat(leaves, 0, f"params of {where(problem, i)}").vector(leaves))
    for v, slopes in param_directional(problem, i, h_in, costate, probes, eps, draw=draw):
        estimate += (v * slopes[:, None]).sum(0)
    return unflatten_params(problem, i, estimate / probes.n), {"param_queries": 2 * probes.n}


def param_directional(
    problem: Problem,
    i: int,
    h_in: Any,
    costate: Any,
    probes: Probes,
    eps: float,
    fn: Callable[..., Any] | None = None,
    draw: Callable[..., Any] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(v, <(h(W+εv) − h(W−εv)) / 2ε, p>)`` chunk by chunk: stage i's parameter probes ``v: (k, d)``
    (its ``"params"`` stream, all leaves flattened) and the central differences of its output along
    them against the costate ``p``, ``(k,)``; with ``fn(params, h)`` in place of the stage (a twin:
    the same probes and steps, not a call of the stage); with ``draw(seed, (), d, dtype, device)``,
    the chunks of directions it yields in place of the probes'."""
    leaves, spec = param_leaves(problem.params[i])
    flat = Flat(leaves, 0, f"params of {where(problem, i)}")
    theta = flat.vector(leaves)
    stage = OutputLeaves(problem, i, fn)
    for v in (draw or probes.chunks)(problem.probe_seed(i, "params"), (), flat.d, theta.dtype, theta.device):
        slopes = []
        with torch.no_grad():  # not around the yield: a consumer's code would run without grad
            for direction in v:
                if fn is None:
                    problem.charge(i, rows_of(h_in))
                plus = stage(spec.unflatten(flat.leaves(theta + eps * direction)), h_in)
                if fn is None:
                    problem.charge(i, rows_of(h_in))
                minus = stage(spec.unflatten(flat.leaves(theta - eps * direction)), h_in)
                slope = [(a - b).unsqueeze(0) / (2 * eps) for a, b in zip(plus, minus)]
                slopes.append(inner(slope, stage.costates(costate), 0, f"output of {where(problem, i)}"))
        yield v, torch.cat(slopes)


def unflatten_params(problem: Problem, i: int, v: torch.Tensor) -> Any:
    """Stage i's parameter tree from its flattened vector ``v: (d,)``."""
    leaves, spec = param_leaves(problem.params[i])
    return spec.unflatten(Flat(leaves, 0, f"params of {where(problem, i)}").leaves(v))
