"""One stage range of a rank as a ``torch.distributed.pipelining`` stage: pipelining's schedules
call it, the engine's one runner (``eae_func.runner.Range``) computes inside it.

    F(j):  tape_j  = Range.forward(x_lo of microbatch j)              send x_hi   (boundary codec)
    B(j):  piece_j = Range.backward(tape_j, the received p_hi)         send p_lo   (costate codec)
    I(j):  the same, each stage's weight half deferred                 (zero-bubble schedules)
    W(j):  the deferred weight halves of microbatch j

Pipelining's own stage runs autograd on its module; this one overrides the compute
(``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``) and the messages
(``get_{fwd,bwd}_{send,recv}_ops``: a codec's payload tensors; a costate also carries a one-byte
flag, 0 where no costate flows) and leaves the rest to pipelining: the schedule, batching and
waiting on the point-to-point ops, and the inference of what crosses each cut, from one forward
of microbatch 0 per pipeline and shape (RNG forked, physical stages not metered). Its module has
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

from .. import fold as F
from ..microbatch import Microbatch
from ..runner import Piece, Range
from .codecs import Codec, Encoded, Raw, round_trip


@dataclasses.dataclass
class Step:
    """What a rank's stages share during one pipeline step: the microbatches, the buffers (threaded
    through the forwards), the pass state (threaded through the backwards), busy seconds, byte
    counts, and whether a failure was this rank's own computation."""

    pieces: Sequence[Microbatch]
    buffers: tuple
    pass_state: Any
    busy_s: float = 0.0
    counts: dict = dataclasses.field(default_factory=dict)
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
    """Stage range ``index`` (stages ``lo..hi-1`` of the chain) of ``num_ranges``, on ``device``,
    talking over ``group``; ``where`` names it in errors. ``begin(runner, step)`` before each step,
    ``end()`` after it."""

    def __init__(
        self,
        index: int,
        num_ranges: int,
        lo: int,
        hi: int,
        device: torch.device,
        group: Any,
        codecs: tuple[Codec, Codec],
        where: str,
    ):
        super().__init__(torch.nn.Module(), index, num_ranges, device, group=group)
        self.lo, self.hi, self.codecs, self.where = lo, hi, codecs, where
        self.runner: Range | None = None
        self.step: Step | None = None
        self.tapes: dict[int, F.Tape] = {}
        self.ran_with: dict[int, tuple] = {}
        self.done: dict[int, Piece] = {}
        self.inbox: dict[int, Any] = {}  # boundary states received, encoded
        self.outbox: dict[int, Any] = {}  # boundary states to send
        self.costates_in: dict[int, tuple] = {}  # (flag, encoded) received
        self.costates_out: dict[int, tuple] = {}  # (flag, encoded) to send

    def begin(self, runner: Range, step: Step) -> None:
        self.end()
        self.runner, self.step = runner, step

    def end(self) -> None:
        """Let go of a step's tapes, pieces, messages, runner and shared state."""
        for d in (self.tapes, self.ran_with, self.done, self.inbox, self.outbox, self.costates_in, self.costates_out):
            d.clear()
        self.runner = self.step = None

    # -- compute

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple, kwargs: dict | None = None, save_forward_output=True):
        j, step, runner = fwd_chunk_id, self._step, self._runner
        with step.computing(f"the forward of microbatch {j} on {self.where}"):
            h = None if self.is_first else self.inbox.pop(j).decode()
            self.ran_with[j] = step.buffers
            tape = runner.forward(step.buffers, step.pieces[j], h)
            lo, hi = self.lo, self.hi
            step.buffers = step.buffers[:lo] + tuple(tape.buffers[i] for i in range(lo, hi)) + step.buffers[hi:]
            self.tapes[j] = tape
            if self.is_last:
                return None
            out = self.outbox[j] = tape.take_output()
            single_tensor(out, f"the output of {self.where}, sent to the next stage range")
            return out

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        j, step, runner = bwd_chunk_id, self._step, self._runner
        with step.computing(f"the backward of microbatch {j} on {self.where}"):
            received = None
            if not self.is_last:
                flag, enc = self.costates_in.pop(j)
                received = enc.decode() if flag.item() else None
            piece = runner.backward(
                self.tapes.pop(j),
                self.ran_with.pop(j),
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
        """Queue p_lo for the previous range, encoded; the trace's record of boundary lo becomes
        the round trip (what the previous range receives)."""
        meta = self._crossing("inputs")
        codec = self.codecs[1]
        p = piece.costate
        flag = torch.ones(1, dtype=torch.uint8, device=self.device)
        if p is None:
            flag.zero_()
            self.costates_out[j] = flag, self._empty(codec, meta)
            return piece
        what = f"the costate at boundary {self.lo} (the input of {self.where})"
        single_tensor(p, what)
        if tuple(p.shape) != tuple(meta.shape):
            raise ValueError(
                f"{what} has shape {tuple(p.shape)} after the passes, the boundary state has shape "
                f"{tuple(meta.shape)}: the previous stage range cannot use it"
            )
        p = p.to(meta.dtype)
        if isinstance(codec, Raw):
            self.costates_out[j] = flag, codec.encode(p)
            return piece
        record, enc = round_trip(codec, piece.trace[-1].replace(value=p))
        if not self._runner.opts.keep_costates:
            record = record.replace(value=None)
        self.costates_out[j] = flag, enc
        return dataclasses.replace(piece, trace=piece.trace[:-1] + (record,))

    # -- messages

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        if self.is_first:
            return []
        enc = self.inbox[fwd_chunk_id] = self._empty(self.codecs[0], self._crossing("inputs"))
        return self._ops(dist.irecv, enc.payload, self.stage_index - 1, "activation", "received")

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        if self.is_last:
            return []
        enc = self.codecs[0].encode(self.outbox.pop(fwd_chunk_id))
        return self._ops(dist.isend, enc.payload, self.stage_index + 1, "activation", "sent")

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        if self.is_last or not self.has_backward:
            return []
        flag = torch.zeros(1, dtype=torch.uint8, device=self.device)
        enc = self._empty(self.codecs[1], self._crossing("outputs"))
        self.costates_in[bwd_chunk_id] = flag, enc
        return self._ops(dist.irecv, (flag, *enc.payload), self.stage_index + 1, "costate", "received")

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        if self.is_first or not self.has_backward:
            return []
        flag, enc = self.costates_out.pop(bwd_chunk_id)
        return self._ops(dist.isend, (flag, *enc.payload), self.stage_index - 1, "costate", "sent")

    def _ops(self, op, tensors: Sequence[torch.Tensor], peer_range: int, kind: str, direction: str) -> list:
        self._step.count(kind, direction, tensors)
        peer = self._resolve_peer_global_rank(peer_range)
        return [dist.P2POp(op, t, peer, self.group) for t in tensors]

    def _empty(self, codec: Codec, meta: Any) -> Encoded:
        shape, arg = tuple(meta.shape), codec.arg_for(tuple(meta.shape))
        payload = tuple(torch.zeros(s, dtype=d, device=self.device) for s, d in codec.layout(shape, meta.dtype, arg))
        return Encoded(codec, shape, meta.dtype, arg, payload)

    # -- what pipelining's metadata inference runs

    def _compute_outputs(self, *args: torch.Tensor, module: torch.nn.Module, **kwargs: Any) -> torch.Tensor:
        """The range's output on microbatch 0 (the first range) or on zeros of the received shape,
        the RNG forked and physical stages not metered: what crosses the cut after this range,
        marked as expecting a costate. The last range sends nothing: a placeholder."""
        runner = dataclasses.replace(self._runner, meter=None)
        h = None if self.is_first else torch.zeros_like(args[0]).detach()
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            tape = runner.forward(self._step.buffers, self._step.pieces[0], h)
        if self.is_last:
            return torch.zeros((), device=self.device, requires_grad=True)
        out = tape.take_output()
        single_tensor(out, f"the output of {self.where}, sent to the next stage range")
        return out.detach().requires_grad_(out.is_floating_point())

    def _compute_input_grads(self, outputs: list, all_fwd_inputs: list, grad_outputs: list | None = None) -> tuple:
        """A costate of each floating input's shape and dtype (the runner computes the real ones)."""
        return tuple(torch.zeros_like(t) if t.is_floating_point() else None for t in all_fwd_inputs)

    def _crossing(self, side: str) -> Any:
        """Pipelining's metadata (shape, dtype) of what enters (``"inputs"``) or leaves this range."""
        metas = getattr(self._stage_meta, side)
        assert metas is not None, "pipelining infers the metadata on the first step"
        return metas[0]

    @property
    def _step(self) -> Step:
        assert self.step is not None, "RangeStage.begin runs before every pipeline step"
        return self.step

    @property
    def _runner(self) -> Range:
        assert self.runner is not None, "RangeStage.begin runs before every pipeline step"
        return self.runner


def single_tensor(value: Any, what: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: only a single tensor can cross a rank boundary, got {type(value).__name__}")
