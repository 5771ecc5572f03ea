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
boundary, as in ``eae_func.capture``.

The graph is fixed to the example's shapes and Python values (a module's train/eval mode, a
closed-over number), so a capture is kept per function, params layout and input layout, with a
fingerprint of what the function reads from its closure and globals (modules, tensors, plain
values, the helper functions it calls), and made again when that changes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import linecache
import os
import random
import sys
import sysconfig
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import optree
import torch
from torch import nn
from torch.export.graph_signature import InputKind

from . import capture
from .cache import kept, register
from .chain import Stage
from .tree import NAMESPACE

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

    def __init__(self, fn: Callable, params_spec: Any, inputs_spec: Any):
        super().__init__()
        self.fn, self.params_spec, self.inputs_spec = fn, params_spec, inputs_spec

    def forward(self, *leaves: Any) -> Any:
        n = self.params_spec.num_leaves
        return self.fn(self.params_spec.unflatten(leaves[:n]), *self.inputs_spec.unflatten(leaves[n:]))


class _Piece:
    """One stage of a captured function: ``fn(params_l, h) -> h'``, ``params_l`` a dict of its leaves."""

    def __init__(self, piece: capture.Piece, name: str):
        self.piece, self.__name__ = piece, name

    def __call__(self, params: dict, h: Any) -> Any:
        return self.piece.run(params.__getitem__, h)


@dataclasses.dataclass(frozen=True)
class Captured:
    """A function cut into ``stages`` (``ties``: leaves read by several); ``leaves`` are the params'
    leaf names in their flat order, ``spec`` their structure."""

    stages: tuple[Stage, ...]
    ties: tuple
    leaves: tuple[str, ...]
    spec: Any

    def per_stage(self, tree: Any, leaf: Callable = lambda v: v) -> tuple[dict, ...]:
        """A tree in params' structure (``tree``'s entry at each leaf position, passed through ``leaf``)
        as one dict ``{leaf name: entry}`` per stage, of the leaves it reads."""
        flat = dict(zip(self.leaves, map(leaf, self.spec.flatten_up_to(tree))))
        return tuple({n: flat[n] for n in s.param_names or ()} for s in self.stages)

    def assemble(self, per_stage: tuple, default: Any) -> Any:
        """One value per leaf from per-stage dicts (a tied leaf's from its lowest stage: the last
        the fold reaches), in ``spec``'s structure; ``default(j)`` for leaf j that no stage reads
        (or whose value is ``None``)."""
        found: dict = {}
        for stage in per_stage:
            for n, v in stage.items():
                if v is not None:
                    found.setdefault(n, v)
        return self.spec.unflatten([found[n] if n in found else default(j) for j, n in enumerate(self.leaves)])


_CAPTURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
register("captured functions", "ef.cut: the graphs captured from a function (weakly), per input layout (the 8 "
         "used last per function)", lambda: _CAPTURED.clear())  # fmt: skip


def captured(fn: Callable, params: Any, inputs: tuple) -> Captured:
    """``fn``'s capture for ``params``' and ``inputs``' layouts: kept per function and layouts with
    the fingerprint of what it reads from outside (``closure``), captured again when that changes."""
    owner = getattr(fn, "__func__", fn)  # a bound method is made anew at every attribute access
    key = (id(getattr(fn, "__self__", None)), _layout(params), _layout(inputs))
    try:
        cache = _CAPTURED.setdefault(owner, {})
    except TypeError:  # not weakly referenceable: captured every call
        cache = {}
    with capture.LOCK:  # a second thread capturing the same function waits and finds this capture
        return kept(cache, key, closure(fn), lambda: capture_function(fn, params, inputs))


def _layout(tree: Any) -> tuple:
    """A capture's cache key for ``tree``: its structure, ``capture.layout`` of its leaves, their devices."""
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    devices = tuple(t.device for t in leaves if isinstance(t, torch.Tensor))
    return spec, tuple(_hashable(v) for v in capture.layout(leaves)), devices


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return "object", id(value)
    return value


