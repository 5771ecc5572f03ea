"""Pipeline parallelism on ``torch.distributed.pipelining``: its schedules, our stage ranges and costates.

The chain is cut into ``p * v`` contiguous stage ranges; range r runs on pipeline rank ``r mod p``
(``v`` ranges per rank for the interleaved schedule). Each range is a pipelining stage whose
compute is the engine's one runner (``eae_func.distributed.stage.RangeStage``): for microbatch j
it runs the forward of its range from the received x_lo and sends x_hi; later, from the received
costate p_hi (or the loss, on the last range), the reverse fold with the passes at boundaries
hi-1..lo (and L) and sends p_lo, encoded by the costate codec. Pipelining's schedule decides the
order:

    gpipe             all forwards, then all backwards
    1f1b              one forward, one backward in the steady state (GPipe's order when m < p)
    interleaved_1f1b  1F1B over v ranges per rank, looping (bubble ~ (p-1) / (v m + p - 1))
    zero_bubble       pipelining's ZB1P: each backward split into I (costates: J_x^T p, the passes)
                      and W (weights: J_W^T p, deferred into the bubbles), both rebuilt from the
                      boundary under the replayed RNG

Each microbatch's loss is scaled by its share of the batch inside the runner (pipelining's
``scale_grads`` is off), so with every option, passes included,

    grads on every rank = those of ef.sweep(chain, same options, microbatches=m)

bit for bit, with ``codec.as_pass()`` at the cut boundaries when a costate codec is used. Tied
tensors whose uses sit on several ranks (embedding and head) get the sum of all uses' gradients.
The ranks agree on the plan when the pipeline is made and on the options before every step: a step
all_gathers a digest of each rank's options on the host (their values cross only when a digest
changes), and the loss and the tied gradients cross as tensors, so a step after the first reads no
device value on the host and pickles nothing. All traffic runs on the pipeline's own process
groups, whose timeout turns a dead or stalled peer into ``PeerError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..adjoint import Measurements
from ..core import boundary as B
from ..core import microbatch as M
from ..core.options import Options, make
from ..core.result import SweepResult, metered
from ..core.runner import Range
from ..core.ties import tie_groups
from ..passes.combinators import carries_state
from ..program.chain import Chain, hooked_grads
from ..program.physical import Meter
from .codecs import Codec, Raw
from .data_parallel import host_group
from .launch import PeerError
from .peers import Agreement, Peers
from .plan import SCHEDULES, SINGLE, balance, check_ranges, ideal_bubble
from .stage import RangeStage, Step

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..core.options import SweepOptions

__all__ = ["Pipeline", "PipelineResult"]


@dataclasses.dataclass(frozen=True)
class PipelineResult(SweepResult):
    """One rank's share of a pipeline sweep.

    loss:       the full loss (sent to every rank by the last one).
    grads:      gradients of this rank's stages ``stages`` (one dict per stage).
    adjoints:   the boundary records this rank produced, after passes and wire codec: L (last
                rank), then each of its ranges' boundaries, highest first; all ranks' together are
                the single-process trace.
    buffers:    this rank's stages' updated buffers.
    pass_state: the pass state threaded through this rank's boundaries.
    stats:      per-stage counters as ``SweepResult.stats``, plus ``stats["wire"]`` (bytes and
                messages sent / received, per kind) and ``stats["schedule"]`` (busy and step seconds,
                measured and ideal bubble fraction).
    stages:     the stage indices this rank owns.
    """

    stages: tuple[Any, ...] = ()


class Pipeline(Peers):
    """A chain split over ranks; every rank of the pipeline builds one with the same arguments.

    chain:           the whole chain (every rank knows every stage; each runs its own ranges).
    ranges:          ``p * v`` contiguous ``(lo, hi)`` covering the chain, range r on pipeline rank
                     ``r mod p``; ``None``: ``balance(params, p * v)``.
    params:          the chain's params, only used to balance.
    ranks:           the global ranks forming this pipeline, first stage first (default: all).
    schedule:        ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` or ``"zero_bubble"``
                     (pipelining's ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
                     ``ScheduleInterleavedZeroBubble``).
    ranges_per_rank: ``v`` (default 2 for ``interleaved_1f1b``, else 1; gpipe and 1f1b take 1).
    costate_codec:   how costates cross rank boundaries (``codecs.int8()``, ...; ``None``: raw).
    boundary_codec:  how boundary states cross them going forward (``None``: raw; any other codec
                     changes what the next rank computes, so gradients change too).
    timeout:         seconds any transfer may wait before this rank raises ``PeerError`` (the
                     timeout of the pipeline's process group).
    device:          where this rank computes and receives (default: the current CUDA device
                     under NCCL, else the CPU).
    """

    def __init__(
        self,
        chain: Chain,
        ranges: Sequence[Any] | None = None,
        *,
        params: Sequence[Any] | None = None,
        ranks: Sequence[int] | None = None,
        schedule: str = "1f1b",
        ranges_per_rank: int | None = None,
        costate_codec: Codec | None = None,
        boundary_codec: Codec | None = None,
        timeout: float = 60.0,
        device: torch.device | None = None,
    ):
        if not dist.is_initialized():
            raise RuntimeError(
                "Pipeline: call torch.distributed.init_process_group (or eae_func.distributed.init) first"
            )
        if schedule not in SCHEDULES:
            raise ValueError(f"Pipeline: schedule must be one of {tuple(SCHEDULES)}, got {schedule!r}")
        v = ranges_per_rank if ranges_per_rank is not None else 2 if schedule == "interleaved_1f1b" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or (schedule in SINGLE and v != 1):
            raise ValueError(
                f"Pipeline: ranges_per_rank must be a positive int (1 for {' and '.join(SINGLE)}), got {v!r}"
            )
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"Pipeline: timeout must be a finite number of seconds > 0, got {timeout!r}")
        self.chain, self.schedule, self.ranges_per_rank, self.timeout = chain, schedule, v, float(timeout)
        self.ranks = tuple(range(dist.get_world_size())) if ranks is None else tuple(int(r) for r in ranks)
        self.rank = dist.get_rank()
        if self.rank not in self.ranks:
            raise ValueError(f"Pipeline: rank {self.rank} is not one of the pipeline's ranks {self.ranks}")
        self.position = self.ranks.index(self.rank)
        p = len(self.ranks)
        if ranges is None:
            if params is None:
                raise ValueError("Pipeline: give the stage ranges, or params to balance them by parameter count")
            ranges = balance(params, p * v)
        self.ranges = check_ranges(ranges, len(chain), p * v, v)
        self.owned = tuple(range(self.position, p * v, p))
        self.stages = tuple(i for r in self.owned for i in range(*self.ranges[r]))
        self.costate_codec = costate_codec or Raw()
        self.boundary_codec = boundary_codec or Raw()
        if device is None:
            nccl = dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = device
        self.group: Any = dist.new_group(
            list(self.ranks), timeout=datetime.timedelta(seconds=self.timeout), use_local_synchronization=True
        )
        self.host_group = host_group(self.group, datetime.timedelta(seconds=self.timeout))
        self.failure: str | None = None
        self.agreement: Agreement | None = None
        self._schedules: dict[Any, Any] = {}
        self._agree()

    def sweep(
        self,
        params: Sequence[Any],
        x: Any = None,
        *loss_args: Any,
        pass_state: Any = None,
        buffers: Sequence[Any] | None = None,
        **options: Unpack[SweepOptions],
    ) -> PipelineResult:
        """This rank's part of ``ef.sweep(chain, params, x, *loss_args, **options)``.

        params:  one entry per stage of the whole chain; only this rank's entries are read
                 (the others may be ``None``). Same for ``buffers`` (``None``: the modules' own).
                 A tensor object that appears in stages of several ranks (a tied embedding and
                 head) is found on every rank that is given both entries; otherwise declare it
                 in ``chain.ties``.
        x:       the input batch, needed on the first rank; ``loss_args`` on the last rank
                 (other ranks may pass them too: they are ignored, except that the last rank
                 weighs its microbatches by x's rows when no loss arg has a batch dim). The
                 microbatches must have equal shapes: a pipelining stage receives into buffers
                 of one shape.
        options: those of ``ef.sweep``; a pass with state sees this rank's boundaries only, in the
                 same order as in one process; ``budget`` counts this rank's physical stages.
                 Not across ranks: ``update`` (a fused step needs every microbatch's and every
                 rank's share of a gradient first) and model-level estimators (they probe the
                 whole chain from its input); ``zbp``, ``exact``, ``twin`` and ``frozen`` need
                 only their stage.
        """
        chain, first = self.chain, self.position == 0
        opts = make("Pipeline.sweep", options).bind(chain)
        self._refuse(opts)
        params = chain.check_params(params, self.stages)
        buffers = chain.check_buffers(buffers)
        if first and x is None:
            raise ValueError(f"Pipeline.sweep: rank {self.rank} runs the first stage and needs the input x")
        pieces = self._pieces(opts, x, loss_args)
        state = pass_state  # None: the passes start in this rank's first fold, from its boundaries
        device = B.device_of([params[i] for i in self.stages], x if first else None, default=self.device)
        meter = Meter(chain, tuple(i for i in opts.physical if i in self.stages), opts.budget)
        groups = tie_groups(chain, params)
        with self._guard():
            agreement = self._agree_on_step(opts, groups, pieces)
        stages, schedule = self._checked_schedule(agreement, opts, state, device)
        step = Step(pieces, buffers, state, agreement.presence)
        for stage in stages:
            stage.begin(Range(chain, stage.lo, stage.hi, params, opts, device, meter), step)
        with self._guard():
            wall = self._run(schedule, step, opts.microbatches, device)
            loss, grads, trace, stats = self._collect(stages, opts.microbatches)
            for stage in stages:
                stage.end()
            loss = self._share_loss(loss, agreement)
            grads = self._tie(params, grads, groups, agreement)
            hooks = {(n, name): p for n, i in enumerate(self.stages) for name, p in chain.stages[i].hooked().items()}
            grads = hooked_grads(grads, hooks)  # p.register_hook: on each parameter's whole gradient, as autograd
        stats = self._stats(metered(stats, chain, meter), step, wall, opts.microbatches, schedule)
        own_buffers = tuple(step.buffers[i] for i in self.stages)
        return PipelineResult(loss, grads, trace, own_buffers, step.pass_state, Measurements(stats), stages=self.stages)

    def _pieces(self, opts: Options, x: Any, loss_args: tuple[Any, ...]) -> list[Any]:
        """The step's microbatches of what this rank reads: the input (first rank; the last rank may
        weigh its pieces by x's rows, for a loss without targets) and the loss args (last rank)."""
        first, last = self.position == 0, self.position == len(self.ranks) - 1
        pieces = M.split(
            x if first or last else None,
            loss_args if last else None,
            opts.microbatches,
            opts.reduction,
            opts.key,
            where="Pipeline.sweep",
        )
        if last and any(mb.scale is None for mb in pieces):
            raise ValueError(
                f"Pipeline.sweep: rank {self.rank} computes the loss and needs a batched tensor to weigh the "
                f"microbatches of a {opts.reduction!r} loss: give it x too (the last rank reads only its rows), "
                f"a batched loss arg, or microbatches=1"
            )
        return pieces

    def _checked_schedule(
        self, agreement: Agreement, opts: Options, state: Any, device: torch.device
    ) -> tuple[Any, ...]:
        """``_schedule_for`` the first rank's microbatch shape, once the shapes and passes allow it."""
        shapes, m = agreement.everyone[0]["inputs"], opts.microbatches
        if len({repr(s) for s in shapes}) > 1:
            raise ValueError(
                f"Pipeline.sweep: microbatches={m} cuts the first rank's input into pieces of shapes {shapes}; "
                f"a pipelining stage receives into buffers of one shape: give a batch whose rows divide by {m}"
            )
        stages, schedule = self._schedule_for(shapes[0], m, device)
        if carries_state(opts.passes.start() if state is None else state) and not self._in_one_process_order(schedule):
            raise ValueError(
                f"Pipeline.sweep: passes {opts.passes.name!r} keep state, and schedule {self.schedule!r} runs the "
                f"backwards of a rank's ranges out of one process's order; use one range per rank "
                f"(gpipe, 1f1b, zero_bubble) or stateless passes"
            )
        return stages, schedule

    def _run(self, schedule: Any, step: Step, m: int, device: torch.device) -> float:
        """One step of pipelining's ``schedule`` over ``m`` microbatches; its wall seconds. A failed
        transfer is a ``PeerError`` naming this rank's neighbours."""
        first, last = self.position == 0, self.position == len(self.ranks) - 1
        index = torch.arange(m, device=device).unsqueeze(1)  # microbatch j's "input": its index
        began = time.perf_counter()
        try:
            schedule.step(*((index,) if first else ()), target=index if last else None, return_outputs=False)
        except Exception as e:
            if step.failed_here:
                raise
            raise PeerError(
                f"rank {self.rank} ({self.where(self.rank)}): a transfer of the pipeline step failed within the "
                f"timeout ({self.timeout:g} s); a neighbour died, stalled or disagrees ({self._neighbours()}): {e}"
            ) from e
        return time.perf_counter() - began

    def _stats(self, stats: dict[Any, Any], step: Step, wall: float, m: int, schedule: Any) -> dict[Any, Any]:
        """``stats`` with the wire's counts and the schedule's busy and step seconds and bubble."""
        p = len(self.ranks)
        stats["wire"] = dict(step.counts)
        stats["schedule"] = {
            "name": self.schedule,
            "ranks": p,
            "ranges_per_rank": self.ranges_per_rank,
            "microbatches": m,
            "busy_s": step.busy_s,
            "step_s": wall,
            "bubble": 1 - step.busy_s / wall if wall > 0 else 0.0,
            "ideal_bubble": ideal_bubble(self.schedule, p, m, self.ranges_per_rank, schedule),
        }
        return stats

    def _refuse(self, opts: Options) -> None:
        """Refuse a step after a failed one (its links may be closed), and what a pipeline cannot run."""
        if self.failure is not None:
            raise PeerError(
                f"rank {self.rank}: an earlier step of this pipeline failed ({self.failure}); its links "
                f"may be closed: re-create the process group and the pipeline"
            )
        if opts.update is not None:
            raise ValueError(
                "Pipeline.sweep: update= cannot cross ranks: a fused step needs the gradient summed over "
                "every microbatch (and every rank's use of a tied tensor) before it steps; run the "
                "pipeline unfused and step the optimizer on res.grads"
            )
        if opts.data_parallel:
            raise ValueError(
                "Pipeline.sweep: data_parallel= is for ef.sweep; across pipelines, average res.grads over "
                "the replicas with D.average_gradients(res.grads, mesh.data_group)"
            )
        sharded = [self.chain.where(i) for i in self.stages if self.chain.stages[i].sharded is not None]
        if sharded:
            raise TypeError(
                f"Pipeline.sweep: {', '.join(sharded)} are FSDP2 (fully_shard) modules, which ef.sweep runs on "
                f"FSDP's own engine; a pipeline does not yet"
            )
        if opts.estimator is not None and getattr(opts.estimator, "scope", "model") != "stage" and len(self.ranks) > 1:
            raise ValueError(
                f"Pipeline.sweep: estimator={opts.estimator!r} probes the whole chain from its input, "
                f"which no single rank has; across ranks use an estimator that needs only its stage "
                f"(zbp, exact, twin, frozen)"
            )

    def _schedule_for(self, shape: Any, m: int, device: torch.device) -> tuple[Any, ...]:
        """This rank's stages and pipelining's schedule for microbatches of ``shape`` (built once
        per shape and count: pipelining infers what crosses each cut on the first step)."""
        key = (repr(shape), m, str(device))
        if key not in self._schedules:
            specs: dict[Any, Any] = {}  # range -> the tree structure of what it sends, shared by this rank's ranges
            stages = [
                RangeStage(
                    r,
                    len(self.ranges),
                    self.ranges[r],
                    device,
                    self.group,
                    (self.boundary_codec, self.costate_codec),
                    f"rank {self.rank}, {self._range_name(r)}",
                    specs,
                )
                for r in self.owned
            ]
            # 1F1B with fewer microbatches than ranges warms up with all of them: GPipe's order,
            # which pipelining's Schedule1F1B refuses and ScheduleGPipe runs
            cls = SCHEDULES["gpipe" if self.schedule == "1f1b" and m < len(self.ranges) else self.schedule]
            chosen = stages[0] if self.schedule in SINGLE else stages
            self._schedules[key] = stages, cls(chosen, m, loss_fn=_no_loss, scale_grads=False)
        return self._schedules[key]

    def _in_one_process_order(self, schedule: Any) -> bool:
        """Whether every rank's backwards (B or I actions) visit its boundaries as one process does:
        microbatch by microbatch, each from the highest range down (the same answer on every rank)."""
        order = getattr(schedule, "pipeline_order", None)
        if not order:  # gpipe and 1f1b: one range, microbatches in order
            return True
        kinds = ("FULL_BACKWARD", "BACKWARD_INPUT")
        for actions in order.values():
            ran = [
                (a.microbatch_index, -a.stage_index)
                for a in actions
                if a is not None and a.computation_type.name in kinds
            ]
            if ran != sorted(ran):
                return False
        return True

    def _collect(self, stages: list[Any], m: int) -> tuple[Any, ...]:
        """``(loss on the last rank else None, grads per stage, trace, stats)`` from the stages' pieces."""
        grads, trace, stats, loss = [], (), {}, None
        for stage in stages:
            pieces = [stage.done[j] for j in range(m)]
            grads += list(M.sum_grads([piece.grads for piece in pieces]))
            trace = M.join_adjoints([piece.trace for piece in pieces]) + trace  # the highest range first
            for name, entry in M.sum_stats([piece.stats for piece in pieces]).items():
                stats[name] = {**stats.get(name, {}), **entry}
            if stage.is_last:
                losses = [piece.loss for piece in pieces]
                loss = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
        return loss, tuple(grads), trace, stats

    @contextlib.contextmanager
    def _guard(self):
        """Record any failure of a step, so the next ``sweep`` refuses to run on broken links."""
        try:
            yield
        except Exception as e:
            self.failure = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            raise


def _no_loss(output: Any, target: Any) -> None:
    """Pipelining's loss hook: the last range computes the loss itself, inside the runner."""
    return None
