"""``compile=``: each digital stage's forward, and its reverse step as one graph, by ``torch.compile``.

    forward:  x_l = h_l(W_l, x_{l-1})                                 one compiled graph
    reverse:  (J_W^T p_l, J_x^T p_l) = vjp(h_l at (W_l, x_{l-1}))(p_l)  the recompute and the local
                                                                        vjp in one compiled graph
                                                                        (``torch.func.vjp``), which
                                                                        AOTAutograd partitions and fuses

Both are module-level compiled functions of ``(module or fn, params, buffers, x, ...)``:
stages that run the same code on the same shapes (twelve layers of one class) share their graphs,
and a new step, key or microbatch of one shape recompiles nothing. The passes, the RNG replay,
the checks and the fold stay in Python between stages. Random ops run as eager ATen ops inside
the graphs (inductor's ``fallback_random``), so dropout draws from the global RNG exactly as the
uncompiled stage does and the recompute replays its masks bit for bit.

At run time (a model cut with ``split_at`` where it calls the cut modules, ``eae_func.drivers.cuts``), each
cut call's forward is compiled (``call``: the module's own ``forward`` on the call's arguments), and
its rebuild is the same compiled forward with grad, whose backward graph autograd runs for the local
vjp; the RNG, modes, autocast and the parameters it ran with are replayed around it as without
``compile=``. Layers of one class on one shape share the graphs (the module's parameters are the
graph's inputs); a call that keeps its graph or some ops' outputs (``recompute=``) or is physical
runs eager.

On a chain: module and function stages whose graph the remat policy rebuilds, on any boundary of
tensors in tuples, lists, dicts or namedtuples (the graphs flatten it as ``torch.utils._pytree``
does; the costates are put back in the fold's order); physical and FSDP stages, kept graphs and
containers ``torch.utils._pytree`` does not know run as without ``compile=``. A model cut by graph
capture runs each piece between two cuts as its graph on positional inputs (parameters, buffers
and boundary values in the graph's order), and pieces that compute the same share one graph
(``capture.structure``): twelve layers of a captured Llama compile one forward and one reverse.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch.func import functional_call, vjp

from .. import compat
from ..cache import kept, register
from ..compat import pytree
from ..program.captured_stage import CapturedStage
from ..program.slots import module_lock

__all__ = ["call", "eligible", "forward", "reverse"]


def eligible(stage: Any, i: int, opts: Any, layout: Any) -> bool:
    """Whether stage i runs compiled: ``compile=`` given, a digital module or function stage, on a
    boundary of ``layout`` whose containers ``torch.utils._pytree`` knows."""
    return (
        opts.compile is not None and stage.sharded is None and i not in opts.physical and in_order(layout) is not None
    )


def in_order(layout: Any) -> tuple[Any, ...] | None:
    """The fold's index (optree's order) of each leaf of a boundary of ``layout`` in
    ``torch.utils._pytree``'s order, or ``None`` where the two do not see the same leaves."""
    return _order(layout.spec)


@functools.lru_cache(maxsize=256)
def _order(spec: Any) -> tuple[Any, ...] | None:
    n = spec.num_leaves
    order = tuple(k for k in pytree.tree_leaves(spec.unflatten(list(range(n)))) if isinstance(k, int))
    return order if sorted(order) == list(range(n)) else None


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _run(target: Any, params: dict[Any, Any], buffers: dict[Any, Any], h: torch.Tensor) -> tuple[Any, dict[Any, Any]]:
    """The stage's forward: a module on the given tensors (its buffers cloned, so updated ones come
    back), or a function stage."""
    if isinstance(target, torch.nn.Module):
        fresh = {n: b.clone() for n, b in buffers.items()}
        return functional_call(target, {**params, **fresh}, (h,), strict=False), fresh
    return target(params, h), {}