def capture_function(fn: Callable, params: Any, inputs: tuple) -> Captured:
    """``fn(params, *inputs)`` captured and cut at its ``cut`` marks (see the module docstring)."""
    label = _label(fn)
    paths, leaves, spec = optree.tree_flatten_with_path(params, namespace=NAMESPACE)
    names = _leaf_names(paths)
    for name, t in zip(names, leaves):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"params: leaves must be tensors, {name!r} is a {type(t).__name__}")
    tree: Any = list(inputs)
    data, inputs_spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    cuts: list = []
    _MARKS.cuts = cuts
    try:
        program, drew = capture.exported(_Traced(fn, spec, inputs_spec), (*(t.detach() for t in leaves), *data), {})
    except capture.Refused:
        raise
    except Exception as e:
        where = _user_line(e) or label
        if capture.data_dependent(e):
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
            f"{label} draws from Python's {' and '.join(drew)} at {_drawn_at(fn, params, inputs) or label}; "
            f"a capture would bake that one draw into every later call: draw with torch's RNG "
            f"(torch.rand, dropout), which the sweep replays"
        )
    if not cuts:
        raise ValueError(
            f"{label} has no ef.cut: mark where one stage ends and the next begins, e.g. "
            f"h = ef.cut(block(p['layers'][i], h), f'block{{i}}') after each block"
        )
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
    for out in program.graph_signature.output_specs:  # a function that returns a cut's output
        out.arg.name = marked.get(out.arg.name, out.arg.name)
    sources = _sources(program, names, fn)
    n = len(cuts) + 1
    pieces = capture.split(
        program, stage_of, n, sources, functools.partial(optree.tree_leaves, namespace=NAMESPACE), inputs, label
    )
    stage_names = [c or f"stage_{k}" for k, c in enumerate(cuts)] + ["output"]
    stage_names = [s if stage_names.count(s) == 1 else f"{s}#{k}" for k, s in enumerate(stage_names)]
    layout = {name: (t.shape, t.dtype) for name, t in zip(names, leaves)}
    stages, readers = [], {}
    for k, (piece, name) in enumerate(zip(pieces, stage_names)):
        read = tuple(sorted({key for kind, key in piece.sources.values() if kind == "parameter"}, key=names.index))
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
    ties = tuple(tuple(group) for group in readers.values() if len(group) > 1)
    return Captured(tuple(stages), ties, tuple(names), spec)


def _leaf_names(paths: list) -> list[str]:
    """Dotted pytree paths (``layers.0.wq``), made unique where two paths print alike."""
    names = [".".join(str(k) for k in path) or "params" for path in paths]
    return [n if names.count(n) == 1 else f"{n}#{j}" for j, n in enumerate(names)]


def _sources(program: Any, names: list[str], fn: Callable) -> dict:
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
            trainable = _trainable(fn) if trainable is None else trainable
            if isinstance(value, torch.Tensor) and (value.requires_grad or value.data_ptr() in trainable):
                what = trainable.get(value.data_ptr(), f"a tensor of shape {tuple(value.shape)}")
                raise ValueError(
                    f"{_label(fn)} reads {what}, a tensor that requires grad, from outside its params: a "
                    f"capture would treat it as a constant and give it no gradient. Pass it in params (a "
                    f"module's weights: torch.func.functional_call(module, params['block'], (h,))), or "
                    f"detach it (or requires_grad_(False)) if it is not trained"
                )
            sources[spec.arg.name] = ("constant", spec.target)
        else:
            raise RuntimeError(
                f"{_label(fn)}: the captured graph has an input of kind {spec.kind}, which eae_func cannot feed"
            )
    return sources


