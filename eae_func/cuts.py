"""Run-time cuts: a model's own forward runs as written, and each call of a module matched by
``split_at`` is one stage, as ``torch.utils.checkpoint`` cuts a model.

    call of a matched module m on inputs a (stage l, in call order):
        keep a (detached; RNG and autocast state; m's buffers as they were), run m under no_grad
        and return its outputs x_l through one autograd node whose inputs are a's leaves that
        require grad
    loss.backward-like driver: ``torch.autograd.grad(loss, params)`` differentiates the glue
        (embeddings, masks, rotary tables, head, loss) and, at each node, runs stage l's reverse step:
        p_l through the passes; m rebuilt at the params it ran with (RNG, autocast and modes replayed,
        buffers on throwaway clones); (J_W^T p_l, J_a^T p_l) by one ``torch.autograd.grad``
        (``vjp.pull_back``); J_W^T p_l added to the parameters' gradients (frozen ones excluded),
        J_a^T p_l handed back to autograd

Nothing is traced or cached: hooks, custom ``autograd.Function`` backwards, data-dependent control
flow (MoE routing) and Python state behave as in eager PyTorch; a module called twice is two stages
whose parameter gradients are summed. A cut inside another cut's call runs as part of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import nn

from . import boundary as B
from . import capture
from . import early_stop as ES
from . import fold as F
from . import microbatch as M
from . import vjp as V
from .adjoint import AdjointState, Measurements, fold_in
from .capture import as_call, canonical_names, matches
from .chain import Slots, module_lock, through_hooks, trainable_names
from .options import Options
from .passes import Context

_ACTIVE = threading.local()  # .depth: > 0 while a cut module runs (its forward or its rebuild) on this thread


def needs_graph(opts: Options) -> list[str]:
    """The options set in ``opts`` that only a chain (graph capture) implements."""
    default = Options()
    given = [
        n
        for n in ("microbatches", "estimator", "budget", "update", "boundary_dtype", "offload", "compile")
        if getattr(opts, n) != getattr(default, n)
    ]
    if opts.physical:
        given.append("physical")
    if opts.recompute != default.recompute:
        given.append("recompute")
    if opts.data_parallel not in (None, False):
        given.append("data_parallel")
    return given


@dataclasses.dataclass
class Call:
    """One call of a cut module, what its reverse step needs: the call's input leaves (detached) and
    their ``spec``, which of them require grad (``inputs``), the tensors the module held in its
    parameters' places (the sweep's leaves, by the module's own names, aliases included), its buffers
    as they were before the call, torch's RNG and the autocast state, the modes of its modules
    (``fold.modes_of``), Python's and numpy's generator states where the module draws from them
    (``HostRandom``); after the forward, which output leaves are tensors and the output's spec."""

    index: int
    name: str
    module: nn.Module
    forward: Callable
    leaves: list
    spec: Any
    inputs: list
    params: dict
    buffers: dict
    rng: tuple | None
    autocast: tuple
    modes: tuple
    host: tuple | None = None
    sums: list | None = None
    out_spec: Any = None
    out_tensors: tuple = ()


