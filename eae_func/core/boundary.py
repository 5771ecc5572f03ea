"""Boundary states: splitting a pytree into differentiable and integer leaves,
and storing it in a lower dtype and/or on the CPU between the sweeps."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import optree
import torch

from ..tree import NAMESPACE, map_tensors

__all__ = [
    "Layout",
    "Policy",
    "Prefetcher",
    "device_of",
    "first_tensor",
    "flat",
    "is_differentiable",
    "leaves",
    "nbytes",
    "split",
    "split_as",
]


def is_differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


TENSOR: Any = optree.tree_structure(torch.empty(0), namespace=NAMESPACE)  # type: ignore[arg-type]  # a lone tensor's spec


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """``optree.tree_flatten`` in the library's namespace, without a call into optree for a lone
    tensor (most boundaries: the fold flattens each several times per stage)."""
    if isinstance(tree, torch.Tensor):
        return [tree], TENSOR
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def flat(tree: Any, none_is_leaf: bool = False) -> list[Any]:
    """``optree.tree_leaves`` in the library's namespace, a lone tensor without a call into optree."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    return optree.tree_leaves(tree, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def leaves(tree: Any, where: str) -> tuple[list[Any], Any]:
    """Leaves and treespec of a boundary state: at least one leaf, every leaf a tensor."""
    leaves_, spec = flatten(tree)
    if not leaves_:
        raise TypeError(
            f"{where}: boundary states must be tensors or pytrees of tensors, got "
            f"{type(tree).__name__} with no tensor in it"
        )
    for t in leaves_:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{where}: boundary states must be tensors or pytrees of tensors, "
                f"found a leaf of type {type(t).__name__}"
            )
    return leaves_, spec


def split(tree: Any, where: str) -> tuple[list[Any], Callable[[list[Any]], Any], Callable[[list[Any]], Any]]:
    """``(floats, rebuild, costate_like)`` for a boundary state.

    ``floats`` are its differentiable leaves; ``rebuild(floats)`` puts new ones
    back beside the integer leaves; ``costate_like(floats)`` builds the matching
    costate tree with ``None`` where a leaf has no costate.
    """
    flat, spec = leaves(tree, where)
    return _split(flat, spec, [is_differentiable(t) for t in flat])


def split_as(tree: Any, layout: Layout) -> tuple[list[Any], Callable[[list[Any]], Any], Callable[[list[Any]], Any]]:
    """``split`` of a state known to have ``layout`` (a tape's boundary, checked when it was made)."""
    return _split(flat(tree), layout.spec, layout.mask)


def _split(
    flat: list[Any], spec: Any, mask: Sequence[bool]
) -> tuple[list[Any], Callable[[list[Any]], Any], Callable[[list[Any]], Any]]:
    if all(mask):  # every leaf differentiable: nothing to put back
        return list(flat), spec.unflatten, spec.unflatten

    def fill(new: list[Any], other: Callable[[torch.Tensor], Any]) -> Any:
        it = iter(new)
        return spec.unflatten([next(it) if m else other(t) for t, m in zip(flat, mask)])

    return (
        [t for t, m in zip(flat, mask) if m],
        lambda new: fill(new, lambda t: t),
        lambda new: fill(new, lambda t: None),
    )


@dataclasses.dataclass(frozen=True)
class Policy:
    """Where boundary states live between the forward and the reverse sweep.

    dtype:   store differentiable leaves in this dtype (e.g. ``torch.bfloat16``);
             the forward feeds the next stage the stored value, so the reverse
             recomputes exactly what the forward ran.
    offload: keep them on the CPU (pinned when the compute device is CUDA), copied there
             on a side stream, and copy each back to the device one stage ahead of its use.
    """

    dtype: torch.dtype | None = None
    offload: bool = False

    def store(self, tree: Any, like: Layout, stream: Any = None) -> tuple[Any, Any]:
        """``(kept, fed)``: the state as the tape keeps it (in ``dtype``; on the CPU with ``offload``,
        the device-to-host copies issued on ``stream``, a side CUDA stream, so the compute stream
        never waits on them) and as the next stage runs on it: the kept values back in the compute
        dtype, cast on the device (no round trip through the host)."""
        low = map_tensors(lambda t: t.to(self.dtype) if self.dtype is not None and is_differentiable(t) else t, tree)
        fed = self.load(low, like) if self.dtype is not None else tree
        kept = map_tensors(lambda t: to_host(t, stream), low) if self.offload else low
        return kept, fed

    def load(self, stored: Any, like: Layout) -> Any:
        """The stored state back in the compute dtype and on the compute device."""
        flat = optree.tree_leaves(stored, namespace=NAMESPACE)
        return like.spec.unflatten(
            [t.to(device=dev, dtype=dt, non_blocking=True) for t, (dev, dt) in zip(flat, like.placements)]
        )


