"""Pytree helpers: optree's functions in this library's registry namespace (where
``AdjointState`` is registered), as ``jax.tree_util`` users expect them."""

import functools

import optree

__all__ = ["tree_leaves", "tree_map", "tree_structure"]

NAMESPACE = "eae_func"

tree_map = functools.partial(optree.tree_map, namespace=NAMESPACE)
"""``optree.tree_map(f, tree, *rest)`` over trees that may hold ``AdjointState``."""
tree_leaves = functools.partial(optree.tree_leaves, namespace=NAMESPACE)
"""``optree.tree_leaves(tree)``, an ``AdjointState``'s tensors among them."""
tree_structure = functools.partial(optree.tree_structure, namespace=NAMESPACE)
"""``optree.tree_structure(tree)``, ``AdjointState`` a node."""
