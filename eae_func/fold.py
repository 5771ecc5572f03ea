"""The engine: a forward sweep that records a tape, the loss boundary condition, and the
reverse sweep as a fold over the tape (think ``jax.lax.scan`` run backwards).

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

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import optree
import torch
from torch.profiler import record_function

from . import boundary as B
from . import compiled, fsdp, remat
from . import early_stop as ES
from . import vjp as V
from .adjoint import AdjointState, fold_in
from .chain import Chain
from .lazy import event_seconds
from .microbatch import add
from .options import Options
from .passes import Context
from .physical import Meter, rows_of
from .replay import HOST, NULL, autocast, check_modes, drew, host_kind, in_modes, modes_of, replay_rng, rng_state
from .tree import NAMESPACE

__all__ = [
    "Carry",
    "Deferred",
    "Tape",
    "boundary_condition",
    "boundary_name",
    "check_costate",
    "check_scalar",
    "closed_over",
    "device_of",
    "forward",
    "make_step",
    "note",
    "reverse",
    "timer",
    "traced",
]


STAGE_COUNTERS = ("forward_s", "recompute_s", "vjp_s", "pass_s", "boundary_bytes")


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
    rng: tuple | None
    buffers: Mapping
    closure: Callable | None = None
    frozen: frozenset[str] = frozenset()
    cached: Any = None
    modes: tuple = ()


class Tape:
    """The forward sweep's record of stages ``lo..hi-1``: one ``Entry`` per stage, the range's
    output, the updated buffers and the forward's counters.

    ``pop()`` hands out the last entry once, its boundary loaded back to the compute dtype and
    device, and starts loading the next one (a side CUDA stream with ``offload``);
    ``take_output()`` hands out x_hi once.
    """

    def __init__(self, policy: B.Policy, device: torch.device):
        self.entries: list[Entry] = []
        self.output: Any = None
        self.buffers: dict[int, Mapping] = {}
        self.stats: dict[str, dict] = {}
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
    stats: dict


# ----------------------------------------------------------------------------- small parts


def boundary_name(chain: Chain, l: int) -> str:
    """The ``stage`` field of boundary l's record: the stage whose output it is, ``"input"`` at 0."""
    return chain.names[l - 1] if l > 0 else "input"


def device_of(*trees: Any, default: torch.device = torch.device("cpu")) -> torch.device:
    """Where the stages compute: the device of the first tensor of ``trees`` (the params first)."""
    for tree in trees:
        first = first_tensor(tree)
        if first is not None:
            return first.device
    return default


def first_tensor(tree: Any) -> torch.Tensor | None:
    """The first tensor leaf of ``tree`` in optree's order, found without flattening all of a tuple."""
    if isinstance(tree, torch.Tensor):
        return tree
    if isinstance(tree, (tuple, list)):
        return next((t for t in map(first_tensor, tree) if t is not None), None)
    return next((t for t in optree.tree_leaves(tree, namespace=NAMESPACE) if isinstance(t, torch.Tensor)), None)


class timed:  # noqa: N801 - used as a context manager, like contextlib's
    """Add the seconds of the block to ``stats[key]``, inside a profiler range ``label`` while a
    profiler runs (a range costs about as much as a tiny stage's kernel, so none is opened otherwise).
    On a CUDA ``device`` the seconds are the GPU's, between two CUDA events, read only when used
    (``Lazy``): the host only queues the work, so its clock would measure the launches."""

    __slots__ = ("stats", "key", "label", "range", "start", "cuda")

    def __init__(self, stats: dict, key: str, label: str, device: torch.device | None = None):
        self.stats, self.key, self.label, self.range = stats, key, label, None
        self.cuda = device is not None and device.type == "cuda"

    def __enter__(self):
        if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
            self.range = record_function(self.label)
            self.range.__enter__()
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.stats[self.key] = self.stats.get(self.key, 0) + event_seconds(self.start, end)
        else:
            self.stats[self.key] = self.stats.get(self.key, 0) + time.perf_counter() - self.start
        if self.range is not None:
            self.range.__exit__(*exc)


def timer(opts: Options, stats: dict, key: str, label: str, device: torch.device | None = None):
    """``timed(stats, key, label, device)`` if ``opts.timers``, else a context that does nothing."""
    return timed(stats, key, label, device) if opts.timers else NULL


def note(e: Exception, what: str) -> None:
    """Add ``what`` (the stage or boundary) as a note to ``e``."""
    e.add_note(f"(eae_func: in {what})")