def _reverse(
    target: Any,
    trainable: dict[Any, Any],
    frozen: dict[Any, Any],
    buffers: dict[Any, Any],
    h: Any,
    cotangents: list[Any],
):
    """``(J_W^T p, J_x^T p)``, the latter for h's differentiable leaves, all in pytree order."""
    leaves, spec = pytree.tree_flatten(h)
    where = [k for k, t in enumerate(leaves) if _differentiable(t)]

    def outputs(p: dict[Any, Any], xs: list[Any]) -> list[Any]:
        full = list(leaves)
        for k, x in zip(where, xs):
            full[k] = x
        out, _ = _run(target, {**p, **frozen}, buffers, pytree.tree_unflatten(full, spec))
        return [t for t in pytree.tree_leaves(out) if _differentiable(t)]

    pullback = vjp(outputs, trainable, [leaves[k] for k in where])[1]
    return pullback(cotangents)


def _call(forward: Any, args: tuple[Any, ...], kwargs: dict[Any, Any]) -> Any:
    """A cut module's call at run time."""
    return forward(*args, **kwargs)


def _run_graph(graph: Any, args: list[Any]) -> tuple[Any, ...]:
    """A captured piece's graph on its positional inputs."""
    return graph(*args)


def _reverse_graph(
    graph: Any, args: list[Any], where: tuple[Any, ...], outputs_at: tuple[Any, ...], cotangents: list[Any]
) -> tuple[Any, ...]:
    """The vjp of a captured piece's graph: the cotangents of its outputs ``outputs_at`` pulled back
    to its inputs ``where``."""

    def outputs(xs: list[Any]) -> list[Any]:
        full = list(args)
        for k, x in zip(where, xs):
            full[k] = x
        outs = graph(*full)
        return [outs[k] for k in outputs_at]

    return vjp(outputs, [args[k] for k in where])[1](cotangents)[0]


_COMPILED: dict[str, tuple[Any, ...]] = {}
RECOMPILE_LIMIT = 64  # graphs per compiled function: kinds of stage x shapes
register(
    "compiled", "compile=: the compiled functions per torch.compile options (8 sets), and the pytree orders of "
    "boundary layouts (256)", lambda: (_COMPILED.clear(), _order.cache_clear()),
)  # fmt: skip


def _compiled(opts: Any) -> tuple[Any, ...]:
    """The compiled forward and reverse of module and function stages, then of captured pieces'
    graphs, for ``opts.compile`` (``torch.compile``'s keyword arguments, whose values may be dicts:
    keyed by their repr)."""
    options: dict[str, Any] = {"dynamic": False, **opts.compile}  # one graph per stage kind and shape
    return kept(
        _COMPILED,
        repr(sorted(opts.compile.items())),
        None,
        lambda: tuple(torch.compile(fn, **options) for fn in (_run, _reverse, _run_graph, _reverse_graph, _call)),  # pyright: ignore[reportUnknownMemberType]  # torch.compile's own signature holds Callable[..., Unknown]
    )


def _target(stage: Any) -> Any:
    return stage.module if stage.module is not None else stage.fn


def _between(stage: Any) -> Any:
    """The piece of a captured stage between two cuts (boundary dicts in and out, a graph of its
    own), else ``None``. Such pieces run their graph on positional inputs, so layers that compute
    the same share it (``capture.structure``), and with it the compiled graphs."""
    module = stage.module
    if isinstance(module, CapturedStage):
        piece = module.piece
        if piece.graph is not None and piece.user_inputs is None and piece.user_outputs is None:
            return piece
    return None


