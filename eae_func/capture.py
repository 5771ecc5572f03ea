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
import contextlib
import dataclasses
import fnmatch
import functools
import itertools
import operator
import random
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optree
import torch
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.node import map_arg
from torch.fx.passes.split_module import split_module

from .compat import pytree as torch_pytree
from .tree import NAMESPACE

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


def matches(path: str, pattern: str) -> bool:
    """``pattern`` matches module ``path`` part by part (``fnmatch`` globs per dotted part)."""
    parts, globs = path.split("."), pattern.split(".")
    return len(parts) == len(globs) and all(fnmatch.fnmatchcase(p, g) for p, g in zip(parts, globs))


def as_call(x: Any) -> tuple[tuple, dict]:
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


PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # its parameters, buffers, children and hooks: read apart


def fingerprint(model: nn.Module, seen: dict[int, Any] | None = None, depth: int = 0) -> tuple:
    """What a capture of ``model`` depends on, as one comparable value: the module tree (paths,
    classes, identities, training flags, hooks), every parameter and buffer (identity, shape,
    dtype, device, requires_grad) and every module's other attributes by ``described`` (numbers,
    strings, flags, a Hugging Face config and what it holds, at any depth). A capture whose
    fingerprint differs from the model's is stale."""
    seen = {} if seen is None else seen

    def attributes(module: nn.Module) -> tuple:
        return tuple((k, described(v, seen, depth + 1)) for k, v in vars(module).items() if k not in _MODULE_INTERNALS)

    modules = tuple(
        (name, id(m), type(m), m.training, attributes(m), tuple(tuple(getattr(m, h).keys()) for h in _HOOKS))
        for name, m in model.named_modules(remove_duplicate=False)
    )
    tensors = tuple(
        (name, id(t), t.shape, t.dtype, t.device, t.requires_grad)
        for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    )
    hooks = tuple(tuple(d.keys()) for d in _global_hooks())
    return modules, tensors, hooks


DEPTH = 64  # levels ``described`` follows into containers and objects; deeper ones count by identity


def described(v: Any, seen: dict[int, Any], depth: int = 0) -> Any:
    """``v`` as a comparable value that changes when anything a captured program may read of it
    changes: plain values as they are, tensors by identity, shape, dtype, device and requires_grad,
    modules by ``fingerprint``, containers and objects' attributes at every depth (``cfg.sub.scale``),
    functions, classes and Python modules by identity (and anything ``DEPTH`` levels down). ``seen``
    holds what was described (an object met again gets the same description, whatever the order; one
    met inside itself, a cycle mark)."""
    if isinstance(v, PLAIN):
        return v
    key = id(v)
    if key in seen:
        return seen[key] if seen[key] is not None else ("cycle", key)
    seen[key] = None
    inner = depth + 1
    if isinstance(v, torch.Tensor):
        out: Any = (key, v.shape, v.dtype, v.device, v.requires_grad)
    elif depth >= DEPTH:
        out = key
    elif isinstance(v, nn.Module):  # one the model holds beside its children: in the same walk
        out = fingerprint(v, seen, inner)
    elif isinstance(v, (types.ModuleType, type)) or callable(v):
        out = key
    elif isinstance(v, (list, tuple)):
        out = type(v), tuple(described(e, seen, inner) for e in v)
    elif isinstance(v, (set, frozenset)):
        out = type(v), tuple(described(e, seen, inner) for e in sorted(v, key=repr))
    elif isinstance(v, dict):
        out = type(v), tuple((k, described(e, seen, inner)) for k, e in v.items())
    elif hasattr(v, "__dict__"):
        out = key, type(v), tuple((k, described(e, seen, inner)) for k, e in vars(v).items())
    else:
        out = key
    seen[key] = out
    return out


_TENSOR = operator.attrgetter("shape", "dtype", "device", "requires_grad")
_FLAT = itertools.chain.from_iterable


