"""A pipeline's plan: its stage ranges (balanced by parameter count, or given and checked), the
schedules of pipelining it runs, and their ideal bubble."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
from torch.distributed import pipelining

from ..tree import NAMESPACE

__all__ = ["SCHEDULES", "SINGLE", "balance", "check_ranges", "ideal_bubble"]


SCHEDULES = {
    "gpipe": pipelining.ScheduleGPipe,
    "1f1b": pipelining.Schedule1F1B,
    "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
    "zero_bubble": pipelining.ScheduleInterleavedZeroBubble,
}
"""``Pipeline(schedule=...)``'s names for ``torch.distributed.pipelining``'s schedules."""

SINGLE = ("gpipe", "1f1b")  # one stage range per rank


def balance(params: Sequence[Any], parts: int) -> tuple[tuple[int, int], ...]:
    """Contiguous stage ranges ``(lo, hi)``, one per part, none empty, minimising the largest
    part's parameter count (a tied tensor counts in every stage that uses it)."""
    sizes = [sum(t.numel() for t in optree.tree_leaves(p, namespace=NAMESPACE)) for p in params]
    n = len(sizes)
    if not 1 <= parts <= n:
        raise ValueError(f"balance: cannot split {n} stages into {parts} non-empty ranges")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # best[k][i]: the smallest possible largest load splitting stages [0, i) into k ranges.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                load = max(best[k - 1][j], prefix[i] - prefix[j])
                if load < best[k][i]:
                    best[k][i], cut[k][i] = load, j
    ranges, i = [], n
    for k in range(parts, 0, -1):
        ranges.append((cut[k][i], i))
        i = cut[k][i]
    return tuple(reversed(ranges))


def check_ranges(ranges: Sequence[Any], stages: int, parts: int, per_rank: int) -> tuple[Any, ...]:
    ranges = tuple((int(lo), int(hi)) for lo, hi in ranges)
    if len(ranges) != parts:
        raise ValueError(
            f"Pipeline: {len(ranges)} stage ranges for {parts // per_rank} ranks x {per_rank} per rank; "
            f"give {parts} (lo, hi)"
        )
    expected = 0
    for lo, hi in ranges:
        if lo != expected or hi <= lo:
            raise ValueError(f"Pipeline: stage ranges {ranges} must be non-empty, contiguous and start at 0")
        expected = hi
    if expected != stages:
        raise ValueError(f"Pipeline: stage ranges {ranges} cover {expected} stages, the chain has {stages}")
    return ranges


def ideal_bubble(name: str, ranks: int, microbatches: int, per_rank: int = 1, schedule: Any = None) -> float:
    """The idle fraction with uniform stages: ``(p-1) / (v m + p-1)`` for gpipe, 1f1b and
    interleaved 1f1b; for zero_bubble, the idle slots of pipelining's own plan of unit-time actions."""
    if name == "zero_bubble" and schedule is not None:
        slots = [a for rank in schedule.pipeline_order.values() for a in rank]
        return sum(a is None for a in slots) / len(slots)
    return (ranks - 1) / (per_rank * microbatches + ranks - 1)
