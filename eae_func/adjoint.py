"""The costate record that flows through the reverse sweep.

``AdjointState`` holds the costate ``p_l = dLoss/dx_l`` at boundary ``l`` plus
static facts about it. It is a frozen dataclass and a plain value: registered as
a pytree both in PyTorch's registry (read by ``torch.func`` transforms) and in
optree under the ``"eae_func"`` namespace, its only leaf is the costate value and
its static fields are cheap hashable values (index, stage, key, history). What the
passes measured (``meta``) rides along as ``Measurements``, which never make two
structures differ and are never read by a comparison, so two records that differ
only in their costates and measurements ``tree_map`` together (the result keeps the
first record's). The boundary state x_l is not in the record: passes read it from
their context.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import optree
import torch

from .cache import register
from .compat import pytree as torch_pytree
from .tree import NAMESPACE

__all__ = ["AdjointState", "Measurements", "fold_in"]


class Measurements(Mapping[Any, Any]):
    """An immutable (and picklable) mapping of what passes measured at a boundary."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None):
        self._items = dict(items or {})

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return repr(self._items)

    def __reduce__(self):
        return Measurements, (self._items,)


class Carried:
    """A record's measurements in its pytree's static data: carried, not compared. Any two are equal
    and hash alike, so no structure comparison reads a lazy device number and measurements never
    make two records' structures differ."""

    __slots__ = ("meta",)

    def __init__(self, meta: Mapping[str, Any]):
        self.meta = meta

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Carried)

    def __hash__(self) -> int:
        return hash(Carried)

    def __repr__(self) -> str:
        return "Carried(...)"

    def __reduce__(self):
        return Carried, (self.meta,)


@dataclasses.dataclass(frozen=True, eq=False)
class AdjointState:
    """Costate ``value`` at boundary ``index`` (``L`` is the loss side, ``0`` the input).

    value:    the costate, a tensor or a pytree mirroring the boundary state;
              ``None`` leaves mark boundary leaves with no costate (integer inputs).
    index:    boundary index l; the costate feeds stage l (1-based) on its way back.
    stage:    name of the stage whose output is this boundary (``"input"`` for l = 0).
    key:      int seed for this boundary, ``fold_in(sweep_key, index)``.
    history:  names of the passes applied so far, in order.
    meta:     immutable mapping of what passes measured (scale, kept fraction, ...).
    """

    value: Any
    index: int
    stage: str
    key: int = 0
    history: tuple[Any, ...] = ()
    meta: Mapping[str, Any] = dataclasses.field(default_factory=Measurements)

    def __post_init__(self):
        if not isinstance(self.meta, Measurements):
            object.__setattr__(self, "meta", Measurements(self.meta))
        object.__setattr__(self, "history", tuple(self.history))

    def replace(self, **changes: Any) -> AdjointState:
        """A new record with ``changes``; ``meta`` given as a mapping is merged, not replaced."""
        if "meta" in changes:
            changes["meta"] = {**self.meta, **changes["meta"]}
        return dataclasses.replace(self, **changes)

    def applied(self, name: str, value: Any, **meta: Any) -> AdjointState:
        """The record after pass ``name`` produced ``value`` and measured ``meta``."""
        return AdjointState(
            value,
            self.index,
            self.stage,
            self.key,
            self.history + (name,),
            Measurements({**self.meta, **meta}) if meta else self.meta,
        )

    def seed(self) -> int:
        """The seed of the pass about to run: ``fold_in(key, len(history))``, so two random passes
        at one boundary (at different positions of the history) never share draws."""
        return fold_in(self.key, len(self.history))

    def generator(self, device: torch.device | str | None = None) -> torch.Generator:
        """A fresh generator seeded by ``seed()`` (same key and position, same draws), on ``device``
        (``None``: the costate's, so draws land where the costate is)."""
        if device is None:
            leaves = self.tensors()
            device = leaves[0].device if leaves else "cpu"
        return torch.Generator(device=device).manual_seed(self.seed())

    def tensors(self) -> list[Any]:
        """The costate's tensor leaves (``None`` leaves skipped)."""
        return optree.tree_leaves(self.value, namespace=NAMESPACE)

    def __repr__(self) -> str:
        shapes = optree.tree_map(lambda t: tuple(t.shape), self.value, namespace=NAMESPACE)
        return (
            f"AdjointState(index={self.index}, stage={self.stage!r}, value={shapes}, "
            f"history={self.history}, meta={dict(self.meta)})"
        )


def _flatten(adj: Any) -> tuple[list[Any], tuple[Any, ...]]:
    return [adj.value], (adj.index, adj.stage, adj.key, adj.history, Carried(adj.meta))


def _unflatten(children: Any, context: Any) -> AdjointState:
    index, stage, key, history, carried = context
    return AdjointState(children[0], index, stage, key, history, carried.meta)


def _flatten_with_keys(adj: Any) -> tuple[list[tuple[Any, Any]], Any]:
    return [(torch_pytree.GetAttrKey("value"), adj.value)], _flatten(adj)[1]


optree.register_pytree_node(
    AdjointState,  # pyright: ignore[reportArgumentType] (optree's stub types a node class as a Collection)
    lambda adj: (*_flatten(adj), ("value",)),
    lambda context, children: _unflatten(children, context),  # pyright: ignore[reportArgumentType] (same)
    namespace=NAMESPACE,
)
torch_pytree.register_pytree_node(
    AdjointState,
    _flatten,
    _unflatten,
    serialized_type_name="eae_func.AdjointState",
    flatten_with_keys_fn=_flatten_with_keys,
)


@functools.lru_cache(maxsize=1 << 16)
def fold_in(key: int, data: int) -> int:
    """Deterministically derive a new 63-bit seed from ``key`` and ``data`` (as jax.random.fold_in);
    cached, since a sweep derives the same boundary keys every step."""
    digest = hashlib.blake2b(f"{int(key)}:{int(data)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


register("boundary keys", "fold_in(key, index), the 65,536 used last", fold_in.cache_clear)
