"""Ties: one tensor used by several stages (a tied embedding and head) gets the sum of every
use's gradient. The groups are found once, here, for ``ef.sweep``, the fused updates and the
pipeline: the same tensor object in several places of ``params``, or a group of ``chain.ties``.
``tie_grads`` sums them once every stage's gradients exist (a sweep; a pipeline rank, adding the
other ranks' sums); ``InFold`` as the fold emits them (fused updates, which let go of each stage's
gradients at once).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import optree

from ..program.chain import Chain
from ..tree import NAMESPACE
from .microbatch import add

__all__ = ["InFold", "tie_grads", "tie_groups"]


def tie_groups(chain: Chain, params: tuple[Any, ...]) -> list[Any]:
    """The groups of ``(stage, path)`` (an optree path into that stage's params) that are one tensor:
    the same object in several places of ``params``, or a group of ``chain.ties`` (which survives a
    pure update that unties the objects); groups that share a member are one."""
    if not chain.ties:  # the common case, checked in one pass: no tensor object used twice
        ids = [  # a module stage's params are a flat dict of tensors (checked), any other a pytree
            id(t)
            for s, p in zip(chain.stages, params)
            for t in (
                p.values()
                if s.param_names is not None and type(cast(object, p)) is dict
                else optree.tree_leaves(p, namespace=NAMESPACE)
            )
        ]
        if len(set(ids)) == len(ids):
            return []
    uses: dict[Any, Any] = {}
    for i, p in enumerate(params):
        paths, leaves, _ = optree.tree_flatten_with_path(p, namespace=NAMESPACE)
        for path, t in zip(paths, leaves):
            uses.setdefault(id(t), set()).add((i, path))
    groups = [g for g in uses.values() if len(g) > 1] + [{(i, (name,)) for i, name in g} for g in chain.ties]
    merged: list[Any] = []
    for g in groups:
        overlapping = [m for m in merged if m & g]
        merged = [m for m in merged if not m & g] + [set(g).union(*overlapping)]
    return sorted(tuple(sorted(m)) for m in merged)  # in one order on every rank of a pipeline


def tie_grads(
    params: tuple[Any, ...],
    grads: tuple[Any, ...],
    groups: list[Any],
    stages: Sequence[int] | None = None,
    combine: Callable[..., Any] | None = None,
) -> tuple[Any, ...]:
    """Give every use of a tied tensor the sum of all its uses' gradients, g = Σ_uses g_use (``None``,
    frozen or unused, is the zero), added in the group's order (``groups`` from ``tie_groups``).
    ``grads`` has one entry per stage of ``stages`` (default: every stage of ``params``); the sums run
    over the uses among them, and ``combine({group: sum})``, where given, is called with them (even
    none) and returns the totals (a pipeline rank adds the other ranks' sums)."""
    if not groups:
        return grads
    stages = range(len(params)) if stages is None else stages
    entry = {stage: k for k, stage in enumerate(stages)}
    uses = [[(entry[i], path) for i, path in group if i in entry] for group in groups]
    paths = {k: optree.tree_paths(params[stages[k]], namespace=NAMESPACE) for group in uses for k, _ in group}
    at = [[(k, paths[k].index(path)) for k, path in group] for group in uses]
    flats = [optree.tree_flatten(g, none_is_leaf=True, namespace=NAMESPACE) for g in grads] if any(at) else []
    leaves = [list(f) for f, _ in flats]
    sums = {n: functools.reduce(add, (leaves[k][j] for k, j in group)) for n, group in enumerate(at) if group}
    totals = sums if combine is None else combine(sums)
    if not sums:
        return grads
    for n, group in enumerate(at):
        for k, j in group:
            leaves[k][j] = totals[n]
    return tuple(spec.unflatten(f) for (_, spec), f in zip(flats, leaves))


class InFold:
    """Tied parameters of stages whose params are flat dicts, for a fold that hands out each stage's
    gradients from the highest stage down and lets go of them: a tied tensor is due once, at the
    lowest stage using it (the last use the fold reaches), with g = Σ_uses g_use added as the uses
    come (``None`` the zero); at its other uses it is not due. The sums so far are a value the
    caller threads (``due``), not kept here."""

    def __init__(self, groups: list[Any]):
        self.group_of: dict[Any, Any] = {}  # (stage, name) -> (group index, its uses (stage, name), lowest first)
        for n, group in enumerate(groups):
            uses = sorted((stage, path[0]) for stage, path in group)
            for use in uses:
                self.group_of[use] = (n, uses)

    def uses(self, i: int, name: str) -> list[Any]:
        """Every use of the tensor at ``(i, name)``, lowest stage first (itself alone if it is not tied)."""
        found = self.group_of.get((i, name))
        return [(i, name)] if found is None else found[1]

    def due(self, i: int, grads: dict[Any, Any], sums: Mapping[Any, Any]) -> tuple[dict[Any, Any], Mapping[Any, Any]]:
        """``(the gradients due at stage i, the new sums)``: its own, and a tied tensor's sum where i is
        its lowest stage; ``sums`` (group -> Σ of the uses so far) is not changed, a new one is returned."""
        due: dict[Any, Any]
        due, sums = {}, dict(sums)
        for name, g in grads.items():
            found = self.group_of.get((i, name))
            if found is None:
                due[name] = g
                continue
            n, uses = found
            sums[n] = add(sums.get(n), g)
            if uses[0][0] == i:
                due[name] = sums.pop(n)
        return due, sums
