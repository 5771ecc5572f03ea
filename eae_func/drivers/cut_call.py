"""One call of a cut module (``cuts``): ``Call``, what its reverse step needs, and the helpers that
read a call's inputs, outputs and module."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from ..compat import pytree
from ..core import boundary as B
from ..program.capture import matches
from ..program.slots import Slots

__all__ = ["ACTIVE", "Call", "cut_modules", "holding", "local_params", "refuse_caches", "routes", "sums", "walk"]

ACTIVE = threading.local()  # .depth: > 0 while a cut module runs (its forward, rebuild or estimate) on this thread


@dataclasses.dataclass
class Call:
    """One call of a cut module, what its reverse step needs: the call's input leaves (detached) and
    their ``spec``, which of them require grad (``inputs``), the tensors the module held in its
    parameters' places (the sweep's leaves, by the module's own names, aliases included), its buffers
    as they were before the call, torch's RNG and the autocast state, the modes of its modules
    (``replay.modes_of``), Python's and numpy's generator states where the module draws from them
    (``replay.HostRandom``); after the forward, the output's spec, the position of each of its floating
    tensors of its own (``through``: one position per distinct tensor, the ones autograd's node
    returns), each leaf's tensor of the node (``routes``, ``None``: a leaf the caller gets as the
    forward returned it), until the caller has them, those leaves (``constants``), the leaves its
    forward wrote into (``InputWrites``: kept as copies from before the call) and the others'
    versions (-1: not a tensor, or written), which must still be theirs when it is rebuilt; the
    parameters it trains (``trained``: inputs of its node, so autograd accumulates their gradients
    after its reverse step, and a fused update steps them only then) and their versions; with a
    boundary policy (``boundary_dtype=``, ``offload=``), the positions of the inputs kept as it
    stores them (``stored``) and their ``layout`` as computed; for a physical cut, its place in the
    sweep's roster of them (``physical``); the shape, dtype and device of each output of its node
    (``outs``); where ``recompute=`` keeps its graph from the forward, ``(output, inputs, parameters)``
    of that graph (``graph``), and where it keeps some ops' outputs, the context that replays them
    in the rebuild (``cached``); whether its forward ran compiled (``compile=``: its rebuild does too,
    so a dropout mask is drawn by the same ops)."""

    index: int
    name: str
    module: nn.Module
    forward: Callable[..., Any]
    leaves: list[Any]
    spec: Any
    inputs: list[Any]
    params: dict[Any, Any]
    buffers: dict[Any, Any]
    rng: tuple[Any, ...] | None
    autocast: tuple[Any, ...]
    modes: tuple[Any, ...]
    host: tuple[Any, ...] | None = None
    sums: list[Any] | None = None
    out_spec: Any = None
    through: tuple[Any, ...] = ()
    routes: tuple[Any, ...] = ()
    constants: list[Any] | None = None
    versions: list[Any] = dataclasses.field(default_factory=cast("Callable[[], list[Any]]", list))
    written: tuple[Any, ...] = ()
    trained: list[Any] = dataclasses.field(default_factory=cast("Callable[[], list[Any]]", list))
    trained_versions: list[Any] = dataclasses.field(default_factory=cast("Callable[[], list[Any]]", list))
    stored: tuple[Any, ...] = ()
    layout: Any = None
    physical: int | None = None
    outs: list[Any] = dataclasses.field(default_factory=cast("Callable[[], list[Any]]", list))
    graph: tuple[Any, ...] | None = None
    cached: Any = None
    compiled: bool = False


def walk(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any], tuple[Any, ...]]:
    """Over a cut module and its submodules in ``named_modules(remove_duplicate=False)``'s order (walked
    over ``_modules`` itself, without its generators): its parameters by name (aliases included, as
    ``named_parameters(remove_duplicate=False)``), clones of its buffers by name, its modes (each
    module with its training flag, once per place it sits in)."""
    params: dict[str, Any] = {}
    buffers: dict[str, Any] = {}
    modes: list[Any] = []

    def visit(m: nn.Module, dot: str) -> None:
        modes.append((m, m.training))
        for n, p in m._parameters.items():  # pyright: ignore[reportPrivateUsage]
            if p is not None:
                params[dot + n] = p
        for n, b in m._buffers.items():  # pyright: ignore[reportPrivateUsage]
            if b is not None:
                buffers[dot + n] = b.detach().clone()
        for name, child in m._modules.items():  # pyright: ignore[reportPrivateUsage]
            if child is not None:
                visit(child, f"{dot}{name}.")

    visit(module, "")
    return params, buffers, tuple(modes)


def local_params(call: Call) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """The call's parameters as the leaves of a new graph, one per distinct tensor (its aliases share
    it), each requiring grad as the parameter does: by name, and the trained ones in
    ``call.trained``'s order."""
    own: dict[int, torch.Tensor] = {}
    local = {n: own.setdefault(id(p), p.detach().requires_grad_(p.requires_grad)) for n, p in call.params.items()}
    return local, [own[id(p)] for p in call.trained]