class Watch:
    """``fingerprint(model)`` with what it was read from: every object the walk met (modules and
    objects with a ``__dict__``: their class), every container (their ``__dict__``, a module's
    parameter, buffer, child and hook dicts, dicts, lists and sets: their lengths, keys and, by
    identity, what they hold, kept alive so no identity is reused) and every tensor (shape, dtype,
    device, requires_grad). While all of these are as they were, the fingerprint is too: ``current()``
    checks a model in a few C loops of identity comparisons and walks it again only when something
    moved (a plain value re-assigned an equal one walks again and keeps the capture). An object's
    ``__dict__`` replaced wholesale is not seen."""

    def __init__(self, model: nn.Module):
        self.model = weakref.ref(model)
        self.fingerprint = fingerprint(model)
        self.objects: list = []
        self.dicts: list = list(_global_hooks())
        self.sequences: list = []
        self.tensors: list = []
        self._reach(model)
        self.kind = type(self.objects.pop(0))  # the model itself is held weakly
        self.filled_dicts = [d for d in self.dicts if d]
        self.filled_sequences = [s for s in self.sequences if s]
        self.held = list(self._held())
        self.state = self._state()

    def _reach(self, root: Any) -> None:
        """Collect what ``fingerprint`` reads from ``root`` (a superset: at every depth, every key)."""
        seen: set = set()
        todo = [root]
        while todo:
            v = todo.pop()
            if isinstance(v, PLAIN) or id(v) in seen:
                continue
            seen.add(id(v))
            if isinstance(v, torch.Tensor):
                self.tensors.append(v)
            elif isinstance(v, nn.Module):
                self.objects.append(v)
                own = vars(v)
                self.dicts += [own, own["_parameters"], own["_buffers"], own["_modules"], *(own[h] for h in _HOOKS)]
                todo += [e for k, e in own.items() if k not in _MODULE_INTERNALS]
                todo += [*own["_parameters"].values(), *own["_buffers"].values(), *own["_modules"].values()]
            elif isinstance(v, (types.ModuleType, type)) or callable(v):
                continue
            elif isinstance(v, (list, set)):
                self.sequences.append(v)
                todo += v
            elif isinstance(v, (tuple, frozenset)):
                todo += v
            elif isinstance(v, dict):
                self.dicts.append(v)
                todo += v.values()
            elif hasattr(v, "__dict__"):
                self.objects.append(v)
                self.dicts.append(vars(v))
                todo += vars(v).values()

    def _held(self) -> Any:
        return itertools.chain(_FLAT(map(dict.values, self.filled_dicts)), _FLAT(self.filled_sequences))

    def _state(self) -> tuple:
        return (
            list(map(len, self.dicts)) + list(map(len, self.sequences)),
            list(_FLAT(self.filled_dicts)),
            list(map(type, self.objects)),
            list(map(_TENSOR, self.tensors)),
        )

    def current(self) -> Watch:
        """This watch while the model is as it was, else a new one (whose fingerprint may be equal)."""
        model = self.model()
        if model is None or (
            type(model) is self.kind and self._state() == self.state and all(map(operator.is_, self._held(), self.held))
        ):
            return self
        return Watch(model)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Watch) and (self is other or self.fingerprint == other.fingerprint)

    __hash__ = None  # type: ignore[assignment]


def numpy_drew(before: dict) -> bool:
    """Whether numpy's global generator moved since ``before`` (``get_state(legacy=False)``)."""
    now = np.random.get_state(legacy=False)
    return (
        now["state"]["pos"] != before["state"]["pos"]
        or now["has_gauss"] != before["has_gauss"]
        or not np.array_equal(now["state"]["key"], before["state"]["key"])
    )


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks")


def _global_hooks() -> tuple:
    from torch.nn.modules import module as M

    return tuple(getattr(M, name) for name in _GLOBAL_HOOKS)


def canonical_names(named) -> dict:
    """Every name of a tensor in ``named`` (aliases included) -> its first name."""
    first: dict = {}
    return {name: first.setdefault(id(t), name) for name, t in named}