def to_host(t: torch.Tensor, stream: Any) -> torch.Tensor:
    """A CPU copy of ``t`` (pinned, same memory format), copied on ``stream`` when given: the side
    stream waits for ``t`` to be computed, and ``t``'s memory is not reused before the copy ends."""
    if t.device.type == "cpu":
        return t
    host = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
    if stream is None:
        host.copy_(t, non_blocking=True)
        return host
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=True)
    t.record_stream(stream)
    return host


@dataclasses.dataclass(frozen=True)
class Layout:
    """Shape, dtype and device of every leaf of a boundary state, for loads and checks."""

    spec: Any
    shapes: tuple[Any, ...]
    placements: tuple[Any, ...]  # (device, dtype) per leaf

    @staticmethod
    def of(tree: Any) -> Layout:
        return Layout.of_leaves(*flatten(tree))

    @staticmethod
    def of_leaves(flat: list[Any], spec: Any) -> Layout:
        if len(flat) == 1:  # most boundaries: one tensor, without the generators
            t = flat[0]
            return Layout(spec, (t.shape,), ((t.device, t.dtype),))
        return Layout(spec, tuple(t.shape for t in flat), tuple((t.device, t.dtype) for t in flat))

    @functools.cached_property
    def mask(self) -> tuple[bool, ...]:
        """Which leaves are differentiable (floating or complex): those with a costate."""
        return tuple(dt.is_floating_point or dt.is_complex for _, dt in self.placements)

    @functools.cached_property
    def costate_spec(self) -> Any:
        """The tree structure a costate of this boundary has (``None`` leaves counted as leaves)."""
        return optree.tree_structure(
            self.spec.unflatten([0] * self.spec.num_leaves), none_is_leaf=True, namespace=NAMESPACE
        )


def nbytes(tree: Any) -> int:
    """Bytes of the tensor leaves of ``tree``."""
    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(tree, namespace=NAMESPACE))


class Prefetcher:
    """Copies offloaded boundaries to the device on a side CUDA stream, one stage ahead. The same
    stream carried the forward's device-to-host copies, so each load is ordered after its store."""

    def __init__(self, policy: Policy, device: torch.device):
        self.policy = policy
        self.stream = torch.cuda.Stream(device) if policy.offload and device.type == "cuda" else None
        self.pending: dict[int, Any] = {}

    def start(self, index: int, stored: Any, like: Layout) -> None:
        if self.stream is None:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # after the compute queued so far
        with torch.cuda.stream(self.stream):
            self.pending[index] = self.policy.load(stored, like)

    def get(self, index: int, stored: Any, like: Layout) -> Any:
        if self.stream is None or index not in self.pending:
            if self.stream is not None:  # the device-to-host copy ran on the side stream
                torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            return self.policy.load(stored, like)
        current = torch.cuda.current_stream(self.stream.device)
        current.wait_stream(self.stream)
        tree = self.pending.pop(index)
        for t in optree.tree_leaves(tree, namespace=NAMESPACE):
            if t.is_cuda:
                t.record_stream(current)
        return tree


def device_of(*trees: Any, default: torch.device = torch.device("cpu")) -> torch.device:
    """Where the stages compute: the device of the first tensor of ``trees`` (the params first)."""
    for tree in trees:
        first = first_tensor(tree)
        if first is not None:
            return first.device
    return default


def first_tensor(tree: Any) -> torch.Tensor | None:
    """The first tensor leaf of ``tree`` in optree's order, found without flattening all of a tuple."""
    if isinstance(tree, torch.Tensor):
        return tree
    if isinstance(tree, (tuple, list)):
        return next((t for t in map(first_tensor, cast("Sequence[Any]", tree)) if t is not None), None)
    named: dict[Any, Any] = tree  # as the dict it is tested for
    if type(named) is dict and named and all(type(k) is str for k in named):  # optree's order: sorted keys
        return first_tensor([named[k] for k in sorted(named)])
    return next((t for t in optree.tree_leaves(tree, namespace=NAMESPACE) if isinstance(t, torch.Tensor)), None)
