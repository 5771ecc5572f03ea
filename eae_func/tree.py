"""Pytree helpers: optree's functions in this library's registry namespace (where
``AdjointState`` is registered), as ``jax.tree_util`` users expect them."""

import functools

import optree

NAMESPACE = "eae_func"

tree_map = functools.partial(optree.tree_map, namespace=NAMESPACE)
tree_leaves = functools.partial(optree.tree_leaves, namespace=NAMESPACE)
tree_structure = functools.partial(optree.tree_structure, namespace=NAMESPACE)
