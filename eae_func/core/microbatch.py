"""Microbatching, in one place for ``ef.sweep`` and the pipeline: cut a batch into pieces
whose gradients sum to the full batch's, and join the pieces' results.

With ``k`` pieces of ``n_j`` rows (``n = Σ n_j``) and a loss that is a ``mean`` over rows,
piece j's loss is scaled by ``n_j / n`` (``sum``: by 1), so Σ_j scale_j loss_j is the full
batch's loss and the summed gradients are its gradients. Piece j's key is
``fold_in(key, -1 - j)`` (the key itself when k = 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import optree
import torch

from ..adjoint import AdjointState, fold_in
from ..tree import NAMESPACE

__all__ = ["Microbatch", "add", "join_adjoints", "merge_counters", "split", "sum_grads", "sum_stats"]


@dataclasses.dataclass(frozen=True)
class Microbatch:
    """One piece: its input (``None`` where this process has none), loss args, loss scale and key."""

    x: Any
    loss_args: tuple[Any, ...]
    scale: float | None
    key: int


def _batched(tree: Any) -> list[Any]:
    return [t for t in optree.tree_leaves(tree, namespace=NAMESPACE) if isinstance(t, torch.Tensor) and t.ndim > 0]


def _pieces(tree: Any, k: int) -> list[Any]:
    """``tree`` cut into ``k`` pieces along dim 0 of every tensor leaf (other leaves repeated)."""
    flat, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    cut = [t.tensor_split(k) if isinstance(t, torch.Tensor) and t.ndim > 0 else (t,) * k for t in flat]
    return [spec.unflatten([c[j] for c in cut]) for j in range(k)]


def _check_rows(tree: Any, name: str, n: int, k: int, where: str) -> None:
    """Refuse a tensor leaf of ``tree`` with a batch dim other than the batch's ``n`` rows: cut into
    ``k`` pieces, it would not line up with the input's pieces (a ``(1, d)`` target meant to broadcast)."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    for path, t in zip(paths, leaves):
        if isinstance(t, torch.Tensor) and t.ndim > 0 and t.shape[0] != n:
            at = name + "".join(f"[{p!r}]" for p in path)
            raise ValueError(
                f"{where}: microbatches={k} cuts {at} on dim 0, but it has shape {tuple(t.shape)}, not the "
                f"batch's {n} rows; give it {n} rows (a target meant to broadcast: t.expand({n}, ...)), let the "
                f"loss close over it, or use microbatches=1"
            )


def split(
    x: Any, loss_args: tuple[Any, ...] | None, k: int, reduction: str, key: int, where: str = "sweep"
) -> list[Microbatch]:
    """``k`` microbatches of ``x`` and ``loss_args`` (either may be ``None``: a pipeline rank that
    has no input or computes no loss); ``k`` and ``reduction`` as checked by ``Options``. The rows
    are counted on the first batched tensor of ``x``, else of ``loss_args``; ``scale`` is ``None``
    where neither has one."""
    if k == 1:
        return [Microbatch(x, () if loss_args is None else loss_args, 1.0, key)]
    reference = _batched(x) or _batched(loss_args)
    if x is not None and not _batched(x):
        raise ValueError(f"{where}: microbatches={k} cuts the input on dim 0, but it has no tensor with a batch dim")
    n = reference[0].shape[0] if reference else None
    if n is not None and n < k:
        raise ValueError(
            f"{where}: microbatches={k} is more than the {n} rows of the batch; use at most {n} microbatches"
        )
    if n is not None:
        _check_rows(x, "x", n, k, where)
        _check_rows(loss_args, "loss_args", n, k, where)
    xs = _pieces(x, k) if x is not None else [None] * k
    args = _pieces(loss_args, k) if loss_args is not None else [()] * k
    if n is None:
        return [Microbatch(xs[j], args[j], None, fold_in(key, -1 - j)) for j in range(k)]
    sizes = [len(r) for r in torch.arange(n).tensor_split(k)]
    scales = [s / n if reduction == "mean" else 1.0 for s in sizes]
    return [Microbatch(xs[j], args[j], scales[j], fold_in(key, -1 - j)) for j in range(k)]


def join_adjoints(traces: Sequence[tuple[Any, ...]]) -> tuple[Any, ...]:
    """One record per boundary from the microbatches' traces: costates concatenated on dim 0,
    each piece's meta under ``meta["microbatches"]``."""
    if len(traces) == 1:
        return traces[0]
    return tuple(_join(records) for records in zip(*traces))


def _join(records: Sequence[AdjointState]) -> AdjointState:
    values = [r.value for r in records]
    value = None if values[0] is None else optree.tree_map(lambda *ts: torch.cat(ts), *values, namespace=NAMESPACE)
    return records[0].replace(value=value, meta={"microbatches": tuple(dict(r.meta) for r in records)})


def add(a: Any, b: Any) -> Any:
    """``a + b`` where ``None`` (no gradient: frozen or unused) is the zero."""
    return b if a is None else a if b is None else a + b


def sum_grads(grads: Sequence[Any]) -> Any:
    total = grads[0]
    for g in grads[1:]:
        total = optree.tree_map(add, total, g, none_is_leaf=True, namespace=NAMESPACE)
    return total


def merge_counters(*counters: dict[Any, Any]) -> dict[Any, Any]:
    """One stage's counters (seconds, calls, rows, queries, ...) from several dicts, added key by key;
    ``boundary_bytes``, a size, is the largest."""
    total: dict[Any, Any] = {}
    for c in counters:
        for k, v in c.items():
            total[k] = max(total.get(k, 0), v) if k == "boundary_bytes" else total.get(k, 0) + v
    return total


def sum_stats(all_stats: Sequence[dict[Any, Any]]) -> dict[Any, Any]:
    """The microbatches' stats as one: each stage's counters merged (``merge_counters``);
    ``boundaries`` keeps each piece's meta under ``"microbatches"``."""
    if len(all_stats) == 1:
        return all_stats[0]
    names = dict.fromkeys(name for stats in all_stats for name in stats if name != "boundaries")
    total = {name: merge_counters(*(stats[name] for stats in all_stats if name in stats)) for name in names}
    total["boundaries"] = {
        i: {"microbatches": tuple(s["boundaries"][i] for s in all_stats)} for i in all_stats[0]["boundaries"]
    }
    return total
