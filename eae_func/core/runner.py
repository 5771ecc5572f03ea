"""The one per-range runner: one microbatch over the stages ``lo..hi-1`` of a chain.

    tape         = forward(chain, lo, hi, params, buffers, x_lo)      keep x_lo..x_{hi-1}
    loss, carry  = boundary_condition(chain, x_L, loss_args)          if hi = L, else the received p_hi
    carry, outs  = reverse(step, [carry], tape)                       p_{hi-1}..p_lo, grads
    -> Piece(loss, grads, trace, buffers, pass state, stats, p_lo, pending updates)

``ef.sweep`` runs it over the whole chain once per microbatch, every pipeline rank over its own
range, and the model-level estimators' oracle over the whole chain for its exact trace. The
estimators' probes run each stage as the tape did: ``Problem.call`` replays the stage's RNG
state (dropout masks repeat) in the modes its forward saw, under the sweep's autocast, and
``Problem.feed`` rounds a stage's output to the boundary dtype as the forward fed it to the
next stage.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ..adjoint import AdjointState, fold_in
from ..program.chain import Chain
from ..program.physical import ProbeChecks
from . import boundary as B
from . import costates as C
from . import fold as F
from . import plain
from . import replay as R
from . import tape as TP
from .microbatch import Microbatch, merge_counters
from .options import Options
from .problem import Problem
from .result import Piece
from .update import Pending, Updater

__all__ = ["Range"]


@dataclasses.dataclass(frozen=True)
class Range(TP.Span):
    """A ``tape.Span`` (stages ``lo..hi-1`` of ``chain`` at ``params``, run as the bound ``opts`` say
    on ``device``) with its forward, its reverse fold and what an estimator sees of it."""

    def forward(self, buffers: tuple[Any, ...], mb: Microbatch, h: Any = None) -> TP.Tape:
        """The forward of microbatch ``mb`` from ``h`` (``None``: ``mb.x``, the chain's input)."""
        return TP.forward(self, buffers, mb.x if h is None else h, self.at(mb))

    def backward(
        self,
        tape: TP.Tape,
        mb: Microbatch,
        pass_state: Any,
        received: Any = None,
        updater: Updater | None = None,
        pending: Pending | None = None,
        defer_weights: bool = False,
        earlier: list[Any] | None = None,
    ) -> Piece:
        """The reverse fold of ``tape`` from the loss (the range ends the chain) or from the
        ``received`` costate p_hi. ``updater``: fused
        updates, ``pending`` threaded through the fold's carry from this value. ``defer_weights``:
        the parameter gradients of stages rebuilt from their boundary come as ``fold.Deferred``;
        ``earlier``: earlier microbatches' gradients, one entry per stage, added to this one's
        (``fold.make_step``)."""
        chain, lo, hi, opts = self.chain, self.lo, self.hi, self.at(mb)
        if pass_state is None:  # the passes start here, seeing the boundaries they will be applied to
            pass_state = opts.passes.start(C.example(chain, lo, hi, tape.entries) if opts.passes.wants_example else ())
        stats: dict[Any, Any] = {}
        if hi == len(chain):
            assert mb.scale is not None, "the range that computes the loss weighs its microbatches"
            stats["loss"] = {"forward_s": 0.0, "pass_s": 0.0} if opts.timers else {}
            loss, carry = F.boundary_condition(
                chain, tape.take_output(), mb.loss_args, opts, pass_state, mb.scale, stats["loss"]
            )
            carry = dataclasses.replace(carry, pending=pending)
            head, loss, start = (C.traced(carry.shown, opts),), loss * mb.scale, [carry]
            del carry  # the fold holds p_L alone: it is freed once stage L-1 has used it
        else:
            adj = AdjointState(received, hi, C.boundary_name(chain, hi), fold_in(opts.key, hi))
            C.check_costate(chain, hi, adj, tape.entries[-1].out_layout)
            loss, head, start = None, (), [F.Carry(adj, pass_state, pending)]
        problem = self.problem(tape, mb) if opts.physical else None
        step = F.make_step(chain, self.params, opts, self.device, problem, updater, defer_weights, earlier)
        carry, outs = F.reverse(step, start, tape)
        trace = tuple(a for a in head + tuple(o.record for o in reversed(outs)) if a is not None)
        stats.update(
            {chain.names[i]: merge_counters(tape.stats[chain.names[i]], o.stats) for i, o in zip(range(lo, hi), outs)}
        )
        stats["boundaries"] = {a.index: dict(a.meta) for a in trace}
        return Piece(
            loss,
            tuple(o.grads for o in outs),
            trace,
            tuple(tape.buffers[i] for i in range(lo, hi)),
            carry.pass_state,
            stats,
            carry.adj.value,
            carry.pending,
        )

    def run(
        self,
        buffers: tuple[Any, ...],
        mb: Microbatch,
        pass_state: Any,
        updater: Updater | None = None,
        pending: Pending | None = None,
        earlier: list[Any] | None = None,
    ) -> Piece:
        """Forward and backward of the whole chain on microbatch ``mb`` (a plain range: ``plain.run``)."""
        if updater is None and plain.applies(self.opts, self.chain, self.lo, self.hi):
            return plain.run(self, buffers, mb, pass_state, pending, earlier)
        return self.backward(
            self.forward(buffers, mb), mb, pass_state, updater=updater, pending=pending, earlier=earlier
        )

    def exact_trace(self, probed: Chain, buffers: tuple[Any, ...], mb: Microbatch) -> tuple[Any, ...]:
        """The exact trace of ``probed`` (the chain with every boundary shown) on this microbatch: the
        model-level estimators' oracle, run without passes, timers or physical stages."""
        opts = self.at(mb)
        exact = Options(
            key=opts.key,
            boundary_dtype=opts.boundary_dtype,
            offload=opts.offload,
            autocast=opts.autocast,
            timers=False,
        ).bind(probed)
        piece = Microbatch(mb.x, mb.loss_args, 1.0, opts.key)
        whole = Range(probed.showing_all(), 0, len(probed), self.params, exact, self.device)
        return whole.run(buffers, piece, None).trace

    def problem(self, tape: TP.Tape, mb: Microbatch) -> Problem:
        """What the estimators see of this microbatch: stages run as the tape ran them (digital
        stages' RNG replayed, physical ones drawing afresh), the exact trace from this runner."""
        chain, opts, device, buffers = self.chain, self.at(mb), self.device, tape.ran_with
        rng = {e.index: e.rng for e in tape.entries if e.index not in opts.physical}
        modes = {e.index: e.modes for e in tape.entries}
        rounding = B.Policy(opts.boundary_dtype)
        checks = ProbeChecks(chain)

        def call(i: int, params: Any, h: Any) -> Any:
            with R.replay_rng(rng.get(i), device), R.in_modes(modes.get(i, ())), R.autocast(opts.autocast, device):
                out = chain.stages[i].call(params, buffers[i], h)[0]
            if i in opts.physical:
                checks.add(i, out, h)
            return out

        def feed(i: int, out: Any) -> Any:
            if rounding.dtype is None or i == len(chain) - 1:
                return out
            return rounding.store(out, B.Layout.of(out))[1]

        def state(i: int) -> Any:
            entry = next((e for e in tape.entries if e.index == i), None)  # looked up, not held: the fold frees them
            if entry is None:
                raise ValueError(
                    f"Problem.state({i}): {chain.where(i) if 0 <= i < len(chain) else f'stage {i}'} is not on "
                    f"this tape (stages {self.lo}..{self.hi - 1}) or the reverse sweep has handed its entry out; "
                    "read states in prepare"
                )
            return tape.prefetch.get(i, entry.boundary, entry.layout) if tape.stored_apart else entry.boundary

        whole = self.lo == 0 and self.hi == len(chain)
        return Problem(
            chain,
            self.params,
            buffers,
            mb.x if whole else None,
            mb.loss_args if whole else None,
            opts.physical,
            opts.key,
            mb.scale if mb.scale is not None else 1.0,
            functools.partial(self.exact_trace, buffers=buffers, mb=mb) if whole else None,
            self.meter,
            call,
            feed,
            frozenset(i for i, drew in rng.items() if drew is not None),
            state,
            checks=checks,
        )
