"""Pure functions as chains: ``model_fn(params, x)`` over any params pytree, cut at ``ef.cut`` marks.

    def model_fn(p, x):
        h = embed(p["embed"], x)
        for i, layer in enumerate(p["layers"]):
            h = ef.cut(block(layer, h), f"block{i}")
        return head(p["head"], h)

    grads = ef.grad(model_fn, params, x, y, loss=F.cross_entropy)

``cut(h, name)`` is the identity in plain PyTorch (autograd and ``torch.func.grad`` see nothing).
The capture exports ``model_fn`` with ``torch.export`` (``strict=False``), where each cut puts an
identity op ``eae_func::cut`` on every tensor leaf of ``h``; the graph is split there (the marks
themselves are removed): stage k is what runs between cut k-1 and cut k and is named by cut k, the
last stage ``"output"``. Each stage reads exactly the parameter leaves its operations use, named by
their pytree paths (``"layers.0.wq"``); a leaf read by several stages is tied (its gradient is the
sum of the uses'). Every value alive across a cut (the residual stream, a mask) travels in the
boundary, as in ``eae_func.program.capture``.

The graph is fixed to the example's shapes and Python values (a module's train/eval mode, a
closed-over number), so a capture is kept per function, params layout and input layout, with a
fingerprint of what the function reads from its closure and globals (modules, tensors, plain
values, the helper functions it calls), and made again when that changes.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import nn
from torch.export.graph_signature import InputKind

from ..cache import kept, register
from ..tree import NAMESPACE
from . import capture, exporting
from . import user_code as U
from .captured_stage import Piece, layout
from .chain import Stage

__all__ = ["capture_function", "captured", "cut"]


_MARKS = threading.local()  # .cuts: the names of the cuts seen so far, while a capture runs on this thread


@torch.library.custom_op("eae_func::cut", mutates_args=())
def _mark(x: torch.Tensor, index: int) -> torch.Tensor:
    """The mark of cut ``index`` in a captured graph (removed before the graph is run)."""
    return x.clone()


@_mark.register_fake
def _(x: torch.Tensor, index: int) -> torch.Tensor:
    return torch.empty_like(x)


def cut(h: Any, name: str | None = None) -> Any:
    """Mark a stage boundary after ``h`` (a tensor or any pytree of them) inside a function given to
    ``ef.grad`` / ``ef.value_and_grad`` / ``ef.sweep``; ``name`` names the stage that ends here (for
    passes, ``physical=`` and ``stats``). Returns ``h`` itself: the identity outside a capture."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"cut: name must be a string or None, got {type(name).__name__}")
    cuts = getattr(_MARKS, "cuts", None)
    if cuts is None:
        return h
    index = len(cuts)
    cuts.append(name)
    return optree.tree_map(
        lambda t: _mark(t, index) if isinstance(t, torch.Tensor) else t, h, namespace=NAMESPACE, none_is_leaf=True
    )


class _Traced(nn.Module):
    """``model_fn`` as a module over the flat leaves of ``(params, inputs)``, as export takes them."""

    def __init__(self, fn: Callable[..., Any], params_spec: Any, inputs_spec: Any):
        super().__init__()
        self.fn, self.params_spec, self.inputs_spec = fn, params_spec, inputs_spec

    def forward(self, *leaves: Any) -> Any:
        n = self.params_spec.num_leaves
        return self.fn(self.params_spec.unflatten(leaves[:n]), *self.inputs_spec.unflatten(leaves[n:]))


class _Piece:
    """One stage of a captured function: ``fn(params_l, h) -> h'``, ``params_l`` a dict of its leaves."""

    def __init__(self, piece: Piece, name: str):
        self.piece, self.__name__ = piece, name

    def __call__(self, params: dict[Any, Any], h: Any) -> Any:
        return self.piece.run(params.__getitem__, h)


