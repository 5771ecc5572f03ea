"""Early stop of a rebuild: the ops after the last tensor the rebuilt graph saves make their nodes
but run no kernel, as ``torch.utils.checkpoint``'s recompute stops at the last tensor it needs.

    a rebuild of stage l:  ops o_1..o_n saving s_1..s_N (an op saves its inputs before its kernel
                           runs, its outputs after)
    its tail:              the ops dispatched after s_N is saved (Llama's down_proj and residual
                           add); the vjp reads s_1..s_N and the tail's nodes, never the tail's values
    early stop:            the tail's autograd parts run, its kernels do not: each output is
                           allocated, NaN, in the layout the op gave it when the tail was learned

The tail of a kind of rebuild (``key``: the stage's module, by identity, and its inputs' layout: two
calls of one module share it, and a key an object's id outlived only costs a miss) is learned from
the kind's first rebuild, run in full under a dispatch mode: N, the save after which the tail's
first op comes, and each tail op with its arguments (layouts, scalars, which earlier tail outputs
it reads) and its outputs' layouts. A kind is never stopped when its tail skips less than ``WORTH``
multiply-adds (kernels too small to pay for the counting; a stage whose inputs are too small for
that, ``may_pay``, is not even looked up) or is not safe to skip: a random,
in-place or data-dependent op, a host read, an op under ``no_grad`` or in a custom ``Function``, a
value neither returned nor read by the next ops (kept aside), saved-tensor hooks of the model's
own. Later rebuilds count the saves with a saved-tensor hook and push the mode at that save, so
only the tail's few ops pass through Python. A stopped rebuild that goes another way than the
learned one (a save after s_N, a tail op, argument or output that is not the learned one, any
error) is run again in full, and a kind that misses twice is not stopped again: the gradients are
always those of the full rebuild, bit for bit.

The tail's values are NaN in a stopped rebuild: a module that keeps one in Python state
(``self.out = out``) or reads one with ``.tolist()`` / ``.numpy()``, which no dispatch sees, sees
NaN there (``early_stop=False`` rebuilds in full). A rebuild runs the forward hooks of the modules
inside the stage, as ``torch.utils.checkpoint``'s recompute does; a kind is not stopped while
such a hook or a global one (``register_module_forward_hook``) is registered (``observed``), so no
hook sees NaN.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction

from .. import compat
from ..cache import register
from ..compat import TorchDispatchMode, pytree

__all__ = ["WORTH", "allocated", "described", "may_pay", "observed", "rebuilt", "whole"]


R = TypeVar("R")
aten = torch.ops.aten

WORTH = 1 << 22  # multiply-adds a tail must skip to pay for counting the saves (~100 µs of a CPU core)
REACH = 1 << 12  # a tail op's multiply-adds per element of the stage's inputs, at most, as far as
# ``may_pay`` assumes (a layer's last product reduces over its hidden width, not over thousands)
LIMIT = 256  # kinds remembered (the oldest learned is dropped first)
RISKY = frozenset({torch.Tag.nondeterministic_seeded, torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output})
REDUCES = {aten.mm.default: 0, aten.bmm.default: 0, aten.addmm.default: 1, aten.baddbmm.default: 1}  # which
# argument's last dimension a matrix product sums over: its multiply-adds are numel(out) times that
LEARN = object()  # a kind not seen yet
_KINDS: dict[Hashable, Kind | None] = {}  # what each kind of rebuild learned (None: never stopped)
register("early_stop", "early_stop=: what each kind of rebuild learned of its tail, by module, call structure "
         "and modes (the 256 used last)", lambda: _KINDS.clear())  # fmt: skip
_LOCK = threading.Lock()


class Miss(Exception):
    """A stopped rebuild went another way than the tail its kind learned."""


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of a learned tail."""

    func: Any
    args: tuple[Any, ...]  # its arguments as ``Rebuild.describe`` gives them
    outs: tuple[Any, ...]  # (shape, stride, dtype, device) of each output tensor
    spec: Any  # the outputs' structure
    view: bool  # it aliases an input (``_unsafe_view`` does, undeclared): it is run, no kernel to skip


