"""One stage range of a rank as a ``torch.distributed.pipelining`` stage: pipelining's schedules
call it, the engine's one runner (``eae_func.core.runner.Range``) computes inside it.

    F(j):  tape_j  = Range.forward(x_lo of microbatch j)              send x_hi   (boundary codec)
    B(j):  piece_j = Range.backward(tape_j, the received p_hi)         send p_lo   (costate codec)
    I(j):  the same, each stage's weight half deferred                 (zero-bubble schedules)
    W(j):  the deferred weight halves of microbatch j

A boundary is any pytree of tensors (``(h, mask)``, a captured model's ``{node: tensor}``): its leaves
cross as pipelining's tuple of tensors, floating ones through the codec, integer and boolean ones
raw; its costate is a one-byte flag per leaf (0 where that leaf has no costate: an integer leaf, or
none flows) and the codec's payload of every floating leaf. The receiver reads the flags on the first
step of an agreement on the options (``Step.presence``) and knows them from then on: the sender
checks that it sends a costate on the same leaves, so later steps read nothing on the host.

Pipelining's own stage runs autograd on its module; this one overrides the compute
(``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``) and the messages
(``get_{fwd,bwd}_{send,recv}_ops``) and leaves the rest to pipelining: the schedule, batching and
waiting on the point-to-point ops, and the inference of what crosses each cut, from one forward of
microbatch 0 per pipeline and shape (RNG forked, physical stages not metered), whose metadata going
forward also carries the boundary's tree structure (``_send_meta`` / ``_recv_meta``). Its module has
no parameters: gradients are the runner's, summed over microbatches in order, never ``.grad``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from ..core import boundary as B
from ..core import fold as F
from ..core.microbatch import Microbatch
from ..core.result import Piece
from ..core.runner import Range
from ..core.tape import Tape
from .codecs import Codec, Encoded, Raw, round_trip

__all__ = [
    "RangeStage",
    "Step",
    "costate_inbox",
    "costate_leaves",
    "costate_message",
    "received_costate",
    "wire_tensors",
]


RAW = Raw()


@dataclasses.dataclass
class Step:
    """What a rank's stages share during one pipeline step: the microbatches, the buffers (threaded
    through the forwards), the pass state (threaded through the backwards), which leaves of each
    costate carry one (per ``(boundary, microbatch)``, learnt on the first step of the ranks'
    agreement and kept by it), busy seconds, byte counts, and whether a failure was this rank's own
    computation."""

    pieces: Sequence[Microbatch]
    buffers: tuple[Any, ...]
    pass_state: Any
    presence: dict[Any, Any] = dataclasses.field(default_factory=dict)
    busy_s: float = 0.0
    counts: dict[Any, Any] = dataclasses.field(default_factory=dict)
    failed_here: bool = False

    @contextlib.contextmanager
    def computing(self, what: str):
        start = time.perf_counter()
        try:
            yield
        except Exception as e:
            self.failed_here = True
            e.add_note(f"(in {what})")
            raise
        finally:
            self.busy_s += time.perf_counter() - start

    def count(self, kind: str, direction: str, tensors: Sequence[torch.Tensor]) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        for key in (f"bytes_{direction}", f"{kind}_bytes_{direction}"):
            self.counts[key] = self.counts.get(key, 0) + nbytes
        self.counts[f"messages_{direction}"] = self.counts.get(f"messages_{direction}", 0) + 1


class RangeStage(PipelineStage):
    """Stage range ``index`` (stages ``lo..hi-1`` of the chain, ``span = (lo, hi)``) of ``num_ranges``, on ``device``,
    talking over ``group``; ``where`` names it in errors; ``specs`` (shared by a rank's ranges) maps a
    range to the tree structure of what it sends. ``begin(runner, step)`` before each step, ``end()``
    after it."""

    def __init__(
        self,
        index: int,
        num_ranges: int,
        span: tuple[int, int],
        device: torch.device,
        group: Any,
        codecs: tuple[Codec, Codec],
        where: str,
        specs: dict[Any, Any],
    ):
        super().__init__(torch.nn.Module(), index, num_ranges, device, group=group)
        (self.lo, self.hi), self.codecs, self.where, self.specs = span, codecs, where, specs
        self.runner: Range | None = None
        self.step: Step | None = None
        self.tapes: dict[int, Tape] = {}
        self.done: dict[int, Piece] = {}
        self.inbox: dict[int, Any] = {}  # boundary states received, encoded
        self.outbox: dict[int, Any] = {}  # boundary states to send
        self.costates_in: dict[int, tuple[Any, ...]] = {}  # (flags, encoded per leaf) received
        self.costates_out: dict[int, tuple[Any, ...]] = {}  # (flags, encoded per leaf) to send

    def begin(self, runner: Range, step: Step) -> None:
        self.end()
        self.runner, self.step = runner, step

    def end(self) -> None:
        """Let go of a step's tapes, pieces, messages, runner and shared state."""
        for d in (self.tapes, self.done, self.inbox, self.outbox, self.costates_in, self.costates_out):
            d.clear()
        self.runner = self.step = None

    # -- compute

    def forward_one_chunk(
        self, fwd_chunk_id: int, args: tuple[Any, ...], kwargs: dict[Any, Any] | None = None, save_forward_output=True
    ):
        j, step, runner = fwd_chunk_id, self._step, self._runner
        with step.computing(f"the forward of microbatch {j} on {self.where}"):
            h = (
                None
                if self.is_first
                else self.specs[self.stage_index - 1].unflatten([enc.decode() for enc in self.inbox.pop(j)])
            )
            tape = runner.forward(step.buffers, step.pieces[j], h)
            lo, hi = self.lo, self.hi
            step.buffers = step.buffers[:lo] + tuple(tape.buffers[i] for i in range(lo, hi)) + step.buffers[hi:]
            self.tapes[j] = tape
            if self.is_last:
                return None
            self.outbox[j] = tape.take_output()
            return self.outbox[j]

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        j, step, runner = bwd_chunk_id, self._step, self._runner
        with step.computing(f"the backward of microbatch {j} on {self.where}"):
            received = None
            if not self.is_last:
                flags, encoded = self.costates_in.pop(j)
                received = received_costate(self._presence(j, flags), encoded, self.specs[self.stage_index])
            piece = runner.backward(
                self.tapes.pop(j),
                step.pieces[j],
                step.pass_state,
                received,
                defer_weights=not full_backward,
            )
            step.pass_state = piece.pass_state
            if not self.is_first:
                piece = self._send_costate(j, piece)
            self.done[j] = piece

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        j = bwd_chunk_id
        with self._step.computing(f"the weight gradients of microbatch {j} on {self.where}"):
            piece = self.done[j]
            grads = tuple(g.compute() if isinstance(g, F.Deferred) else g for g in piece.grads)
            self.done[j] = dataclasses.replace(piece, grads=grads)

    def _send_costate(self, j: int, piece: Piece) -> Piece:
        """Queue p_lo for the previous range, each leaf encoded; the trace's record of boundary lo
        becomes the round trip (what the previous range receives)."""
        metas, codec, spec = self._crossing("inputs"), self.codecs[1], self.specs[self.stage_index - 1]
        what = f"the costate at boundary {self.lo} (the input of {self.where})"
        values = costate_leaves(piece.costate, spec, metas, what)
        self._promise(j, tuple(t is not None for t in values), what)
        if isinstance(codec, Raw) or all(t is None for t in values):
            encoded = [None if t is None else codec.encode(t) for t in values]
        else:
            record, encoded = round_trip(codec, piece.trace[-1].replace(value=spec.unflatten(values)))
            if not self._runner.opts.keep_costates:
                record = record.replace(value=None)
            piece = dataclasses.replace(piece, trace=piece.trace[:-1] + (record,))
        self.costates_out[j] = costate_message(encoded, metas, codec, self.device)
        return piece

    def _presence(self, j: int, flags: torch.Tensor) -> tuple[Any, ...]:
        """Which leaves of the costate received for microbatch j carry one: the message's flags, read
        on the first step of the agreement, then known (``_promise``)."""
        key = (self.hi, j)
        if key not in self._step.presence:
            self._step.presence[key] = tuple(bool(f) for f in flags.tolist())
        return self._step.presence[key]

    def _promise(self, j: int, present: tuple[Any, ...], what: str) -> None:
        """Record which leaves of the costate sent for microbatch j carry one, on the first step of the
        agreement; on later steps refuse another set: the receiver no longer reads the flags."""
        known = self._step.presence.setdefault((self.lo, j), present)
        if present != known:
            raise ValueError(
                f"{what} has a costate on leaves {_indices(present)} of the boundary, and had one on leaves "
                f"{_indices(known)} on the first step with these options, which the previous range now expects "
                f"without reading the flags; a pass or estimator must give a costate (or None) at the same "
                f"leaves on every step with the same options"
            )

    # -- messages

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
        if self.is_first:
            return []
        metas = self._crossing("inputs")
        encoded = self.inbox[fwd_chunk_id] = [empty(self._codec(0, meta), meta, self.device) for meta in metas]
        return self._ops(dist.irecv, wire_tensors(encoded), self.stage_index - 1, "activation", "received")

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[Any]:
        if self.is_last:
            return []
        leaves = self.specs[self.stage_index].flatten_up_to(self.outbox.pop(fwd_chunk_id))
        encoded = [self._codec(0, t).encode(t) for t in leaves]
        return self._ops(dist.isend, wire_tensors(encoded), self.stage_index + 1, "activation", "sent")

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
        if self.is_last or not self.has_backward:
            return []
        flags, encoded = self.costates_in[bwd_chunk_id] = costate_inbox(
            self._crossing("outputs"), self.codecs[1], self.device
        )
        return self._ops(dist.irecv, (flags, *wire_tensors(encoded)), self.stage_index + 1, "costate", "received")

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
        if self.is_first or not self.has_backward:
            return []
        flags, encoded = self.costates_out.pop(bwd_chunk_id)
        return self._ops(dist.isend, (flags, *wire_tensors(encoded)), self.stage_index - 1, "costate", "sent")

    def _ops(self, op, tensors: Sequence[torch.Tensor], peer_range: int, kind: str, direction: str) -> list[Any]:
        self._step.count(kind, direction, tensors)
        peer = self._resolve_peer_global_rank(peer_range)
        return [dist.P2POp(op, t, peer, self.group) for t in tensors]

    def _codec(self, kind: int, leaf: Any) -> Codec:
        """The boundary (``kind`` 0) or costate (1) codec of a leaf (a tensor or its metadata): integer
        and boolean leaves cross raw."""
        return self.codecs[kind] if differentiable(leaf) else RAW

    # -- what pipelining's metadata inference runs

    def _compute_outputs(self, *args: torch.Tensor, module: torch.nn.Module, **kwargs: Any) -> Any:
        """The range's output on microbatch 0 (the first range) or on zeros of the received leaves,
        the RNG forked and physical stages not metered: what crosses the cut after this range, its
        leaves (the floating ones marked as expecting a costate) and, in ``specs``, its structure.
        The last range sends nothing: a placeholder."""
        runner = dataclasses.replace(self._runner, meter=None)
        zeros = [torch.zeros_like(a).detach() for a in args]
        h = None if self.is_first else self.specs[self.stage_index - 1].unflatten(zeros)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            tape = runner.forward(self._step.buffers, self._step.pieces[0], h)
        if self.is_last:
            return torch.zeros((), device=self.device, requires_grad=True)
        leaves, self.specs[self.stage_index] = B.leaves(tape.take_output(), f"the output of {self.where}")
        return tuple(t.detach().requires_grad_(differentiable(t)) for t in leaves)

    def _compute_input_grads(
        self, outputs: list[Any], all_fwd_inputs: list[Any], grad_outputs: list[Any] | None = None
    ) -> tuple[Any, ...]:
        """A costate of each floating input's shape and dtype (the runner computes the real ones)."""
        return tuple(torch.zeros_like(t) if t.is_floating_point() else None for t in all_fwd_inputs)

    def _send_meta(self, meta: Any, dst_stage: int) -> None:
        """Pipelining's metadata for another rank; going forward, with the tree structure of the boundary."""
        if dst_stage == self.stage_index + 1:
            meta = (meta, self.specs[self.stage_index])
        super()._send_meta(meta, dst_stage)

    def _recv_meta(self, src_stage: int) -> Any:
        meta = super()._recv_meta(src_stage)
        if src_stage == self.stage_index - 1:
            meta, self.specs[src_stage] = meta
        return meta

    def _crossing(self, side: str) -> tuple[Any, ...]:
        """Pipelining's metadata (shape, dtype) of each leaf of what enters (``"inputs"``) or leaves this range."""
        metas = getattr(self._stage_meta, side)
        assert metas is not None, "pipelining infers the metadata on the first step"
        return tuple(metas)

    @property
    def _step(self) -> Step:
        assert self.step is not None, "RangeStage.begin runs before every pipeline step"
        return self.step

    @property
    def _runner(self) -> Range:
        assert self.runner is not None, "RangeStage.begin runs before every pipeline step"
        return self.runner


def differentiable(leaf: Any) -> bool:
    """Whether a tensor (or pipelining's metadata of one) has a costate: a floating or complex dtype."""
    return leaf.dtype.is_floating_point or leaf.dtype.is_complex


def empty(codec: Codec, meta: Any, device: torch.device) -> Encoded:
    """Zeros where ``codec``'s payload of a tensor like ``meta`` (its shape and dtype) is received."""
    shape, arg = tuple(meta.shape), codec.arg_for(tuple(meta.shape))
    payload = tuple(torch.zeros(s, dtype=d, device=device) for s, d in codec.layout(shape, meta.dtype, arg))
    return Encoded(codec, shape, meta.dtype, arg, payload)


def costate_leaves(costate: Any, spec: Any, metas: Sequence[Any], what: str) -> list[Any]:
    """The costate of a boundary of structure ``spec`` and leaves like ``metas``, one entry per leaf:
    ``None`` where it has none and at every integer or boolean leaf (the fold would not use one), else
    the leaf's costate in the leaf's dtype. Another structure, or a leaf of another shape, is refused."""
    try:
        leaves = [None] * len(metas) if costate is None else spec.flatten_up_to(costate)
    except ValueError as e:
        raise ValueError(f"{what} has another structure than the boundary state {spec}: {e}") from e
    for t, meta in zip(leaves, metas):
        if t is not None and tuple(t.shape) != tuple(meta.shape):
            raise ValueError(
                f"{what} has a leaf of shape {tuple(t.shape)} after the passes, the boundary state's has "
                f"shape {tuple(meta.shape)}: the previous stage range cannot use it"
            )
    return [None if t is None or not differentiable(m) else t.to(m.dtype) for t, m in zip(leaves, metas)]


def costate_message(
    encoded: Sequence[Any], metas: Sequence[Any], codec: Codec, device: torch.device
) -> tuple[Any, ...]:
    """``(flags, encoded)`` as they go on the wire: a flag per leaf (1 where ``encoded`` has a costate),
    the codec's payload of every floating leaf (zeros where it has none), nothing for the others."""
    flags = torch.tensor([enc is not None for enc in encoded], dtype=torch.uint8, device=device)
    return flags, [
        enc if enc is not None or not differentiable(m) else empty(codec, m, device) for enc, m in zip(encoded, metas)
    ]


def costate_inbox(metas: Sequence[Any], codec: Codec, device: torch.device) -> tuple[Any, ...]:
    """``(flags, encoded)`` to receive a costate message into (``costate_message``'s layout)."""
    flags = torch.zeros(len(metas), dtype=torch.uint8, device=device)
    return flags, [empty(codec, m, device) if differentiable(m) else None for m in metas]


def received_costate(present: Sequence[bool], encoded: Sequence[Any], spec: Any) -> Any:
    """The costate a received message carries, in the boundary's structure ``spec``: each leaf decoded
    where ``present`` (the message's flags), else ``None``."""
    return spec.unflatten([enc.decode() if on else None for on, enc in zip(present, encoded)])


def _indices(present: tuple[Any, ...]) -> list[Any]:
    return [k for k, on in enumerate(present) if on]


def wire_tensors(encoded: Sequence[Encoded | None]) -> list[torch.Tensor]:
    """The tensors that go on the wire for a boundary's leaves, in leaf order (none for ``None``)."""
    return [t for enc in encoded if enc is not None for t in enc.payload]