@dataclasses.dataclass(frozen=True)
class Captured:
    """A function cut into ``stages`` (``ties``: leaves read by several); ``leaves`` are the params'
    leaf names in their flat order, ``spec`` their structure."""

    stages: tuple[Stage, ...]
    ties: tuple[Any, ...]
    leaves: tuple[str, ...]
    spec: Any

    def per_stage(self, tree: Any, leaf: Callable[..., Any] = lambda v: v) -> tuple[dict[Any, Any], ...]:
        """A tree in params' structure (``tree``'s entry at each leaf position, passed through ``leaf``)
        as one dict ``{leaf name: entry}`` per stage, of the leaves it reads."""
        flat = dict(zip(self.leaves, map(leaf, self.spec.flatten_up_to(tree))))
        return tuple({n: flat[n] for n in s.param_names or ()} for s in self.stages)

    def assemble(self, per_stage: tuple[Any, ...], default: Any) -> Any:
        """One value per leaf from per-stage dicts (a tied leaf's from its lowest stage: the last
        the fold reaches), in ``spec``'s structure; ``default(j)`` for leaf j that no stage reads
        (or whose value is ``None``)."""
        found: dict[Any, Any] = {}
        for stage in per_stage:
            for n, v in stage.items():
                if v is not None:
                    found.setdefault(n, v)
        return self.spec.unflatten([found[n] if n in found else default(j) for j, n in enumerate(self.leaves)])


_CAPTURED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
register("captured functions", "ef.cut: the graphs captured from a function (weakly), per input layout (the 8 "
         "used last per function)", lambda: _CAPTURED.clear())  # fmt: skip


def captured(fn: Callable[..., Any], params: Any, inputs: tuple[Any, ...]) -> Captured:
    """``fn``'s capture for ``params``' and ``inputs``' layouts: kept per function and layouts with
    the fingerprint of what it reads from outside (``closure``), captured again when that changes."""
    owner = getattr(fn, "__func__", fn)  # a bound method is made anew at every attribute access
    key = (id(getattr(fn, "__self__", None)), _layout(params), _layout(inputs))
    try:
        cache = _CAPTURED.setdefault(owner, {})
    except TypeError:  # not weakly referenceable: captured every call
        cache = {}
    with exporting.LOCK:  # a second thread capturing the same function waits and finds this capture
        return kept(cache, key, U.closure(fn), lambda: capture_function(fn, params, inputs))


def _layout(tree: Any) -> tuple[Any, ...]:
    """A capture's cache key for ``tree``: its structure, ``captured_stage.layout`` of its leaves, their devices."""
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    devices = tuple(t.device for t in leaves if isinstance(t, torch.Tensor))
    return spec, tuple(_hashable(v) for v in layout(leaves)), devices


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return "object", id(value)
    return value


