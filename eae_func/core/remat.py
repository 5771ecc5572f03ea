"""The remat policy: which stages' graphs the reverse sweep rebuilds from their saved input
and which it keeps from the forward.

    always()          rebuild every stage (the memory-saving sweep; ``recompute=True``)
    never()           keep every stage's graph (plain autograd's memory, no second forward; ``False``)
    where(pred)       rebuild stage i when ``pred(i, name)`` is true
    budget(nbytes)    keep the last graphs whose saved tensors fit in ``nbytes``
    save(ops, where)  rebuild every stage, but keep the outputs of ``ops`` (say ``MATMULS``) from
                      the forward of the stages ``where`` says: the rebuild reuses them (torch's
                      selective activation checkpointing, within a stage); ``keep=`` whole graphs

Every setting gives the same gradients; only memory and time differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import typing
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts  # pyright: ignore[reportUnknownVariableType]  # torch: an untyped policy parameter

from ..cache import register
from ..compat import OpOverload, TorchDispatchMode, pytree

__all__ = ["MATMULS", "Remat", "always", "budget", "never", "save", "where"]

aten = torch.ops.aten
MATMULS = (
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
)
"""The ops whose outputs ``save(MATMULS)`` keeps: the matrix products and fused attention."""


@dataclasses.dataclass(frozen=True)
class Remat:
    """A remat policy; ``kind`` is one of ``"always"``, ``"never"``, ``"where"`` (with ``predicate``)
    or ``"budget"`` (with ``nbytes``). Make one with ``always``, ``never``, ``where`` or ``budget``."""

    kind: str
    predicate: Callable[[int, str], bool] | None = None
    nbytes: int = 0
    ops: Any = None
    keep: Callable[[int, str], bool] | None = None

    def plan(self, sizes: dict[Any, Any] | None = None) -> Plan:
        """The per-forward decisions of this policy (a byte budget is spent stage by stage; ``sizes``
        are the graph bytes earlier forwards like this one measured, which the plan updates)."""
        return Plan(self, self.nbytes, {} if sizes is None else sizes)


def always() -> Remat:
    """Rebuild every stage's graph from its saved input (the memory-saving sweep)."""
    return Remat("always")


def never() -> Remat:
    """Keep every stage's graph from the forward: no recompute, memory like plain autograd."""
    return Remat("never")


def where(predicate: Callable[[int, str], bool]) -> Remat:
    """Rebuild stage i's graph when ``predicate(i, name)`` is true, keep it otherwise."""
    if not callable(predicate):
        raise TypeError(f"remat.where: expected a predicate (index, name) -> bool, got {type(predicate).__name__}")
    return Remat("where", predicate=predicate)