class Sweep:
    """One sweep over a model with run-time cuts: the cut modules' forwards replaced for its duration,
    the calls so far, the pass state, the cut stages' parameter gradients (by the sweep's leaf
    tensor's id), the trace and the stats."""

    def __init__(self, model: nn.Module, split_at: Sequence[str], opts: Options, pass_state: Any, device: Any):
        self.opts, self.pass_state, self.device = opts, pass_state, device
        self.names = cut_modules(model, split_at)
        self.calls: dict[str, int] = {}
        self.ungraded: set[str] = set()
        self.count = 0
        self.grads: dict[int, torch.Tensor] = {}
        self.trace: list[AdjointState] = []
        self.stats: dict[str, dict] = {}
        # an input of every cut's node: autograd runs only the nodes on a path to an input it is asked
        # for, and a cut whose parameters no glue reads is on the path to this one alone
        self.anchor = torch.empty(0, requires_grad=True)

    @contextlib.contextmanager
    def installed(self):
        """The cut modules' ``forward`` replaced by a cut (an instance attribute, so the module's hooks
        run around it and a ``module.forward(x)`` call goes through it too), put back on exit."""
        replaced = []
        try:
            for name, module in self.names.items():
                replaced.append((module, module.__dict__.get("forward")))
                module.forward = self.cut(name, module, module.forward)
            yield
        finally:
            for module, own in replaced:
                if own is None:
                    del module.forward
                else:
                    module.forward = own

    def cut(self, name: str, module: nn.Module, forward: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if getattr(_ACTIVE, "depth", 0):  # inside a cut: part of its call
                return forward(*args, **kwargs)
            if not torch.is_grad_enabled():  # no graph wanted (a custom Function's forward, no_grad)
                self.ungraded.add(name)
                return forward(*args, **kwargs)
            return self.stage(name, module, forward, args, kwargs)

        return call

    def stage(self, name: str, module: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """The next stage: this call of ``module``, run without a graph, its output through one node."""
        k = self.calls[name] = self.calls.get(name, 0) + 1
        self.count += 1
        leaves, spec = pytree.tree_flatten((args, kwargs))
        call = Call(
            self.count,
            name if k == 1 else f"{name}#{k}",
            module,
            forward,
            [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves],
            spec,
            [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad],
            dict(module.named_parameters(remove_duplicate=False)),
            {n: b.detach().clone() for n, b in module.named_buffers(remove_duplicate=False)},
            F.rng_state(self.device),
            autocast_state(self.device),
            F.modes_of(module),
        )
        call.host = HOST.before(module)
        tensors = StageCall.apply(self, call, self.anchor, *[leaves[i] for i in call.inputs])
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if t else None for t in call.out_tensors], call.out_spec)

    def run_forward(self, call: Call) -> list:
        """The call without a graph: its output's tensor leaves."""
        args, kwargs = pytree.tree_unflatten(call.leaves, call.spec)
        stats = self.stats.setdefault(call.name, {})
        _ACTIVE.depth = getattr(_ACTIVE, "depth", 0) + 1
        seed = torch.initial_seed()
        try:
            with F.timer(self.opts, stats, "forward_s", f"eae/{call.name}/forward"), torch.no_grad():
                out = call.forward(*args, **kwargs)
            if torch.initial_seed() != seed:  # it seeds torch's generator itself (torch.seed(): Reformer)
                call.sums = sums(out)  # which the rebuild cannot replay: it must come to the same outputs
        except Exception as e:
            F.note(e, f"the forward of cut {call.name!r}")
            raise
        finally:
            _ACTIVE.depth -= 1
        if call.rng is not None and not F.drew(call.rng, self.device):
            call.rng = None
        call.host = HOST.after(call.module, call.host)
        leaves, call.out_spec = pytree.tree_flatten(out)
        call.out_tensors = tuple(isinstance(t, torch.Tensor) for t in leaves)
        if not any(call.out_tensors):
            raise TypeError(f"cut {call.name!r}: its output has no tensor ({type(out).__name__}); cut another module")
        return [t for t in leaves if isinstance(t, torch.Tensor)]

    def kind(self, call: Call) -> Hashable | None:
        """The kind of the call's rebuild for ``early_stop`` (``None``: it runs in full: the option is
        off, the call is too small to pay, or it reseeds torch's generator and must be checked
        against its forward)."""
        if not self.opts.early_stop or call.sums is not None or not ES.may_pay(call.leaves):
            return None
        return (
            id(call.module),
            call.spec,
            tuple(map(ES.described, call.leaves)),
            tuple(p.requires_grad for p in call.params.values()),
            call.autocast,
            tuple(training for _, training in call.modes),
        )

    def passes(self, call: Call, costates: list) -> list:
        """The costate of the call's output after the passes (one tensor, or a tuple for several)."""
        value = costates[0] if len(costates) == 1 else tuple(costates)
        adj = AdjointState(value, call.index, call.name, fold_in(self.opts.key, call.index))
        if not self.opts.no_passes:
            stats = self.stats.setdefault(call.name, {})
            try:
                with F.timer(self.opts, stats, "pass_s", f"eae/{call.name}/passes"):
                    out = self.opts.passes.update(adj, self.pass_state, Context(None, None, self.opts.key))
            except Exception as e:
                F.note(e, f"the passes at cut {call.name!r}")
                raise
            if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], AdjointState)):
                raise TypeError(
                    f"pass {self.opts.passes.name!r} at cut {call.name!r}: update must return (AdjointState, state), "
                    f"got {type(out).__name__}"
                )
            adj, self.pass_state = out
            got = [adj.value] if len(costates) == 1 else list(adj.value) if isinstance(adj.value, tuple) else None
            if (
                got is None
                or len(got) != len(costates)
                or any(not isinstance(g, torch.Tensor) or g.shape != c.shape for g, c in zip(got, costates))
            ):
                raise ValueError(
                    f"pass {self.opts.passes.name!r} at cut {call.name!r}: expected a costate like "
                    f"{[tuple(c.shape) for c in costates]}, got {type(adj.value).__name__}"
                )
            costates = got
        self.trace.append(adj if self.opts.keep_costates else adj.replace(value=None))
        return costates

    def reverse(self, call: Call, costates: list) -> list:
        """The call's reverse step: the passes on its output costate, the module rebuilt at the
        params it ran with, one local vjp; the parameter gradients added up, the input costates returned."""
        costates = self.passes(call, costates)
        stats = self.stats.setdefault(call.name, {})
        leaves, own = list(call.leaves), {}
        local = {n: own.setdefault(id(p), p.detach().requires_grad_(p.requires_grad)) for n, p in call.params.items()}
        trainable = {id(p): p for p in call.params.values() if p.requires_grad and B.is_differentiable(p)}
        inputs = [leaves[i].requires_grad_() for i in call.inputs]  # detached when kept
        args, kwargs = pytree.tree_unflatten(leaves, call.spec)

        def rebuild(run: Callable) -> Any:
            with (
                torch.enable_grad(),
                F.timer(self.opts, stats, "recompute_s", f"eae/{call.name}/recompute"),
                F.replay_rng(call.rng, self.device),
                F.in_modes(call.modes),
                HOST.replay(call.host),
                replay_autocast(call.autocast),
                module_lock(call.module),
                holding(call.module, {**local, **{n: b.clone() for n, b in call.buffers.items()}}),
            ):
                return run(call.forward, *args, **kwargs)

        _ACTIVE.depth = getattr(_ACTIVE, "depth", 0) + 1
        try:
            out = ES.rebuilt(self.kind(call), rebuild)
        except Exception as e:
            F.note(e, f"the rebuild of cut {call.name!r}")
            e.add_note(
                "(eae_func: the rebuild runs the module again on the inputs of its forward; one the forward "
                "changed in place (a KV cache, a dict or list it appends to) differs now: call the model "
                "without a cache (use_cache=False), or cut where no such state is passed)"
            )
            raise
        finally:
            _ACTIVE.depth -= 1
        if call.sums is not None and not all(torch.equal(a, b) for a, b in zip(sums(out), call.sums)):
            raise ValueError(
                f"cut {call.name!r} seeds torch's generator afresh (torch.seed(), as Reformer's layers do for "
                f"their dropout) and its rebuild came to other outputs than its forward: its gradients would "
                f"belong to other random numbers. Cut a module that does not reseed, or turn its randomness off"
            )
        edges = V.places([t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)])
        del out  # an output the graph does not save is freed now
        wanted = [own[i] for i in trainable] + inputs
        with F.timer(self.opts, stats, "vjp_s", f"eae/{call.name}/vjp"):
            grads = V.pull_back(edges, costates, wanted)
        for i, g in zip(trainable, grads):
            # plus what a custom Function's own backward accumulated into .grad (Reformer's reversible
            # layers run torch.autograd.backward on their parameters, as under plain autograd)
            g = M.add(g, own[i].grad)
            if g is not None:
                self.grads[i] = M.add(self.grads.get(i), g)
        return list(grads[len(trainable) :])


