"""The engine: the loss boundary condition and the reverse sweep as a fold over the tape the
forward sweep recorded (``eae_func.core.tape``; think ``jax.lax.scan`` run backwards).

    forward:   x_l = h_l(W_l, x_{l-1}),  l = lo+1..hi      no autograd graph; the tape keeps
                                                            x_{l-1}, its layout and RNG state
    boundary:  p_L = loss_scale * d loss(x_L) / d x_L, then the passes
    reverse:   carry, out_l = step(carry, entry_l),  l = hi..lo+1
    step:      (grad W_l, p_{l-1}) = vjp(h_l at (W_l, x_{l-1}))(p_l), then the passes
               (the stage's graph rebuilt from x_{l-1}, one ``torch.autograd.grad``: ``vjp.local_vjp``)

Everything works on a stage range ``lo..hi``, so ``ef.sweep`` (the whole chain), each
microbatch and every pipeline rank run these same functions. ``reverse`` hands each tape
entry to the step once and keeps no reference to it: the boundary, and the pullback
built from it, are freed when the step returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optree
import torch

from ..adjoint import AdjointState, fold_in
from ..program.chain import Chain
from ..tree import NAMESPACE, map_tensors
from . import boundary as B
from . import compiled, fsdp_reverse
from . import early_stop as ES
from . import vjp as V
from .costates import boundary_name, processed, shown_as, traced
from .diagnose import closed_over, naming, note
from .microbatch import add
from .options import Options
from .replay import autocast, in_modes, replay_rng
from .tape import Entry, Tape, replaying
from .timing import timer

__all__ = [
    "Carry",
    "Deferred",
    "boundary_condition",
    "check_scalar",
    "make_step",
    "rebuild_kind",
    "rebuilt_vjp",
    "reverse",
]


@dataclasses.dataclass(frozen=True)
class Carry:
    """What the fold carries from boundary l to l-1: the record of p_l after the passes
    (its costate feeds stage l's step), the pass state, what the fused updates have made
    so far (``update.Pending``; ``None`` without them) and the record the passes returned
    where the chain shows boundary l (``processed``)."""

    adj: AdjointState
    pass_state: Any
    pending: Any = None
    shown: AdjointState | None = None


@dataclasses.dataclass(frozen=True)
class StepOut:
    """What one step emits: the stage's parameter gradients, the record of its input boundary
    as the trace keeps it (``None``: the chain does not show it), and the step's counters."""

    grads: Any
    record: AdjointState | None
    stats: dict[Any, Any]


# ----------------------------------------------------------------------------- small parts


# ----------------------------------------------------------------------------- the three parts


def boundary_condition(
    chain: Chain,
    h: Any,
    loss_args: tuple[Any, ...],
    opts: Options,
    pass_state: Any,
    loss_scale: float,
    stats: dict[Any, Any],
) -> tuple[torch.Tensor, Carry]:
    """``(loss, carry of p_L)``: p_L = loss_scale * d loss(x_L) / d x_L, through the passes; the loss
    runs under the stages' autocast, as an AMP training step computes it."""
    L = len(chain)
    device = B.device_of(h)
    try:
        with timer(opts, stats, "forward_s", "eae/loss", device), autocast(opts.autocast, device):
            floats, rebuild, costate_like = B.split(h, "input of the loss")
            with torch.enable_grad():
                inputs = [t.detach().requires_grad_() for t in floats]
                loss = chain.loss(rebuild(inputs), *loss_args)
            check_scalar(loss)
            if (outside := closed_over([loss], inputs)) is not None:
                raise ValueError(
                    f"loss: it depends on tensors that require grad besides the chain's output (shapes {outside}), "
                    f"a head or norm it closes over, whose gradients the sweep would silently drop; make it the "
                    f"chain's last stage, or cut the model at run time (capture='run'), where it is glue"
                )
            p = V.pull_back(V.places([loss]), [torch.full_like(loss, loss_scale)], inputs)
    except Exception as e:
        note(e, "the loss")
        raise
    costate = costate_like([torch.zeros_like(t) if g is None else g for g, t in zip(p, inputs)])
    adj = AdjointState(costate, L, boundary_name(chain, L), fold_in(opts.key, L))
    shown = shown_as(chain, adj, opts.key)
    if not opts.no_passes:
        adj, pass_state, shown = processed(chain, opts, adj, pass_state, h, B.Layout.of(h), stats)
    return loss.detach(), Carry(adj, pass_state, shown=shown)


def check_scalar(loss: Any) -> None:
    """Refuse a loss that is not a scalar floating-point tensor."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not B.is_differentiable(loss):
        got = f"shape {tuple(loss.shape)}, {loss.dtype}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss: expected a scalar floating-point tensor, got {got}")


@dataclasses.dataclass(frozen=True)
class Deferred:
    """A stage's parameter gradients ``J_W^T p``, computed when ``compute()`` is called (the W half
    of a zero-bubble backward: the stage rebuilt from its boundary with the input detached)."""

    compute: Callable[[], Any]


def make_step(
    chain: Chain,
    params: tuple[Any, ...],
    opts: Options,
    device: torch.device,
    problem: Any = None,
    updater: Any = None,
    defer_weights: bool = False,
    earlier: list[Any] | None = None,
) -> Callable[[Carry, Entry], tuple[Carry, StepOut]]:
    """The reverse step ``(carry, entry) -> (carry, out)`` of one stage (``Step``).

    A digital stage takes the exact local vjp: its closure from the tape, or one rebuilt from the
    entry's boundary under the replayed RNG state. A physical stage asks the estimator
    (``stage_vjp(problem, prepared, i, h_in, costate)``, fresh randomness, no replay); with
    physical stages, ``opts.estimator.prepare(problem)`` runs here, once. With an ``updater``
    (fused updates), ``pending = updater.apply(carry.pending, i, grads)`` consumes the stage's
    gradients at once, the step emits none and carries the new ``pending``; a failure says which
    stages a torch.optim update had stepped (``updater.note``). With ``defer_weights`` a digital
    stage that is rebuilt from its boundary computes ``J_x^T p`` alone and emits its parameter
    gradients as ``Deferred`` (the I/W split of zero-bubble schedules: the same numbers, the weight
    half run later). With ``earlier`` (one entry
    per stage of the chain: the gradients of earlier microbatches), the step emits its stage's
    gradients plus that entry and lets go of the entry, so one set of gradients is alive at a time.
    """
    prepared = opts.estimator.prepare(problem) if opts.physical else None
    if problem is not None:
        problem.checked()
    observed = opts.keep_costates or not opts.no_passes  # p_0, the chain input's costate, is read by someone
    return Step(chain, params, opts, device, problem, prepared, updater, defer_weights, earlier, observed)


@dataclasses.dataclass(frozen=True)
class Step:
    """One stage's reverse step (``make_step``), its parts: ``local`` (the stage's gradients and the
    costate of its input, by the estimator or a vjp) and what follows it (earlier microbatches'
    gradients added, the fused update, the passes). ``observed``: whether p_0, the costate of the
    chain's input, is read by someone (kept in the trace, or seen by the passes)."""

    chain: Chain
    params: tuple[Any, ...]
    opts: Options
    device: torch.device
    problem: Any
    prepared: Any
    updater: Any
    defer_weights: bool
    earlier: list[Any] | None
    observed: bool

    def __call__(self, carry: Carry, entry: Entry) -> tuple[Carry, StepOut]:
        chain, opts, device, updater = self.chain, self.opts, self.device, self.updater
        pending = carry.pending
        try:
            i, s = entry.index, chain.stages[entry.index]
            stats: dict[Any, Any] = {}
            try:
                grads, costate_in = self.local(entry, carry.adj, stats)
            except Exception as e:
                note(e, f"the reverse step of {chain.where(i)}")
                raise
            if self.earlier is not None:
                before, now = self.earlier[i], grads
                grads, self.earlier[i] = optree.tree_map(add, before, now, none_is_leaf=True, namespace=NAMESPACE), None
            if updater is not None:
                with (
                    timer(opts, stats, "update_s", f"eae/{s.name}/update", device),
                    naming(f"the update of {chain.where(i)}"),
                ):
                    pending = updater.apply(pending, i, grads)
                grads = None
            adj, pass_state = (
                AdjointState(costate_in, i, boundary_name(chain, i), fold_in(opts.key, i)),
                carry.pass_state,
            )
            shown = shown_as(chain, adj, opts.key)
            if i in opts.physical or not opts.no_passes:  # else the step built the costate from the boundary
                adj, pass_state, shown = processed(chain, opts, adj, pass_state, entry.boundary, entry.layout, stats)
            return Carry(adj, pass_state, pending, shown), StepOut(grads, traced(shown, opts), stats)
        except BaseException as e:  # KeyboardInterrupt too: say which stages a torch.optim update had stepped
            if updater is not None:
                updater.note(pending, e)
            raise

    def local(self, entry: Entry, adj: AdjointState, stats: dict[Any, Any]) -> tuple[Any, Any]:
        """``(the stage's parameter gradients, the costate of its input)`` from ``adj``, the costate of
        its output: the estimator's at a physical stage, none where no costate flows (``E.frozen()``
        downstream), else the exact local vjp (``digital``)."""
        i, s, opts, device = entry.index, self.chain.stages[entry.index], self.opts, self.device
        # built from this layout by the previous step, or checked against it (after passes, an estimator
        # or a transfer from another rank)
        costate = B.flat(adj.value, none_is_leaf=True)
        if i in opts.physical:
            with timer(opts, stats, "vjp_s", f"eae/{s.name}/estimate", device), autocast(opts.autocast, device):
                grads, costate_in, cost = opts.estimator.stage_vjp(
                    self.problem, self.prepared, i, entry.boundary, entry.out_layout.spec.unflatten(costate)
                )
                self.problem.checked()
            stats.update(cost)
            if entry.frozen:
                grads = {n: None if n in entry.frozen else g for n, g in grads.items()}
            return grads, costate_in
        if all(c is None for c in costate):  # no costate flows here: nothing to do
            grads = map_tensors(lambda t: None, self.params[i])
            return grads, B.split_as(entry.boundary, entry.layout)[2]([None] * sum(entry.layout.mask))
        return self.digital(entry, costate, stats)

    def digital(self, entry: Entry, costate: list[Any], stats: dict[Any, Any]) -> tuple[Any, Any]:
        """The exact local vjp of a digital stage at ``costate`` (its output's, flat): recompute and vjp
        as one compiled graph where eligible, the weight half deferred (``defer_weights``), or the
        closure the tape kept or one rebuilt from the entry's boundary."""
        i, s, opts, device, params = entry.index, self.chain.stages[entry.index], self.opts, self.device, self.params
        floats, rebuild, costate_like = B.split_as(entry.boundary, entry.layout)
        closure = entry.closure
        done = None
        rebuilt = closure is None and entry.cached is None
        wanted = i > 0 or self.observed
        if rebuilt and compiled.eligible(s, i, opts, entry.layout):  # recompute + vjp: one graph
            with (
                timer(opts, stats, "vjp_s", f"eae/{s.name}/vjp", device),
                replay_rng(entry.rng, device),
                in_modes(entry.modes),
                autocast(opts.autocast, device),
            ):
                done = compiled.reverse(
                    s, opts, params[i], entry.buffers, entry, V.cotangent(costate, entry.out_layout)
                )
        if done is not None:
            grads, g_in = done
        elif rebuilt and self.defer_weights and s.sharded is None:
            cot = V.cotangent(costate, entry.out_layout)
            grads, g_in = self.deferred_vjp(entry, floats, rebuild, cot, wanted, stats)
        else:
            if closure is None:
                closure = self.rebuilt_closure(entry, floats, rebuild, stats)
            with timer(opts, stats, "vjp_s", f"eae/{s.name}/vjp", device):
                grads, g_in = closure(V.cotangent(costate, entry.out_layout), wanted)
        if s.sharded is not None:
            fsdp_reverse.prefetch_below(self.chain, i)
        return grads, None if g_in is None else costate_like(g_in)

    def rebuilt_closure(
        self,
        entry: Entry,
        floats: list[Any],
        rebuild: Callable[..., Any],
        stats: dict[Any, Any],
        params_too: bool = True,
        inputs_too: bool = True,
    ) -> Callable[..., Any]:
        """``rebuilt_vjp`` of the entry's stage under its replayed RNG state, modes and autocast,
        stopped early (``early_stop``) where the options allow and the stage is neither FSDP's nor
        ``remat.save``'s."""
        s, params, opts, device = self.chain.stages[entry.index], self.params[entry.index], self.opts, self.device

        def attempt(run: Callable[..., Any]) -> Callable[..., Any]:
            with (
                timer(opts, stats, "recompute_s", f"eae/{s.name}/recompute", device),
                replay_rng(entry.rng, device),
                in_modes(entry.modes),
                autocast(opts.autocast, device),
            ):
                step = replaying(entry.cached, run)
                return rebuilt_vjp(s, params, entry, floats, rebuild, params_too, inputs_too, step)

        return ES.rebuilt(rebuild_kind(opts, s, entry, floats, params_too, inputs_too), attempt)

    def deferred_vjp(
        self,
        entry: Entry,
        floats: list[Any],
        rebuild: Callable[..., Any],
        cot: list[Any],
        inputs_too: bool,
        stats: dict[Any, Any],
    ) -> tuple[Any, ...]:
        """``(Deferred J_W^T p, J_x^T p)`` of the entry's stage: the input half now (the stage rebuilt
        with its parameters detached; ``None`` without ``inputs_too``), the weight half when the
        ``Deferred`` is computed (rebuilt with its input detached), both under the replayed RNG state."""
        name, opts, device = self.chain.stages[entry.index].name, self.opts, self.device

        def pullback(weights: bool) -> Callable[..., Any]:
            inputs = [f.detach() for f in floats] if weights else floats
            return self.rebuilt_closure(entry, inputs, rebuild, stats, weights, not weights)

        def weights() -> Any:
            rebuilt = pullback(True)
            with timer(opts, stats, "weight_s", f"eae/{name}/weights", device):
                return rebuilt(cot, False)[0]

        if not inputs_too:
            return Deferred(weights), None
        rebuilt = pullback(False)
        with timer(opts, stats, "vjp_s", f"eae/{name}/vjp", device):
            return Deferred(weights), rebuilt(cot, True)[1]