@dataclasses.dataclass
class Kind:
    """What a kind of rebuild learned: its saves, when to push the mode, its tail."""

    saves: int  # N
    push: int  # the save after which the mode must be on (the count at the op before the tail)
    tail: tuple[Op, ...]
    returns: tuple[Any, ...]  # per tensor the stage returns: the tail output it is (its number), or None
    misses: int = 0


def rebuilt(key: Hashable | None, attempt: Callable[[Callable[..., Any]], R]) -> R:
    """``attempt(run)``, where ``attempt`` rebuilds the stage and calls ``run(f, *args, **kwargs)``
    for its forward; ``run`` stops the forward early where kind ``key`` learned its tail (``None``:
    never), learns it on the kind's first rebuild, and a stopped attempt that misses is made again
    in full (``attempt`` must set up its replayed state itself: RNG, modes, autocast)."""
    try:
        kind = None if key is None else _KINDS.get(key, LEARN)
    except TypeError:  # an argument's structure is not hashable: no kind
        kind = None
    if kind is None:
        return attempt(whole)
    if not isinstance(kind, Kind):  # the kind's first rebuild: in full, watched
        rebuild = Rebuild(None)
        result = attempt(rebuild.run)
        with _LOCK:
            _KINDS.pop(key, None)
            _KINDS[key] = rebuild.learned
            while len(_KINDS) > LIMIT:
                del _KINDS[next(iter(_KINDS))]
        return result
    rebuild = Rebuild(kind)
    try:
        result = attempt(rebuild.run)
    except Exception:
        if not rebuild.skipped:  # the full forward's own error
            raise
        result, rebuild.missed = None, rebuild.missed or "it raised"
    if rebuild.missed is not None:
        kind.misses += 1
        if kind.misses >= 2:
            with _LOCK:
                _KINDS[key] = None
        if rebuild.skipped:
            return attempt(whole)
    return cast(R, result)


def may_pay(tensors: Any) -> bool:
    """Whether a stage with these input tensors may have a tail worth stopping, ``WORTH`` at
    ``REACH`` multiply-adds per input element: smaller stages are not even looked up (the lookup
    costs a few microseconds in the fold, 1-2% of a tiny stage's step)."""
    return sum(t.numel() for t in tensors if isinstance(t, torch.Tensor)) * REACH >= WORTH


def observed(modules: Iterable[nn.Module]) -> bool:
    """Whether a forward hook or pre-hook could see a rebuild's tail: one of ``modules`` (those the
    rebuild calls) has one, or a global one is registered."""
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:  # pyright: ignore[reportPrivateUsage, reportUnknownMemberType]  # torch keeps the hooks in private dicts of untyped callables
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)  # pyright: ignore[reportPrivateUsage, reportUnknownMemberType, reportUnknownArgumentType]  # as above