class StageCall(torch.autograd.Function):
    """One cut call in the model's graph: its forward runs the module without a graph, its backward
    is the sweep's reverse step for the call."""

    @staticmethod
    def forward(ctx: Any, sweep: Sweep, call: Call, anchor: torch.Tensor, *inputs: torch.Tensor) -> Any:  # type: ignore[override]
        tensors = sweep.run_forward(call)
        ctx.sweep, ctx.call = sweep, call
        ctx.mark_non_differentiable(*[t for t in tensors if not B.is_differentiable(t)])
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *costates: torch.Tensor) -> Any:  # type: ignore[override]
        call, ctx.call = ctx.call, None  # the call's boundary is let go with its step
        return (None, None, None, *ctx.sweep.reverse(call, list(costates)))


def sums(out: Any) -> list:
    """One number per floating output leaf, to tell whether a rebuild repeated its forward."""
    return [t.detach().sum() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and B.is_differentiable(t)]


class HostRandom:
    """Python's ``random`` and numpy's global generator, which a module's forward may draw from
    (BigBird's random attention blocks): their states cost tens of microseconds to read, so each kind
    of module (class and training flag) is watched on its first call in the process, and only the
    kinds that drew then have their states saved at every call and replayed by the rebuild. A module
    that draws only on later calls, or only sometimes, is not seen."""

    def __init__(self):
        self.watched: set[tuple] = set()
        self.drawing: set[tuple] = set()

    @staticmethod
    def state() -> tuple:
        return random.getstate(), np.random.get_state(legacy=False)

    def before(self, module: nn.Module) -> tuple | None:
        """The states before a call, where its kind draws or has not been watched yet."""
        kind = type(module), module.training
        return self.state() if kind in self.drawing or kind not in self.watched else None

    def after(self, module: nn.Module, before: tuple | None) -> tuple | None:
        """The states to replay for this call (``None``: it draws nothing)."""
        kind = type(module), module.training
        if kind not in self.watched:
            self.watched.add(kind)
            assert before is not None
            if random.getstate() != before[0] or capture.numpy_drew(before[1]):
                self.drawing.add(kind)
        return before if kind in self.drawing else None

    @contextlib.contextmanager
    def replay(self, states: tuple | None):
        if states is None:
            yield
            return
        now = self.state()
        random.setstate(states[0])
        np.random.set_state(states[1])
        try:
            yield
        finally:
            random.setstate(now[0])
            np.random.set_state(now[1])