def rebuild_kind(opts: Options, s: Any, entry: Entry, floats: list[Any], params_too: bool, inputs_too: bool) -> Any:
    """The kind ``early_stop`` learns a rebuild of the entry's stage under (``None``: rebuilt in full):
    what its ops depend on, cheaply (the rest, layouts and dtypes, is checked op for op); only where
    the options allow, the stage is neither FSDP's nor ``remat.save``'s and its tail may pay."""
    if not (
        opts.early_stop
        and s.sharded is None
        and entry.cached is None
        and ES.may_pay(floats)
        and not ES.observed(m for m, _ in entry.modes)
    ):
        return None
    return (
        id(s.module if s.module is not None else s.fn),
        tuple(f.shape for f in floats),
        entry.frozen,
        params_too,
        inputs_too,
        opts.autocast,
        entry.modes[0][1] if entry.modes else None,  # the stage's training flag
    )


def rebuilt_vjp(
    s: Any,
    params: Any,
    entry: Entry,
    floats: list[Any],
    rebuild: Callable[..., Any],
    params_too: bool = True,
    inputs_too: bool = True,
    run: Callable[..., Any] = ES.whole,
) -> Callable[..., Any]:
    """The pullback of stage ``s`` rebuilt from its boundary (``floats`` put back by ``rebuild``) at
    ``params`` (``vjp.local_vjp``; the entry's buffers, its frozen parameters held), its forward
    called through ``run`` (``early_stop``); an FSDP stage's runs FSDP's own backward
    (``fsdp_reverse.local_vjp``)."""
    buffers = entry.buffers
    if s.sharded is not None:
        return fsdp_reverse.local_vjp(s, buffers, floats, rebuild)[1]
    call: Callable[[Any, Any], Any] = lambda p, x: run(s.call, p, buffers, x)[0]
    return V.local_vjp(call, params, floats, rebuild, entry.frozen, (params_too, inputs_too))[1]


def reverse(
    step: Callable[[Carry, Entry], tuple[Carry, StepOut]], start: Carry | list[Carry], tape: Tape
) -> tuple[Carry, tuple[StepOut, ...]]:
    """The fold: ``step`` over the tape's entries, last first, each handed out once, from ``start``,
    the carry at boundary hi, or a one-element list holding it, which the fold empties: then no
    caller's reference keeps p_hi alive while the stages below it run.

    Returns the final carry (boundary lo) and the outputs in stage order lo..hi-1.
    """
    outputs: list[StepOut]
    carry, outputs = (start.pop() if isinstance(start, list) else start), []
    while len(tape):
        carry, out = step(carry, tape.pop())
        outputs.append(out)
    return carry, tuple(reversed(outputs))