_NATIVE = (tuple, list, dict, collections.OrderedDict, collections.defaultdict, collections.deque, type(None))
_REGISTERED: set = set()


def _register_output_types(spec) -> None:
    """Make optree (in this library's namespace) see through the output's pytree nodes the way
    torch's pytree does (``ModelOutput`` and other registered classes)."""
    cls = spec.type
    if cls in torch_pytree.SUPPORTED_NODES and cls not in _NATIVE and cls not in _REGISTERED:
        node = torch_pytree.SUPPORTED_NODES[cls]
        optree.register_pytree_node(
            cls, node.flatten_fn, lambda context, children: node.unflatten_fn(children, context), namespace=NAMESPACE
        )
        _REGISTERED.add(cls)
    for child in spec.children():
        _register_output_types(child)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One stage of a split graph: ``graph`` (``None``: no operation of its own) maps ``inputs``
    (graph node names) to ``outputs``; ``sources[name]`` says where a non-boundary input comes
    from (``("parameter" | "buffer", qualified name)`` or ``("constant", key)``); the boundary it
    returns is ``{name: value}`` of the ``carried`` nodes, or the user's output (``out_spec``) for
    the last piece. The first piece reads the user's input, flattened by ``flatten``, and refuses
    one whose layout is not ``example``'s."""

    graph: nn.Module | None
    inputs: list
    outputs: list
    sources: dict
    carried: list
    user_inputs: list | None
    user_outputs: list | None
    out_spec: Any
    constants: dict
    example: list
    flatten: Callable[[Any], list]

    def environment(self, h: Any) -> dict:
        if self.user_inputs is None:
            return dict(h)
        flat = self.flatten(h)
        got = layout(flat)
        if got != self.example:
            raise ValueError(
                f"captured stage: the model was captured for inputs {self.example}, got {got}; "
                f"capture again with this input (ef.grad(model, ...) captures once per input layout)"
            )
        return dict(zip(self.user_inputs, flat))

    def bind(self, lookup: Callable[[str], torch.Tensor], h: Any) -> tuple[list, dict]:
        """``(args, env)``: the graph's positional inputs on boundary ``h`` (its parameters and buffers
        read by ``lookup(name)``), and the values known so far by node name."""
        env = self.environment(h)
        args = []
        for name in self.inputs:
            kind, key = self.sources.get(name, ("value", name))
            args.append(
                lookup(key)
                if kind in ("parameter", "buffer")
                else self.constants[key]
                if kind == "constant"
                else env[name]
            )
        return args, env

    def collect(self, env: dict, outs: Sequence) -> Any:
        """The piece's output from ``env`` and the graph's outputs ``outs``: the boundary it carries,
        or the user's output for the last piece."""
        env.update(zip(self.outputs, outs))
        if self.user_outputs is not None:
            return torch_pytree.tree_unflatten([env[n] for n in self.user_outputs], self.out_spec)
        return {name: env[name] for name in self.carried}

    def run(self, lookup: Callable[[str], torch.Tensor], h: Any) -> Any:
        """The piece on boundary ``h``, its parameters and buffers read by ``lookup(name)``."""
        args, env = self.bind(lookup, h)
        return self.collect(env, self.graph(*args) if self.graph is not None else ())


def layout(leaves: list) -> list:
    """What a capture is specialised to: each tensor leaf's shape and dtype, any other leaf itself."""
    return [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves]