HOST = HostRandom()


def cut_modules(model: nn.Module, split_at: Sequence[str]) -> dict[str, nn.Module]:
    """The modules of ``model`` matched by a pattern of ``split_at`` (glob per dotted part)."""
    if isinstance(split_at, str) or not split_at or not all(isinstance(p, str) for p in split_at):
        raise TypeError(f"split_at: expected a list of module paths (glob patterns), got {split_at!r}")
    found = {n: m for n, m in model.named_modules() if n and any(matches(n, p) for p in split_at)}
    if not found:
        shown = [n for n, _ in model.named_modules() if n][:12]
        raise ValueError(
            f"split_at: no module of {type(model).__name__} matches {list(split_at)}; its modules include {shown}"
        )
    return found


def autocast_state(device: torch.device) -> tuple:
    kind = device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


def replay_autocast(state: tuple):
    kind, enabled, dtype = state
    return torch.autocast(kind, dtype=dtype, enabled=enabled)


@contextlib.contextmanager
def holding(module: nn.Module, tensors: Mapping[str, torch.Tensor]):
    """``module`` with ``tensors`` in the places of its parameters and buffers of those names."""
    slots = Slots.of(module, tuple(tensors))
    if slots is None:
        raise RuntimeError(f"cuts: {type(module).__name__} no longer has the parameters it ran with")
    with slots.holding(tensors):
        yield