def routes(leaves: list[Any], call: Call) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """For each output leaf, its tensor of the node or ``None`` (the leaf reaches the caller as the
    forward returned it: a non-tensor, an integer tensor, an input that requires no grad returned as
    it was given); and each node tensor's first position. A floating tensor returned twice is one
    tensor of the node, with one costate (the sum of both uses')."""
    if len(leaves) == 1 and _new_floating(leaves[0], call.leaves):  # one tensor of its own: the common case
        return _ONE, _ONE
    given = {id(call.leaves[i]) for i in call.inputs}
    constant = {id(t) for t in call.leaves if isinstance(t, torch.Tensor)} - given
    first: dict[int, int] = {}  # a node tensor's id -> its index among the node's outputs
    route = tuple(
        first.setdefault(id(t), len(first))
        if isinstance(t, torch.Tensor) and B.is_differentiable(t) and id(t) not in constant
        else None
        for t in leaves
    )
    return route, tuple(route.index(k) for k in range(len(first)))


_ONE = (0,)


def _new_floating(t: Any, given: list[Any]) -> bool:
    """Whether ``t`` is a floating tensor that is none of the call's input leaves."""
    return isinstance(t, torch.Tensor) and B.is_differentiable(t) and all(t is not g for g in given)


def refuse_caches(name: str, leaves: list[Any], split_at: list[str]) -> None:
    """Refuse a call passed a key/value cache (what has ``update`` and ``get_seq_length``, as Hugging Face's
    ``Cache`` does): its forward fills it, so its rebuild would read its own keys and values back (twice as
    many, or silently another attention)."""
    cache = next(
        (t for t in leaves if callable(getattr(t, "update", None)) and callable(getattr(t, "get_seq_length", None))),
        None,
    )
    if cache is None:
        return
    others = [p for p in split_at if not matches(name, p)]
    instead = f"split_at={others}" if others else "a module that is not passed one"
    raise ValueError(
        f"cut {name!r} is passed a key/value cache ({type(cache).__name__}) that its forward fills: its rebuild "
        f"would attend to its own keys and values again. Call the model with use_cache=False; where it makes a "
        f"cache even then (XLM's and Flaubert's attentions), cut modules it is not passed to: {instead}"
    )


def sums(out: Any) -> list[Any]:
    """One number per floating output leaf, to tell whether a rebuild repeated its forward."""
    return [t.detach().sum() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and B.is_differentiable(t)]


def cut_modules(
    model: nn.Module, split_at: Sequence[str], modules: Iterable[tuple[str, nn.Module]] | None = None
) -> dict[str, nn.Module]:
    """The modules of ``model`` matched by a pattern of ``split_at`` (glob per dotted part), among
    ``modules`` (``model.named_modules()``, where the caller has it)."""
    if isinstance(split_at, str) or not split_at or not all(isinstance(cast(object, p), str) for p in split_at):
        raise TypeError(f"split_at: expected a list of module paths (glob patterns), got {split_at!r}")
    modules = list(cast("Iterable[tuple[str, nn.Module]]", model.named_modules()) if modules is None else modules)
    found = {n: m for n, m in modules if n and any(matches(n, p) for p in split_at)}
    if not found:
        shown = [n for n, _ in modules if n][:12]
        raise ValueError(
            f"split_at: no module of {type(model).__name__} matches {list(split_at)}; its modules include {shown}"
        )
    return found


def holding(module: nn.Module, tensors: Mapping[str, torch.Tensor]):
    """A context with ``module`` holding ``tensors`` in the places of its parameters and buffers of
    those names."""
    slots = Slots.of(module, tuple(tensors))
    if slots is None:
        raise RuntimeError(f"cuts: {type(module).__name__} no longer has the parameters it ran with")
    return slots.holding(tensors)