def capture_function(fn: Callable[..., Any], params: Any, inputs: tuple[Any, ...]) -> Captured:
    """``fn(params, *inputs)`` captured and cut at its ``cut`` marks (see the module docstring)."""
    label = U.label(fn)
    paths, leaves, spec = optree.tree_flatten_with_path(params, namespace=NAMESPACE)
    names = _leaf_names(paths)
    for name, t in zip(names, leaves):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"params: leaves must be tensors, {name!r} is a {type(t).__name__}")
    tree: Any = list(inputs)
    data, inputs_spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    cuts: list[Any] = []
    _MARKS.cuts = cuts
    try:
        program, drew = exporting.exported(_Traced(fn, spec, inputs_spec), (*(t.detach() for t in leaves), *data), {})
    except exporting.Refused:
        raise
    except Exception as e:
        where = U.user_line(e) or label
        if exporting.data_dependent(e):
            raise ValueError(
                f"{label}: a branch on a tensor's value at {where} cannot be captured (the cuts and "
                f"stages must be the same for every input); compute the branch with torch.where, or "
                f"move it out of the function"
            ) from e
        raise RuntimeError(
            f"{label}: torch.export could not capture it at {where}: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    finally:
        del _MARKS.cuts
    if drew:
        raise ValueError(
            f"{label} draws from Python's {' and '.join(drew)} at {U.drawn_at(fn, params, inputs) or label}; "
            f"a capture would bake that one draw into every later call: draw with torch's RNG "
            f"(torch.rand, dropout), which the sweep replays"
        )
    if not cuts:
        raise ValueError(
            f"{label} has no ef.cut: mark where one stage ends and the next begins, e.g. "
            f"h = ef.cut(block(p['layers'][i], h), f'block{{i}}') after each block"
        )
    stage_of = _unmarked(program)
    sources = _sources(program, names, fn)
    n = len(cuts) + 1
    pieces = capture.split(
        program, stage_of, n, sources, functools.partial(optree.tree_leaves, namespace=NAMESPACE), inputs, label
    )
    stage_names = [c or f"stage_{k}" for k, c in enumerate(cuts)] + ["output"]
    stage_names = [s if stage_names.count(s) == 1 else f"{s}#{k}" for k, s in enumerate(stage_names)]
    stages, ties = _stages(pieces, stage_names, {name: (t.shape, t.dtype) for name, t in zip(names, leaves)})
    return Captured(stages, ties, tuple(names), spec)


def _unmarked(program: Any) -> dict[Any, Any]:
    """Each node's stage, counted by the ``cut`` marks before it, the marks taken out of the graph
    (a function that returns a cut's output returns the value it marked)."""
    graph = program.graph_module.graph
    stage_of, current, marked = {}, 0, {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.eae_func.cut.default:
            current, marked[node.name] = node.args[1] + 1, node.args[0].name
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.op not in ("placeholder", "output"):
            stage_of[node] = current
    program.graph_module.recompile()
    for out in program.graph_signature.output_specs:
        out.arg.name = marked.get(out.arg.name, out.arg.name)
    return stage_of


def _stages(
    pieces: list[Any], stage_names: list[str], layout: dict[Any, Any]
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``(stages, ties)``: a stage per piece, reading the parameter leaves it reads (``layout``: each
    leaf's shape and dtype, in the params' order); a leaf read by several stages is tied."""
    order = list(layout)
    stages, readers = [], {}
    for k, (piece, name) in enumerate(zip(pieces, stage_names)):
        read = tuple(sorted({key for kind, key in piece.sources.values() if kind == "parameter"}, key=order.index))
        for leaf in read:
            readers.setdefault(leaf, []).append((k, leaf))
        stages.append(
            Stage(
                fn=_Piece(piece, name),
                name=name,
                param_names=read,
                param_layout=tuple(layout[leaf] for leaf in read),
            )
        )
    return tuple(stages), tuple(tuple(group) for group in readers.values() if len(group) > 1)


def _leaf_names(paths: list[Any]) -> list[str]:
    """Dotted pytree paths (``layers.0.wq``), made unique where two paths print alike."""
    names = [".".join(str(k) for k in path) or "params" for path in paths]
    return [n if names.count(n) == 1 else f"{n}#{j}" for j, n in enumerate(names)]


def _sources(program: Any, names: list[str], fn: Callable[..., Any]) -> dict[Any, Any]:
    """Where each graph input that is not the user's data comes from: the params' leaves (the first
    user inputs) and constants; a closed-over tensor that requires grad is refused."""
    sources, j, trainable = {}, 0, None
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            if j < len(names):
                sources[spec.arg.name] = ("parameter", names[j])
            j += 1
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            value = program.constants[spec.target]
            trainable = U.trainable(fn) if trainable is None else trainable
            if isinstance(value, torch.Tensor) and (value.requires_grad or value.data_ptr() in trainable):
                what = trainable.get(value.data_ptr(), f"a tensor of shape {tuple(value.shape)}")
                raise ValueError(
                    f"{U.label(fn)} reads {what}, a tensor that requires grad, from outside its params: a "
                    f"capture would treat it as a constant and give it no gradient. Pass it in params (a "
                    f"module's weights: torch.func.functional_call(module, params['block'], (h,))), or "
                    f"detach it (or requires_grad_(False)) if it is not trained"
                )
            sources[spec.arg.name] = ("constant", spec.target)
        else:
            raise RuntimeError(
                f"{U.label(fn)}: the captured graph has an input of kind {spec.kind}, which eae_func cannot feed"
            )
    return sources