def _label(fn: Callable) -> str:
    """``model_fn (file.py:12)``: the function and where it is defined."""
    target = getattr(fn, "func", fn)
    code = getattr(getattr(target, "__func__", target), "__code__", None)
    name = getattr(target, "__qualname__", type(target).__name__)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def _values(fn: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of what ``fn`` reads from outside its arguments: a partial's bound arguments,
    a method's object, a function's closure cells and the globals its code names, a callable object's
    attributes."""
    if isinstance(fn, functools.partial):
        return [("partial", (fn.args, fn.keywords)), *_values(fn.func)]
    if inspect.ismethod(fn):
        return [("self", fn.__self__), *_values(fn.__func__)]
    if isinstance(fn, types.FunctionType):
        found = inspect.getclosurevars(fn)
        return [*found.nonlocals.items(), *found.globals.items()]
    if callable(fn) and hasattr(fn, "__dict__"):
        return list(vars(fn).items())
    return []


_LIBRARIES = (
    *(os.path.dirname(m.__file__ or "") + os.sep for m in (torch, optree, np)),
    os.path.dirname(__file__) + os.sep,
    sysconfig.get_paths()["stdlib"] + os.sep,
)


def _is_user(filename: str) -> bool:
    return not filename.startswith(_LIBRARIES) and not filename.startswith("<frozen")


def _reachable(fn: Any, depth: int = 0):
    """``_values(fn)``, and those of the user's own helper functions it names, three calls deep."""
    for name, v in _values(fn):
        yield name, v
        if isinstance(v, types.FunctionType) and _is_user(v.__code__.co_filename) and depth < 3:
            yield from _reachable(v, depth + 1)


def closure(fn: Any) -> tuple:
    """A comparable fingerprint of what ``fn`` reads from outside (``_reachable``), each value by
    ``capture.described``: at every depth, so a nested dict or ``cfg.sub.scale`` changed between
    calls makes a new capture."""
    seen: dict[int, Any] = {}
    return tuple((name, capture.described(v, seen)) for name, v in _reachable(fn))


def _trainable(fn: Callable) -> dict:
    """``{storage address: name}`` of the tensors that require grad ``fn`` can reach from outside its
    arguments (closed-over tensors, modules' parameters, one level into containers)."""
    found: dict = {}

    def visit(name: str, v: Any, nested: bool) -> None:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            found.setdefault(v.data_ptr(), repr(name))
        elif isinstance(v, nn.Module):
            for path, t in v.named_parameters():
                if t.requires_grad:
                    found.setdefault(t.data_ptr(), f"{name}.{path}")
        elif isinstance(v, (list, tuple)) and not nested:
            for j, e in enumerate(v):
                visit(f"{name}[{j}]", e, True)
        elif isinstance(v, dict) and not nested:
            for k, e in v.items():
                visit(f"{name}[{k!r}]", e, True)

    for name, v in _reachable(fn):
        visit(name, v, False)
    return found


def _frame_line(filename: str, lineno: int) -> str:
    return f"{filename}:{lineno} ({linecache.getline(filename, lineno).strip()})"


def _user_line(error: BaseException) -> str | None:
    """The deepest line of the user's code in ``error``'s traceback (or its causes')."""
    line, seen, e = None, set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            if _is_user(tb.tb_frame.f_code.co_filename):
                line = _frame_line(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
            tb = tb.tb_next
        if line is not None:
            return line
        e = e.__cause__ or e.__context__
    return None


def _drawn_at(fn: Callable, params: Any, inputs: tuple) -> str | None:
    """Where ``fn`` first draws from Python's ``random`` or numpy's global generator: found by running
    it once more, eagerly, tracing the lines of the user's code and comparing the generators' states
    line by line (the states are put back)."""
    found: list[str] = []
    python_rng, numpy_rng = random.getstate(), np.random.get_state(legacy=False)

    def moved() -> bool:
        return random.getstate() != python_rng or capture.numpy_drew(numpy_rng)

    def trace(frame, event, arg):
        if not _is_user(frame.f_code.co_filename):
            return None
        last = [frame.f_lineno]

        def local(frame, event, arg):
            if not found and event in ("line", "return") and moved():
                found.append(_frame_line(frame.f_code.co_filename, last[0]))
            last[0] = frame.f_lineno
            return local

        return local

    with torch.random.fork_rng(), torch.no_grad():
        sys.settrace(trace)
        try:
            fn(params, *inputs)
        except Exception:
            pass  # only where it draws matters here
        finally:
            sys.settrace(None)
            random.setstate(python_rng)
            np.random.set_state(numpy_rng)
    return found[0] if found else None
