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
import functools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import optree
import torch
import torch.distributed as dist
from torch.distributed import pipelining

from .. import fold as F
from .. import microbatch as M
from ..adjoint import Measurements
from ..chain import Chain, hooked_grads
from ..options import Options, make
from ..physical import Meter
from ..runner import Range
from ..sweep import carries_state
from ..sweep_chain import SweepResult, metered
from ..ties import tie_grads, tie_groups
from ..tree import NAMESPACE
from .codecs import Codec, Raw
from .data_parallel import digest, host_group
from .launch import PeerError
from .stage import RangeStage, Step

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..options import SweepOptions

__all__ = ["Pipeline", "PipelineResult", "SCHEDULES", "balance", "ideal_bubble"]


SCHEDULES = {
    "gpipe": pipelining.ScheduleGPipe,
    "1f1b": pipelining.Schedule1F1B,
    "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
    "zero_bubble": pipelining.ScheduleInterleavedZeroBubble,
}
"""``Pipeline(schedule=...)``'s names for ``torch.distributed.pipelining``'s schedules."""
SINGLE = ("gpipe", "1f1b")  # one stage range per rank
OWN = ("inputs", "loss_args", "frozen")  # what a rank tells the others about its own share (not compared)


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

    stages: tuple = ()


@dataclasses.dataclass
class Agreement:
    """What the ranks agreed on for a step, kept while every rank's options keep their digest.

    digests:    each rank's 32-byte options digest, in pipeline order (a ``(p, 32)`` uint8 tensor).
    everyone:   each rank's options as gathered (the first rank's microbatch shapes among them).
    loss_dtype: the loss's dtype, learnt on the first step (``None`` before it).
    presence:   per ``(boundary, microbatch)``, which leaves of the costate crossing it carry one,
                learnt on the first step.
    tied:       per tied group that spans ranks, its ``Tied``, learnt on the first step (``None`` before it).
    """

    digests: torch.Tensor
    everyone: list
    loss_dtype: torch.dtype | None = None
    presence: dict = dataclasses.field(default_factory=dict)
    tied: dict | None = None


@dataclasses.dataclass(frozen=True)
class Tied:
    """A tied group whose uses sit on several ranks, as the first step of an agreement showed it: the
    positions of its owners, of those whose partial sum of its gradients is a tensor (not ``None``),
    and that tensor's shape and dtype."""

    owners: tuple
    senders: tuple
    shape: tuple = ()
    dtype: torch.dtype | None = None

    @staticmethod
    def of(owners: tuple, partials: list) -> Tied:
        """From every rank's partial sum (``None`` where it has none or uses none), in pipeline order."""
        senders = tuple(k for k, t in enumerate(partials) if t is not None)
        if not senders:
            return Tied(owners, senders)
        first = partials[senders[0]]
        return Tied(owners, senders, tuple(first.shape), first.dtype)


def balance(params: Sequence, parts: int) -> tuple[tuple[int, int], ...]:
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