def budget(nbytes: int) -> Remat:
    """Keep the graphs of the last stages whose saved tensors fit in ``nbytes`` together, rebuild
    the others. The reverse sweep uses the kept graphs (and frees them) before it rebuilds any
    stage: a budget of one graph keeps the last stage's, saving its recompute at no peak over
    rebuilding every stage (the tests see the two peaks within a tenth of a graph)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 0:
        raise TypeError(f"remat.budget: expected a byte count (an int >= 0), got {nbytes!r}")
    return Remat("budget", nbytes=int(nbytes))


def save(
    ops: Sequence[Any] | Callable[..., Any] = MATMULS,
    where: Callable[[int, str], bool] | None = None,
    keep: Callable[[int, str], bool] | None = None,
) -> Remat:
    """Rebuild stages' graphs from their saved input, keeping from the forward the outputs of
    ``ops`` (``torch.ops.aten`` overloads, or a policy ``fn(ctx, op, *args, **kwargs) ->
    CheckpointPolicy`` as ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` takes) in
    the stages where ``where(i, name)`` is true (default: all): the rebuild reuses them instead of
    running those ops again, so it costs their outputs' memory and saves their time. The stages
    where ``keep(i, name)`` is true keep their whole graph instead (say the last one: it is used
    before anything is rebuilt, so it costs no peak)."""
    if not callable(ops) and not (
        isinstance(cast(object, ops), Sequence) and all(isinstance(op, OpOverload) for op in ops)
    ):
        raise TypeError(
            f"remat.save: expected a sequence of torch.ops.aten overloads or a policy function, got {ops!r}"
        )
    for label, fn in (("where", where), ("keep", keep)):
        if fn is not None and not callable(fn):
            raise TypeError(f"remat.save: {label} must be a predicate (index, name) -> bool, got {type(fn).__name__}")
    return Remat("save", predicate=where, ops=list(ops) if not callable(ops) else ops, keep=keep)


def policy(value: Any) -> Remat:
    """``recompute=``'s value as a ``Remat``: a ``Remat``, ``True`` (always), ``False`` (never), a
    predicate (where) or an int (a byte budget)."""
    if isinstance(value, Remat):
        return value
    if isinstance(value, bool):
        return always() if value else never()
    if isinstance(value, numbers.Integral) and int(value) >= 0:
        return budget(int(value))
    if callable(value):
        return where(typing.cast(Callable[[int, str], bool], value))
    raise TypeError(
        f"sweep: recompute must be True, False, a predicate (index, name) -> bool, a byte budget "
        f"(an int >= 0) or an ef.remat policy, got {value!r}"
    )


class Plan:
    """One forward's remat decisions. ``rebuilds(i, name)`` before stage i runs; with a byte budget,
    ``kept(i, nbytes)`` after stage i's graph was built says whether it is kept, dropping the
    earliest kept graphs as needed to make room (``evicted()`` names their stages, which the reverse
    sweep then rebuilds), so the last graphs that fit are kept. Once a graph larger than the whole
    budget was seen, no more are built.

    ``sizes`` (stage -> graph bytes, as earlier forwards of these stages on inputs of this layout
    measured them; the plan records what it measures) let a budget build only the graphs it will
    keep: the last ones whose sizes fit. The other stages then run without a graph, so none is
    built and dropped, and the peak is that of the kept graphs alone. Sizes steer nothing but which
    graphs are kept: every choice gives the same gradients, and ``kept`` still holds the budget."""

    def __init__(self, remat: Remat, left: int, sizes: dict[Any, Any]):
        self.remat, self.left, self.largest, self.sizes = remat, left, 0, sizes
        self.held: list[tuple[int, int]] = []  # (stage, bytes) of the kept graphs, oldest first
        self.dropped: list[int] = []
        self.ahead = self._last_that_fit() if self.counts and sizes else None

    @property
    def counts(self) -> bool:
        """Whether graphs' saved bytes must be counted (a byte budget)."""
        return self.remat.kind == "budget"

    def _last_that_fit(self) -> frozenset[int]:
        """The last stages (of those measured) whose graphs fit in the budget together."""
        chosen: list[int]
        chosen, left = [], self.remat.nbytes
        for i in sorted(self.sizes, reverse=True):
            if self.sizes[i] > left:
                break
            chosen.append(i)
            left -= self.sizes[i]
        return frozenset(chosen)

    def rebuilds(self, i: int, name: str) -> bool:
        kind = self.remat.kind
        if kind == "budget":
            planned_out = self.ahead is not None and i not in self.ahead
            return self.remat.nbytes == 0 or self.largest > self.remat.nbytes or planned_out
        if kind == "where":
            assert self.remat.predicate is not None
            return bool(self.remat.predicate(i, name))
        if kind == "save":
            return self.remat.keep is None or not self.remat.keep(i, name)
        return kind == "always"

    def saving(self, i: int, name: str) -> Saving | None:
        """For a stage that keeps some ops' outputs (``save``): its ``Saving``, else ``None``."""
        remat = self.remat
        if remat.kind != "save" or (remat.predicate is not None and not remat.predicate(i, name)):
            return None
        return Saving(remat.ops)

    def kept(self, i: int, nbytes: int) -> bool:
        """Keep stage i's graph of ``nbytes`` if it fits in the budget at all, dropping the earliest
        kept graphs until it fits beside the rest."""
        self.largest, self.sizes[i] = max(self.largest, nbytes), nbytes
        if nbytes > self.remat.nbytes:
            return False
        while nbytes > self.left:
            j, freed = self.held.pop(0)
            self.left += freed
            self.dropped.append(j)
        self.held.append((i, nbytes))
        self.left -= nbytes
        return True

    def evicted(self) -> list[int]:
        """The stages whose kept graphs were dropped since the last call (rebuild them instead)."""
        dropped, self.dropped = self.dropped, []
        return dropped


class Saving:
    """``remat.save`` for one stage: ``forward()`` is the context its forward runs under, keeping
    the chosen ops' outputs (``torch.utils.checkpoint``'s selective checkpointing); ``replay`` then
    hands them to the rebuild's ops in call order, or is ``None``: the forward wrote into a kept
    output after it was kept, through an alias autograd does not version (``torch.matmul``'s
    ``_unsafe_view`` of ``bmm``'s output, which Nystromformer's ``context += conv(v)`` writes), so
    the rebuild would be handed the changed value and give wrong gradients, as torch's own
    selective checkpointing does there; it runs in full instead. The forward watches every write
    into the kept outputs' storage for it (``_Writes``)."""

    def __init__(self, ops: Any):
        self.kept: set[int] = set()  # the storages of the outputs kept
        self.written = False

        def listed(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
            return op in ops

        chosen = ops if callable(ops) else listed

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            decision = chosen(ctx, op, *args, **kwargs)
            if not ctx.is_recompute and decision in (True, CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
                for t in pytree.tree_leaves(ctx.op_output):
                    if isinstance(t, torch.Tensor):
                        self.kept.add(t.untyped_storage().data_ptr())
            return decision

        self._forward, self._replay = create_selective_checkpoint_contexts(policy)

    @contextlib.contextmanager
    def forward(self):
        with _Writes(self), self._forward:  # the writes seen after the caching mode, which runs first
            yield

    @property
    def replay(self) -> Any:
        return None if self.written else self._replay


class _Writes(TorchDispatchMode):
    """Marks ``saving.written`` when an op writes into the storage of an output ``saving`` kept."""

    def __init__(self, saving: Saving):
        super().__init__()  # pyright: ignore[reportUnknownMemberType]  # torch: an untyped _dispatch_key parameter
        self.saving = saving

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[Any, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable and self.saving.kept and not self.saving.written:
            for k, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = kwargs.get(arg.name) if arg.kwarg_only or k >= len(args) else args[k]
                for t in pytree.tree_leaves(value):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.saving.kept:
                        self.saving.written = True
        return func(*args, **kwargs)


class SavedBytes:
    """``saved_tensors_hooks`` that count the bytes of the storages a graph saves, besides ``own``'s."""

    def __init__(self, own: Sequence[torch.Tensor]):
        self.seen = {t.untyped_storage().data_ptr() for t in own}
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        # Detached (same storage and version counter): an output its own node saves would otherwise
        # hold that node, a cycle no collector sees, and a graph dropped unused would never be freed.
        return t.detach()

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


_SIZES: dict[
    int, dict[Any, Any]
] = {}  # id(chain) -> {what a forward ran on: {stage: graph bytes}}, while the chain lives
register("remat", "recompute= budgets: the graph bytes forwards of a chain or model measured, per stage range and "
         "input layout, dropped with the chain or model", lambda: _SIZES.clear())  # fmt: skip


def sizes(chain: Any, key: Any) -> dict[Any, Any]:
    """The graph bytes that forwards of ``chain`` on ``key`` (the stage range, input layout,
    autocast and boundary storage) measured, stage by stage: the ``sizes`` of that forward's ``Plan``."""
    if id(chain) not in _SIZES:
        _SIZES[id(chain)] = {}
        weakref.finalize(chain, _SIZES.pop, id(chain), None)
    return _SIZES[id(chain)].setdefault(key, {})
