"""Pipeline schedules: the order in which each rank runs its microbatches and talks to its neighbours.

With p ranks and m microbatches, rank r runs forward F(j) and backward B(j) of
every microbatch j, F(j) before B(j):

    gpipe (fill-drain): F(0) .. F(m-1), B(0) .. B(m-1); holds m microbatches.
    1f1b:               w = min(p-1-r, m) warm-up forwards, then F(w+i), B(i)
                        alternating, then the remaining backwards; holds at most
                        p - r microbatches (the boundaries of the rest are freed).

Both have the ideal bubble ``(p-1) / (m+p-1)`` with uniform stages.

A schedule is one tuple of ``Op(kind, microbatch)`` per rank, communication
included: ``recv_activation`` before F on r > 0, ``send_activation`` after F on
r < p-1, ``recv_costate`` before B on r < p-1, ``send_costate`` after B on r > 0.
The sends to rank r+1 are placed so that the sequence of operations between
every pair of neighbours is the same, in the same order, on both sides; so the
schedule cannot deadlock even where a send blocks until its receive is posted
(NCCL point-to-point on one stream), which ``simulate(..., rendezvous=True)`` checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

NAMES = ("gpipe", "1f1b")


class Op(NamedTuple):
    kind: str  # forward | backward | recv_activation | send_activation | recv_costate | send_costate
    microbatch: int


def compute_order(name: str, rank: int, ranks: int, microbatches: int) -> list[Op]:
    """The forwards and backwards of ``rank`` in order."""
    m = microbatches
    if name == "gpipe":
        return [Op("forward", j) for j in range(m)] + [Op("backward", j) for j in range(m)]
    if name == "1f1b":
        w = min(ranks - 1 - rank, m)
        steady = [op for i in range(m - w) for op in (Op("forward", w + i), Op("backward", i))]
        return [Op("forward", j) for j in range(w)] + steady + [Op("backward", j) for j in range(m - w, m)]
    raise ValueError(f"schedule: expected one of {NAMES}, got {name!r}")


def schedule(name: str, ranks: int, microbatches: int) -> tuple[tuple[Op, ...], ...]:
    """Every rank's operations, communication included (see the module docstring)."""
    if ranks < 1 or microbatches < 1:
        raise ValueError(f"schedule: need at least one rank and one microbatch, got {ranks} and {microbatches}")
    ops: list = [None] * ranks
    for r in reversed(range(ranks)):
        # What rank r+1 does with r, mirrored: the order rank r must follow with r+1.
        mirror = {"recv_activation": "send_activation", "send_costate": "recv_costate"}
        partner = [Op(mirror[o.kind], o.microbatch) for o in ops[r + 1] if o.kind in mirror] if r < ranks - 1 else []
        ops[r] = tuple(_place(compute_order(name, r, ranks, microbatches), partner, first=r == 0))
    return tuple(ops)


def _place(order: list[Op], partner: list[Op], first: bool) -> list[Op]:
    """Interleave ``order`` with the operations towards rank r+1 (``partner``, in that order):
    each send as soon as its forward has run, each receive just before its backward."""
    out, pos, done = [], 0, set()

    def sends_ready():
        nonlocal pos
        while pos < len(partner) and partner[pos].kind == "send_activation" and partner[pos].microbatch in done:
            out.append(partner[pos])
            pos += 1

    for op in order:
        if op.kind == "forward":
            if not first:
                out.append(Op("recv_activation", op.microbatch))
            out.append(op)
            done.add(op.microbatch)
            sends_ready()
            continue
        if partner:
            while True:
                nxt = partner[pos]
                if nxt.kind == "send_activation" and nxt.microbatch not in done:
                    raise AssertionError(
                        f"schedule: rank r+1 needs activation {nxt.microbatch} before rank r has computed it"
                    )
                out.append(nxt)
                pos += 1
                if nxt == Op("recv_costate", op.microbatch):
                    break
            sends_ready()
        out.append(op)
        if not first:
            out.append(Op("send_costate", op.microbatch))
    if pos != len(partner):
        raise AssertionError("schedule: operations towards rank r+1 left unplaced")
    return out


def simulate(
    ops: Sequence[Sequence[Op]],
    forward_s: float | Sequence[float] = 1.0,
    backward_s: float | Sequence[float] = 2.0,
    rendezvous: bool = False,
) -> dict:
    """Run a schedule on a model clock (communication free, compute ``forward_s`` / ``backward_s``
    per microbatch, per rank if given as a list) and return ``makespan``, per-rank ``busy``
    and the ``bubble`` fraction ``1 - sum(busy) / (p * makespan)``.

    rendezvous=False: sends return at once, a receive waits for its send.
    rendezvous=True:  a send also waits for its receive to be posted (the strictest
    semantics); a schedule that deadlocks raises ``RuntimeError``.
    """
    p = len(ops)
    fwd = list(forward_s) if isinstance(forward_s, Sequence) else [forward_s] * p
    bwd = list(backward_s) if isinstance(backward_s, Sequence) else [backward_s] * p
    clock, pc, busy = [0.0] * p, [0] * p, [0.0] * p
    posted: dict = {}  # (src, dst, kind, microbatch, "send" | "recv") -> time the op was posted
    peer = {"send_activation": 1, "recv_activation": -1, "send_costate": -1, "recv_costate": 1}
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pc[r] < len(ops[r]):
                op = ops[r][pc[r]]
                if op.kind in ("forward", "backward"):
                    dt = fwd[r] if op.kind == "forward" else bwd[r]
                    clock[r] += dt
                    busy[r] += dt
                else:
                    other = r + peer[op.kind]
                    sending = op.kind.startswith("send")
                    channel = (r, other) if sending else (other, r)
                    key = (*channel, op.kind.split("_")[1], op.microbatch)
                    posted.setdefault((*key, "send" if sending else "recv"), clock[r])
                    match = posted.get((*key, "recv" if sending else "send"))
                    if match is None and (rendezvous or not sending):
                        break
                    clock[r] = max(clock[r], match) if match is not None and (rendezvous or not sending) else clock[r]
                pc[r] += 1
                progress = True
    if any(pc[r] < len(ops[r]) for r in range(p)):
        stuck = {r: ops[r][pc[r]] for r in range(p) if pc[r] < len(ops[r])}
        raise RuntimeError(f"simulate: the schedule deadlocks; ranks stuck at {stuck}")
    makespan = max(clock)
    return {"makespan": makespan, "busy": busy, "bubble": 1 - sum(busy) / (p * makespan) if makespan else 0.0}


def ideal_bubble(ranks: int, microbatches: int) -> float:
    """``(p-1) / (m+p-1)``: the idle fraction of GPipe and 1F1B with uniform stages."""
    return (ranks - 1) / (microbatches + ranks - 1)