class Pipeline:
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
        ranges: Sequence | None = None,
        *,
        params: Sequence | None = None,
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
        self.ranges = _check_ranges(ranges, len(chain), p * v, v)
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
        self._schedules: dict = {}
        self._agree()

    def plan(self) -> dict:
        """What every rank of the pipeline must agree on: ranks, stage ranges, schedule, codecs and
        the chain's structure (stage names; a module stage's parameter names, shapes and dtypes)."""

        def structure(s):
            if s.module is None:
                return [s.name, s.physical]
            return [s.name, s.physical, [[n, list(t.shape), str(t.dtype)] for n, t in s.module.named_parameters()]]

        return {
            "ranks": list(self.ranks),
            "ranges": [list(r) for r in self.ranges],
            "schedule": self.schedule,
            "costate_codec": self.costate_codec.name,
            "boundary_codec": self.boundary_codec.name,
            "stages": [structure(s) for s in self.chain.stages],
        }

    def _agree(self) -> None:
        differences = self._differences(self._gather(self.plan(), "the plan", self.host_group))
        if differences:
            raise PeerError(
                f"rank {self.rank} ({self.where(self.rank)}): the ranks of the pipeline disagree before "
                f"the first step; give every rank the same chain, ranges, schedule and codecs: "
                + "; ".join(differences)
            )

    def _agree_on_step(self, opts: Options, groups: list, pieces: list) -> Agreement:
        """The ranks' agreement on this step's options, the tied tensors found in params and (from the
        first and last ranks) the microbatches' shapes; ``PeerError`` naming what differs: a rank with
        another key, an extra pass or another boundary dtype would compute gradients no single sweep
        gives. Every step all_gathers each rank's digests of its options and of its key (which may
        change every step without a new agreement); the options themselves are gathered only when a
        digest differs from the last agreement's (on the first step too), so every rank takes the
        same path."""
        mine = self._step_options(opts, groups, pieces)
        row = torch.cat([digest({k: v for k, v in mine.items() if k != "key"}), digest(opts.key)])
        rows = self._gather_digests(row)
        agreed, p = self.agreement, len(self.ranks)
        if (
            agreed is not None
            and torch.equal(rows[:, :32], agreed.digests)
            and torch.equal(rows[:, 32:], row[32:].expand(p, -1))
        ):
            return agreed
        everyone = self._gather(mine, "the options", self.host_group)
        differences = self._differences([{k: v for k, v in theirs.items() if k not in OWN} for theirs in everyone])
        if differences:
            raise PeerError(
                f"rank {self.rank} ({self.where(self.rank)}): the ranks of the pipeline were given different "
                f"options for this step; give every rank the same Pipeline.sweep options (and the whole params, "
                f"or chain.ties, for tensors shared across ranks): " + "; ".join(differences)
            )
        self.agreement = Agreement(rows[:, :32], everyone)
        return self.agreement

    def _step_options(self, opts: Options, groups: list, pieces: list) -> dict:
        """What this rank says about a step: its options and tied tensors, the shapes of its
        microbatches' inputs (the first rank: the others receive into buffers of their shapes) or
        loss args (the last rank: with its options, they fix the loss's dtype), and which of its uses
        of tied tensors are frozen (with its options, whether its partial sums are ``None``)."""
        k = self.position
        return {
            "key": opts.key,
            "microbatches": opts.microbatches,
            "reduction": opts.reduction,
            "passes": opts.passes.describe(),
            "boundary_dtype": str(opts.boundary_dtype),
            "autocast": str(opts.autocast),
            "keep_costates": opts.keep_costates,
            "estimator": repr(opts.estimator),
            "physical": list(opts.physical),
            "ties": [[[i, list(map(str, path))] for i, path in group] for group in groups],
            "inputs": _shapes([mb.x for mb in pieces]) if k == 0 else None,
            "loss_args": _shapes([mb.loss_args for mb in pieces]) if k == len(self.ranks) - 1 else None,
            "frozen": self._frozen_ties(groups),
        }

    def _frozen_ties(self, groups: list) -> list:
        """This rank's uses ``[stage, path]`` of tied tensors that are frozen (``requires_grad=False``)."""
        used = {i for group in groups for i, _ in group if i in self.stages}
        frozen = {i: self.chain.stages[i].frozen() for i in used}
        return [
            [i, list(map(str, path))] for group in groups for i, path in group if i in used and path[0] in frozen[i]
        ]

    def _gather_digests(self, row: torch.Tensor) -> torch.Tensor:
        """Every pipeline rank's digest ``row`` (host memory), stacked in pipeline order."""
        everyone = [torch.empty_like(row) for _ in self.ranks]
        with self._exchanging("the options' digests"):
            dist.all_gather(everyone, row, group=self.host_group)
        return torch.stack(everyone)

    def _gather(self, mine: Any, what: str, group: Any) -> list:
        """Every pipeline rank's ``mine``, in pipeline order (pickled)."""
        everyone: list = [None] * len(self.ranks)
        with self._exchanging(what):
            dist.all_gather_object(everyone, mine, group=group)
        return everyone

    @contextlib.contextmanager
    def _exchanging(self, what: str):
        """Turn a failed collective into ``PeerError`` naming this rank and ``what`` it exchanged."""
        try:
            yield
        except RuntimeError as e:
            raise PeerError(
                f"rank {self.rank} ({self.where(self.rank)}): exchanging {what} failed within the timeout "
                f"({self.timeout:g} s); a peer died, stalled or is not in this pipeline: {e}"
            ) from e

    def _differences(self, everyone: list) -> list:
        mine = everyone[self.position]
        return [
            f"{key}: {mine[key]} here, {theirs.get(key)} on rank {rank}"
            for rank, theirs in zip(self.ranks, everyone)
            for key in mine
            if mine[key] != theirs.get(key)
        ]

    def where(self, rank: int) -> str:
        """``"stages 2-3 ('b2'..'b3')"``: what global ``rank`` runs in this pipeline."""
        if rank not in self.ranks:
            return "not in this pipeline"
        p = len(self.ranks)
        return ", ".join(self._range_name(r) for r in range(self.ranks.index(rank), len(self.ranges), p))

    def _neighbours(self) -> str:
        """The ranks this one exchanges boundaries with, and what they run."""
        p = len(self.ranks)
        peers = sorted(
            {(r + d) % p for r in self.owned for d in (-1, 1) if 0 <= r + d < len(self.ranges)} - {self.position}
        )
        return "; ".join(f"rank {self.ranks[k]}: {self.where(self.ranks[k])}" for k in peers)

    def _range_name(self, r: int) -> str:
        lo, hi = self.ranges[r]
        names = self.chain.names
        return (
            f"stage {lo} ({names[lo]!r})"
            if hi - lo == 1
            else f"stages {lo}-{hi - 1} ({names[lo]!r}..{names[hi - 1]!r})"
        )

    def sweep(
        self,
        params: Sequence,
        x: Any = None,
        *loss_args: Any,
        pass_state: Any = None,
        buffers: Sequence | None = None,
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
        if self.failure is not None:
            raise PeerError(
                f"rank {self.rank}: an earlier step of this pipeline failed ({self.failure}); its links "
                f"may be closed: re-create the process group and the pipeline"
            )
        chain, p, k = self.chain, len(self.ranks), self.position
        first, last = k == 0, k == p - 1
        opts = make("Pipeline.sweep", options).bind(chain)
        self._refuse(opts)
        params = chain.check_params(params, self.stages)
        buffers = chain.check_buffers(buffers)
        if first and x is None:
            raise ValueError(f"Pipeline.sweep: rank {self.rank} runs the first stage and needs the input x")
        m = opts.microbatches
        pieces = M.split(
            x if first or last else None,  # the last rank may weigh its pieces by x's rows (a loss without targets)
            loss_args if last else None,
            m,
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
        state = opts.passes.init() if pass_state is None else pass_state
        device = F.device_of([params[i] for i in self.stages], x if first else None, default=self.device)
        meter = Meter(chain, tuple(i for i in opts.physical if i in self.stages), opts.budget)
        groups = tie_groups(chain, params)
        with self._guard():
            agreement = self._agree_on_step(opts, groups, pieces)
        shapes = agreement.everyone[0]["inputs"]
        if len({repr(s) for s in shapes}) > 1:
            raise ValueError(
                f"Pipeline.sweep: microbatches={m} cuts the first rank's input into pieces of shapes {shapes}; "
                f"a pipelining stage receives into buffers of one shape: give a batch whose rows divide by {m}"
            )
        stages, schedule = self._schedule_for(shapes[0], m, device)
        if carries_state(state) and not self._in_one_process_order(schedule):
            raise ValueError(
                f"Pipeline.sweep: passes {opts.passes.name!r} keep state, and schedule {self.schedule!r} runs the "
                f"backwards of a rank's ranges out of one process's order; use one range per rank "
                f"(gpipe, 1f1b, zero_bubble) or stateless passes"
            )
        step = Step(pieces, buffers, state, agreement.presence)
        for stage in stages:
            stage.begin(Range(chain, stage.lo, stage.hi, params, opts, device, meter), step)
        index = torch.arange(m, device=device).unsqueeze(1)  # microbatch j's "input": its index
        with self._guard():
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
            wall = time.perf_counter() - began
            loss, grads, trace, stats = self._collect(stages, m)
            for stage in stages:
                stage.end()
            loss = self._share_loss(loss, agreement)
            grads = self._tie(params, grads, groups, agreement)
            hooks = {(n, name): p for n, i in enumerate(self.stages) for name, p in chain.stages[i].hooked().items()}
            grads = hooked_grads(grads, hooks)  # p.register_hook: on each parameter's whole gradient, as autograd
        stats = metered(stats, chain, meter)
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
        own_buffers = tuple(step.buffers[i] for i in self.stages)
        return PipelineResult(loss, grads, trace, own_buffers, step.pass_state, Measurements(stats), stages=self.stages)

    def _refuse(self, opts: Options) -> None:
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

    def _schedule_for(self, shape: Any, m: int, device: torch.device) -> tuple:
        """This rank's stages and pipelining's schedule for microbatches of ``shape`` (built once
        per shape and count: pipelining infers what crosses each cut on the first step)."""
        key = (repr(shape), m, str(device))
        if key not in self._schedules:
            specs: dict = {}  # range -> the tree structure of what it sends, shared by this rank's ranges
            stages = [
                RangeStage(
                    r,
                    len(self.ranges),
                    self.ranges[r][0],
                    self.ranges[r][1],
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

    def _collect(self, stages: list, m: int) -> tuple:
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

    def _share_loss(self, loss: torch.Tensor | None, agreement: Agreement) -> torch.Tensor:
        """The last rank's summed loss (a scalar), on every rank: broadcast as a tensor of the dtype
        the first step with this agreement learnt, when it crossed pickled."""
        last = self.ranks[-1]
        with self._exchanging(f"the loss from rank {last}"):
            if agreement.loss_dtype is None:
                held: list = [loss]
                dist.broadcast_object_list(held, src=last, group=self.group)
                agreement.loss_dtype = held[0].dtype
                return held[0].to(self.device)
            if loss is None:
                loss = torch.empty((), dtype=agreement.loss_dtype, device=self.device)
            elif loss.dtype != agreement.loss_dtype:
                raise ValueError(
                    f"Pipeline.sweep: rank {self.rank}'s loss is {loss.dtype} this step, {agreement.loss_dtype} on "
                    f"the first step with the same options and loss args, and the other ranks receive it as that; "
                    f"keep the loss's dtype, or make a new Pipeline"
                )
            loss = loss.to(self.device)
            dist.broadcast(loss, src=last, group=self.group)
            return loss

    def _tie(self, params: tuple, grads: tuple, groups: list, agreement: Agreement) -> tuple:
        """Give every use of a tied tensor the sum of all uses' gradients (``ties.tie_grads``): each rank
        sums its own uses in order, and where a group spans ranks the partial sums (``_partials``) are
        added in rank order, so every owner holds bit-identical totals."""

        def combine(partial: dict) -> dict:
            parts = self._partials(partial, groups, agreement)
            return {n: functools.reduce(M.add, parts[n], None) for n in partial}

        return tie_grads(params, grads, groups, self.stages, combine)

    def _partials(self, partial: dict, groups: list, agreement: Agreement) -> dict:
        """Per tied group this rank uses, the owners' partial sums that are not ``None``, in rank order:
        its own where the group is this rank's alone; where it spans ranks, gathered pickled on the first
        step of the agreement (which learns ``agreement.tied``), later sent between the owners as
        tensors (``_swap_partials``)."""
        owners = [tuple(sorted({self._owner(i) for i, _ in group})) for group in groups]
        parts = {n: [p] if p is not None else [] for n, p in partial.items()}
        if all(len(o) == 1 for o in owners):
            return parts
        if agreement.tied is not None:
            return parts | self._swap_partials(partial, agreement.tied)
        everyone = self._gather(partial, "tied gradients", self.group)
        sent = [[theirs.get(n) for theirs in everyone] for n in range(len(groups))]
        agreement.tied = {n: Tied.of(o, sent[n]) for n, o in enumerate(owners) if len(o) > 1}
        return parts | {n: [t for t in sent[n] if t is not None] for n in partial if n in agreement.tied}

    def _swap_partials(self, partial: dict, tied: dict) -> dict:
        """The partial sums of the spanning groups this rank owns, sent point to point between their
        owners as tensors of the shape and dtype the first step learnt; a partial sum that is ``None``
        now and was not then (or the other way round) is refused."""
        ops, parts = [], {}
        for n, group in tied.items():
            if n not in partial:
                continue
            mine = partial[n]
            if (mine is not None) != (self.position in group.senders):
                raise ValueError(
                    f"Pipeline.sweep: rank {self.rank}'s gradient of a tied tensor is "
                    f"{'a tensor' if mine is not None else 'None'} this step, and was not on the first step with "
                    f"these options, which its other owners now expect without exchanging it pickled"
                )
            device = self.device if mine is None else mine.device
            parts[n] = [
                mine if k == self.position else torch.empty(group.shape, dtype=group.dtype, device=device)
                for k in group.senders
            ]
            peers = [(k, t) for k, t in zip(group.senders, parts[n]) if k != self.position]
            ops += [dist.P2POp(dist.irecv, t, self.ranks[k], self.group) for k, t in peers]
            if mine is not None:
                mine = mine.contiguous()
                ops += [
                    dist.P2POp(dist.isend, mine, self.ranks[k], self.group) for k in group.owners if k != self.position
                ]
        with self._exchanging("tied gradients"):
            for work in dist.batch_isend_irecv(ops) if ops else ():
                work.wait()
        return parts

    def _owner(self, stage: int) -> int:
        r = next(r for r, (lo, hi) in enumerate(self.ranges) if lo <= stage < hi)
        return r % len(self.ranks)

    @contextlib.contextmanager
    def _guard(self):
        """Record any failure of a step, so the next ``sweep`` refuses to run on broken links."""
        try:
            yield
        except Exception as e:
            self.failure = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            raise


def _check_ranges(ranges: Sequence, stages: int, parts: int, per_rank: int) -> tuple:
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


def _no_loss(output: Any, target: Any) -> None:
    """Pipelining's loss hook: the last range computes the loss itself, inside the runner."""
    return None


def _shapes(trees: list) -> list:
    """Per tree, the shapes and dtypes of its tensor leaves."""
    return [
        [
            [list(t.shape), str(t.dtype)]
            for t in optree.tree_leaves(tree, namespace=NAMESPACE)
            if isinstance(t, torch.Tensor)
        ]
        for tree in trees
    ]