class CapturedStage(nn.Module):
    """One piece of a captured forward: ``h -> h'`` over the model's own parameters and buffers.

    Its submodules mirror the model's module paths, so ``named_parameters()`` gives the
    model's names; the engine substitutes the given tensors for them, and BatchNorm running statistics
    are updated in place in the buffers it is given, as the model's own forward would.
    """

    def __init__(self, model: nn.Module, piece: Piece, training: bool):
        super().__init__()
        # Everything but the mirrored tensors lives in one attribute whose name no module path uses.
        self._eae = types.SimpleNamespace(piece=piece, training=training, model=weakref.ref(model))
        for kind, name in piece.sources.values():
            if kind not in ("parameter", "buffer"):
                continue
            owner, leaf = self._mirror_owner(name)
            if leaf in owner._parameters or leaf in owner._buffers:
                continue
            if kind == "parameter":
                owner.register_parameter(leaf, model.get_parameter(name))
            else:
                owner.register_buffer(leaf, model.get_buffer(name))

    def _mirror_owner(self, name: str) -> tuple[nn.Module, str]:
        """The submodule of this stage at ``name``'s module path (made where missing) and the leaf name."""
        *path, leaf = name.split(".")
        module: nn.Module = self
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        return module, leaf

    def _lookup(self, name: str) -> torch.Tensor:
        return functools.reduce(getattr, name.split("."), self)

    @property
    def piece(self) -> Piece:
        """The piece of the captured graph this stage runs, refused if the model changed mode since."""
        plan = self._eae
        model = plan.model()
        if model is not None and model.training != plan.training:
            mode = "train" if plan.training else "eval"
            raise ValueError(
                f"captured stage: the model was captured in {mode} mode and is now in the other; "
                f"capture again (ef.grad(model, ...) captures once per mode)"
            )
        return plan.piece

    def forward(self, h: Any) -> Any:
        return self.piece.run(self._lookup, h)


def _stage_of_nodes(graph, cut_modules: set) -> tuple[dict, list, list]:
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


def _occurrences(names: list) -> list[int]:
    """How many times each name came before it."""
    counts: collections.Counter = collections.Counter()
    out = []
    for n in names:
        out.append(counts[n])
        counts[n] += 1
    return out


def exported(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, list[str]]:
    """``(program, drew)``: ``torch.export.export(module, args, kwargs, strict=False)`` with torch's
    RNG forked (a capture draws no random numbers the next forward should see); ``drew`` names the
    Python-level generators (``random``, ``numpy.random``) the forward drew from, whose states are
    put back: a capture would bake that one draw into every later call. A forward that applies a
    custom ``torch.autograd.Function`` is refused: export traces its forward and drops its backward."""
    python_rng, numpy_rng = random.getstate(), np.random.get_state(legacy=False)
    try:
        with torch.random.fork_rng(), custom_functions() as applied:
            program = torch.export.export(module, args, kwargs, strict=False)
    finally:
        drew = [
            name
            for name, moved in (("random", random.getstate() != python_rng), ("numpy.random", numpy_drew(numpy_rng)))
            if moved
        ]
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)
    if applied:
        raise Refused(
            f"capture: the forward applies the custom autograd Function{'s' if len(applied) > 1 else ''} "
            f"{', '.join(sorted(applied))}; torch.export traces its forward and drops its own backward, so the "
            f"gradients would silently differ. Cut a model at run time (capture='run', the default for a model "
            f"with split_at), which runs it as written"
        )
    return program, drew


class Refused(ValueError):
    """What a capture refuses to run (it would differ from eager silently), raised as it is."""


LOCK = threading.RLock()
"""Held by a capture from first look to cache entry: ``torch.export`` swaps a model's tensors for fake
ones while it traces, so a second thread capturing (or fingerprinting) the same model meanwhile would
read the fakes. One capture at a time; the second finds the first's in the cache."""


@contextlib.contextmanager
def custom_functions():
    """The names of the custom ``torch.autograd.Function`` classes applied in the block (a set)."""
    applied: set[str] = set()
    function = torch.autograd.Function
    original = function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if cls.__module__.split(".")[0] != "torch":  # torch's own Functions export with their backward
            applied.add(cls.__qualname__)
        return original.__func__(cls, *args, **kwargs)

    with LOCK:
        function.apply = classmethod(apply)  # type: ignore[method-assign, assignment]
        try:
            yield applied
        finally:
            function.apply = original  # type: ignore[method-assign]


def data_dependent(e: BaseException) -> bool:
    """Whether an export failed on a branch on a tensor's value (a guard on data)."""
    return "data-dependent" in str(e) or "GuardOnDataDependent" in type(e).__name__


