"""The costate record that flows through the reverse sweep.

``AdjointState`` holds the costate ``p_l = dLoss/dx_l`` at boundary ``l`` plus
static facts about it. It is a frozen dataclass registered as a pytree both in
PyTorch's registry (read by ``torch.func`` transforms) and in optree under the
``"eae_func"`` namespace: its only leaf is the costate value, so transforms and
``optree.tree_map(..., namespace=NAMESPACE)`` see straight through it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from types import MappingProxyType
from typing import Any, Mapping

import optree
import torch
import torch.utils._pytree as torch_pytree

from .tree import NAMESPACE


class _Opaque:
    """Static field compared by identity, so it can hold tensors (the boundary state)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


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
    boundary: the boundary state x_l itself, readable by passes (synthetic
              gradients); static, never a leaf, and dropped from the returned trace.
    """

    value: Any
    index: int
    stage: str
    key: int = 0
    history: tuple = ()
    meta: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    boundary: Any = None

    def __post_init__(self):
        if not isinstance(self.meta, MappingProxyType):
            object.__setattr__(self, "meta", MappingProxyType(dict(self.meta)))
        object.__setattr__(self, "history", tuple(self.history))

    def replace(self, **changes: Any) -> "AdjointState":
        """A new record with ``changes``; ``meta`` given as a mapping is merged, not replaced."""
        if "meta" in changes:
            changes["meta"] = {**self.meta, **changes["meta"]}
        return dataclasses.replace(self, **changes)

    def applied(self, name: str, value: Any, **meta: Any) -> "AdjointState":
        """The record after pass ``name`` produced ``value`` and measured ``meta``."""
        return self.replace(value=value, history=self.history + (name,), meta=meta)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A fresh generator seeded by this boundary's key: same key, same draws."""
        return torch.Generator(device=device).manual_seed(self.key)

    def tensors(self) -> list:
        """The costate's tensor leaves (``None`` leaves skipped)."""
        return optree.tree_leaves(self.value, namespace=NAMESPACE)

    def __repr__(self) -> str:
        shapes = optree.tree_map(lambda t: tuple(t.shape), self.value, namespace=NAMESPACE)
        return (f"AdjointState(index={self.index}, stage={self.stage!r}, value={shapes}, "
                f"history={self.history}, meta={dict(self.meta)})")


def _flatten(adj: AdjointState):
    context = (adj.index, adj.stage, adj.key, adj.history, tuple(adj.meta.items()), _Opaque(adj.boundary))
    return [adj.value], context


def _unflatten(children, context) -> AdjointState:
    index, stage, key, history, meta, boundary = context
    return AdjointState(children[0], index, stage, key, history, dict(meta), boundary.value)


optree.register_pytree_node(
    AdjointState,
    lambda adj: (*_flatten(adj), ("value",)),
    lambda context, children: _unflatten(children, context),
    namespace=NAMESPACE,
)
torch_pytree.register_pytree_node(
    AdjointState,
    _flatten,
    _unflatten,
    serialized_type_name="eae_func.AdjointState",
    flatten_with_keys_fn=lambda adj: ([(torch_pytree.GetAttrKey("value"), adj.value)], _flatten(adj)[1]),
)


def fold_in(key: int, data: int) -> int:
    """Deterministically derive a new 63-bit seed from ``key`` and ``data`` (as jax.random.fold_in)."""
    digest = hashlib.blake2b(f"{int(key)}:{int(data)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
