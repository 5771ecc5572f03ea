"""A sweep of a chain, the one path of ``ef.sweep`` that runs the engine: the chain checked, one
fold per microbatch over its whole range (``runner.Range``), the data-parallel reducer, the ties'
gradients summed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import torch

from ..adjoint import Measurements
from ..core import boundary as B
from ..core import fsdp_reverse
from ..core import microbatch as M
from ..core import replay as R
from ..core.options import Request
from ..core.result import SweepResult, metered
from ..core.runner import Range
from ..core.ties import tie_grads, tie_groups
from ..core.update import Updater
from ..program.chain import Chain, hooked_grads
from ..program.physical import Meter
from . import model_sweep

__all__ = ["Folded", "on_chain", "reducer_of"]


@dataclasses.dataclass
class Folded:
    """What the folds over a sweep's microbatches leave: each piece's loss, trace and counters, the
    gradients summed over the pieces (``None`` with a fused update), and the buffers, pass state and
    fused updates' ``pending`` the last fold returned."""

    buffers: Any
    pass_state: Any
    pending: Any
    grads: Any = None
    losses: list[Any] = dataclasses.field(default_factory=cast("Callable[[], list[Any]]", list))
    traces: list[Any] = dataclasses.field(default_factory=cast("Callable[[], list[Any]]", list))
    stats: list[Any] = dataclasses.field(default_factory=cast("Callable[[], list[Any]]", list))


def on_chain(chain: Chain, req: Request) -> SweepResult:
    """``sweep`` of a chain: checked, one fold per microbatch over the whole chain (``runner.Range``),
    the ties' gradients summed, or the fused updates' results."""
    params = chain.check_params(req.params)
    buffers = chain.check_buffers(req.buffers)
    opts = req.opts.bind(chain)
    sharded = any(s.sharded is not None for s in chain.stages)
    if sharded:
        fsdp_reverse.check(chain, params, buffers, opts)
    state = req.pass_state  # None: the passes start in the first fold, from its boundaries (Range.backward)
    meter = Meter(chain, opts.physical, opts.budget)
    groups = tie_groups(chain, params)
    hooks = {(i, n): p for i, s in enumerate(chain.stages) for n, p in s.hooked().items()}
    hold = min(opts.physical) if opts.budget is not None and opts.physical else None
    reducer = reducer_of(False if sharded else opts.data_parallel, chain, params, groups)  # FSDP: its own
    updater, pending = (  # checked first
        Updater.prepare(opts.update, chain, params, groups, hold, reducer, hooks)
        if opts.update is not None or reducer is not None
        else (None, None)
    )
    whole = Range(chain, 0, len(chain), params, opts, B.device_of(params, req.x), meter)
    pieces = M.split(req.x, req.loss_args, opts.microbatches, opts.reduction, opts.key)
    folded = _fold(whole, pieces, Folded(buffers, state, pending), updater, sharded)
    total = folded.losses[0] if len(folded.losses) == 1 else torch.stack(folded.losses).sum()
    stats = metered(M.sum_stats(folded.stats), chain, meter)
    if reducer is not None:
        stats["data_parallel"] = dict(reducer.stats)
    trace, stats, pending = M.join_adjoints(folded.traces), Measurements(stats), folded.pending
    if updater is None:
        grads = hooked_grads(tie_grads(params, folded.grads, groups), hooks)
        return SweepResult(total, grads, trace, folded.buffers, folded.pass_state, stats, params)
    assert pending is not None  # the folds carry it
    if updater.keeping:
        return SweepResult(total, updater.grads(pending), trace, folded.buffers, folded.pass_state, stats, params)
    pure = updater.spec.fn is not None
    new_params, update_state = (pending.params, pending.state) if pure else (params, None)
    return SweepResult(total, None, trace, folded.buffers, folded.pass_state, stats, new_params, update_state)


def _fold(whole: Range, pieces: list[Any], folded: Folded, updater: Any, sharded: bool) -> Folded:
    """One fold of ``whole`` per microbatch in turn, threading buffers, pass state and ``pending``;
    the last fold's steps run the fused ``updater``, which finishes after it (FSDP2 stages: under its
    sweep, each fold reduce-scattering as the last one must)."""
    try:
        with fsdp_reverse.Sweep(whole.chain) if sharded else R.NULL as on_fsdp:
            for j, mb in enumerate(pieces):
                last = j == len(pieces) - 1
                # each stage's step adds the earlier microbatches' gradients to its own and lets go of
                # them: one set of gradients is alive, not one per microbatch; the last fold updates
                # the last piece is let go too: it holds those gradients as well
                earlier, folded.grads, piece = None if folded.grads is None else list(folded.grads), None, None
                with on_fsdp.fold(last) if on_fsdp is not None else R.NULL:
                    piece = whole.run(
                        folded.buffers, mb, folded.pass_state, updater if last else None, folded.pending, earlier
                    )
                folded.buffers, folded.pass_state, folded.pending = piece.buffers, piece.pass_state, piece.pending
                assert piece.loss is not None  # the range ends the chain
                folded.losses.append(piece.loss)
                folded.grads = piece.grads
                folded.traces.append(piece.trace)
                folded.stats.append(piece.stats)
            if updater is not None:
                assert folded.pending is not None  # the folds carry it
                folded.pending = updater.finish(folded.pending)
    except BaseException as e:  # KeyboardInterrupt too: say which stages a fused update already stepped
        if updater is not None and folded.pending is not None:
            updater.note(folded.pending, e)
        raise
    return folded


def reducer_of(group: Any, chain: Chain, params: tuple[Any, ...], groups: list[Any]) -> Any:
    """The ``Reducer`` of ``data_parallel=group`` (``None``: none), once the replicas agree on the chain
    (``data_parallel.agree``); a multi-process run without ``data_parallel=`` is warned that its
    gradients are this rank's alone (``False`` says so on purpose)."""
    if group is None and model_sweep.multi_process():
        from ..distributed.data_parallel import warn_local_gradients

        warn_local_gradients("sweep")
    if group is None or group is False:
        return None
    from ..distributed.data_parallel import Reducer, agree, replica_layout

    agree(group, replica_layout(chain, params, groups))
    return Reducer(group)