def call(opts: Any, forward: Any, *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)`` compiled: a cut module's call at run time (with grad: its rebuild,
    whose backward autograd runs on the compiled backward graph)."""
    with _eager_random():
        return _compiled(opts)[4](forward, args, kwargs)


def forward(
    stage: Any, opts: Any, params: Any, buffers: Mapping[Any, Any], h: torch.Tensor
) -> tuple[Any, dict[Any, Any]]:
    """``stage.call(params, buffers, h)``, compiled."""
    piece = _between(stage)
    if piece is not None:
        args, env = piece.bind({**params, **buffers}.__getitem__, h)
        with _eager_random():
            return piece.collect(env, _compiled(opts)[2](piece.graph, args)), dict(buffers)
    fn = _compiled(opts)[0]
    with _eager_random(), _lock(stage):
        return fn(_target(stage), dict(params), dict(buffers), h)


def reverse(
    stage: Any, opts: Any, params: Any, buffers: Mapping[Any, Any], entry: Any, cotangents: list[Any]
) -> tuple[Any, ...] | None:
    """``(J_W^T p, J_x^T p)`` of the stage at ``params`` on the tape entry's boundary for the
    cotangents of its output's differentiable leaves (both in the fold's order), the recompute and
    the vjp one compiled graph; ``None`` where the output's containers are not ``torch.utils._pytree``'s.
    Only trainable parameters are differentiated: frozen ones (``requires_grad=False`` in the
    module) and integer ones get ``None``."""
    piece = _between(stage)
    if piece is not None:
        return _reverse_piece(piece, opts, params, buffers, entry, cotangents)
    out_order = in_order(entry.out_layout)
    if out_order is None:
        return None
    train = {n: t for n, t in params.items() if n not in entry.frozen and t.is_floating_point()}
    rest = {n: t for n, t in params.items() if n not in train}
    rank = _ranks(entry.out_layout.mask)
    cot = [cotangents[rank[k]] for k in out_order if entry.out_layout.mask[k]]
    fn = _compiled(opts)[1]
    with _eager_random(), _lock(stage):
        grads, g = fn(_target(stage), train, rest, dict(buffers), entry.boundary, cot)
    mask, rank = entry.layout.mask, _ranks(entry.layout.mask)
    g_in: list[Any] = [None] * len(rank)
    for k, gk in zip([k for k in in_order(entry.layout) or () if mask[k]], g):
        g_in[rank[k]] = gk
    return {n: grads.get(n) for n in params}, g_in


def _reverse_piece(
    piece: Any, opts: Any, params: Any, buffers: Mapping[Any, Any], entry: Any, cotangents: list[Any]
) -> tuple[Any, ...]:
    """``reverse`` of a captured piece between two cuts, on its graph: the output's cotangents (by
    node name) pulled back to the trainable parameters and the boundary's differentiable values; a
    value the piece passes through unchanged takes its output cotangent as well."""
    h = entry.boundary
    args, _ = piece.bind({**params, **buffers}.__getitem__, h)
    where: list[int]
    wanted: list[tuple[str, Any]]
    where, wanted = [], []
    for k, name in enumerate(piece.inputs):
        kind, key = piece.sources.get(name, ("value", name))
        if kind == "parameter" and key not in entry.frozen and args[k].is_floating_point():
            where.append(k)
            wanted.append(("parameter", key))
        elif kind == "value" and _differentiable(args[k]):
            where.append(k)
            wanted.append(("value", name))
    out_names = [path[0] for path, m in zip(entry.out_layout.spec.paths(), entry.out_layout.mask) if m]
    cot = dict(zip(out_names, cotangents))
    outputs_at = tuple(k for k, name in enumerate(piece.outputs) if name in cot)
    grads: dict[Any, Any] = dict.fromkeys(params)
    g_in: dict[Any, Any] = {}
    if where and outputs_at:
        with _eager_random():
            pulled = _compiled(opts)[3](
                piece.graph, args, tuple(where), outputs_at, [cot[piece.outputs[k]] for k in outputs_at]
            )
        for (kind, key), g in zip(wanted, pulled):
            into = grads if kind == "parameter" else g_in
            into[key] = g if into.get(key) is None else into[key] + g  # a tensor read twice
    for name, c in cot.items():
        if name in h and name not in piece.outputs:  # passed through
            g_in[name] = c if g_in.get(name) is None else g_in[name] + c
    in_names = [path[0] for path, m in zip(entry.layout.spec.paths(), entry.layout.mask) if m]
    return grads, [g_in[n] if g_in.get(n) is not None else torch.zeros_like(h[n]) for n in in_names]


def _ranks(mask: tuple[Any, ...]) -> dict[Any, Any]:
    """Leaf index -> its place among the differentiable leaves (the fold's costate lists)."""
    return {k: r for r, k in enumerate(k for k, m in enumerate(mask) if m)}


def _lock(stage: Any) -> Any:
    return module_lock(stage.module) if stage.module is not None else contextlib.nullcontext()


def _eager_random() -> Any:
    """Random ops as eager ATen ops inside the compiled graphs (the same draws as without compile=),
    and room for one graph per kind of stage (the two functions are shared by every stage)."""
    return compat.eager_random_compile(RECOMPILE_LIMIT)