@contextlib.contextmanager
def naming(what: str):
    """Add ``what`` as a note to any exception raised in the block (hot paths use ``note`` in an
    ``except``, which costs nothing until something fails)."""
    try:
        yield
    except Exception as e:
        note(e, what)
        raise


def explain(e: Exception, chain: Chain, i: int, params: Any, h: Any, autocast_dtype: torch.dtype | None) -> None:
    """When stage i failed on an input whose dtype or device differs from its params', add a note
    saying which stage made that input (a black box returning float64, or data on another device)."""
    floats = [
        t for t in optree.tree_leaves(h, namespace=NAMESPACE) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    weights = [
        t
        for t in optree.tree_leaves(params, namespace=NAMESPACE)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    if floats and weights:
        got, want = (floats[0].dtype, floats[0].device), (weights[0].dtype, weights[0].device)
        if got[1] != want[1] or (got[0] != want[0] and autocast_dtype is None):
            source = f"the output of {chain.where(i - 1)}" if i > 0 else "the chain's input"
            e.add_note(
                f"(eae_func: the input of {chain.where(i)} is {got[0]} on {got[1]}, its params are "
                f"{want[0]} on {want[1]}: {source} must be {want[0]} on {want[1]})"
            )


def check_closed_over(chain: Chain, i: int, outputs: list, own: Sequence[torch.Tensor] = ()) -> None:
    """Refuse ``outputs`` (stage i's output leaves) that depend on a tensor requiring grad other than
    ``own`` (the stage's params and input as the sweep gave them): stage i then closes over, say, a
    module's weights, whose gradient the sweep would silently drop. With no ``own`` tensors, any output
    requiring grad is one."""
    leaves = closed_over(outputs, own)
    if leaves is None:
        return
    raise ValueError(
        f"{chain.where(i)}: its output depends on a tensor that requires grad but is not among its "
        f"params (shapes {leaves or 'unknown'}): a stage that closes over a module's weights would get "
        f"no gradient for them; pass them in params (ef.from_module, or functional_call on them)"
    )


def closed_over(outputs: Sequence, own: Sequence[torch.Tensor] = (), data: Sequence[torch.Tensor] = ()) -> list | None:
    """The shapes of up to three leaf tensors requiring grad, other than ``own``, that ``outputs``
    depend on (``[]``: some, unknown; ``None``: none). A view of one of the ``data`` tensors (the
    inputs) made a leaf that requires grad inside the forward (``x[:, None]``, as HuBERT's feature
    encoder makes) is not counted: no caller holds it."""
    grad_fns = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not grad_fns:
        return None
    mine = {id(t) for t in own}
    inputs = {t.untyped_storage().data_ptr() for t in data if isinstance(t, torch.Tensor)}
    leaves, seen, todo = [], set(), [f for f in grad_fns if f is not None]
    while todo and len(leaves) < 3:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf tensor
        if (
            variable is not None
            and id(variable) not in mine
            and not (variable._base is not None and variable.untyped_storage().data_ptr() in inputs)
        ):
            leaves.append(tuple(variable.shape))
        todo += [f for f, _ in fn.next_functions if f is not None]
    return None if mine and not leaves else leaves


def check_costate(chain: Chain, l: int, adj: Any, layout: B.Layout) -> list:
    """The leaves of the costate at boundary ``l`` (``None`` where a boundary leaf has none),
    checked against the boundary's ``layout``: a record, of the boundary's structure and shapes."""
    where_ = (
        "costate at boundary 0 (the chain's input)"
        if l == 0
        else f"costate entering {chain.where(l - 1)} at boundary {l}"
    )
    what = "the chain's input" if l == 0 else "the stage output"
    if not isinstance(adj, AdjointState):
        raise TypeError(f"{where_}: a pass returned {type(adj).__name__}, expected an AdjointState")
    flat, spec = optree.tree_flatten(adj.value, none_is_leaf=True, namespace=NAMESPACE)
    if spec != layout.costate_spec:
        raise ValueError(f"{where_}: costate structure {spec} differs from {what} {layout.costate_spec}")
    for t, shape in zip(flat, layout.shapes):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where_}: costate shape {got} differs from {what} shape {tuple(shape)}")
    return flat


def processed(
    chain: Chain, opts: Options, adj: AdjointState, pass_state: Any, boundary: Any, layout: B.Layout, stats: dict
) -> tuple[AdjointState, Any, AdjointState | None]:
    """``(adj, pass_state, record)``: boundary l's costate after the passes, where the chain shows the
    boundary (``Chain.showing``: the passes see the record of its shown part, under its shown index,
    name and key), checked against the boundary's ``layout``; ``record``: what the passes returned
    (``None``: the boundary is not shown, and nothing ran). The sweep skips this for a costate it
    built from the boundary itself when there are no passes."""
    l = adj.index
    shown = chain.showing(l)
    if shown is None:
        check_costate(chain, l, adj, layout)  # an estimator's or another rank's costate all the same
        return adj, pass_state, None
    record = (  # a chain that shows every boundary as itself passes the record it has
        adj
        if chain.shown is None
        else AdjointState(part(adj.value, shown.keys), shown.index, shown.name, fold_in(opts.key, shown.index))
    )
    ctx = Context(part(boundary, shown.keys), chain.stages[l - 1] if l > 0 else None, opts.key)
    try:
        with timer(opts, stats, "pass_s", f"eae/{shown.name}/passes", layout.placements[0][0]):
            out = opts.passes.update(record, pass_state, ctx)
    except Exception as e:
        note(e, f"the passes at boundary {shown.index} ({shown.name!r})")
        raise
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"pass {opts.passes.name!r} at boundary {shown.index} ({shown.name!r}): update must return "
            f"(AdjointState, state), got {type(out).__name__}"
        )
    if not isinstance(out[0], AdjointState):
        check_costate(chain, l, out[0], layout)  # raises, naming what it got
    full = adj.replace(value=with_part(adj.value, shown.keys, out[0].value))
    flat = check_costate(chain, l, full, layout)
    given = optree.tree_leaves(adj.value, none_is_leaf=True, namespace=NAMESPACE)
    if any(t is None and g is not None for t, g in zip(flat, given)):
        at = "the chain's input" if l == 0 else f"output of {chain.where(l - 1)}"
        raise ValueError(
            f"pass {opts.passes.name!r} at boundary {shown.index} ({at}): returned value=None for a costate that "
            f"was a tensor, which would silently zero every gradient upstream of it; return a costate "
            f"(adj.replace(value=torch.zeros_like(adj.value)) stops the signal on purpose)"
        )
    return full, out[1], out[0]


