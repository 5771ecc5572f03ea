"""Cutting any model into stages with PyTorch's own graph capture.

``cut(model, example, split_at)`` exports the model's forward with
``torch.export.export(strict=False)`` (the KV cache of a Hugging Face model turned
off), assigns every node of the graph to a stage by the module it runs in
(``node.meta["nn_module_stack"]``) and splits the graph there with
``torch.fx.passes.split_module``. A module whose path matches a pattern of
``split_at`` (glob per dotted part: ``"transformer.h.*"`` matches
``transformer.h.3``, not ``transformer.h.3.attn``) gets a stage of its own; the
operations between two matches form a stage too. So GPT-2 cut at
``"transformer.h.*"`` is: embeddings, h.0, ..., h.11, final norm + head.

Each stage is an ``nn.Module`` holding exactly the model's parameters and buffers
it uses, under their names in the model (the same tensor objects: a tied
embedding and head is one parameter in two stages), so the engine runs it on the
given parameters like any module stage. Every value alive across a cut (the
residual stream, a causal mask, rotary tables, a skip connection) travels in the
boundary state, a dict ``{graph node name: tensor}``; integer and boolean ones
have no costate. The graph is fixed to the example's shapes and to the model's
train / eval mode at capture; a stage called otherwise says so.
"""

from __future__ import annotations

import collections
import fnmatch
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.node import map_arg
from torch.fx.passes.split_module import split_module

from ..cache import register
from ..compat import pytree as torch_pytree
from .captured_stage import CapturedStage, Piece, layout, register_output_types
from .exporting import Refused, data_dependent, exported
from .watch import GLOBAL_HOOKS, HOOKS, global_hooks

__all__ = ["Refused"]

_ROOT = "model."


class _Exportable(nn.Module):
    """The model with its KV cache off (a Hugging Face model's cache is not exportable)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        if getattr(getattr(self.model, "config", None), "use_cache", None) is not None:
            kwargs.setdefault("use_cache", False)
        return self.model(*args, **kwargs)


@functools.lru_cache(maxsize=1 << 16)
def matches(path: str, pattern: str) -> bool:
    """``pattern`` matches module ``path`` part by part (``fnmatch`` globs per dotted part); cached,
    since a sweep cut at run time matches every module of the model at every step."""
    parts, globs = path.split("."), pattern.split(".")
    return len(parts) == len(globs) and all(fnmatch.fnmatchcase(p, g) for p, g in zip(parts, globs))


register("module paths matched", "split_at: whether a pattern matches a module path, the 65,536 used last",
         matches.cache_clear)  # fmt: skip


def as_call(x: Any) -> tuple[tuple[Any, ...], dict[Any, Any]]:
    """The model's ``(args, kwargs)`` from an input: a tensor, a tuple of positional inputs or a dict
    of keyword inputs."""
    if isinstance(x, tuple):
        return x, {}
    if isinstance(x, dict):
        return (), dict(x)
    return (x,), {}


def _module_calls(node) -> list[tuple[str, str]]:
    """The module calls a graph node runs in, outermost first: ``(path relative to the model, call
    key)``; a module's second call has a key of its own (``"...@1"``)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(path[len(_ROOT) :], key) for key, (path, _) in stack.items() if path.startswith(_ROOT)]


def canonical_names(named: Iterable[tuple[Any, Any]]) -> dict[Any, Any]:
    """Every name of a tensor in ``named`` (aliases included) -> its first name."""
    first: dict[Any, Any] = {}
    return {name: first.setdefault(id(t), name) for name, t in named}