def cut_model(model: nn.Module, example: Any, split_at: Sequence[str]) -> tuple[list[CapturedStage], list[str], dict]:
    """``(stages, names, shown)``: ``model``'s forward on ``example`` cut before and after every module
    whose path matches a pattern of ``split_at`` (see the module docstring); ``shown``: the boundaries
    the cuts' calls output, as run-time cuts show them (``_shown``)."""
    if isinstance(split_at, str) or not all(isinstance(p, str) for p in split_at) or not split_at:
        raise TypeError(f"split_at: expected a list of module paths (glob patterns), got {split_at!r}")
    cut_modules = {n for n, _ in model.named_modules() if n and any(matches(n, p) for p in split_at)}
    if not cut_modules:
        shown = [n for n, _ in model.named_modules() if n][:12]
        raise ValueError(
            f"split_at: no module of {type(model).__name__} matches {list(split_at)}; its modules include {shown}"
        )
    hooked = [
        f"{name or '(the model)'}.{kind[1:]}"
        for name, m in model.named_modules()
        for kind in _HOOKS
        if getattr(m, kind)
    ] + [f"global {kind}" for kind, hooks in zip(_GLOBAL_HOOKS, _global_hooks()) if hooks]
    if hooked:
        raise ValueError(
            f"split_at with capture='graph': {type(model).__name__} has hooks ({', '.join(hooked[:4])}); a captured "
            f"graph runs a hook once, at capture, and bakes its effect in. Cut at run time (capture='run', the "
            f"default), which runs hooks on every call"
        )
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
    pieces = split(program, stage_of, len(names), sources, _model_leaves, example, "split_at")
    return [CapturedStage(model, piece, model.training) for piece in pieces], names, _shown(pieces, names, cuts)


def _shown(pieces: list[Piece], names: list[str], cuts: list) -> dict:
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


def _model_leaves(h: Any) -> list:
    return torch_pytree.tree_leaves(as_call(h))


def split(
    program: Any, stage_of: dict, n: int, sources: dict, flatten: Callable, example: Any, where: str
) -> list[Piece]:
    """``program``'s graph as ``n`` pieces, node ``v`` in piece ``stage_of[v]``; ``sources`` say where the
    inputs that are not the user's come from; ``flatten`` turns the first piece's input into the graph's
    user inputs (their layout is fixed to ``example``'s)."""
    module, signature = program.graph_module, program.graph_signature
    _keep_casts(module, stage_of)
    user_inputs = [s.arg.name for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
    returned = next(v for v in module.graph.nodes if v.op == "output").args[0]  # after _keep_casts rewired them
    user_outputs = [v.name for v, s in zip(returned, signature.output_specs) if s.kind == OutputKind.USER_OUTPUT]
    if len(user_outputs) != len(signature.output_specs):
        kinds = sorted({str(s.kind) for s in signature.output_specs if s.kind != OutputKind.USER_OUTPUT})
        raise RuntimeError(
            f"{where}: the captured graph returns {kinds} besides the model output (in-place "
            f"updates of inputs); cut the model by hand"
        )
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
    shared: dict = {}
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
    _register_output_types(out_spec)
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


def structure(graph: Any) -> Any:
    """What a piece's graph computes, positionally: each node's op, target and arguments (nodes as
    their places, names left out). Two graphs of one structure are interchangeable; a graph that
    reads attributes or submodules of its own, or holds a tensor in its code, is its own structure."""
    place: dict = {}
    nodes = []
    for node in graph.graph.nodes:
        args = map_arg((node.args, node.kwargs), lambda v: ("node", place[v]))
        held = any(isinstance(a, torch.Tensor) for a in torch_pytree.tree_leaves(args))
        if node.op in ("get_attr", "call_module") or held:
            return graph
        place[node] = len(place)
        nodes.append((node.op, "" if node.op == "placeholder" else str(node.target), repr(args)))
    return tuple(nodes)


def _keep_casts(module: Any, stage_of: dict) -> None:
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