def shown_as(chain: Chain, adj: AdjointState, key: int) -> AdjointState | None:
    """The record of boundary ``adj.index`` as the chain shows it when no pass runs (``processed``)."""
    if chain.shown is None:
        return adj
    shown = chain.showing(adj.index)
    if shown is None:
        return None
    value = None if adj.value is None else part(adj.value, shown.keys)
    return AdjointState(value, shown.index, shown.name, fold_in(key, shown.index))


def part(tree: Any, keys: tuple[str, ...] | None) -> Any:
    """The entries ``keys`` of a boundary (its state or its costate): one as itself, several as a
    tuple; ``None``: the whole boundary."""
    if keys is None:
        return tree
    return tree[keys[0]] if len(keys) == 1 else tuple(tree[k] for k in keys)


def with_part(costate: Any, keys: tuple[str, ...] | None, value: Any) -> Any:
    """``costate`` with its entries ``keys`` replaced by ``value`` (as ``part`` gives them); a value of
    another structure is returned as it is, for ``check_costate`` to name."""
    if keys is None:
        return value
    parts = (value,) if len(keys) == 1 else value
    if not isinstance(parts, tuple) or len(parts) != len(keys):
        return value
    return {**costate, **dict(zip(keys, parts))}


def traced(adj: AdjointState | None, opts: Options) -> AdjointState | None:
    """The record as the trace keeps it: without its costate unless ``keep_costates``."""
    if adj is None or opts.keep_costates:
        return adj
    return AdjointState(None, adj.index, adj.stage, adj.key, adj.history, adj.meta)


# ----------------------------------------------------------------------------- the three parts


