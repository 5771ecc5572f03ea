"""Point-to-point transfers between ranks: a header, then the encoded payload.

Every message is a fixed-size int64 header

    [magic, kind, index, codec code, codec arg, dtype code, ndim, shape[0..7]]

followed by the codec's payload tensors (none for an absent costate, ndim = -1).
The receiver reads the header, checks it against what it expects (kind,
microbatch, codec, and the shape when it knows it), allocates the payload from
the codec's layout and receives it. Sends are asynchronous (``isend``; on CUDA
the header goes through pinned memory, so queueing it does not block the host);
receives wait on their work handles with a timeout, so a dead or stalled peer
becomes a ``PeerError`` naming both ranks and their stages instead of a hang.
Bytes sent and received are counted per message kind.

Costs on a GPU (NCCL): reading a received header is one host sync per message
(the payload cannot be allocated before its shape is known). A receive is
waited for by polling ``is_completed`` with short sleeps up to the timeout, then
``wait()`` orders the compute stream after it; a timeout raises ``PeerError``
without aborting the communicator. NCCL's own watchdog kills a rank whose
operation outlives the process group's timeout, so that timeout must exceed the
wire's (``eae_func.distributed.init(timeout=...)`` sets it; give the pipeline a
smaller ``timeout``).
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from .codecs import Codec, Encoded, by_code

MAGIC = 0xEAE
MAX_NDIM = 8
HEADER_LEN = 7 + MAX_NDIM
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
KINDS = ("activation", "costate", "loss", "tie", "plan", "options")


class PeerError(RuntimeError):
    """A transfer between two ranks failed or timed out (a peer died, stalled, or disagrees)."""


class Wire:
    """This rank's end of the point-to-point links.

    rank:    this process's global rank; ``where(rank)`` describes any rank (its stages),
             for error messages.
    timeout: seconds a receive (or the final wait on the sends) may take.
    device:  where headers live (CUDA for NCCL, CPU for gloo).
    """

    def __init__(self, rank: int, where, timeout: float, device: torch.device):
        self.rank, self.where, self.device = rank, where, device
        self.timeout = datetime.timedelta(seconds=timeout)
        self.pending: list[tuple[Any, torch.Tensor, str]] = []  # (work, the tensor kept alive, description)
        self.counts = {
            "bytes_sent": 0,
            "bytes_received": 0,
            "header_bytes": 0,
            "messages_sent": 0,
            "messages_received": 0,
            "wait_s": 0.0,
        }
        self.counts |= {f"{kind}_bytes_{d}": 0 for kind in KINDS for d in ("sent", "received")}

    # -- sending

    def send(self, dst: int, kind: str, index: int, enc: Encoded | None) -> None:
        """Queue the header and payload of ``enc`` (``None``: no costate) for rank ``dst``."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[:3] = torch.tensor([MAGIC, KINDS.index(kind), index])
        if enc is None:
            header[6] = -1
        else:
            if len(enc.shape) > MAX_NDIM:
                raise ValueError(
                    f"rank {self.rank}: cannot send a {len(enc.shape)}-dim {kind}; at most {MAX_NDIM} dims"
                )
            header[3:7] = torch.tensor([enc.codec.code, enc.arg, DTYPES.index(enc.dtype), len(enc.shape)])
            header[7 : 7 + len(enc.shape)] = torch.tensor(enc.shape, dtype=torch.int64)
        what = f"{kind} {index} to rank {dst} ({self.where(dst)})"
        if self.device.type == "cuda":  # from pinned memory: the copy is queued, the host goes on
            header = header.pin_memory().to(self.device, non_blocking=True)
        for t in (header, *(enc.payload if enc is not None else ())):
            self.pending.append((self._post(dist.isend, t, dst, f"sending {what}"), t, what))
        payload = enc.nbytes if enc is not None else 0
        self.counts["bytes_sent"] += payload + header.numel() * 8
        self.counts["header_bytes"] += header.numel() * 8
        self.counts[f"{kind}_bytes_sent"] += payload
        self.counts["messages_sent"] += 1
        self.pending = [p for p in self.pending if not p[0].is_completed()]

    def flush(self) -> None:
        """Wait (with the timeout) until every queued send has been delivered."""
        pending, self.pending = self.pending, []
        for work, _, what in pending:
            self._wait(work, f"sending {what}")

    # -- receiving

    def recv(self, src: int, kind: str, index: int, codec: Codec, shape: tuple | None = None) -> torch.Tensor | None:
        """The tensor rank ``src`` sent as ``kind`` number ``index`` (``None`` for an absent
        costate), decoded. ``shape``: the shape it must have (checked from the header)."""
        what = f"{kind} {index} from rank {src} ({self.where(src)})"
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        self._wait(self._post(dist.irecv, header, src, f"waiting for {what}"), f"waiting for {what}")
        h = header.tolist()
        if h[0] != MAGIC:
            raise PeerError(f"rank {self.rank} ({self.where(self.rank)}): garbled header for {what}: {h}")
        got_kind = KINDS[h[1]] if 0 <= h[1] < len(KINDS) else f"kind {h[1]}"
        if (got_kind, h[2]) != (kind, index):
            raise PeerError(
                f"rank {self.rank} ({self.where(self.rank)}): expected {what}, got {got_kind} {h[2]} "
                f"(the ranks run different schedules or microbatch counts)"
            )
        self.counts["bytes_received"] += HEADER_LEN * 8
        self.counts["messages_received"] += 1
        if h[6] == -1:
            return None
        if h[3] != codec.code:
            raise PeerError(
                f"rank {self.rank} ({self.where(self.rank)}): {what} is encoded with {by_code(h[3])}, "
                f"this rank expects {codec.name}; give every rank the same codecs"
            )
        got_shape = tuple(h[7 : 7 + h[6]])
        if shape is not None and got_shape != tuple(shape):
            raise PeerError(
                f"rank {self.rank} ({self.where(self.rank)}): {what} has shape {got_shape}, "
                f"but the boundary it belongs to has shape {tuple(shape)}"
            )
        dtype = DTYPES[h[5]]
        payload = tuple(torch.empty(s, dtype=d, device=self.device) for s, d in codec.layout(got_shape, dtype, h[4]))
        works = [self._post(dist.irecv, t, src, f"waiting for the payload of {what}") for t in payload]
        for work in works:
            self._wait(work, f"waiting for the payload of {what}")
        enc = Encoded(codec, got_shape, dtype, h[4], payload)
        self.counts["bytes_received"] += enc.nbytes
        self.counts[f"{kind}_bytes_received"] += enc.nbytes
        return enc.decode()

    def _post(self, op, tensor: torch.Tensor, peer: int, what: str):
        """``op(tensor, peer)`` (``dist.isend`` / ``dist.irecv``), a failure to post it a ``PeerError``."""
        try:
            return op(tensor, peer)
        except RuntimeError as e:
            raise PeerError(
                f"rank {self.rank} ({self.where(self.rank)}): {what} failed at once; the peer died "
                f"or the process group is broken: {e}"
            ) from e

    def _wait(self, work, what: str) -> None:
        start = time.perf_counter()
        try:
            if self.device.type == "cuda":  # NCCL: poll (no busy wait, no abort on timeout), then order streams
                pause = 1e-5
                while not work.is_completed():
                    if time.perf_counter() - start > self.timeout.total_seconds():
                        raise RuntimeError("timed out")
                    time.sleep(pause)
                    pause = min(2 * pause, 1e-2)
                work.wait()
            else:
                work.wait(self.timeout)
        except RuntimeError as e:
            raise PeerError(
                f"rank {self.rank} ({self.where(self.rank)}): {what} failed after "
                f"{time.perf_counter() - start:.1f} s (timeout {self.timeout.total_seconds():g} s); "
                f"the peer died, stalled or disagrees: {e}"
            ) from e
        finally:
            self.counts["wait_s"] += time.perf_counter() - start
