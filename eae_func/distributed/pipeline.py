"""Pipeline parallelism: each rank owns a contiguous stage range and runs the EAE sweep of
its range on a pipeline schedule; boundary states go forward and costates go back with
point-to-point ops, the costate optionally encoded by a wire codec.

Rank k owns stages ``[lo_k, hi_k)`` and runs the engine's own parts on them
(``eae_func.fold``: ``forward``, ``boundary_condition``, ``reverse``; microbatches cut by
``eae_func.microbatch``). For microbatch j it receives x_{lo_k}, runs its forward, sends
x_{hi_k}; later it receives p_{hi_k}, runs the reverse fold (passes at boundaries
hi_k-1..lo_k, and at L on the last rank) and sends p_{lo_k}, encoded. So

    grads on every rank = those of ef.sweep(whole chain, same passes, key, microbatches)

with ``codec.as_pass()`` appended to the passes at the cut boundaries when a costate
codec is used. Tied parameters whose uses sit on different ranks (embedding and head)
get the sum of all uses' gradients by exchanging their partial sums.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import optree
import torch
import torch.distributed as dist

from .. import fold as F
from .. import microbatch as M
from ..adjoint import Measurements
from ..chain import Chain
from ..options import Options, make
from ..physical import Meter
from ..runner import Range
from ..sweep import SweepResult, metered
from ..ties import tie_grads, tie_groups
from ..tree import NAMESPACE
from . import schedule as S
from .codecs import Codec, Raw, round_trip
from .wire import PeerError, Wire

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..options import SweepOptions


@dataclasses.dataclass(frozen=True)
class PipelineResult(SweepResult):
    """One rank's share of a pipeline sweep.

    loss:       the full loss (sent to every rank by the last one).
    grads:      gradients of this rank's stages ``stages`` (one dict per stage).
    adjoints:   the boundary records this rank produced, after passes and wire codec:
                L (last rank) and hi-1 down to lo; all ranks' together are the single-process trace.
    buffers:    this rank's stages' updated buffers.
    pass_state: the pass state threaded through this rank's boundaries.
    stats:      per-stage counters as ``SweepResult.stats``, plus ``stats["wire"]`` (bytes and
                messages sent / received, per kind) and ``stats["schedule"]`` (busy and step seconds,
                measured and ideal bubble fraction).
    stages:     the range of stage indices this rank owns.
    """

    stages: range = range(0)


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

    chain:          the whole chain (every rank knows every stage; each runs its own range).
    ranges:         one ``(lo, hi)`` per pipeline rank, contiguous, covering the chain; ``None``:
                    ``balance(params, len(ranks))``.
    params:         the chain's params, only used to balance.
    ranks:          the global ranks forming this pipeline, first stage first (default: all).
    schedule:       ``"1f1b"`` (at most p - k microbatches in flight on rank k) or ``"gpipe"``.
    costate_codec:  how costates cross rank boundaries (``codecs.int8()``, ...; ``None``: raw).
    boundary_codec: how boundary states cross them going forward (``None``: raw; any other
                    codec changes what the next rank computes, so gradients change too).
    timeout:        seconds any receive may wait before this rank raises ``PeerError``.
    device:         where received tensors go (default: the current CUDA device under NCCL,
                    else the CPU).
    """

    def __init__(
        self,
        chain: Chain,
        ranges: Sequence | None = None,
        *,
        params: Sequence | None = None,
        ranks: Sequence[int] | None = None,
        schedule: str = "1f1b",
        costate_codec: Codec | None = None,
        boundary_codec: Codec | None = None,
        timeout: float = 60.0,
        device: torch.device | None = None,
    ):
        if not dist.is_initialized():
            raise RuntimeError(
                "Pipeline: call torch.distributed.init_process_group (or eae_func.distributed.init) first"
            )
        self.chain = chain
        self.ranks = tuple(range(dist.get_world_size())) if ranks is None else tuple(int(r) for r in ranks)
        self.rank = dist.get_rank()
        if self.rank not in self.ranks:
            raise ValueError(f"Pipeline: rank {self.rank} is not one of the pipeline's ranks {self.ranks}")
        self.position = self.ranks.index(self.rank)
        if ranges is None:
            if params is None:
                raise ValueError("Pipeline: give the stage ranges, or params to balance them by parameter count")
            ranges = balance(params, len(self.ranks))
        self.ranges = _check_ranges(ranges, len(chain), len(self.ranks))
        self.lo, self.hi = self.ranges[self.position]
        if schedule not in S.NAMES:
            raise ValueError(f"Pipeline: schedule must be one of {S.NAMES}, got {schedule!r}")
        self.schedule = schedule
        self.costate_codec = costate_codec or Raw()
        self.boundary_codec = boundary_codec or Raw()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"Pipeline: timeout must be a finite number of seconds > 0, got {timeout!r}")
        self.timeout = float(timeout)
        if device is None:
            nccl = dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = device
        self.failure: str | None = None
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
        """Exchange ``plan()`` with both neighbours and raise ``PeerError`` naming what differs."""
        differences = self._exchange("plan", self.plan())
        if differences:
            raise PeerError(
                f"rank {self.rank} ({self.where(self.rank)}): the ranks of the pipeline disagree before "
                f"the first step; give every rank the same chain, ranges, schedule and codecs: "
                + "; ".join(differences)
            )

    def _agree_on_step(self, opts: Options, groups: list) -> None:
        """Exchange this step's options (and the tied tensors found in params) with both neighbours
        before the step, and raise ``PeerError`` naming what differs: a rank with another key, an
        extra pass or another boundary dtype would compute gradients no single sweep gives."""
        mine = {
            "key": opts.key,
            "microbatches": opts.microbatches,
            "reduction": opts.reduction,
            "passes": opts.passes.name,
            "boundary_dtype": str(opts.boundary_dtype),
            "autocast": str(opts.autocast),
            "estimator": repr(opts.estimator),
            "physical": list(opts.physical),
            "ties": [[[i, list(map(str, path))] for i, path in group] for group in groups],
        }
        differences = self._exchange("options", mine)
        if differences:
            raise PeerError(
                f"rank {self.rank} ({self.where(self.rank)}): the ranks of the pipeline were given different "
                f"options for this step; give every rank the same Pipeline.sweep options (and the whole params, "
                f"or chain.ties, for tensors shared across ranks): " + "; ".join(differences)
            )

    def _exchange(self, kind: str, mine: dict) -> list:
        """Send ``mine`` to both neighbours and receive theirs (every rank sends its own whatever it
        receives, so every rank of a disagreeing pair raises); the differences, each naming the key."""
        wire = Wire(self.rank, self.where, self.timeout, self.device)
        payload = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8).to(self.device)
        differences = []
        k = self.position
        for peer, first_send in ((k - 1, False), (k + 1, True)):  # the lower rank of a pair sends first
            if not 0 <= peer < len(self.ranks):
                continue
            rank = self.ranks[peer]
            if first_send:
                wire.send(rank, kind, 0, Raw().encode(payload))
            theirs = json.loads(bytes(received(wire.recv(rank, kind, 0, Raw()), f"the {kind}").cpu().tolist()).decode())
            if not first_send:
                wire.send(rank, kind, 0, Raw().encode(payload))
            differences += [
                f"{key}: {mine[key]} here, {theirs.get(key)} on rank {rank}"
                for key in mine
                if mine[key] != theirs.get(key)
            ]
        wire.flush()
        return differences

    @property
    def stages(self) -> range:
        """The stage indices this rank owns."""
        return range(self.lo, self.hi)

    def where(self, rank: int) -> str:
        """``"stages 2-3 ('b2'..'b3')"``: what global ``rank`` runs in this pipeline."""
        if rank not in self.ranks:
            return "not in this pipeline"
        lo, hi = self.ranges[self.ranks.index(rank)]
        names = self.chain.names
        return (
            f"stage {lo} ({names[lo]!r})"
            if hi - lo == 1
            else f"stages {lo}-{hi - 1} ({names[lo]!r}..{names[hi - 1]!r})"
        )

    def _owner(self, stage: int) -> int:
        return next(k for k, (lo, hi) in enumerate(self.ranges) if lo <= stage < hi)

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
                 weighs its microbatches by x's rows when no loss arg has a batch dim).
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
        chain, lo, hi, p, k = self.chain, self.lo, self.hi, len(self.ranks), self.position
        first, last = k == 0, k == p - 1
        opts = make("Pipeline.sweep", options).bind(chain)
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
        sharded = [chain.where(i) for i in range(self.lo, self.hi) if chain.stages[i].sharded is not None]
        if sharded:
            raise TypeError(
                f"Pipeline.sweep: {', '.join(sharded)} are FSDP2 (fully_shard) modules, which ef.sweep runs on "
                f"FSDP's own engine; a pipeline does not yet"
            )
        if opts.estimator is not None and getattr(opts.estimator, "scope", "model") != "stage" and p > 1:
            raise ValueError(
                f"Pipeline.sweep: estimator={opts.estimator!r} probes the whole chain from its input, "
                f"which no single rank has; across ranks use an estimator that needs only its stage "
                f"(zbp, exact, twin, frozen)"
            )
        params = chain.check_params(params, self.stages)
        buffers = chain.check_buffers(buffers)
        if first and x is None:
            raise ValueError(f"Pipeline.sweep: rank {self.rank} runs the first stage and needs the input x")
        microbatches = opts.microbatches
        pieces = M.split(
            x if first or last else None,  # the last rank may weigh its pieces by x's rows (a loss without targets)
            loss_args if last else None,
            microbatches,
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
        device = F.device_of(params[lo:hi], x if first else None, default=self.device)
        meter = Meter(chain, tuple(i for i in opts.physical if lo <= i < hi), opts.budget)
        mine = Range(chain, lo, hi, params, opts, device, meter)
        groups = tie_groups(chain, params)
        with self._guard():
            self._agree_on_step(opts, groups)

        with self._guard():  # a failed step leaves the ranks out of step: no later step may reuse them
            wire = Wire(self.rank, self.where, self.timeout, self.device)
            prev = self.ranks[k - 1] if not first else -1  # -1: no such neighbour (never used)
            nxt = self.ranks[k + 1] if not last else -1
            inbox, outbox, tapes, costates, outgoing, ran_with = {}, {}, {}, {}, {}, {}
            grads, losses, traces, all_stats = [], [], {}, {}
            busy, step_start = 0.0, time.perf_counter()
            for op in S.schedule(self.schedule, p, microbatches)[k]:
                j = op.microbatch
                mb = pieces[j]
                if op.kind == "recv_activation":
                    inbox[j] = wire.recv(prev, "activation", j, self.boundary_codec)
                elif op.kind == "send_activation":
                    wire.send(nxt, "activation", j, self.boundary_codec.encode(outbox.pop(j)))
                elif op.kind == "recv_costate":
                    like = tapes[j].entries[-1].out_layout
                    costates[j] = wire.recv(nxt, "costate", j, self.costate_codec, shape=like.shapes[0])
                elif op.kind == "send_costate":
                    wire.send(prev, "costate", j, outgoing.pop(j))
                else:
                    start = time.perf_counter()
                    try:
                        if op.kind == "forward":
                            ran_with[j] = buffers
                            tapes[j] = mine.forward(buffers, mb, None if first else inbox.pop(j))
                            buffers = buffers[:lo] + tuple(tapes[j].buffers[i] for i in self.stages) + buffers[hi:]
                            if not last:
                                outbox[j] = tapes[j].take_output()
                                _check_tensor(outbox[j], f"output of {chain.where(hi - 1)}, sent to rank {nxt}")
                        else:
                            tape = tapes.pop(j)
                            input_shape = tape.entries[0].layout.shapes[0]
                            piece = mine.backward(tape, ran_with.pop(j), mb, state, costates.pop(j, None))
                            state, trace = piece.pass_state, piece.trace
                            if not first:
                                outgoing[j], trace = self._encode_costate(trace, input_shape)
                            losses.append(piece.loss)
                            grads.append(piece.grads)
                            traces[j], all_stats[j] = trace, piece.stats
                    except Exception as e:
                        e.add_note(f"(on rank {self.rank}, {self.where(self.rank)}, {op.kind} of microbatch {j})")
                        raise
                    busy += time.perf_counter() - start
            loss = self._share_loss(wire, losses)
            grads = self._tie(wire, params, tie_grads(params, M.sum_grads(grads), groups, lo), groups)
            wire.flush()
        step = time.perf_counter() - step_start

        stats = metered(M.sum_stats([all_stats[j] for j in range(microbatches)]), chain, meter)
        stats["wire"] = dict(wire.counts)
        stats["schedule"] = {
            "name": self.schedule,
            "ranks": p,
            "microbatches": microbatches,
            "busy_s": busy,
            "step_s": step,
            "bubble": 1 - busy / step if step > 0 else 0.0,
            "ideal_bubble": S.ideal_bubble(p, microbatches),
        }
        trace = M.join_adjoints([traces[j] for j in range(microbatches)])
        return PipelineResult(loss, grads, trace, buffers[lo:hi], state, Measurements(stats), stages=self.stages)

    @contextlib.contextmanager
    def _guard(self):
        """Record any failure of a step, so the next ``sweep`` refuses to run on broken links."""
        try:
            yield
        except Exception as e:
            self.failure = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            raise

    def _encode_costate(self, trace: tuple, shape: tuple) -> tuple:
        """``(the costate p_lo to send, encoded; the trace with boundary lo's record as its round trip)``."""
        adj = trace[-1]
        if adj.value is None:
            return None, trace
        what = f"rank {self.rank}: costate at boundary {self.lo} (input of {self.where(self.rank)})"
        _check_tensor(adj.value, what)
        if adj.value.shape != shape:
            raise ValueError(
                f"{what} has shape {tuple(adj.value.shape)} after the passes, the boundary state "
                f"has shape {tuple(shape)}; rank {self.ranks[self.position - 1]} cannot use it"
            )
        if isinstance(self.costate_codec, Raw):
            return self.costate_codec.encode(adj.value), trace
        record, enc = round_trip(self.costate_codec, adj)
        return enc, trace[:-1] + (record,)

    def _share_loss(self, wire: Wire, losses: list) -> torch.Tensor:
        """The last rank sends the summed loss to every other rank of the pipeline."""
        if self.position == len(self.ranks) - 1:
            loss = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
            for r in self.ranks[:-1]:
                wire.send(r, "loss", 0, Raw().encode(loss))
            return loss
        return received(wire.recv(self.ranks[-1], "loss", 0, Raw(), shape=()), "the loss")

    def _tie(self, wire: Wire, params: tuple, grads: tuple, groups: list) -> tuple:
        """Give every use of a tied tensor whose uses sit on several ranks (``groups`` from
        ``tie_groups``; those within this rank are summed already) the sum of all uses' gradients.

        Each owner sums its own uses, sends that partial sum to the other owners and adds
        theirs in rank order, so every owner ends with bit-identical totals. Of each pair,
        the lower position sends first (a consistent order for blocking transports).
        """
        flat = [optree.tree_flatten(g, none_is_leaf=True, namespace=NAMESPACE) for g in grads]
        leaves = [list(f) for f, _ in flat]
        paths = [optree.tree_paths(params[i], namespace=NAMESPACE) for i in self.stages]
        for n, group in enumerate(groups):
            owners = sorted({self._owner(i) for i, _ in group})
            mine = [(i - self.lo, paths[i - self.lo].index(path)) for i, path in group if self.lo <= i < self.hi]
            if len(owners) == 1 or not mine:
                continue
            partials: dict[int, torch.Tensor] = {self.position: sum(leaves[a][b] for a, b in mine)}  # type: ignore[dict-item]
            shape = tuple(partials[self.position].shape)
            for o in owners:
                if o == self.position:
                    continue
                if self.position < o:
                    wire.send(self.ranks[o], "tie", n, Raw().encode(partials[self.position]))
                partials[o] = received(wire.recv(self.ranks[o], "tie", n, Raw(), shape=shape), "a tied gradient")
                if self.position > o:
                    wire.send(self.ranks[o], "tie", n, Raw().encode(partials[self.position]))
            total = sum(partials[o] for o in owners)
            for a, b in mine:
                leaves[a][b] = total
        return tuple(spec.unflatten(f) for (_, spec), f in zip(flat, leaves))


def _check_ranges(ranges: Sequence, stages: int, parts: int) -> tuple:
    ranges = tuple((int(lo), int(hi)) for lo, hi in ranges)
    if len(ranges) != parts:
        raise ValueError(f"Pipeline: {len(ranges)} stage ranges for {parts} ranks; give one (lo, hi) per rank")
    expected = 0
    for lo, hi in ranges:
        if lo != expected or hi <= lo:
            raise ValueError(f"Pipeline: stage ranges {ranges} must be non-empty, contiguous and start at 0")
        expected = hi
    if expected != stages:
        raise ValueError(f"Pipeline: stage ranges {ranges} cover {expected} stages, the chain has {stages}")
    return ranges


def received(value: torch.Tensor | None, what: str) -> torch.Tensor:
    """A received tensor that cannot be missing (only a costate may be ``None``: no costate)."""
    if value is None:
        raise PeerError(f"received no tensor for {what}")
    return value


def _check_tensor(value: Any, what: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: only a single tensor can cross a rank boundary, got {type(value).__name__}")
