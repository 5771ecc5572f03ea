"""The local vector-Jacobian product of one stage: the reverse step of the method.

    x' = h(W, x)        (J_W^T p, J_x^T p) = vjp(h at (W, x))(p)

computed as ``torch.utils.checkpoint`` computes it: the stage's graph built from x with detached,
requires-grad copies of W's trainable leaves and of x's differentiable ones, then one
``torch.autograd.grad`` of p (cheaper per stage than ``torch.func.vjp``'s wrapping, same memory),
which frees the graph as it runs and records no double-backward graph. A parameter that is
frozen (``requires_grad=False`` in its module), integer or never read gets ``None``, as plain
autograd leaves its ``.grad``; an input the output does not depend on gets zeros.

``local_vjp`` serves the fold (kept and rebuilt graphs, the I/W halves of a zero-bubble backward)
and the estimators' exact forms; the loss boundary and run-time cuts (a module rebuilt in place)
call ``pull_back`` on graphs of their own, and FSDP stages, whose backward runs FSDP's hooks into
``.grad``, share ``connected``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import optree
import torch
from torch.autograd.graph import get_gradient_edge

from .. import compat
from ..tree import NAMESPACE
from . import boundary as B

__all__ = ["connected", "cotangent", "local_vjp", "places", "pull_back"]


def places(outputs: Sequence[torch.Tensor]) -> list[Any]:
    """Each output's place in the graph, ``None`` for one that requires no grad (a constant of the
    stage). The places, not the outputs: an output the graph does not save (a residual sum) is freed
    before the vjp runs, as checkpoint's recomputed output is."""
    return [get_gradient_edge(t) if t.requires_grad else None for t in outputs]


def connected(outputs: Sequence[Any], cotangents: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """The outputs (or their places) that are in the graph, i.e. not ``None``, and their cotangents:
    the others pull nothing back."""
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if o is not None]
    return [o for o, _ in pairs], [c for _, c in pairs]


def pull_back(outputs: Sequence[Any], cotangents: Sequence[Any], wanted: Sequence[torch.Tensor]) -> Sequence[Any]:
    """``Σ_k J_k^T c_k`` with respect to each tensor of ``wanted``, ``J_k`` the Jacobian of output k
    (a tensor or its place; ``None``: not in the graph), by one ``torch.autograd.grad``; ``None`` for
    a wanted tensor no connected output depends on. Each cotangent has its output's shape (the
    callers' costates come from autograd or from passes that keep the shape), so torch's own
    checks of them are skipped (``compat.pull_back_unchecked``)."""
    graph, cots = connected(outputs, cotangents)
    if not graph or not wanted:
        return [None] * len(wanted)
    return compat.pull_back_unchecked(graph, cots, wanted)


def cotangent(costate: list[Any], layout: B.Layout) -> list[Any]:
    """The costate leaves (one per output leaf of ``layout``, ``None``: none) as the cotangent of the
    output's differentiable leaves: in their dtype, zeros where the costate has none."""
    return [
        torch.zeros(shape, dtype=dt, device=dev) if c is None else c if c.dtype == dt else c.to(dt)
        for c, shape, (dev, dt), m in zip(costate, layout.shapes, layout.placements, layout.mask)
        if m
    ]


def local_vjp(
    fn: Callable[..., Any],
    params: Any,
    floats: list[Any],
    rebuild: Callable[..., Any],
    frozen: frozenset[str] = frozenset(),
    wrt: tuple[bool, bool] = (True, True),
    check: Callable[..., Any] | None = None,
    has_aux: bool = False,
) -> tuple[Any, ...]:
    """``(output, pullback)`` of ``fn(params, rebuild(floats))`` run with its local autograd graph (with
    ``has_aux``, ``fn`` returns ``(output, aux)`` and this ``(output, pullback, aux)``), as
    ``torch.func.vjp`` returns them. ``pullback(cotangents, inputs_too=True)`` is ``(J_W^T p, J_x^T p)``
    for the cotangents of the output's differentiable leaves (``cotangent``): the first in params'
    structure, ``None`` where a leaf is not differentiated (named in ``frozen``, a top-level key;
    integer; or not read), the second one tensor per leaf of ``floats`` (zeros where the output does
    not depend on it), ``None`` with ``inputs_too=False``. ``wrt = (params_too, inputs_too)``:
    ``(False, True)`` / ``(True, False)`` build the graph of the inputs alone / the parameters alone
    (the I and W halves of a zero-bubble backward). The output is still attached to the graph; ``check(output leaves, inputs)`` sees it
    before the pullback is made."""
    params_too, inputs_too = wrt
    unflatten: Callable[[list[Any]], Any]
    if type(cast(object, params)) is dict and all(isinstance(t, torch.Tensor) for t in params.values()):  # a module's
        names, leaves = list(params), list(params.values())
        unflatten = lambda xs: dict(zip(names, xs))
    else:  # any pytree (a function stage): a frozen name is a top-level key
        tree: Any = params
        paths, leaves, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
        names, unflatten = [path[0] if path else None for path in paths], spec.unflatten
    trainable = [params_too and B.is_differentiable(t) and name not in frozen for name, t in zip(names, leaves)]
    n = len(leaves)
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_(m) for t, m in zip(leaves, trainable)]
        inputs += [t.detach().requires_grad_(inputs_too) for t in floats]
        result = fn(unflatten(inputs[:n]), rebuild(inputs[n:]))
    out = result[0] if has_aux else result
    flat_out = B.flat(out)
    if check is not None:
        check(flat_out, inputs)
    edges = places([t for t in flat_out if B.is_differentiable(t)])

    def pullback(cotangents: list[Any], inputs_too: bool = True) -> tuple[Any, ...]:
        sources = inputs if inputs_too else inputs[:n]
        wanted = [t for t in sources if t.requires_grad]
        grads = iter(pull_back(edges, cotangents, wanted))
        full = [next(grads) if t.requires_grad else None for t in sources]
        if not inputs_too:
            return unflatten(full), None
        return unflatten(full[:n]), [torch.zeros_like(t) if g is None else g for g, t in zip(full[n:], inputs[n:])]

    return (out, pullback, result[1]) if has_aux else (out, pullback)