def _stage_of_nodes(graph, cut_modules: set[Any]) -> tuple[dict[Any, Any], list[Any], list[Any]]:
    """Stage index of every computing node (in execution order), each stage's name (a module's
    second call ``"name#2"``, as run-time cuts name it) and the cut module each stage is a call of
    (``None``: the operations between cuts)."""
    stage_of, names, cuts, current, owner, seen = {}, [], [], -1, None, []
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        calls = _module_calls(node)
        paths = [path for path, _ in calls]
        hit = next((call for call in calls if call[0] in cut_modules), None)
        if current < 0 or (hit != owner and (paths or owner is not None)):  # a call ends where its module does
            current, owner, seen = current + 1, hit, []
            names.append(None if hit is None else hit[0])
            cuts.append(None if hit is None else hit[0])
        ancestor = any(c.startswith(paths[-1] + ".") for c in cut_modules) if paths else True
        if not ancestor and paths[-1] not in seen and hit is None:
            seen.append(paths[-1])
            names[current] = "+".join(seen) if len(seen) < 4 else f"{seen[0]}..{seen[-1]}"
        stage_of[node] = current
    names = [n or f"stage_{k}" for k, n in enumerate(names)]
    return stage_of, [n if k == 0 else f"{n}#{k + 1}" for n, k in zip(names, _occurrences(names))], cuts


def _occurrences(names: list[Any]) -> list[int]:
    """How many times each name came before it."""
    counts: collections.Counter = collections.Counter()
    out = []
    for n in names:
        out.append(counts[n])
        counts[n] += 1
    return out


def cut_model(
    model: nn.Module, example: Any, split_at: Sequence[str]
) -> tuple[list[CapturedStage], list[str], dict[Any, Any]]:
    """``(stages, names, shown)``: ``model``'s forward on ``example`` cut before and after every module
    whose path matches a pattern of ``split_at`` (see the module docstring); ``shown``: the boundaries
    the cuts' calls output, as run-time cuts show them (``_shown``)."""
    cut_modules = _cuttable(model, split_at)
    args, kwargs = as_call(example)
    try:
        program, drew = exported(_Exportable(model), args, kwargs)
    except Refused:
        raise
    except Exception as e:
        remedy = (
            " A data-dependent branch (a guard on a tensor's value) cannot be captured: turn off what "
            "takes it (layerdrop=0, a fixed sequence length) or cut by hand."
            if data_dependent(e)
            else ""
        )
        raise RuntimeError(
            f"split_at: torch.export could not capture {type(model).__name__}'s forward: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}.{remedy} Or cut it by hand: ef.Chain([ef.stage(fn, "
            f"name=...), ...], loss=...) with one pure function per piece, or an nn.Sequential / list of modules"
        ) from e
    if drew:
        raise ValueError(
            f"split_at: {type(model).__name__}'s forward draws from Python's {' and '.join(drew)} (e.g. "
            f"LayerDrop's random.random()); a capture would bake that one draw into every later call. Turn it "
            f"off (layerdrop=0, eval mode) or draw with torch's RNG, which the sweep replays"
        )
    module, signature = program.graph_module, program.graph_signature
    stage_of, names, cuts = _stage_of_nodes(module.graph, cut_modules)
    running = set(filter(None, cuts))
    idle = sorted(cut_modules - running)
    if idle:
        raise ValueError(
            f"split_at: {list(split_at)} matches {len(cut_modules)} modules of {type(model).__name__}, but "
            f"{len(idle)} of them ({', '.join(idle[:4])}{', ...' if len(idle) > 4 else ''}) run no operation of "
            f"the captured graph as a module: a container (a ModuleList is never called; name its children, "
            f"e.g. 'h.*'), or a layer called as layer.forward(x), which bypasses the module call the capture "
            f"sees. Cut at modules that are called"
        )
    pieces = split(program, stage_of, len(names), _sources(model, signature), _model_leaves, example, "split_at")
    return [CapturedStage(model, piece, model.training) for piece in pieces], names, _shown(pieces, names, cuts)