def forward(
    chain: Chain,
    lo: int,
    hi: int,
    params: tuple,
    buffers: tuple,
    h: Any,
    opts: Options,
    device: torch.device,
    meter: Meter | None = None,
) -> Tape:
    """Stages ``lo..hi-1`` on ``h`` with no autograd graph (except the graphs the remat policy keeps).

    ``params`` and ``buffers`` have one entry per stage of the whole chain. Boundaries are stored
    as ``opts.boundary`` says, and the next stage runs on exactly what is stored. A stage that
    writes into its input is refused (the first one runs on a copy, so the caller's input is
    never written). ``meter`` counts the physical stages' rows.
    """
    kept, layout = h, B.Layout.of_leaves(*B.leaves(h, f"input of {chain.where(lo)}"))
    measured = (
        remat.sizes(chain, (lo, hi, layout, opts.autocast, opts.boundary, opts.recompute.nbytes))
        if opts.recompute.kind == "budget"
        else None
    )
    tape, plan = Tape(opts.boundary, device), opts.recompute.plan(measured)
    if lo == 0:  # the caller's input: the first stage runs on a copy, which a write into it cannot leave
        h = optree.tree_map(lambda t: t.detach().clone(), h, namespace=NAMESPACE)
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
            chain, i, params[i], buffers[i], h, opts, device, plan, stats, frozen
        )
        check_modes(modes, chain.where(i))
        host = HOST.after(kind, host)
        if host is not None:
            rng = (*(rng or (None, None)), *host)
        upstream_params = upstream_params or bool(optree.tree_leaves(params[i], namespace=NAMESPACE))
        if upstream_params and not any(B.is_differentiable(t) for t in outputs):
            raise TypeError(
                f"output of {chain.where(i)}: only integer tensors "
                f"({', '.join(str(t.dtype) for t in outputs)}), so no costate flows back to the "
                f"parameters before it; a stage must return a floating-point tensor"
            )
        out_layout = B.Layout.of_leaves(outputs, out_spec)
        tape.entries.append(Entry(i, kept, layout, out_layout, rng, buffers[i], closure, frozen, cached, modes))
        for j in plan.evicted():  # a later graph took its place in the byte budget: rebuild it instead
            tape.entries[j - lo] = dataclasses.replace(tape.entries[j - lo], closure=None)
        kept, h = tape.stored(out, out_layout, last=i == len(chain) - 1)
        layout = out_layout  # the next stage's input has it (a stored copy is loaded back to it)
    tape.output = h
    return tape


def run_stage(
    chain: Chain,
    i: int,
    params: Any,
    buffers: Mapping,
    h: Any,
    opts: Options,
    device: torch.device,
    plan: remat.Plan,
    stats: dict,
    frozen: frozenset[str],
) -> tuple[Any, tuple, Callable | None, tuple | None, Any, Mapping]:
    """Stage i's forward on ``h``: ``(output, (its leaves, treespec), vjp closure if its graph is kept,
    RNG state to replay or None, the replaying context of the ops' outputs it kept or None, its
    updated buffers)``; its counters are added to ``stats``. The remat ``plan`` says whether the graph is kept
    (a physical stage's never is: its reverse step comes from the estimator) and which ops'
    outputs are (``remat.save``)."""
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
    if [t._version for t in inputs] != versions:
        raise ValueError(
            f"{chain.where(i)} modified its input in place (e.g. nn.ReLU(inplace=True)); the "
            f"sweep keeps each stage's input to recompute it: use the out-of-place form"
        )
    return out, flat, closure, rng if drew(rng, device) else None, cached, updated


def kept_ops(
    chain: Chain, i: int, params: Any, buffers: Mapping, h: Any, saving: remat.Saving, frozen: frozenset[str]
) -> tuple[Any, Mapping]:
    """Stage i run as its rebuild will run it (its parameters and inputs requiring grad, as
    ``vjp.local_vjp`` makes them; ``torch.matmul`` picks its kernels by them), the ops ``remat.save``
    names keeping their outputs for the rebuild; its graph let go: ``(detached output, updated buffers)``."""

    def call(p: Any, x: Any) -> tuple:
        with saving.forward():  # the stage's own ops alone, as ``replaying`` hands them back
            return chain.stages[i].call(p, buffers, x)

    floats, rebuild, _ = B.split(h, f"input of {chain.where(i)}")
    check = lambda o, own: check_closed_over(chain, i, o, own)
    out, _, updated = V.local_vjp(call, params, floats, rebuild, frozen, check=check, has_aux=True)
    return optree.tree_map(torch.Tensor.detach, out, namespace=NAMESPACE), updated


def replaying(cached: Any, run: Callable) -> Callable:
    """``run`` (``early_stop``'s) with ``remat.save``'s kept outputs handed to the stage's own ops,
    nothing around them (``cached``: the replaying context, ``None``: none)."""
    if cached is None:
        return run

    def replayed(fn: Callable, *args: Any) -> Any:
        with cached:
            return run(fn, *args)

    return replayed


