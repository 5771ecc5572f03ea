"""Ties: one tensor used by several stages (a tied embedding and head) gets the sum of every
use's gradient. The groups are found once, here, for ``ef.sweep``, the fused updates and the
pipeline: the same tensor object in several places of ``params``, or a group of ``chain.ties``.
"""

from __future__ import annotations

import functools

import optree

from .chain import Chain
from .microbatch import add
from .tree import NAMESPACE


def tie_groups(chain: Chain, params: tuple) -> list:
    """The groups of ``(stage, path)`` (an optree path into that stage's params) that are one tensor:
    the same object in several places of ``params``, or a group of ``chain.ties`` (which survives a
    pure update that unties the objects); groups that share a member are one."""
    if not chain.ties:  # the common case, checked in one pass: no tensor object used twice
        ids = [  # a module stage's params are a flat dict of tensors (checked), any other a pytree
            id(t)
            for s, p in zip(chain.stages, params)
            for t in (
                p.values()
                if s.param_names is not None and type(p) is dict
                else optree.tree_leaves(p, namespace=NAMESPACE)
            )
        ]
        if len(set(ids)) == len(ids):
            return []
    uses: dict = {}
    for i, p in enumerate(params):
        paths, leaves, _ = optree.tree_flatten_with_path(p, namespace=NAMESPACE)
        for path, t in zip(paths, leaves):
            uses.setdefault(id(t), set()).add((i, path))
    groups = [g for g in uses.values() if len(g) > 1] + [{(i, (name,)) for i, name in g} for g in chain.ties]
    merged: list = []
    for g in groups:
        overlapping = [m for m in merged if m & g]
        merged = [m for m in merged if not m & g] + [set(g).union(*overlapping)]
    return sorted(tuple(sorted(m)) for m in merged)  # in one order on every rank of a pipeline


def tie_grads(params: tuple, grads: tuple, groups: list, lo: int = 0) -> tuple:
    """Give every use of a shared tensor (``groups``, from ``tie_groups``) the sum of all its uses'
    gradients; ``grads`` has one entry per stage from ``lo`` on, and only groups within them are summed."""
    hi = lo + len(grads)
    local = [g for g in groups if all(lo <= i < hi for i, _ in g)]
    if not local:
        return grads
    paths = [optree.tree_paths(params[i], namespace=NAMESPACE) for i in range(lo, hi)]
    original, specs = zip(*(optree.tree_flatten(g, none_is_leaf=True, namespace=NAMESPACE) for g in grads))
    flat = [list(g) for g in original]
    for group in local:
        members = [(i - lo, paths[i - lo].index(path)) for i, path in group]
        total = functools.reduce(add, (original[i][j] for i, j in members))
        for i, j in members:
            flat[i][j] = total
    return tuple(spec.unflatten(f) for spec, f in zip(specs, flat))