def sweep_model(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    x: Any,
    loss_args: tuple,
    loss: Callable,
    split_at: Sequence[str],
    pass_state: Any,
    buffers: Mapping[str, torch.Tensor] | None,
    opts: Options,
) -> tuple:
    """``(loss, grads, trace, buffers, pass_state, stats)`` of ``model`` cut at run time at ``split_at``,
    at ``params``, a flat ``{qualified name: tensor}`` dict as ``dict(model.named_parameters())`` gives
    (a frozen parameter it lacks is used as the module holds it; a trainable one is differentiated
    whatever the given tensor's ``requires_grad``: ``chain.trainable_names``); ``grads`` has the
    names of ``params`` and ``buffers`` every buffer's, updated (BatchNorm's running statistics), the
    module's own never written."""
    own_params = list(model.named_parameters(remove_duplicate=False))
    own_buffers = list(model.named_buffers(remove_duplicate=False))
    first = canonical_names([*own_params, *own_buffers])  # a tied tensor's names -> its first name
    trainable = trainable_names(model, params)  # the module's flags, not the given tensors'
    kept = {n: b for n, b in own_buffers if first[n] == n}
    wrong = sorted(set(buffers or {}) - set(kept))
    if wrong:
        raise ValueError(f"buffers: {wrong[:5]} are not buffers of {type(model).__name__} (named_buffers' names)")
    leaves = {n: p.detach().requires_grad_(n in trainable and B.is_differentiable(p)) for n, p in params.items()}
    fresh = {n: b.detach().clone() for n, b in {**kept, **(buffers or {})}.items()}
    given = {**leaves, **fresh}
    run = Sweep(model, split_at, opts, opts.passes.init() if pass_state is None else pass_state, F.device_of(leaves, x))
    args, kwargs = as_call(x)
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:  # a Hugging Face model: a KV
        kwargs.setdefault("use_cache", False)  # cache the forward fills would be read again by the rebuilds
    with module_lock(model), holding(model, {n: given[f] for n, f in first.items() if f in given}):
        # the cuts are in place for the forward alone: a matched module run again by a custom Function's
        # own backward (a reversible layer's recompute) runs as written
        with run.installed(), F.autocast(opts.autocast, run.device):  # the loss too, as AMP computes it
            output = model(*args, **kwargs)
            try:
                value = loss(output, *loss_args)
            except Exception as e:
                F.note(e, "the loss")
                raise
        del output
        F.check_scalar(value)
        if not run.count:
            why = (
                f"{', '.join(sorted(run.ungraded)[:4])} ran without autograd (under no_grad, or inside a custom "
                f"autograd Function that computes its own backward, as Reformer's reversible layers do); cut "
                f"modules that autograd differentiates"
                if run.ungraded
                else "a container (a ModuleList is never called; name its children, e.g. 'layers.*') or a "
                "module the forward skips"
            )
            raise ValueError(
                f"split_at: no module matched by {list(split_at)} ({list(run.names)[:4]}) ran as a stage in "
                f"{type(model).__name__}'s forward, so nothing would be cut: {why}"
            )
        wanted = [n for n, t in leaves.items() if t.requires_grad]
        glue = (
            torch.autograd.grad(value, [*(leaves[n] for n in wanted), run.anchor], allow_unused=True)[:-1]
            if value.requires_grad
            else (None,) * len(wanted)
        )
    grads: dict[str, Any] = dict.fromkeys(params)
    hooked = {first[n]: p for n, p in own_params if p._backward_hooks}  # p.register_hook(fn): run on the sum
    for n, g in zip(wanted, glue):  # what autograd returned, what a Function put in .grad, the cuts' sum
        grads[n] = M.add(M.add(g, leaves[n].grad), run.grads.get(id(leaves[n])))
        if n in hooked:
            grads[n] = through_hooks(hooked[n], grads[n])
    stats = dict(run.stats)
    stats["boundaries"] = {a.index: dict(a.meta) for a in run.trace}
    return value.detach(), grads, tuple(run.trace), fresh, run.pass_state, Measurements(stats)