def whole(f: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The forward in full."""
    return f(*args, **kwargs)


def unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class Rebuild(TorchDispatchMode):
    """One rebuild's forward under the counting hook. Learning (``kind`` None), the mode watches
    every op and keeps the ops since the last save; else it comes on at save ``kind.push`` and,
    from save N on, skips the kernels of the learned tail, op for op."""

    def __init__(self, kind: Kind | None):
        super().__init__()  # pyright: ignore[reportUnknownMemberType]  # torch: an untyped _dispatch_key parameter
        self.kind = kind
        self.count = 0  # tensors saved so far
        self.began = self.last = self.before = 0  # the count when the tail so far began / at the last op / before it
        self.ops: list[Op] = []  # the tail so far
        self.outputs: list[weakref.ref[torch.Tensor]] = []  # its outputs, weakly: a skipped kernel's output is freed as
        # the kernel's would be (an id of a freed one may come back: ``number`` checks the object)
        self.held: list[torch.Tensor] = []  # learning: the outputs themselves, for their nodes
        self.index: dict[int, int] = {}  # id of a tail output -> its number
        self.read: set[int] = set()  # the tail outputs a later tail op read
        self.work = 0  # the tail's multiply-adds
        self.unsafe: str | None = None  # why the tail so far cannot be skipped
        self.learned: Kind | None = None
        self.skipped = self.pushed = self.packing = False
        self.missed: str | None = None
        self.hooks: tuple[Any, ...] = ()
        self.modes = 0  # dispatch modes on when the forward began

    def run(self, f: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``f(*args, **kwargs)`` with its saves counted and, from save ``push``, under this mode."""
        if not compat.saved_hooks_enabled():
            self.missed = "saved-tensor hooks are disabled"
            return f(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(self.pack, unpack):
            self.hooks, self.modes = hooks_on_top(), compat.dispatch_modes_on()
            if self.kind is None or self.kind.push == 0:
                self.push()
            try:
                out = f(*args, **kwargs)
            finally:
                if self.pushed:
                    if compat.innermost_dispatch_mode() is not self:
                        raise RuntimeError("early_stop: the stage's forward left a dispatch mode of its own on")
                    self.__exit__(None, None, None)  # pyright: ignore[reportUnknownMemberType]  # torch: untyped parameters
        returns = tuple(self.number(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        if self.kind is None:
            self.learned = self.learn(returns)
        elif self.skipped and (returns != self.kind.returns or len(self.ops) != len(self.kind.tail)):
            self.miss("its tail ended otherwise than the one learned")
        self.outputs, self.held, self.index = [], [], {}  # the graph holds what it needs of them
        return out

    def push(self) -> None:  # pyright: ignore[reportIncompatibleMethodOverride]  # shadows TorchDispatchMode's deprecated classmethod push
        self.pushed = True
        self.__enter__()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count += 1
        if self.kind is not None:
            if self.count == self.kind.push and not self.pushed:
                if compat.dispatch_modes_on() == self.modes:
                    self.push()
                else:  # pushed now, it would be popped by the model's own mode
                    self.miss("runs under a dispatch mode of the model's own")
            if self.count > self.kind.saves:
                self.miss("it saves more tensors than the one learned")
        self.packing = True
        try:  # detached (same storage and version): an output its own node saves would hold it in a cycle
            return t.detach()
        finally:
            self.packing = False

    def miss(self, why: str) -> None:
        self.missed = self.missed or why
        if self.skipped:
            raise Miss(f"early_stop: the rebuild {why}; it runs again in full")

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[Any, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.packing:
            return func(*args, **kwargs)
        if self.kind is None:
            return self.watch(func, args, kwargs)
        if self.count < self.kind.saves or self.missed is not None:
            return func(*args, **kwargs)
        op, k = None, len(self.ops)
        if k < len(self.kind.tail) and torch.is_grad_enabled() and self.ours():
            op = self.kind.tail[k]
        if op is None or op.func is not func or op.args != self.describe(args, kwargs):
            self.miss(f"dispatched {func} where its tail had {op.func if op else 'no op'}")
            return func(*args, **kwargs)
        if op.view:
            out = func(*args, **kwargs)
        else:
            self.skipped = True
            out = pytree.tree_unflatten([allocated(*o) for o in op.outs], op.spec)
        self.ops.append(op)
        self.track(pytree.tree_leaves(out))
        return out

    def watch(self, func: Any, args: tuple[Any, ...], kwargs: dict[Any, Any]) -> Any:
        """Learning: ``func`` run, and kept as the tail's next op (its first if a save came since)."""
        if self.count > self.began:
            self.began, self.before = self.count, self.last
            self.ops, self.outputs, self.held, self.index = [], [], [], {}
            self.read, self.work, self.unsafe = set(), 0, None
        self.last = self.count
        described = self.describe(args, kwargs)
        self.read.update(cast("Iterable[int]", (d[1] for d in described[1] if type(d) is tuple and d[:1] == ("tail",))))
        grad, ours = torch.is_grad_enabled(), self.ours()
        out = func(*args, **kwargs)
        leaves, spec = pytree.tree_flatten(out)
        if not leaves or not all(isinstance(t, torch.Tensor) and t.layout == torch.strided for t in leaves):
            self.unsafe = self.unsafe or f"{func} returns no strided tensor (a host read)"
        elif RISKY.intersection(func.tags) or func._schema.is_mutable:
            self.unsafe = self.unsafe or f"{func} is random, data-dependent or in place"
        elif not grad or not ours:
            self.unsafe = self.unsafe or f"{func} runs without grad or under saved-tensor hooks of the model's own"
        else:
            view = func is aten._unsafe_view.default or any(r.alias_info is not None for r in func._schema.returns)
            self.ops.append(Op(func, described, tuple(layout(t) for t in leaves), spec, view))
            r = REDUCES.get(func)
            self.work += 0 if view else leaves[0].numel() * (1 if r is None else args[r].shape[-1])
        self.track(leaves)
        return out

    def learn(self, returns: tuple[Any, ...]) -> Kind | None:
        """The kind's ``Kind`` from the tail watched to the end (``None``: never stop it)."""
        kept_aside = set(range(len(self.outputs))) - self.read - set(returns)
        function = any(isinstance(t.grad_fn, BackwardCFunction) for t in self.held)
        if self.unsafe or kept_aside or function or self.work < WORTH:
            return None
        return Kind(self.count, self.before, tuple(self.ops), returns)

    def track(self, leaves: list[Any]) -> None:
        for t in leaves:
            if isinstance(t, torch.Tensor):
                self.index[id(t)] = len(self.outputs)
                self.outputs.append(weakref.ref(t))
                if self.kind is None:
                    self.held.append(t)

    def number(self, t: torch.Tensor) -> int | None:
        """Tail output ``t``'s number (``None``: not a tail output)."""
        n = self.index.get(id(t))
        return n if n is not None and self.outputs[n]() is t else None

    def describe(self, args: tuple[Any, ...], kwargs: dict[Any, Any]) -> tuple[Any, ...]:
        """An op's arguments: their structure and, per leaf, ``("tail", n)`` for tail output n, the
        layout of another tensor, or the value."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        return spec, tuple(
            x
            if not isinstance(x, torch.Tensor)
            else ("tensor", *layout(x))
            if (n := self.number(x)) is None
            else ("tail", n)
            for x in leaves
        )

    def ours(self) -> bool:
        """No saved-tensor hooks of the model's own are on top of the counting one."""
        return hooks_on_top() == self.hooks


def hooks_on_top() -> tuple[Any, ...]:
    """The ids of the saved-tensor hooks on top (ids, not the hooks: a mode holding its own bound
    ``pack`` would be a reference cycle, its tail's outputs kept until a collection)."""
    return tuple(map(id, compat.saved_hooks_on_top()))


def layout(t: torch.Tensor) -> tuple[Any, ...]:
    return t.shape, t.stride(), t.dtype, t.device


def described(leaf: object) -> Hashable:
    """An argument of a stage, as part of its kind's key: a tensor's layout, a plain value, or the
    type of anything else (a key must not keep a cache object and its tensors alive)."""
    if isinstance(leaf, torch.Tensor):
        return layout(leaf)
    return leaf if leaf is None or isinstance(leaf, (bool, int, float, str)) else type(leaf)


def allocated(shape: torch.Size, stride: tuple[Any, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output whose kernel is skipped: NaN where it is floating, so that no read of it passes for a value."""
    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return t.fill_(float("nan")) if t.is_floating_point() or t.is_complex() else t
