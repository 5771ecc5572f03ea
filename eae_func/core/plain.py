"""The fold over a plain range: the whole chain (each microbatch's, earlier ones' gradients added),
with its passes, kept costates and timers, but no estimator, fused update, stored-apart boundaries,
autocast, compile or kept graphs (what ``ef.grad``, ``ef.value_and_grad`` and ``ef.sweep`` run by
default), as two loops with nothing else in them.

    forward:  x_l = h_l(W_l, x_{l-1}), each stage's input, RNG state and modes kept
    reverse:  (grad W_l, p_{l-1}) = vjp(h_l rebuilt from x_{l-1})(p_l), then the passes,  l = L..1

Each stage's forward and reverse step is the general fold's (``tape.run_stage``'s checks,
``fold.rebuilt_vjp`` under ``replay_rng`` and ``in_modes``, early stop by ``fold.rebuild_kind``),
the same records and counters come out, bit for bit; what is left out is the records, branches
and counters of the options a plain range does not have (a stage's host cost fell from 0.9x
checkpointing's to about half of it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from ..adjoint import AdjointState, fold_in
from ..program.slots import module_lock
from ..tree import NAMESPACE, map_tensors
from . import boundary as B
from . import early_stop as ES
from . import vjp as V
from .costates import boundary_name, example, processed, shown_as, traced
from .diagnose import check_closed_over, explain, note
from .fold import boundary_condition, rebuild_kind, rebuilt_vjp
from .microbatch import Microbatch, add
from .options import Options
from .replay import HOST, NULL, check_modes, drew, host_kind, in_modes, modes_of, replay_rng, rng_state
from .result import Piece
from .tape import STAGE_COUNTERS, Entry, Span, check_floating, check_unwritten, with_host
from .timing import timed

__all__ = ["applies", "run"]


def applies(opts: Options, chain: Any, lo: int, hi: int) -> bool:
    """Whether stages ``lo..hi-1`` of ``chain`` under ``opts`` are a plain range (see the module)."""
    return (
        lo == 0
        and hi == len(chain)
        and not opts.physical
        and not opts.offload
        and opts.boundary_dtype is None
        and opts.autocast is None
        and opts.compile is None
        and opts.update is None
        and opts.recompute.kind == "always"
        and all(s.sharded is None for s in chain.stages)
    )


def run(
    r: Span, buffers: tuple[Any, ...], mb: Microbatch, pass_state: Any, pending: Any = None, earlier: Any = None
) -> Piece:
    """``Range.run`` of a plain range ``r`` (``applies``) with no updater: the same ``Piece``, the fused
    updates' ``pending`` (a later microbatch's fold runs them) handed through; with ``earlier`` (one
    entry per stage: the earlier microbatches' gradients), each stage's gradients plus its entry,
    which is let go at once, as ``fold.make_step`` adds them."""
    chain, opts = r.chain, r.at(mb)
    entries, output, new_buffers, counters = forward(r, opts, buffers, mb.x)
    assert mb.scale is not None, "the range that computes the loss weighs its microbatches"
    stats: dict[Any, Any] = {"loss": {"forward_s": 0.0, "pass_s": 0.0} if opts.timers else {}}
    if pass_state is None:  # the passes start here, seeing the boundaries they will be applied to
        pass_state = opts.passes.start(example(chain, 0, len(chain), entries) if opts.passes.wants_example else ())
    loss, carry = boundary_condition(chain, output, mb.loss_args, opts, pass_state, mb.scale, stats["loss"])
    del output
    costate, head, pass_state = carry.adj.value, traced(carry.shown, opts), carry.pass_state
    del carry  # p_L is held by ``costate`` alone: freed once stage L-1 has used it
    grads: list[Any] = [None] * len(entries)
    records = [head]
    observed = opts.keep_costates or not opts.no_passes  # p_0 is read (kept, or seen by the passes)
    while entries:
        entry = entries.pop()
        i = entry.index
        try:
            grads[i], costate = reverse_step(r, opts, entry, costate, i > 0 or observed, counters[chain.names[i]])
        except Exception as e:
            note(e, f"the reverse step of {chain.where(i)}")
            raise
        if earlier is not None:
            grads[i], earlier[i] = (
                optree.tree_map(add, earlier[i], grads[i], none_is_leaf=True, namespace=NAMESPACE),
                None,
            )
        if chain.shown is None and not observed:  # the record as ``traced(shown_as(...))`` keeps it: no costate
            records.append(AdjointState(None, i, boundary_name(chain, i), fold_in(opts.key, i)))
        else:
            adj = AdjointState(costate, i, boundary_name(chain, i), fold_in(opts.key, i))
            shown = shown_as(chain, adj, opts.key)
            if not opts.no_passes:
                adj, pass_state, shown = processed(
                    chain, opts, adj, pass_state, entry.boundary, entry.layout, counters[chain.names[i]]
                )
                costate = adj.value
            records.append(traced(shown, opts))
            del adj, shown
        del entry
    trace = tuple(a for a in records if a is not None)
    stats.update(counters)
    stats["boundaries"] = {a.index: dict(a.meta) for a in trace}
    return Piece(loss * mb.scale, tuple(grads), trace, new_buffers, pass_state, stats, costate, pending)


def forward(
    r: Span, opts: Options, buffers: tuple[Any, ...], x: Any
) -> tuple[list[Entry], Any, tuple[Any, ...], dict[Any, Any]]:
    """Every stage on ``x`` with no autograd graph kept: ``(entries, x_L, updated buffers, counters)``,
    as ``tape.forward`` leaves them for a plain range (the first stage runs on a copy of ``x``; each
    stage's counters are its reverse step's too)."""
    chain, params, device = r.chain, r.params, r.device
    entries: list[Entry]
    new_buffers: list[Any]
    stats: dict[Any, Any]
    kept, entries, new_buffers, stats = x, [], [], {}
    layout = B.Layout.of_leaves(*B.leaves(x, f"input of {chain.where(0)}"))
    h = x.detach().clone() if isinstance(x, torch.Tensor) else map_tensors(lambda t: t.detach().clone(), x)
    upstream_params = False
    for i, s in enumerate(chain.stages):
        counters = stats[chain.names[i]] = dict.fromkeys(STAGE_COUNTERS if opts.timers else ("boundary_bytes",), 0)
        counters["boundary_bytes"] = B.nbytes(kept)
        simple = s.module is not None and not s.buffer_names and not buffers[i] and s.sharded is None
        frozen = None if simple else s.frozen()
        modes = modes_of(s.module)
        kind = host_kind(s, modes)
        host, rng = HOST.before(kind), rng_state(device)
        inputs = B.flat(h)
        versions = [t._version for t in inputs]
        try:
            with clock_of(opts, counters, s.name, device)("forward"), torch.enable_grad():
                # nothing given requires grad: only a closure can make the output
                ran = module_forward(s, params[i], h) if simple else None
                if ran is None:
                    frozen = s.frozen() if frozen is None else frozen
                    out, updated = s.call(params[i], buffers[i], h)
                else:
                    out, updated, frozen = ran
            flat, spec = (
                ([out], B.TENSOR) if isinstance(out, torch.Tensor) else B.leaves(out, f"output of {chain.where(i)}")
            )
            check_closed_over(chain, i, flat)
        except Exception as e:
            explain(e, chain, i, params[i], h, None)
            note(e, f"the forward of {chain.where(i)}")
            raise
        check_unwritten(chain, i, inputs, versions)
        check_modes(modes, chain.where(i))
        rng = with_host(rng if drew(rng, device) else None, HOST.after(kind, host))
        upstream_params = check_floating(chain, i, params[i], flat, upstream_params)
        out_layout = B.Layout.of_leaves(flat, spec)
        entries.append(Entry(i, kept, layout, out_layout, rng, buffers[i], None, frozen, None, modes))
        new_buffers.append(updated)
        kept = h = out
        layout = out_layout
    return entries, h, tuple(new_buffers), stats


def module_forward(s: Any, params: dict[Any, Any], h: Any) -> tuple[Any, dict[Any, Any], frozenset[str]] | None:
    """``(output, updated buffers, frozen names)`` of a module stage without buffers, as ``Stage.call``
    and ``Stage.frozen`` give them, under one lock and one look-up of its places (``None``: the module
    has a tensor under two names or a name is gone: ``Stage.call``'s ``functional_call``)."""
    with module_lock(s.module):
        slots = s.slots()
        if slots is None:
            return None
        own = slots.put(params)  # the module's own tensors, whose flags say what is frozen
        try:
            out = s.module(h)
        finally:
            slots.put_back(own)
    frozen = frozenset(n for (_, _, n), t in zip(slots.places, own) if t is not None and not t.requires_grad)
    return out, {}, frozen


def reverse_step(
    r: Span, opts: Options, entry: Entry, costate: Any, inputs_too: bool, stats: dict[Any, Any]
) -> tuple[Any, Any]:
    """``(the stage's parameter gradients, the costate of its input)`` from ``costate``, its output's,
    as ``fold.Step.local`` gives them for a digital stage rebuilt from its boundary (the second
    ``None`` without ``inputs_too``: the chain's input, whose costate nobody reads); the rebuild's and
    the vjp's seconds added to ``stats`` with ``timers``."""
    params, s, device = r.params[entry.index], r.chain.stages[entry.index], r.device
    clock = clock_of(opts, stats, s.name, device)

    if (
        not opts.timers  # timed, a module stage takes the rebuild below, which times its two parts
        and isinstance(costate, torch.Tensor)
        and s.module is not None
        and not s.buffer_names
        and lone(entry.layout)
        and lone(entry.out_layout)
        and rebuild_kind(opts, s, entry, [entry.boundary], True, True) is None
    ):
        with module_lock(s.module):
            slots = s.slots()
            if slots is not None:  # a module at given tensors, one floating tensor in and out, rebuilt in full
                with replay_rng(entry.rng, device), in_modes(entry.modes):
                    return module_vjp(s.module, slots, params, entry, costate, inputs_too)
    floats, rebuild, costate_like = B.split_as(entry.boundary, entry.layout)
    flat = B.flat(costate, none_is_leaf=True)
    if all(c is None for c in flat):  # no costate flows here: nothing to do
        return map_tensors(lambda t: None, params), costate_like([None] * len(floats))
    kind = rebuild_kind(opts, s, entry, floats, True, True)

    def attempt(run: Any) -> Any:
        with clock("recompute"), replay_rng(entry.rng, device), in_modes(entry.modes):
            return rebuilt_vjp(s, params, entry, floats, rebuild, run=run)

    pullback = attempt(ES.whole) if kind is None else ES.rebuilt(kind, attempt)
    with clock("vjp"):
        grads, g_in = pullback(V.cotangent(flat, entry.out_layout), inputs_too)
    return grads, None if g_in is None else costate_like(g_in)


def clock_of(opts: Options, stats: dict[Any, Any], name: str | None, device: torch.device) -> Callable[[str], Any]:
    """``clock(part)``: with ``timers``, the seconds of stage ``name``'s ``part`` (``"forward"``,
    ``"recompute"``, ``"vjp"``) added to ``stats[part + "_s"]``; else a context that does nothing
    (made at no cost: a tiny stage's step is counted in microseconds)."""
    if not opts.timers:
        return untimed
    return lambda part: timed(stats, f"{part}_s", f"eae/{name}/{part}", device)


def untimed(part: str) -> Any:
    return NULL


def lone(layout: B.Layout) -> bool:
    """Whether a boundary of this layout is one floating-point tensor."""
    return layout.spec == B.TENSOR and layout.placements[0][1].is_floating_point


def module_vjp(
    module: Any, slots: Any, params: dict[Any, Any], entry: Entry, costate: torch.Tensor, inputs_too: bool
) -> tuple[Any, ...]:
    """``(J_W^T p, J_x^T p or None)`` of a module stage rebuilt from its boundary, one floating tensor in
    and out, as ``vjp.local_vjp`` computes them: the module run on detached, requires-grad copies of
    its trainable parameters (``slots``: their places) and of its input (``J_x^T p`` asked for only
    with ``inputs_too``), one engine call at ``p``."""
    given: dict[Any, torch.Tensor]
    frozen, given = entry.frozen, {}
    with torch.enable_grad():
        for n, t in params.items():
            given[n] = t.detach().requires_grad_(n not in frozen and (t.is_floating_point() or t.is_complex()))
        h = entry.boundary.detach().requires_grad_()  # as the general rebuild: kernels may depend on it
        own = slots.put(given)
        try:
            out = module(h)
        finally:
            slots.put_back(own)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"its rebuild returned {type(out).__name__}, its forward one tensor")
    names, leaves = tuple(given), tuple(given.values())
    wanted = [t for t in leaves if t.requires_grad] + ([h] if inputs_too else [])
    dt = entry.out_layout.placements[0][1]
    grads = iter(V.pull_back(V.places([out]), [costate if costate.dtype == dt else costate.to(dt)], wanted))
    del out
    full = {n: next(grads) if t.requires_grad else None for n, t in zip(names, leaves)}
    if not inputs_too:
        return full, None
    g = next(grads)
    return full, torch.zeros_like(h) if g is None else g
