"""The forward sweep over a stage range and the tape it records for the reverse: one ``Entry`` per
stage (its input boundary as the boundary policy stores it, layouts, the RNG states and modes to
replay, its buffers, and with ``recompute=False`` or ``remat.save`` what it kept of its graph).

    x_l = h_l(W_l, x_{l-1}),  l = lo+1..hi      run without an autograd graph (but kept graphs)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import optree
import torch

from ..program.chain import Chain
from ..program.physical import Meter, rows_of
from ..tree import NAMESPACE, map_tensors
from . import boundary as B
from . import compiled, remat
from . import vjp as V
from .diagnose import check_closed_over, explain, note
from .microbatch import Microbatch
from .options import Options
from .replay import HOST, NULL, autocast, check_modes, drew, host_kind, modes_of, rng_state
from .timing import timer

__all__ = [
    "Entry",
    "Span",
    "STAGE_COUNTERS",
    "Tape",
    "check_floating",
    "check_unwritten",
    "forward",
    "kept_graph",
    "kept_ops",
    "replaying",
    "run_stage",
    "with_host",
]


STAGE_COUNTERS = ("forward_s", "recompute_s", "vjp_s", "pass_s", "boundary_bytes")


@dataclasses.dataclass(frozen=True)
class Span:
    """Stages ``lo..hi-1`` of ``chain`` at ``params`` (one entry per stage of the whole chain), run
    as the bound ``opts`` say on ``device``; ``meter`` counts the physical stages' rows. What a
    forward reads of a range (``runner.Range`` adds the reverse)."""

    chain: Chain
    lo: int
    hi: int
    params: tuple[Any, ...]
    opts: Options
    device: torch.device
    meter: Meter | None = None

    def at(self, mb: Microbatch) -> Options:
        """The options for microbatch ``mb`` (its own key)."""
        return self.opts if mb.key == self.opts.key else dataclasses.replace(self.opts, key=mb.key)


@dataclasses.dataclass(frozen=True)
class Entry:
    """What the forward keeps of stage ``index`` for its reverse step.

    boundary:   its input x_{index} (as stored on the tape; in the compute dtype and
                device once handed out by ``Tape.pop``).
    layout:     shape, dtype and device of the input as computed; ``out_layout`` of its output.
    rng:        the global RNG states the stage saw (replayed by the recompute, ``replay_rng``): torch's,
                and Python's and numpy's where it drew from them; ``None`` if it drew nothing.
    buffers:    the buffers it ran with (the recompute runs on throwaway clones).
    closure:    its vjp closure from the forward (``recompute=False``), else ``None``.
    frozen:     the names of its parameters that are not trained (``requires_grad=False``).
    cached:     with ``remat.save``, the context that hands the rebuild the ops' outputs the forward
                kept, else ``None``.
    modes:      ``(module, training)`` for every module of a module stage as its forward ran
                (``modes_of``): the recompute runs in them again.
    """

    index: int
    boundary: Any
    layout: B.Layout
    out_layout: B.Layout
    rng: tuple[Any, ...] | None
    buffers: Mapping[Any, Any]
    closure: Callable[..., Any] | None = None
    frozen: frozenset[str] = frozenset()
    cached: Any = None
    modes: tuple[Any, ...] = ()


class Tape:
    """The forward sweep's record of stages ``lo..hi-1``: one ``Entry`` per stage, the range's
    output, the buffers it ran with (``ran_with``, one entry per stage of the whole chain), the
    updated buffers and the forward's counters.

    ``pop()`` hands out the last entry once, its boundary loaded back to the compute dtype and
    device, and starts loading the next one (a side CUDA stream with ``offload``);
    ``take_output()`` hands out x_hi once.
    """

    def __init__(self, policy: B.Policy, device: torch.device, ran_with: tuple[Any, ...]):
        self.entries: list[Entry] = []
        self.ran_with = ran_with
        self.output: Any = None
        self.buffers: dict[int, Mapping[Any, Any]] = {}
        self.stats: dict[str, dict[Any, Any]] = {}
        self.policy, self.prefetch = policy, B.Prefetcher(policy, device)
        self.stored_apart = policy.dtype is not None or policy.offload

    def __len__(self) -> int:
        return len(self.entries)

    def pop(self) -> Entry:
        entry = self.entries.pop()
        if not self.stored_apart:  # boundaries kept as computed: nothing to load
            return entry
        loaded = self.prefetch.get(entry.index, entry.boundary, entry.layout)
        if self.entries:
            following = self.entries[-1]
            self.prefetch.start(following.index, following.boundary, following.layout)
        return dataclasses.replace(entry, boundary=loaded)

    def stored(self, out: Any, layout: B.Layout, last: bool) -> tuple[Any, Any]:
        """``(as kept, as fed to the next stage)``: a stage output stored as the boundary policy
        says (the next stage runs on what is stored), except the chain's output (the loss's input)."""
        if last or not self.stored_apart:
            return out, out
        return self.policy.store(out, layout, self.prefetch.stream)

    def take_output(self) -> Any:
        output, self.output = self.output, None
        return output


def forward(r: Span, buffers: tuple[Any, ...], h: Any, opts: Options) -> Tape:
    """Stages ``r.lo..r.hi-1`` of range ``r`` on ``h`` with no autograd graph (except the graphs the
    remat policy keeps), under ``opts`` (the range's, with the microbatch's key).

    ``r.params`` and ``buffers`` have one entry per stage of the whole chain. Boundaries are stored
    as ``opts.boundary`` says, and the next stage runs on exactly what is stored. A stage that
    writes into its input is refused (the first one runs on a copy, so the caller's input is
    never written). ``r.meter`` counts the physical stages' rows.
    """
    chain, lo, hi, params, device, meter = r.chain, r.lo, r.hi, r.params, r.device, r.meter
    kept, layout = h, B.Layout.of_leaves(*B.leaves(h, f"input of {chain.where(lo)}"))
    measured = (
        remat.sizes(chain, (lo, hi, layout, opts.autocast, opts.boundary, opts.recompute.nbytes))
        if opts.recompute.kind == "budget"
        else None
    )
    plan: remat.Plan
    tape, plan = Tape(opts.boundary, device, buffers), opts.recompute.plan(measured)
    if lo == 0:  # the caller's input: the first stage runs on a copy, which a write into it cannot leave
        h = map_tensors(lambda t: t.detach().clone(), h)
    upstream_params = False
    for i in range(lo, hi):
        stats = tape.stats[chain.names[i]] = dict.fromkeys(STAGE_COUNTERS if opts.timers else ("boundary_bytes",), 0)
        stats["boundary_bytes"] = B.nbytes(kept)
        if meter is not None and i in opts.physical:
            meter.charge(i, rows_of(h))
        frozen, modes = chain.stages[i].frozen(), modes_of(chain.stages[i].module)
        kind = host_kind(chain.stages[i], modes)
        host = HOST.before(kind)
        out, (outputs, out_spec), closure, rng, cached, tape.buffers[i] = run_stage(
            r, i, buffers[i], h, opts, plan, stats, frozen
        )
        check_modes(modes, chain.where(i))
        rng = with_host(rng, HOST.after(kind, host))
        upstream_params = check_floating(chain, i, params[i], outputs, upstream_params)
        out_layout = B.Layout.of_leaves(outputs, out_spec)
        tape.entries.append(Entry(i, kept, layout, out_layout, rng, buffers[i], closure, frozen, cached, modes))
        for j in plan.evicted():  # a later graph took its place in the byte budget: rebuild it instead
            tape.entries[j - lo] = dataclasses.replace(tape.entries[j - lo], closure=None)
        kept, h = tape.stored(out, out_layout, last=i == len(chain) - 1)
        layout = out_layout  # the next stage's input has it (a stored copy is loaded back to it)
    tape.output = h
    return tape


def with_host(rng: tuple[Any, ...] | None, host: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """A stage's RNG states to replay: torch's (``rng``), then Python's and numpy's where it drew
    from those (``HostRandom.after``)."""
    return rng if host is None else (*(rng or (None, None)), *host)


def check_floating(chain: Chain, i: int, params: Any, outputs: list[Any], upstream_params: bool) -> bool:
    """Whether stage i or one before it has parameters; refuse an output of integers alone after one
    that has (no costate could reach those parameters)."""
    upstream_params = upstream_params or bool(optree.tree_leaves(params, namespace=NAMESPACE))
    floating = B.is_differentiable(outputs[0]) if len(outputs) == 1 else any(map(B.is_differentiable, outputs))
    if upstream_params and not floating:
        raise TypeError(
            f"output of {chain.where(i)}: only integer tensors "
            f"({', '.join(str(t.dtype) for t in outputs)}), so no costate flows back to the "
            f"parameters before it; a stage must return a floating-point tensor"
        )
    return upstream_params


def check_unwritten(chain: Chain, i: int, inputs: list[Any], versions: list[Any]) -> None:
    """Refuse stage i if it wrote into its input (its tensors' ``versions`` moved): the sweep keeps
    the input to rebuild the stage."""
    if [t._version for t in inputs] != versions:
        raise ValueError(
            f"{chain.where(i)} modified its input in place (e.g. nn.ReLU(inplace=True)); the "
            f"sweep keeps each stage's input to recompute it: use the out-of-place form"
        )


def run_stage(
    r: Span,
    i: int,
    buffers: Mapping[Any, Any],
    h: Any,
    opts: Options,
    plan: remat.Plan,
    stats: dict[Any, Any],
    frozen: frozenset[str],
) -> tuple[Any, tuple[Any, ...], Callable[..., Any] | None, tuple[Any, ...] | None, Any, Mapping[Any, Any]]:
    """Stage i of range ``r`` run forward on ``h``: ``(output, (its leaves, treespec), vjp closure if its graph is kept,
    RNG state to replay or None, the replaying context of the ops' outputs it kept or None, its
    updated buffers)``; its counters are added to ``stats``. The remat ``plan`` says whether the graph is kept
    (a physical stage's never is: its reverse step comes from the estimator) and which ops'
    outputs are (``remat.save``)."""
    chain, params, device = r.chain, r.params[i], r.device
    s = chain.stages[i]
    rng, closure, cached = rng_state(device), None, None
    inputs = B.flat(h)
    versions = [t._version for t in inputs]
    try:
        with timer(opts, stats, "forward_s", f"eae/{s.name}/forward", device), autocast(opts.autocast, device):
            if s.sharded is not None:  # through FSDP at its own parameters; its reverse step rebuilds its graph
                with torch.no_grad():
                    out, updated = s.call(params, buffers, h)
                flat = B.leaves(out, f"output of {chain.where(i)}")
            elif i in opts.physical or plan.rebuilds(i, chain.names[i]):
                saving = None if i in opts.physical else plan.saving(i, chain.names[i])
                with torch.enable_grad():  # nothing given requires grad: only a closure can make the output
                    if saving is not None:
                        out, updated = kept_ops(chain, i, params, buffers, h, saving, frozen)
                        cached = saving.replay  # None where the forward wrote into a kept output
                    elif opts.compile is not None and compiled.eligible(s, i, opts, B.Layout.of(h)):
                        out, updated = compiled.forward(s, opts, params, buffers, h)
                    else:
                        out, updated = s.call(params, buffers, h)
                flat = B.leaves(out, f"output of {chain.where(i)}")
                check_closed_over(chain, i, flat[0])
            else:
                out, closure, updated = kept_graph(chain, i, params, buffers, h, plan, frozen)
                flat = B.leaves(out, f"output of {chain.where(i)}")
    except Exception as e:
        explain(e, chain, i, params, h, opts.autocast)
        note(e, f"the forward of {chain.where(i)}")
        raise
    check_unwritten(chain, i, inputs, versions)
    return out, flat, closure, rng if drew(rng, device) else None, cached, updated


def kept_ops(
    chain: Chain, i: int, params: Any, buffers: Mapping[Any, Any], h: Any, saving: remat.Saving, frozen: frozenset[str]
) -> tuple[Any, Mapping[Any, Any]]:
    """Stage i run as its rebuild will run it (its parameters and inputs requiring grad, as
    ``vjp.local_vjp`` makes them; ``torch.matmul`` picks its kernels by them), the ops ``remat.save``
    names keeping their outputs for the rebuild; its graph let go: ``(detached output, updated buffers)``."""

    def call(p: Any, x: Any) -> tuple[Any, ...]:
        with saving.forward():  # the stage's own ops alone, as ``replaying`` hands them back
            return cast("tuple[Any, ...]", chain.stages[i].call(p, buffers, x))

    floats, rebuild, _ = B.split(h, f"input of {chain.where(i)}")
    check: Callable[[list[Any], Sequence[torch.Tensor]], None] = lambda o, own: check_closed_over(chain, i, o, own)
    out, _, updated = V.local_vjp(call, params, floats, rebuild, frozen, check=check, has_aux=True)
    return map_tensors(torch.Tensor.detach, out), updated


def replaying(cached: Any, run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` (``early_stop``'s) with ``remat.save``'s kept outputs handed to the stage's own ops,
    nothing around them (``cached``: the replaying context, ``None``: none)."""
    if cached is None:
        return run

    def replayed(fn: Callable[..., Any], *args: Any) -> Any:
        with cached:
            return run(fn, *args)

    return replayed


def kept_graph(
    chain: Chain, i: int, params: Any, buffers: Mapping[Any, Any], h: Any, plan: remat.Plan, frozen: frozenset[str]
) -> tuple[Any, Callable[..., Any] | None, Mapping[Any, Any]]:
    """Stage i run with its local graph: ``(detached output, vjp closure or None, updated buffers)``;
    with a byte budget the closure is only kept if its saved tensors fit in what is left."""

    def call(p: Any, x: Any) -> tuple[Any, ...]:
        return cast("tuple[Any, ...]", chain.stages[i].call(p, buffers, x))

    check: Callable[[list[Any], Sequence[torch.Tensor]], None] = lambda o, own: check_closed_over(chain, i, o, own)
    floats, rebuild, _ = B.split(h, f"input of {chain.where(i)}")
    saved = remat.SavedBytes([*optree.tree_leaves(params, namespace=NAMESPACE), *floats]) if plan.counts else None
    with saved.hooks() if saved is not None else NULL:
        out, closure, updated = V.local_vjp(call, params, floats, rebuild, frozen, check=check, has_aux=True)
    if saved is not None and not plan.kept(i, saved.bytes):
        closure = None
    return map_tensors(torch.Tensor.detach, out), closure, updated
