"""The EAE sweep of a contiguous stage range ``[lo, hi)``, driven by an output costate.

    forward:  x_l = h_l(W_l, x_{l-1}),  l = lo+1..hi        keep x_lo..x_{hi-1} (a Tape)
    reverse:  given p_hi, (grad W_l, p_{l-1}) = vjp(h_l)(p_l), l = hi..lo+1,
              every p_{l-1} through the passes

This is ``ef.sweep``'s forward sweep and reverse fold cut at a rank boundary:
boundary ``l`` gets index ``l`` and key ``fold_in(key, l)``, the loss boundary
index ``L``, stages replay their RNG state, so passes see exactly what they see
in a single-process sweep (recompute mode, no estimators).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch.func import vjp

from .. import boundary as B
from ..adjoint import AdjointState, fold_in
from ..chain import Chain
from ..passes import combinators as C
from ..sweep import _check_costate, _local, _replay_rng, _rng_state


@dataclasses.dataclass
class Tape:
    """What the forward of one microbatch keeps for its reverse: the inputs x_lo..x_{hi-1},
    their layouts, the output layouts, each stage's RNG state and the buffers it ran with."""

    inputs: list
    layouts: list
    out_layouts: list
    rng: list
    buffers: tuple


def new_stats(chain: Chain, lo: int, hi: int) -> dict:
    """Per-stage counters of ``[lo, hi)``, named as in ``SweepResult.stats``."""
    keys = ("forward_s", "recompute_s", "vjp_s", "pass_s", "boundary_bytes")
    return {chain.stages[i].name: dict.fromkeys(keys, 0) for i in range(lo, hi)}


def where(chain: Chain, i: int) -> str:
    return f"stage {i} ({chain.stages[i].name!r})"


def forward(chain: Chain, lo: int, hi: int, params: tuple, buffers: tuple, h: Any, stats: dict):
    """``(x_hi, tape, updated_buffers)``; no autograd graph is built."""
    device = _device(h)
    tape = Tape([], [], [], [], buffers)
    updated_buffers = list(buffers)
    for i in range(lo, hi):
        s = chain.stages[i]
        B.leaves(h, f"input of {where(chain, i)}")
        tape.layouts.append(B.Layout.of(h))
        tape.inputs.append(h)
        tape.rng.append(_rng_state(device))
        stats[s.name]["boundary_bytes"] = tape.layouts[-1].nbytes(h)
        start = time.perf_counter()
        with torch.no_grad():
            h, updated_buffers[i - lo] = s.call(params[i], buffers[i - lo], h)
        stats[s.name]["forward_s"] += time.perf_counter() - start
        B.leaves(h, f"output of {where(chain, i)}")
        tape.out_layouts.append(B.Layout.of(h))
    return h, tape, tuple(updated_buffers)


def reverse(chain: Chain, lo: int, hi: int, params: tuple, tape: Tape, adj: AdjointState, passes: Any,
            pass_state: Any, key: int, stats: dict):
    """``(grads of [lo, hi), records of boundaries hi-1..lo after the passes, pass_state)``.

    ``adj`` is the costate p_hi at the range's output, already processed; the tape's
    boundaries are released as the fold goes.
    """
    grads, records = [None] * (hi - lo), []
    for i in reversed(range(lo, hi)):
        s, st, k = chain.stages[i], stats[chain.stages[i].name], i - lo
        out_layout = tape.out_layouts[k]
        cot = _check_costate(chain, i, adj, out_layout)
        del adj
        h_in, tape.inputs[k] = tape.inputs[k], None
        floats, rebuild, costate_like = B.split(h_in, f"input of {where(chain, i)}")
        start = time.perf_counter()
        with _replay_rng(tape.rng[k], _device(h_in)):
            _, stage_vjp, _ = vjp(_local(s, tape.buffers[k], rebuild), params[i], floats, has_aux=True)
        st["recompute_s"] += time.perf_counter() - start
        cotangent = out_layout.spec.unflatten(
            [torch.zeros(shape, dtype=dt, device=dev) if c is None else c.to(dt)
             for c, shape, (dev, dt) in zip(cot, out_layout.shapes, out_layout.placements)])
        start = time.perf_counter()
        grads[k], g_in = stage_vjp(cotangent, retain_graph=False)
        st["vjp_s"] += time.perf_counter() - start
        del stage_vjp, cotangent, cot
        name = chain.stages[i - 1].name if i > 0 else "input"
        adj = AdjointState(costate_like(list(g_in)), i, name, fold_in(key, i), boundary=h_in)
        del g_in, h_in, floats
        start = time.perf_counter()
        adj, pass_state = C.apply(passes, adj, pass_state)
        st["pass_s"] += time.perf_counter() - start
        records.append(adj.replace(boundary=None))
    return tuple(grads), records, pass_state


def _device(tree: Any) -> torch.device:
    flat = B.leaves(tree, "boundary")[0]
    return flat[0].device if flat else torch.device("cpu")