def _cuttable(model: nn.Module, split_at: Sequence[str]) -> set[str]:
    """The paths of ``model``'s modules that ``split_at`` matches; refused where none does, or where
    the model has hooks (a captured graph would run them once, at capture)."""
    if isinstance(split_at, str) or not all(isinstance(p, str) for p in split_at) or not split_at:
        raise TypeError(f"split_at: expected a list of module paths (glob patterns), got {split_at!r}")
    cut_modules = {n for n, _ in model.named_modules() if n and any(matches(n, p) for p in split_at)}
    if not cut_modules:
        shown = [n for n, _ in model.named_modules() if n][:12]
        raise ValueError(
            f"split_at: no module of {type(model).__name__} matches {list(split_at)}; its modules include {shown}"
        )
    hooked = [
        f"{name or '(the model)'}.{kind[1:]}" for name, m in model.named_modules() for kind in HOOKS if getattr(m, kind)
    ] + [f"global {kind}" for kind, hooks in zip(GLOBAL_HOOKS, global_hooks()) if hooks]
    if hooked:
        raise ValueError(
            f"split_at with capture='graph': {type(model).__name__} has hooks ({', '.join(hooked[:4])}); a captured "
            f"graph runs a hook once, at capture, and bakes its effect in. Cut at run time (capture='run', the "
            f"default), which runs hooks on every call"
        )
    return cut_modules


def _sources(model: nn.Module, signature: Any) -> dict[Any, Any]:
    """Where each graph input that is not the user's comes from: ``("parameter" | "buffer", the
    model's canonical name)`` or ``("constant", key)``."""
    parameters = canonical_names(model.named_parameters(remove_duplicate=False))
    buffers = canonical_names(model.named_buffers(remove_duplicate=False))
    sources = {}
    for spec in signature.input_specs:
        target = spec.target[len(_ROOT) :] if spec.target else None
        if spec.kind == InputKind.PARAMETER:
            sources[spec.arg.name] = ("parameter", parameters[target])
        elif spec.kind == InputKind.BUFFER:
            sources[spec.arg.name] = ("buffer", buffers[target])
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            sources[spec.arg.name] = ("constant", spec.target)
        elif spec.kind != InputKind.USER_INPUT:
            raise RuntimeError(
                f"split_at: the captured graph has an input of kind {spec.kind}, which eae_func "
                f"cannot feed; cut the model by hand"
            )
    return sources


def _shown(pieces: list[Piece], names: list[str], cuts: list[Any]) -> dict[Any, Any]:
    """``{boundary k + 1: (j, name, keys)}`` for every stage k that is the j-th cut call: its costate is
    the entries ``keys`` of the boundary, those the call itself computed (``None``: the whole output,
    where the call ends the model)."""
    calls = [k for k, cut in enumerate(cuts) if cut is not None]
    return {
        k + 1: (
            j + 1,
            names[k],
            None
            if pieces[k].user_outputs is not None
            else tuple(o for o in pieces[k].outputs if o in pieces[k].carried),
        )
        for j, k in enumerate(calls)
    }


def _model_leaves(h: Any) -> list[Any]:
    return torch_pytree.tree_leaves(as_call(h))


