"""Stages and chains: a network as a list of pure functions ``fn(params_l, h) -> h'``.

``stage`` wraps a plain function (``module_chain.from_module`` makes stages of a module's children).
A ``Chain`` is the stages plus the loss ``loss(x_L, *loss_args) -> scalar``.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import optree
import torch
from torch import nn
from torch.func import functional_call

from ..tree import NAMESPACE
from . import fsdp
from .slots import Slots, module_lock

__all__ = [
    "Chain",
    "Stage",
    "apply",
    "hooked_grads",
    "stage",
    "through_hooks",
]


@dataclasses.dataclass(frozen=True)
class Stage:
    """One block ``h_l = fn(params_l, h_{l-1})`` of the chain.

    For a module stage, ``module`` is run with ``functional_call`` on the given
    params and on fresh clones of ``buffers`` (the module's own buffers by
    default), so running stats are returned, never written into the caller's
    tensors. ``physical``: a black box to the sweep (its reverse step comes from an estimator);
    ``differentiable=False``: nothing may differentiate it (only forward-only estimators).
    ``sharded``: an FSDP2 module's own sharded parameters (``param_names`` order); it runs through
    FSDP at them, never at given tensors (``eae_func.program.fsdp``). ``buffer_names``: the module's buffers
    when the stage was made (a module that has no tensor under two names reads them, and the
    parameters' ``requires_grad``, from their places, ``Slots``, not by walking its submodules).
    """

    fn: Callable[..., Any] | None
    name: str | None = None
    physical: bool = False
    differentiable: bool = True
    module: nn.Module | None = None
    param_names: tuple[str, ...] | None = None
    param_layout: tuple[tuple[torch.Size, torch.dtype], ...] = ()
    aliased: bool = True
    sharded: tuple[nn.Parameter, ...] | None = None
    buffer_names: tuple[str, ...] = ()

    def call(self, params: Any, buffers: Mapping[str, torch.Tensor], h: Any):
        """``(h', updated_buffers)``: the stage applied to ``h``; ``buffers`` are not modified.
        Params are checked by ``Chain.check_params``. The given tensors take the places of the
        module's own for the call (``Slots``); ``functional_call`` runs a module that has a tensor
        under two names (``aliased``: it ties them) or a name that is not a parameter or buffer."""
        if self.module is None:
            assert self.fn is not None  # a function stage
            return self.fn(params, h), {}
        if self.sharded is not None:
            with module_lock(self.module):
                return fsdp.call(self.module, buffers, h), buffers
        fresh = {name: b.clone() for name, b in buffers.items()}
        tensors = {**params, **fresh}
        with module_lock(self.module):  # the module holds the given tensors for the call: one thread at a time
            slots = None if self.aliased else Slots.of(self.module, tensors)
            if slots is None:
                return functional_call(self.module, tensors, (h,), tie_weights=self.aliased, strict=False), fresh
            return slots.call(self.module, tensors, h), fresh

    def frozen(self) -> frozenset[str]:
        """The names of this module stage's parameters that are not trained (``requires_grad=False``
        on the module's own parameter, read now: freezing after ``from_module`` counts)."""
        if self.module is None:
            return frozenset()
        with module_lock(self.module):  # not while another thread's tensors sit in the module
            slots = self.slots()
            if slots is None:
                return frozenset(n for n, p in self.module.named_parameters() if not p.requires_grad)
            own = slots.places[: len(self.param_names or ())]
            return frozenset(n for store, key, n in own if store[key] is not None and not store[key].requires_grad)

    def hooked(self) -> dict[str, torch.Tensor]:
        """This module stage's parameters that carry tensor hooks (``p.register_hook(fn)``), by name,
        read now from the module's own places (an FSDP stage's run in FSDP's own backward)."""
        if self.module is None or self.sharded is not None:
            return {}
        with module_lock(self.module):
            slots = self.slots()
            own = (
                self.module.named_parameters()
                if slots is None
                else ((n, store[key]) for store, key, n in slots.places[: len(self.param_names or ())])
            )
            return {n: p for n, p in own if p is not None and p._backward_hooks}

    def default_buffers(self) -> dict[str, torch.Tensor]:
        if self.module is None or not (self.aliased or self.buffer_names):  # no buffers when it was made
            return {}
        slots = self.slots()
        if slots is None:
            return {name: b.detach() for name, b in self.module.named_buffers()}
        own = (store[key] for store, key, _ in slots.places[len(self.param_names or ()) :])
        return {name: b.detach() for name, b in zip(self.buffer_names, own) if b is not None}

    def slots(self) -> Slots | None:
        """The places of the module's parameters, then its buffers (``None``: a tensor under two names,
        or the module changed so that a name is gone)."""
        if self.aliased or self.module is None or self.param_names is None:
            return None
        return Slots.of(self.module, self.param_names + self.buffer_names)


def through_hooks(param: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor | None:
    """``grad`` through ``param``'s tensor hooks in order, as autograd runs them on a leaf's whole
    gradient before accumulating it into ``.grad``: a hook's result replaces it unless it is ``None``."""
    if grad is None:
        return None
    for hook in tuple((param._backward_hooks or {}).values()):
        out = hook(grad)
        grad = grad if out is None else out
    return grad


def hooked_grads(grads: tuple[Any, ...], hooks: Mapping[tuple[int, str], torch.Tensor]) -> tuple[Any, ...]:
    """``grads`` (one dict per stage) with the gradient of each hooked parameter (``hooks``: ``(stage,
    name) -> parameter``) through its hooks, once per gradient tensor: a tied parameter's summed
    gradient, one tensor in each of its places, is hooked once."""
    out = list(grads)
    for i in {i for i, _ in hooks}:
        out[i] = dict(grads[i])
    done: dict[int, Any] = {}
    for (i, name), param in hooks.items():
        g = grads[i][name]
        if g is not None:
            if id(g) not in done:
                done[id(g)] = through_hooks(param, g)
            out[i][name] = done[id(g)]
    return tuple(out)


def stage(
    fn: Callable[..., Any], name: str | None = None, physical: bool = False, differentiable: bool = True
) -> Stage:
    """A stage from a pure function ``fn(params, h) -> h'`` (``params`` any pytree of tensors);
    ``physical``: run forward only, its reverse step from an estimator; ``differentiable=False``:
    it leaves torch (numpy, a device), so only forward-only estimators may probe it."""
    if isinstance(fn, nn.Module):
        raise TypeError("stage: expected a pure function fn(params, h); wrap modules with ef.from_module")
    if not callable(fn):
        raise TypeError(f"stage: expected a callable fn(params, h), got {type(fn).__name__}")
    return Stage(fn=fn, name=name, physical=physical or not differentiable, differentiable=differentiable)


@dataclasses.dataclass(frozen=True)
class Shown:
    """How a boundary of a chain cut at a model's modules shows to the passes and the trace, as
    run-time cuts show it: the ``index``-th cut call (1, 2, ... in call order) named ``name``
    (``"layers.0"``; a second call of one module ``"layers.0#2"``), its costate the entries ``keys``
    of the boundary (the cut's own outputs; ``None``: the whole boundary)."""

    index: int
    name: str
    keys: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Chain:
    """``x_l = h_l(params_l, x_{l-1})`` for l = 1..L, then ``loss(x_L, *loss_args)``.

    ``ties`` lists groups of ``(stage_index, param_name)`` that are one tensor
    (a tied embedding and head); their gradients are summed. ``shown``: where the passes run and
    what the trace records, ``{boundary l: Shown}`` (a model cut at ``split_at``: the cuts' outputs
    alone, as run-time cuts see them); ``None``: every boundary 0..L, as itself.
    """

    stages: tuple[Stage, ...]
    loss: Callable[..., Any]
    ties: tuple[tuple[tuple[int, str], ...], ...] = ()
    shown: Mapping[int, Shown] | None = None
    names: tuple[str, ...] = dataclasses.field(init=False)
    labels: tuple[str, ...] = dataclasses.field(init=False, repr=False)

    def __init__(
        self,
        stages: Iterable[Stage | Callable[..., Any]],
        loss: Callable[..., Any],
        ties: Iterable[Any] = (),
        shown: Mapping[int, Shown] | None = None,
    ):
        stages = tuple(s if isinstance(s, Stage) else stage(s) for s in stages)
        if not stages:
            raise ValueError("Chain: expected at least one stage, got an empty chain")
        if not callable(loss):
            raise TypeError(f"Chain: loss must be callable loss(output, *loss_args), got {type(loss).__name__}")
        names = tuple(s.name or f"{_base_name(s)}_{i}" for i, s in enumerate(stages))
        named = tuple(dataclasses.replace(s, name=n) for s, n in zip(stages, names))
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"Chain: stage names must be unique, repeated: {duplicates}")
        object.__setattr__(self, "stages", named)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "labels", tuple(f"stage {i} ({n!r})" for i, n in enumerate(names)))
        object.__setattr__(self, "loss", loss)
        object.__setattr__(self, "ties", tuple(tuple((int(i), str(n)) for i, n in group) for group in ties))
        object.__setattr__(self, "shown", None if shown is None else types.MappingProxyType(dict(shown)))
        for group in self.ties:
            for i, n in group:
                if not 0 <= i < len(named):
                    raise ValueError(f"Chain: ties name stage {i}, but the chain has {len(named)} stages")
                own = named[i].param_names
                if own is not None and n not in own:
                    raise ValueError(f"Chain: ties name parameter {n!r} of {self.where(i)}, which has {list(own)}")

    def __len__(self) -> int:
        return len(self.stages)

    def ending_in(self, loss: Callable[..., Any]) -> Chain:
        """This chain with ``loss`` as its loss (the stages as they are, none made again)."""
        if loss is self.loss:
            return self
        if not callable(loss):
            raise TypeError(f"Chain: loss must be callable loss(output, *loss_args), got {type(loss).__name__}")
        chain = copy.copy(self)
        object.__setattr__(chain, "loss", loss)
        return chain

    def showing(self, l: int) -> Shown | None:
        """How boundary ``l`` shows to the passes and the trace (``None``: it does not)."""
        if self.shown is None:
            return Shown(l, self.names[l - 1] if l > 0 else "input")
        return self.shown.get(l)

    def showing_all(self) -> Chain:
        """This chain with every boundary shown as itself (an estimator's exact trace reads them all)."""
        if self.shown is None:
            return self
        chain = copy.copy(self)
        object.__setattr__(chain, "shown", None)
        return chain

    def index(self, name_or_index: str | int) -> int:
        """Stage index of a stage given by name or index."""
        if isinstance(name_or_index, int):
            if not -len(self) <= name_or_index < len(self):
                raise IndexError(f"Chain: no stage {name_or_index}; the chain has {len(self)} stages")
            return name_or_index % len(self)
        if name_or_index not in self.names:
            raise KeyError(f"Chain: no stage named {name_or_index!r}; stages are {list(self.names)}")
        return self.names.index(name_or_index)

    def buffers(self) -> tuple[dict[str, torch.Tensor], ...]:
        """The modules' current buffers, one dict per stage (detached, sharing storage)."""
        return tuple(s.default_buffers() for s in self.stages)

    def where(self, i: int) -> str:
        """``"stage i ('name')"``, as errors name a stage."""
        return self.labels[i]

    def check_params(self, params: Any, stages: Sequence[int] | None = None) -> tuple[Any, ...]:
        """``params`` as a tuple with one entry per stage, those of ``stages`` (default: all)
        checked (a dict of exactly the module's parameter names, shapes and dtypes, tensor leaves
        only) and detached (one tensor given twice stays one tensor: ties are kept)."""
        if not isinstance(params, (tuple, list)) or len(params) != len(self):
            got = f"{len(params)} entries" if isinstance(params, (tuple, list)) else type(params).__name__
            raise ValueError(f"params: expected a tuple with one entry per stage ({len(self)}), got {got}")
        for i in range(len(self)) if stages is None else stages:
            s, p = self.stages[i], params[i]
            if s.param_names is None:
                for leaf in optree.tree_leaves(p, namespace=NAMESPACE):
                    if not isinstance(leaf, torch.Tensor):
                        raise TypeError(
                            f"params of {self.where(i)}: leaves must be tensors, found {type(leaf).__name__}"
                        )
                continue
            if not isinstance(p, Mapping):
                raise TypeError(f"params of {self.where(i)}: expected a dict name -> tensor, got {type(p).__name__}")
            if len(p) != len(s.param_names) or not all(n in p for n in s.param_names):
                missing, extra = set(s.param_names) - set(p), set(p) - set(s.param_names)
                raise ValueError(
                    f"params of {self.where(i)} do not match its module: "
                    f"missing {sorted(missing)}, unexpected {sorted(extra)}"
                )
            for name, (shape, dtype) in zip(s.param_names, s.param_layout):
                t = p[name]
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"params of {self.where(i)}: leaves must be tensors, found {type(t).__name__}")
                if t.dtype != dtype or t.shape != shape:
                    raise ValueError(
                        f"params of {self.where(i)}: {name!r} has shape {tuple(t.shape)} and "
                        f"dtype {t.dtype}, the module's has {tuple(shape)} and {dtype}"
                    )
        detached: dict[Any, Any] = {}

        def detach(t: torch.Tensor) -> torch.Tensor:
            if not t.requires_grad:  # already outside autograd: used as given
                return t
            d = detached.get(id(t))
            if d is None:
                d = detached[id(t)] = t.detach()
            return d

        return tuple(
            None
            if p is None
            else {n: detach(t) for n, t in p.items()}  # checked above: a dict of tensors
            if s.param_names is not None and isinstance(p, dict)
            else optree.tree_map(detach, p, namespace=NAMESPACE)
            for s, p in zip(self.stages, params)
        )

    def check_buffers(self, buffers: Any) -> tuple[Any, ...]:
        """``buffers`` as a tuple with one dict per stage, each naming only its module's buffers (a
        misspelt name would leave the module's own in use); ``None``: the modules' own."""
        if buffers is None:
            return self.buffers()
        if not isinstance(buffers, (tuple, list)) or len(buffers) != len(self):
            raise ValueError(f"buffers: expected a tuple with one dict per stage ({len(self)}), got {buffers!r:.80}")
        for i, (s, b) in enumerate(zip(self.stages, buffers)):
            if not isinstance(b, Mapping):
                continue
            known = (
                ()
                if s.module is None
                else tuple(n for n, _ in s.module.named_buffers(remove_duplicate=False))
                if s.aliased
                else s.buffer_names
            )
            unknown = sorted(set(b) - set(known))
            if unknown:
                raise ValueError(f"buffers: {self.where(i)} has no buffer {unknown}; its buffers are {list(known)}")
        return tuple(buffers)


