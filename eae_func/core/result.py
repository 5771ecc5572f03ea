"""What a sweep returns: ``SweepResult``, what one microbatch's fold over a range returns
(``Piece``), and the counters of its physical stages over the whole step (``metered``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from ..program.chain import Chain
from ..program.physical import Meter
from . import microbatch as M
from .update import Pending

__all__ = ["Piece", "SweepResult", "metered"]


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """loss: the scalar loss; grads: same tree as params (``None`` with fused updates: consumed
    in the fold); adjoints: one ``AdjointState`` per boundary, L down to 0, as they were after
    the passes; buffers: updated buffers, one dict per stage; pass_state: the threaded pass
    state; stats: per stage ``stats[name]`` the forward, recompute, vjp, pass (and update)
    seconds, the bytes of its stored input boundary and an estimator's costs, ``stats["loss"]``,
    and ``stats["boundaries"][l]``: what the passes recorded in ``meta`` at boundary l;
    params, update_state: with a fused pure update, the new params and its state (with a
    torch.optim optimizer, ``params`` are the ones given, updated in place)."""

    loss: torch.Tensor
    grads: Any  # params' structure: a tuple of per-stage dicts, or a flat dict; None when fused
    adjoints: tuple[Any, ...]
    buffers: Any  # one dict per stage, or a flat dict
    pass_state: Any
    stats: Mapping[str, Any]
    params: Any = None
    update_state: Any = None


@dataclasses.dataclass(frozen=True)
class Piece:
    """One microbatch's results over a range: the loss times its scale (``None`` where the range
    does not end the chain), one gradient entry per stage (``None`` each with fused updates; a
    ``fold.Deferred`` with ``defer_weights``), the trace (record L first if the range ends the
    chain, then hi-1 down to lo), the updated buffers of the range's stages, the pass state, the
    stats, p_lo after the passes (what a pipeline rank sends back, kept whatever the trace keeps)
    and what the fused updates had made when the fold ended (``update.Pending``; ``None`` without)."""

    loss: torch.Tensor | None
    grads: tuple[Any, ...]
    trace: tuple[Any, ...]
    buffers: tuple[Any, ...]
    pass_state: Any
    stats: dict[Any, Any]
    costate: Any = None
    pending: Pending | None = None


def metered(stats: dict[Any, Any], chain: Chain, meter: Meter) -> dict[Any, Any]:
    """``stats`` with each physical stage's rows and calls of the whole step (forward included)."""
    for i, counts in meter.counts.items():
        stats[chain.stages[i].name] = M.merge_counters(stats.get(chain.stages[i].name, {}), counts)
    return stats