def split(
    program: Any,
    stage_of: dict[Any, Any],
    n: int,
    sources: dict[Any, Any],
    flatten: Callable[..., Any],
    example: Any,
    where: str,
) -> list[Piece]:
    """``program``'s graph as ``n`` pieces, node ``v`` in piece ``stage_of[v]``; ``sources`` say where the
    inputs that are not the user's come from; ``flatten`` turns the first piece's input into the graph's
    user inputs (their layout is fixed to ``example``'s)."""
    module, signature = program.graph_module, program.graph_signature
    _keep_casts(module, stage_of)
    user_inputs = [s.arg.name for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
    user_outputs = _user_outputs(module, signature, where)
    split = split_module(
        module,
        module,
        lambda node: stage_of[node],
        keep_original_node_name=True,
        keep_original_input_name=True,
        tuple_return=True,
    )
    data_inputs = [name for name in user_inputs if name not in sources]
    graphs, produced, last_use = [], {name: 0 for name in data_inputs}, {name: n for name in user_outputs}
    shared: dict[Any, Any] = {}
    for k in range(n):
        graph = getattr(split, f"submod_{k}", None)
        inputs = [v.name for v in graph.graph.nodes if v.op == "placeholder"] if graph is not None else []
        outputs = (
            [a.name for a in next(v for v in graph.graph.nodes if v.op == "output").args[0]]
            if graph is not None
            else []
        )
        if graph is not None:  # pieces that compute the same (twelve layers of one class) run one graph
            graph = shared.setdefault(structure(graph), graph)
        graphs.append((graph, inputs, outputs))
        produced.update({name: k for name in outputs})
        for name in inputs:
            if name not in sources:
                last_use[name] = max(last_use.get(name, -1), k)
    out_spec = program.call_spec.out_spec
    register_output_types(out_spec)
    return [
        Piece(
            graph,
            inputs,
            outputs,
            {name: sources[name] for name in inputs if name in sources},
            [name for name, at in produced.items() if at <= k < last_use.get(name, -1)],
            data_inputs if k == 0 else None,
            user_outputs if k == n - 1 else None,
            out_spec,
            dict(program.constants),
            layout(flatten(example)),
            flatten,
        )
        for k, (graph, inputs, outputs) in enumerate(graphs)
    ]


def _user_outputs(module: Any, signature: Any, where: str) -> list[str]:
    """The names of the graph's outputs that are the model's; refused where it returns more (in-place
    updates of its inputs)."""
    returned = next(v for v in module.graph.nodes if v.op == "output").args[0]  # after _keep_casts rewired them
    user_outputs = [v.name for v, s in zip(returned, signature.output_specs) if s.kind == OutputKind.USER_OUTPUT]
    if len(user_outputs) != len(signature.output_specs):
        kinds = sorted({str(s.kind) for s in signature.output_specs if s.kind != OutputKind.USER_OUTPUT})
        raise RuntimeError(
            f"{where}: the captured graph returns {kinds} besides the model output (in-place "
            f"updates of inputs); cut the model by hand"
        )
    return user_outputs


def structure(graph: Any) -> Any:
    """What a piece's graph computes, positionally: each node's op, target and arguments (nodes as
    their places, names left out). Two graphs of one structure are interchangeable; a graph that
    reads attributes or submodules of its own, or holds a tensor in its code, is its own structure."""
    place: dict[Any, Any] = {}
    nodes = []
    for node in graph.graph.nodes:
        args = map_arg((node.args, node.kwargs), lambda v: ("node", place[v]))
        held = any(isinstance(a, torch.Tensor) for a in torch_pytree.tree_leaves(args))
        if node.op in ("get_attr", "call_module") or held:
            return graph
        place[node] = len(place)
        nodes.append((node.op, "" if node.op == "placeholder" else str(node.target), repr(args)))
    return tuple(nodes)


def _keep_casts(module: Any, stage_of: dict[Any, Any]) -> None:
    """Put back the dtype conversions the capture dropped as no-ops. Where the model asked for
    ``x.to(torch.float32)`` (an RMSNorm's upcast, ``logits.float()``) and ``x`` was float32 already,
    the graph keeps only ``_assert_tensor_metadata(x, dtype=float32)``; under ``autocast`` ``x`` is
    bfloat16 there and the conversion matters. Each such assertion becomes ``x.to(dtype)``, used in
    ``x``'s place by every later node (a no-op where the dtype is already right), in the assertion's stage."""
    graph = module.graph
    order = {node: k for k, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten._assert_tensor_metadata.default or node.kwargs.get("dtype") is None:
            continue
        source = node.args[0]
        with graph.inserting_after(node):
            cast = graph.call_function(torch.ops.aten.to.dtype, (source, node.kwargs["dtype"]))
        cast.meta = dict(source.meta)
        stage_of[cast] = stage_of.pop(node)
        later = [user for user in source.users if user is not cast and order.get(user, len(order)) > order[node]]
        for user in later:
            user.replace_input_with(source, cast)
        graph.erase_node(node)
    module.recompile()