def kept_graph(
    chain: Chain, i: int, params: Any, buffers: Mapping, h: Any, plan: remat.Plan, frozen: frozenset[str]
) -> tuple[Any, Callable | None, Mapping]:
    """Stage i run with its local graph: ``(detached output, vjp closure or None, updated buffers)``;
    with a byte budget the closure is only kept if its saved tensors fit in what is left."""
    floats, rebuild, _ = B.split(h, f"input of {chain.where(i)}")
    saved = remat.SavedBytes([*optree.tree_leaves(params, namespace=NAMESPACE), *floats]) if plan.counts else None
    with saved.hooks() if saved is not None else NULL:
        out, closure, updated = V.local_vjp(
            lambda p, x: chain.stages[i].call(p, buffers, x),
            params,
            floats,
            rebuild,
            frozen,
            check=lambda o, own: check_closed_over(chain, i, o, own),
            has_aux=True,
        )
    if saved is not None and not plan.kept(i, saved.bytes):
        closure = None
    return optree.tree_map(torch.Tensor.detach, out, namespace=NAMESPACE), closure, updated


def boundary_condition(
    chain: Chain, h: Any, loss_args: tuple, opts: Options, pass_state: Any, loss_scale: float, stats: dict
) -> tuple[torch.Tensor, Carry]:
    """``(loss, carry of p_L)``: p_L = loss_scale * d loss(x_L) / d x_L, through the passes; the loss
    runs under the stages' autocast, as an AMP training step computes it."""
    L = len(chain)
    device = device_of(h)
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
    params: tuple,
    opts: Options,
    device: torch.device,
    problem: Any = None,
    updater: Any = None,
    defer_weights: bool = False,
    earlier: list | None = None,
) -> Callable[[Carry, Entry], tuple[Carry, StepOut]]:
    """The reverse step ``(carry, entry) -> (carry, out)`` of one stage.

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
    observed = opts.keep_costates or not opts.no_passes  # p_0, the chain input's costate, is read by someone

    def step(carry: Carry, entry: Entry) -> tuple[Carry, StepOut]:
        pending = carry.pending
        try:
            i, s = entry.index, chain.stages[entry.index]
            physical, stats = i in opts.physical, {}
            # built from this layout by the previous step, or checked against it (after passes, an estimator
            # or a transfer from another rank)
            costate = B.flat(carry.adj.value, none_is_leaf=True)
            try:
                if physical:
                    with timer(opts, stats, "vjp_s", f"eae/{s.name}/estimate", device), autocast(opts.autocast, device):
                        grads, costate_in, cost = opts.estimator.stage_vjp(
                            problem, prepared, i, entry.boundary, entry.out_layout.spec.unflatten(costate)
                        )
                    stats.update(cost)
                    if entry.frozen:
                        grads = {n: None if n in entry.frozen else g for n, g in grads.items()}
                elif all(c is None for c in costate):  # no costate flows here (E.frozen() downstream): nothing to do
                    grads = optree.tree_map(lambda t: None, params[i], namespace=NAMESPACE)
                    costate_in = B.split_as(entry.boundary, entry.layout)[2]([None] * sum(entry.layout.mask))
                else:
                    floats, rebuild, costate_like = B.split_as(entry.boundary, entry.layout)
                    closure = entry.closure
                    done = None
                    rebuilt = closure is None and entry.cached is None
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
                    elif rebuilt and defer_weights and s.sharded is None:
                        cot = V.cotangent(costate, entry.out_layout)
                        grads, g_in = deferred_vjp(
                            s, params[i], entry, floats, rebuild, cot, i > 0 or observed, opts, stats, device
                        )
                    else:
                        if closure is None:
                            closure = rebuilt_closure(s, params[i], entry, floats, rebuild, opts, stats, device)
                        with timer(opts, stats, "vjp_s", f"eae/{s.name}/vjp", device):
                            grads, g_in = closure(V.cotangent(costate, entry.out_layout), i > 0 or observed)
                    if s.sharded is not None:
                        fsdp.prefetch_below(chain, i)
                    costate_in = None if g_in is None else costate_like(g_in)
            except Exception as e:
                note(e, f"the reverse step of {chain.where(i)}")
                raise
            if earlier is not None:
                before, now = earlier[i], cast(Any, grads)
                grads, earlier[i] = optree.tree_map(add, before, now, none_is_leaf=True, namespace=NAMESPACE), None
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
            if physical or not opts.no_passes:  # else the step built the costate from the boundary: nothing to do
                adj, pass_state, shown = processed(chain, opts, adj, pass_state, entry.boundary, entry.layout, stats)
            return Carry(adj, pass_state, pending, shown), StepOut(grads, traced(shown, opts), stats)
        except BaseException as e:  # KeyboardInterrupt too: say which stages a torch.optim update had stepped
            if updater is not None:
                updater.note(pending, e)
            raise

    return step


def rebuilt_vjp(
    s: Any,
    params: Any,
    buffers: Mapping,
    floats: list,
    rebuild: Callable,
    frozen: frozenset[str],
    params_too: bool = True,
    inputs_too: bool = True,
    run: Callable = ES.whole,
) -> Callable:
    """The pullback of stage ``s`` rebuilt from its boundary (``floats`` put back by ``rebuild``) at
    ``params`` (``vjp.local_vjp``), its forward called through ``run`` (``early_stop``); an FSDP
    stage's runs FSDP's own backward (``fsdp.local_vjp``)."""
    if s.sharded is not None:
        return fsdp.local_vjp(s, buffers, floats, rebuild)[1]
    call = lambda p, x: run(s.call, p, buffers, x)[0]
    return V.local_vjp(call, params, floats, rebuild, frozen, params_too, inputs_too)[1]


def rebuilt_closure(
    s: Any,
    params: Any,
    entry: Entry,
    floats: list,
    rebuild: Callable,
    opts: Options,
    stats: dict,
    device: torch.device,
    params_too: bool = True,
    inputs_too: bool = True,
) -> Callable:
    """``rebuilt_vjp`` under the stage's replayed RNG state, modes and autocast, stopped early
    (``early_stop``) where the options allow and the stage is neither FSDP's nor ``remat.save``'s."""

    def attempt(run: Callable) -> Callable:
        with (
            timer(opts, stats, "recompute_s", f"eae/{s.name}/recompute", device),
            replay_rng(entry.rng, device),
            in_modes(entry.modes),
            autocast(opts.autocast, device),
        ):
            step = replaying(entry.cached, run)
            return rebuilt_vjp(s, params, entry.buffers, floats, rebuild, entry.frozen, params_too, inputs_too, step)

    kind = None  # the rebuild's kind for early_stop (None: in full)
    if (
        opts.early_stop
        and s.sharded is None
        and entry.cached is None
        and ES.may_pay(floats)
        and not ES.observed(m for m, _ in entry.modes)
    ):
        kind = (  # what a rebuild's ops depend on, cheaply (the rest, layouts and dtypes, is checked op for op)
            id(s.module if s.module is not None else s.fn),
            tuple(f.shape for f in floats),
            entry.frozen,
            params_too,
            inputs_too,
            opts.autocast,
            entry.modes[0][1] if entry.modes else None,  # the stage's training flag
        )
    return ES.rebuilt(kind, attempt)


def deferred_vjp(
    s: Any,
    params: Any,
    entry: Entry,
    floats: list,
    rebuild: Callable,
    cot: list,
    inputs_too: bool,
    opts: Options,
    stats: dict,
    device: torch.device,
) -> tuple:
    """``(Deferred J_W^T p, J_x^T p)`` of one stage: the input half now (the stage rebuilt with its
    parameters detached; ``None`` without ``inputs_too``), the weight half when the ``Deferred`` is
    computed (rebuilt with its input detached), both under the replayed RNG state."""

    def pullback(weights: bool) -> Callable:
        inputs = [f.detach() for f in floats] if weights else floats
        return rebuilt_closure(s, params, entry, inputs, rebuild, opts, stats, device, weights, not weights)

    def weights() -> Any:
        rebuilt = pullback(True)
        with timer(opts, stats, "weight_s", f"eae/{s.name}/weights", device):
            return rebuilt(cot, False)[0]

    if not inputs_too:
        return Deferred(weights), None
    rebuilt = pullback(False)
    with timer(opts, stats, "vjp_s", f"eae/{s.name}/vjp", device):
        return Deferred(weights), rebuilt(cot, True)[1]


def reverse(
    step: Callable[[Carry, Entry], tuple[Carry, StepOut]], start: Carry | list[Carry], tape: Tape
) -> tuple[Carry, tuple[StepOut, ...]]:
    """The fold: ``step`` over the tape's entries, last first, each handed out once, from ``start``,
    the carry at boundary hi, or a one-element list holding it, which the fold empties: then no
    caller's reference keeps p_hi alive while the stages below it run.

    Returns the final carry (boundary lo) and the outputs in stage order lo..hi-1.
    """
    carry, outputs = (start.pop() if isinstance(start, list) else start), []
    while len(tape):
        carry, out = step(carry, tape.pop())
        outputs.append(out)
    return carry, tuple(reversed(outputs))