def _base_name(s: Stage) -> str:
    target = s.module if s.module is not None else s.fn
    return type(target).__name__ if isinstance(target, nn.Module) else getattr(target, "__name__", "stage")


def apply(chain: Chain, params: Sequence[Any], x: Any, buffers: Sequence[Any] | None = None) -> Any:
    """The chain's output ``x_L = h_L(params_L, ... h_1(params_1, x))``: the stages run forward in
    order, as the sweep's forward runs them, on ``params`` (one entry per stage) and ``buffers`` (one
    dict per stage; default: the modules' own), which are not modified, under the caller's autograd
    and module modes (``torch.no_grad()``, ``model.eval()`` to evaluate). The loss the sweep
    differentiates is ``chain.loss(apply(chain, params, x), *loss_args)``. A model or a function
    ``model_fn(params, x)`` runs forward by calling it (``ef.cut`` is the identity there)."""
    if not isinstance(chain, Chain):
        raise TypeError(
            f"apply: expected a Chain (ef.from_module, ef.Chain), got {type(chain).__name__}; "
            f"a model or a function model_fn(params, x) runs forward by calling it"
        )
    chain.check_params(params)
    buffers = chain.check_buffers(buffers)
    for i, s in enumerate(chain.stages):
        try:
            x, _ = s.call(params[i], buffers[i], x)
        except Exception as e:
            e.add_note(f"(eae_func.apply: in {chain.where(i)})")
            raise
    return x
