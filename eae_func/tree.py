"""Pytree helpers: optree's functions in this library's registry namespace (where
``AdjointState`` is registered), as ``jax.tree_util`` users expect them."""

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from .cache import register
from .compat import pytree

__all__ = ["flatten_call", "flatten_output", "map_tensors", "tree_leaves", "tree_map", "tree_structure", "unflatten"]

NAMESPACE = "eae_func"

tree_map = functools.partial(optree.tree_map, namespace=NAMESPACE)
"""``optree.tree_map(f, tree, *rest)`` over trees that may hold ``AdjointState``."""
tree_leaves = functools.partial(optree.tree_leaves, namespace=NAMESPACE)
"""``optree.tree_leaves(tree)``, an ``AdjointState``'s tensors among them."""
tree_structure = functools.partial(optree.tree_structure, namespace=NAMESPACE)
"""``optree.tree_structure(tree)``, ``AdjointState`` a node."""


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree_map(fn, tree)`` over a tree whose leaves are tensors, ``fn`` typed as taking one."""
    return optree.tree_map(fn, tree, namespace=NAMESPACE)


_TENSOR = pytree.tree_structure(torch.empty(0))
_CALLS: dict[int, Any] = {}  # n -> the spec of a call on n tensors, no keywords
register("call specs", "run-time cuts: the pytree spec of a call on n tensors, per n", lambda: _CALLS.clear())


def flatten_call(args: tuple[Any, ...], kwargs: dict[Any, Any]) -> tuple[list[Any], Any]:
    """``torch.utils._pytree.tree_flatten((args, kwargs))``; a call on tensors alone (the common
    case, once per cut call) without walking it."""
    if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
        return pytree.tree_flatten((args, kwargs))
    spec = _CALLS.get(len(args))
    if spec is None:
        spec = _CALLS[len(args)] = pytree.tree_structure((args, kwargs))
    return list(args), spec


def flatten_output(out: Any) -> tuple[list[Any], Any]:
    """``torch.utils._pytree.tree_flatten(out)``; a bare tensor without walking it."""
    return ([out], _TENSOR) if isinstance(out, torch.Tensor) else pytree.tree_flatten(out)


def unflatten(leaves: list[Any], spec: Any) -> Any:
    """``torch.utils._pytree.tree_unflatten``, at no cost for the specs ``flatten_call`` and
    ``flatten_output`` make without walking."""
    if spec is _TENSOR:
        return leaves[0]
    if _CALLS.get(len(leaves)) is spec:
        return tuple(leaves), {}
    return pytree.tree_unflatten(leaves, spec)
