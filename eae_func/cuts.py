"""Run-time cuts: a model's own forward runs as written, and each call of a module matched by
``split_at`` is one stage, as ``torch.utils.checkpoint`` cuts a model.

    call of a matched module m on inputs a (stage l, in call order):
        keep a (detached; RNG and autocast state; m's buffers as they were; a copy of the leaves m
        writes into, ``InputWrites``), run m under no_grad and return its outputs x_l (and the
        leaves it wrote into) through one autograd node whose inputs are a's leaves that require grad
        (its floating tensors, each once; its other outputs, integer tensors and the inputs it hands
        back that require no grad reach the caller as the forward returned them)
    loss.backward-like driver: ``torch.autograd.grad(loss, params)`` differentiates the glue
        (embeddings, masks, rotary tables, head, loss) and, at each node, runs stage l's reverse step:
        p_l through the passes; m rebuilt at the params it ran with (RNG, autocast and modes replayed,
        buffers on throwaway clones); (J_W^T p_l, J_a^T p_l) by one ``torch.autograd.grad``
        (``vjp.pull_back``); J_W^T p_l added to the parameters' gradients (frozen ones excluded),
        J_a^T p_l handed back to autograd; a leaf of a written in place since the call is refused

Nothing is traced or cached: hooks, custom ``autograd.Function`` backwards, data-dependent control
flow (MoE routing) and Python state behave as in eager PyTorch; a module called twice is two stages
whose parameter gradients are summed. A cut inside another cut's call runs as part of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from . import boundary as B
from . import compiled as C
from . import early_stop as ES
from . import microbatch as M
from . import physical_cuts as PC
from . import remat as R
from . import replay
from . import tree as T
from . import vjp as V
from .adjoint import AdjointState, fold_in
from .capture import matches
from .chain import Slots, module_lock
from .compat import pytree
from .diagnose import note
from .input_writes import WRITES, leaf_name, param_name
from .options import Options
from .passes import Context
from .physical import Meter
from .timing import timer

__all__ = ["Sweep", "WRITES", "cut_modules", "cutting", "holding"]


_ACTIVE = threading.local()  # .depth: > 0 while a cut module runs (its forward or its rebuild) on this thread


@dataclasses.dataclass
class Call:
    """One call of a cut module, what its reverse step needs: the call's input leaves (detached) and
    their ``spec``, which of them require grad (``inputs``), the tensors the module held in its
    parameters' places (the sweep's leaves, by the module's own names, aliases included), its buffers
    as they were before the call, torch's RNG and the autocast state, the modes of its modules
    (``replay.modes_of``), Python's and numpy's generator states where the module draws from them
    (``replay.HostRandom``); after the forward, the output's spec, the position of each of its floating
    tensors of its own (``through``: one position per distinct tensor, the ones autograd's node
    returns), each leaf's tensor of the node (``routes``, ``None``: a leaf the caller gets as the
    forward returned it), until the caller has them, those leaves (``constants``), the leaves its
    forward wrote into (``InputWrites``: kept as copies from before the call) and the others'
    versions (-1: not a tensor, or written), which must still be theirs when it is rebuilt; the
    parameters it trains (``trained``: inputs of its node, so autograd accumulates their gradients
    after its reverse step, and a fused update steps them only then) and their versions; with a
    boundary policy (``boundary_dtype=``, ``offload=``), the positions of the inputs kept as it
    stores them (``stored``) and their ``layout`` as computed; for a physical cut, its place in the
    sweep's roster of them (``physical``); the shape, dtype and device of each output of its node
    (``outs``); where ``recompute=`` keeps its graph from the forward, ``(output, inputs, parameters)``
    of that graph (``graph``), and where it keeps some ops' outputs, the context that replays them
    in the rebuild (``cached``); whether its forward ran compiled (``compile=``: its rebuild does too,
    so a dropout mask is drawn by the same ops)."""

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
    through: tuple = ()
    routes: tuple = ()
    constants: list | None = None
    versions: list = dataclasses.field(default_factory=list)
    written: tuple = ()
    trained: list = dataclasses.field(default_factory=list)
    trained_versions: list = dataclasses.field(default_factory=list)
    stored: tuple = ()
    layout: Any = None
    physical: int | None = None
    outs: list = dataclasses.field(default_factory=list)
    graph: tuple | None = None
    cached: Any = None
    compiled: bool = False


class Sweep:
    """One sweep over a model with run-time cuts (one microbatch's forward and backward): the cut
    modules' forwards replaced for its duration, the calls so far, the pass state, the trace and the
    stats; the physical cut modules by name (their place in the roster) and the ``meter`` of their rows."""

    def __init__(
        self,
        model: nn.Module,
        split_at: Sequence[str],
        opts: Options,
        pass_state: Any,
        device: Any,
        names: Mapping[str, nn.Module] | None = None,
        meter: Meter | None = None,
    ):
        self.opts, self.pass_state, self.device = opts, pass_state, device
        self.policy = opts.boundary
        self.stores = self.policy.dtype is not None or self.policy.offload
        self.prefetch = B.Prefetcher(self.policy, device) if self.stores else None
        self.names, self.split_at = dict(names or cut_modules(model, split_at)), list(split_at)
        roster = PC.roster(opts, self.names)  # the physical cut modules, checked before anything runs
        self.physical = {} if roster is None else {s.name: k for k, s in enumerate(roster.stages)}
        # recompute=: which calls keep their graph (remat), this forward; a byte budget reads the graph
        # sizes earlier forwards of the model measured, so it builds only the graphs it keeps
        budget = opts.recompute.nbytes  # in the key: a plan under a smaller budget measures fewer graphs
        sizes = R.sizes(model, (tuple(self.split_at), budget)) if opts.recompute.kind == "budget" else None
        self.plan = opts.recompute.plan(sizes)
        self.rebuilt_all = opts.recompute.kind == "always"
        self.graphs: dict[int, Call] = {}  # the calls whose graphs are kept from the forward, by stage
        self.meter = (
            meter if meter is not None or roster is None else Meter(roster, tuple(self.physical.values()), opts.budget)
        )
        self.calls: dict[str, int] = {}
        self.ungraded: set[str] = set()
        self.count = 0
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
        return cutting(lambda: self, name, module, forward)

    def stage(self, name: str, module: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """The next stage: this call of ``module``, run without a graph, its output through one node."""
        k = self.calls[name] = self.calls.get(name, 0) + 1
        self.count += 1
        leaves, spec = T.flatten_call(args, kwargs)
        refuse_caches(name, leaves, self.split_at)
        params, buffers, modes = walk(module.named_modules(remove_duplicate=False))
        call = Call(
            self.count,
            name if k == 1 else f"{name}#{k}",
            module,
            forward,
            [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves],
            spec,
            [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad],
            params,
            buffers,
            replay.rng_state(self.device),
            replay.autocast_state(self.device),
            modes,
        )
        call.host = replay.HOST.before((type(module), module.training))
        call.physical = self.physical.get(name)
        call.versions = [t._version if isinstance(t, torch.Tensor) else -1 for t in call.leaves]
        call.trained = list(
            {id(p): p for p in call.params.values() if p.requires_grad and B.is_differentiable(p)}.values()
        )
        call.trained_versions = [p._version for p in call.trained]
        if self.stores:
            self.store(call)
        tensors = StageCall.apply(self, call, self.anchor, *[leaves[i] for i in call.inputs], *call.trained)
        out, call.constants = call.constants or [], None  # the call keeps no output of its own
        return T.unflatten([c if k is None else tensors[k] for c, k in zip(out, call.routes)], call.out_spec)

    def store(self, call: Call) -> None:
        """The call's inputs that require grad kept as the boundary policy says (in its dtype, on the
        host), as a chain keeps its boundaries: the forward runs on the kept values, so its rebuild
        recomputes exactly what the forward ran; the input costates pass straight through the rounding."""
        picked = [i for i in call.inputs if B.is_differentiable(call.leaves[i])]
        stats = self.stats.setdefault(call.name, {})
        stats["boundary_bytes"] = 0
        if not picked:
            return
        assert self.prefetch is not None  # made where a policy stores
        call.layout = B.Layout.of([call.leaves[i] for i in picked])
        kept, fed = self.policy.store([call.leaves[i] for i in picked], call.layout, self.prefetch.stream)
        for i, t in zip(picked, fed):
            call.leaves[i] = t
            call.versions[i] = t._version
        call.stored = tuple(zip(picked, kept))
        stats["boundary_bytes"] = B.nbytes(kept)

    def run_forward(self, call: Call) -> list:
        """The call without a graph: its output's tensor leaves."""
        args, kwargs = T.unflatten(call.leaves, call.spec)
        stats = self.stats.setdefault(call.name, {})
        copies = WRITES.before(call)
        if call.physical is not None:
            PC.charge_forward(self.meter, call.physical, call)
        _ACTIVE.depth = getattr(_ACTIVE, "depth", 0) + 1
        seed = torch.initial_seed()
        try:
            planned = self.rebuilt_all or call.physical is not None  # no graph: the common case, at no cost
            with timer(self.opts, stats, "forward_s", f"eae/{call.name}/forward"):
                with torch.no_grad() if planned else self.remat(call) as keep:
                    call.compiled = self.opts.compile is not None and call.physical is None and keep is None
                    out = (
                        C.call(self.opts, call.forward, *args, **kwargs)
                        if call.compiled
                        else call.forward(*args, **kwargs)
                    )
            if keep is not None:
                keep(out)
            WRITES.after(call, copies)
            if call.stored and call.written:
                raise ValueError(
                    f"cut {call.name!r} writes into its input {leaf_name(call, call.written[0])} in place, and "
                    f"boundary_dtype= / offload= keep a copy of it: the write would miss the caller's tensor. "
                    f"Write out of place in the module, or leave out boundary_dtype= and offload="
                )
            if call.physical is not None and call.written:
                raise ValueError(
                    f"physical cut {call.name!r} writes into its input {leaf_name(call, call.written[0])} in place, "
                    f"and its estimator runs it again on shifted inputs: write out of place in the module"
                )
            for i, t in call.stored:
                call.leaves[i], call.versions[i] = t, -1  # the kept copy, its own: nothing to watch
            replay.check_modes(call.modes, f"cut {call.name!r}")  # the modes were read before the call
            if torch.initial_seed() != seed:  # it seeds torch's generator itself (torch.seed(): Reformer)
                call.sums = sums(out)  # which the rebuild cannot replay: it must come to the same outputs
        except Exception as e:
            note(e, f"the forward of cut {call.name!r}")
            raise
        finally:
            _ACTIVE.depth -= 1
        if call.rng is not None and not replay.drew(call.rng, self.device):
            call.rng = None
        call.host = replay.HOST.after((type(call.module), call.module.training), call.host)
        leaves, call.out_spec = T.flatten_output(out)
        call.routes, call.through = routes(leaves, call)
        if not call.through:
            raise TypeError(
                f"cut {call.name!r}: its output ({type(out).__name__}) has no floating tensor of its own, so no "
                f"costate; cut another module"
            )
        call.constants = [None if k is not None else t for t, k in zip(leaves, call.routes)]
        # an input the module returns as it is: the node's output must be a tensor of its own
        return [
            leaves[i].clone() if any(leaves[i] is t for t in call.leaves) else leaves[i].detach() for i in call.through
        ]

    @contextlib.contextmanager
    def remat(self, call: Call):
        """The forward of ``call`` as ``recompute=`` plans it, as stage ``call.index - 1`` of a chain of
        the cut calls: without a graph (rebuilt in the reverse step), or with its graph at local
        parameters and inputs that require grad, as the rebuild has them: kept (in ``call.graph``;
        with a byte budget only while it fits), or let go once some ops' outputs are kept for the
        rebuild (``remat.save``: they are handed out in call order, so the forward must take the ops'
        paths the rebuild takes, and ``torch.matmul``, for one, picks its kernels by which inputs
        require grad); yields ``keep(output)``, to call on the forward's output."""
        k, plan = call.index - 1, self.plan
        rebuilt = call.physical is not None or plan.rebuilds(k, call.name)
        saving = plan.saving(k, call.name) if rebuilt and call.physical is None else None
        if rebuilt and saving is None:
            with torch.no_grad():
                yield lambda out: None
            return
        own: dict = {}
        local = {n: own.setdefault(id(p), p.detach().requires_grad_(p.requires_grad)) for n, p in call.params.items()}
        inputs = [call.leaves[i].requires_grad_() for i in call.inputs]  # the call's own detached leaves
        saved = R.SavedBytes([*own.values(), *inputs]) if plan.counts else None

        def keep(out: Any) -> None:
            if saving is not None:  # its graph was built to run the ops as the rebuild will: let go
                call.cached = saving.replay  # None where the forward wrote into a kept output
                return
            if saved is None or plan.kept(k, saved.bytes):
                call.graph = (out, inputs, [own[id(p)] for p in call.trained])
                self.graphs[k] = call
            for j in plan.evicted():  # a later graph took its place in the byte budget: rebuilt instead
                self.graphs.pop(j).graph = None

        try:
            with (
                torch.enable_grad(),
                holding(call.module, local),
                saved.hooks() if saved else contextlib.nullcontext(),
                saving.forward() if saving is not None else contextlib.nullcontext(),
            ):
                yield keep
        except RuntimeError as e:
            if "leaf Variable" in str(e):  # autograd refuses a write into a leaf that requires grad
                e.add_note(
                    f"(eae_func: recompute= keeps the graph of cut {call.name!r} from its forward, where its "
                    f"inputs are leaves, which a write in place into them breaks: rebuild this cut instead)"
                )
            raise

    def kind(self, call: Call) -> Hashable | None:
        """The kind of the call's rebuild for ``early_stop`` (``None``: it runs in full: the option is
        off, the call is too small to pay, it reseeds torch's generator and must be checked against
        its forward, it runs compiled, or a forward hook would see its tail: the module's own do not
        run in it)."""
        if not self.opts.early_stop or call.sums is not None or call.compiled or not ES.may_pay(call.leaves):
            return None
        if ES.observed(m for m, _ in call.modes[1:]):
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
                with timer(self.opts, stats, "pass_s", f"eae/{call.name}/passes"):
                    out = self.opts.passes.update(adj, self.pass_state, Context(None, None, self.opts.key))
            except Exception as e:
                note(e, f"the passes at cut {call.name!r}")
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
        self.record(adj)
        return costates

    def record(self, adj: AdjointState) -> None:
        """The trace's record of a boundary (its costate dropped unless ``keep_costates``)."""
        self.trace.append(adj if self.opts.keep_costates else adj.replace(value=None))

    def reverse(self, call: Call, costates: list) -> list:
        """The call's reverse step: the passes on its output costate, the module rebuilt at the
        params it ran with, one local vjp; the parameter gradients added up, the input costates returned."""
        stale = [i for i, (t, v) in enumerate(zip(call.leaves, call.versions)) if v >= 0 and t._version != v]
        if stale:
            raise ValueError(
                f"cut {call.name!r}: its input {leaf_name(call, stale[0])} was written in place after the call "
                f"(version {call.versions[stale[0]]}, now {call.leaves[stale[0]]._version}), and its rebuild needs "
                f"the values the call was given (plain autograd refuses it too where the module saves that "
                f"input): write out of place (h = h + 1, not h.add_(1)), or clone the tensor before writing it"
            )
        moved = [
            n for p, v in zip(call.trained, call.trained_versions) if p._version != v for n in [param_name(call, p)]
        ]
        if moved:
            raise ValueError(
                f"cut {call.name!r}: its parameter {moved[0]!r} was written in place after the call (an optimizer "
                f"step, or an in-place update between the forward and the backward), and its rebuild needs the "
                f"values the call ran with: update the parameters after the backward"
            )
        if all(c is None for c in costates):  # no costate reaches the call (E.frozen() downstream): no step
            call.graph = None
            self.record(AdjointState(None, call.index, call.name, fold_in(self.opts.key, call.index)))
            return [None] * (len(call.inputs) + len(call.trained))
        costates = [torch.zeros(s, dtype=d, device=v) if c is None else c for c, (s, d, v) in zip(costates, call.outs)]
        dirty = [i for i in call.written if i in call.inputs]  # the outputs after the module's own
        costates = self.passes(call, costates[: len(costates) - len(dirty)]) + costates[len(costates) - len(dirty) :]
        stats = self.stats.setdefault(call.name, {})
        leaves = list(call.leaves)
        if call.stored:
            positions, kept = zip(*call.stored)
            assert self.prefetch is not None
            for i, t in zip(positions, self.prefetch.get(call.index, list(kept), call.layout)):
                leaves[i] = t
        if call.physical is not None:
            return self.estimate(call, leaves, costates)
        if call.graph is not None:  # kept from the forward (recompute=): used once and let go
            (out, inputs, trained), written, call.graph = call.graph, (), None
        else:
            out, written, inputs, trained = self.rebuild(call, leaves, stats)
        rebuilt = T.flatten_output(out)[0]
        edges = V.places(
            [rebuilt[i] for i in call.through] + [t for i, t in zip(call.written, written) if i in call.inputs]
        )
        del out, rebuilt, written  # an output the graph does not save is freed now
        with timer(self.opts, stats, "vjp_s", f"eae/{call.name}/vjp"):
            grads = V.pull_back(edges, costates, [*inputs, *trained])
        # the parameters' gradients, plus what a custom Function's own backward accumulated into .grad
        # (Reformer's reversible layers run torch.autograd.backward on their parameters, as under autograd)
        return [*grads[: len(inputs)], *(M.add(g, p.grad) for g, p in zip(grads[len(inputs) :], trained))]

    def rebuild(self, call: Call, leaves: list, stats: dict) -> tuple[Any, tuple, list, list]:
        """The call's module run again with its graph at the params it ran with, on ``leaves`` (its
        inputs as the forward had them), RNG, modes, Python's generators and autocast replayed, the
        ops' outputs the forward kept (``remat.save``) reused: ``(output, the leaves it wrote into,
        the inputs and the parameters its graph starts from)``."""
        own: dict = {}
        local = {n: own.setdefault(id(p), p.detach().requires_grad_(p.requires_grad)) for n, p in call.params.items()}
        inputs = [leaves[i].requires_grad_() for i in call.inputs]  # detached when kept
        args, kwargs = T.unflatten(leaves, call.spec)
        cached, call.cached = call.cached, None
        forward = functools.partial(C.call, self.opts, call.forward) if call.compiled else call.forward

        def rebuild(run: Callable) -> Any:
            with (
                torch.enable_grad(),
                timer(self.opts, stats, "recompute_s", f"eae/{call.name}/recompute"),
                replay.replay_rng(call.rng, self.device),
                replay.in_modes(call.modes),
                replay.HOST.replay(call.host),
                replay.replay_autocast(call.autocast),
                module_lock(call.module),
                holding(call.module, {**local, **{n: b.clone() for n, b in call.buffers.items()}}),
                cached if cached is not None else contextlib.nullcontext(),
            ):
                if not call.written:
                    return run(forward, *args, **kwargs), ()
                fed = list(leaves)  # the leaves it writes into copied again: an attempt may be made twice
                for i in call.written:
                    fed[i] = leaves[i].clone()
                fed_args, fed_kwargs = T.unflatten(fed, call.spec)
                return run(forward, *fed_args, **fed_kwargs), tuple(fed[i] for i in call.written)

        _ACTIVE.depth = getattr(_ACTIVE, "depth", 0) + 1
        try:
            out, written = ES.rebuilt(self.kind(call) if cached is None else None, rebuild)
        except Exception as e:
            note(e, f"the rebuild of cut {call.name!r}")
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
        spec = T.flatten_output(out)[1]
        if spec != call.out_spec:
            raise ValueError(
                f"cut {call.name!r}: its rebuild returned another structure than its forward ({spec} vs "
                f"{call.out_spec}): cut a module whose output has one structure for its inputs"
            )
        for i, t in zip(call.written, written):
            if t.requires_grad and i not in call.inputs:
                raise ValueError(
                    f"cut {call.name!r} writes into its input {leaf_name(call, i)}, which requires no grad, a value "
                    f"that depends on its parameters: the caller's tensor cannot take that gradient. Write out "
                    f"of place in the module, or pass it a tensor that requires grad"
                )
        return out, written, inputs, [own[id(p)] for p in call.trained]

    def estimate(self, call: Call, leaves: list, costates: list) -> list:
        """A physical cut's reverse step from the estimator (``physical_cuts``): the call run again at
        the inputs and parameters the estimator gives, its modes and autocast replayed, its randomness
        drawn afresh, as a chain's physical stage."""
        names = [param_name(call, p) for p in call.trained]
        # the inputs that require grad; with none (the data), the first tensor, as a chain's first stage has it
        probed = call.inputs or [next(i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor))]

        def run(params: dict, h: tuple) -> tuple:
            fed = list(leaves)
            for i, t in zip(probed, h):
                fed[i] = t
            args, kwargs = T.unflatten(fed, call.spec)
            held = {**call.params, **params, **{n: b.clone() for n, b in call.buffers.items()}}
            _ACTIVE.depth = getattr(_ACTIVE, "depth", 0) + 1  # a cut inside it is part of its call
            try:
                with replay.in_modes(call.modes), replay.replay_autocast(call.autocast), module_lock(call.module):
                    with holding(call.module, held):
                        out = call.forward(*args, **kwargs)
            finally:
                _ACTIVE.depth -= 1
            flat = T.flatten_output(out)[0]
            return tuple(flat[i] for i in call.through)

        stats = self.stats.setdefault(call.name, {})
        h = tuple(leaves[i] for i in probed)
        params = {n: call.params[n].detach() for n in names}
        assert call.physical is not None  # a physical call's
        try:
            with timer(self.opts, stats, "vjp_s", f"eae/{call.name}/estimate"):
                g_in, grads, cost = PC.estimate(
                    call.name.split("#")[0], call.index, run, h, params, costates, self.opts, self.meter, call.physical
                )
        except Exception as e:
            note(e, f"the estimator at physical cut {call.name!r}")
            raise
        stats.update(cost)
        return [*g_in[: len(call.inputs)], *(grads.get(n) for n in names)]


def cutting(sweep_of: Callable[[], Sweep | None], name: str, module: nn.Module, forward: Callable) -> Callable:
    """``module``'s forward cut: a call with grad enabled is the next stage of ``sweep_of()``; one
    inside another cut's call (its forward or rebuild) or without grad runs as written (and is noted
    in the sweep's ``ungraded``, if ``sweep_of()`` gives one then). Under ``torch.compile`` the cut call
    is a graph break: it and its reverse step run as Python, the glue between cuts is compiled."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if getattr(_ACTIVE, "depth", 0):  # inside a cut: part of its call
            return forward(*args, **kwargs)
        if not torch.is_grad_enabled():  # no graph wanted (a custom Function's forward, no_grad)
            sweep = sweep_of()
            if sweep is not None:
                sweep.ungraded.add(name)
            return forward(*args, **kwargs)
        if torch.compiler.is_compiling():  # torch.compile around the model: the call runs as Python
            return _eager(call, args, kwargs)
        sweep = sweep_of()
        assert sweep is not None  # one is made for every call with grad enabled
        return sweep.stage(name, module, forward, args, kwargs)

    return call


@torch.compiler.disable(recursive=True)
def _eager(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` as Python under ``torch.compile``: a graph break."""
    return fn(*args, **kwargs)


class StageCall(torch.autograd.Function):
    """One cut call in the model's graph: its forward runs the module without a graph, its backward
    is the sweep's reverse step for the call. Its inputs are the call's input tensors that require
    grad, then the parameters it trains; inputs its forward wrote into are outputs too."""

    @staticmethod
    def forward(ctx: Any, sweep: Sweep, call: Call, anchor: torch.Tensor, *inputs: torch.Tensor) -> Any:  # type: ignore[override]
        tensors = sweep.run_forward(call)
        ctx.sweep, ctx.call = sweep, call
        ctx.set_materialize_grads(False)  # an output no costate reaches gets None, not zeros: it pulls nothing back
        dirty = [t for i, t in zip(call.inputs, inputs) if i in call.written]  # as autograd records x.mul_(2)
        call.outs = [(t.shape, t.dtype, t.device) for t in (*tensors, *dirty)]
        if not dirty:
            return tuple(tensors)
        ctx.mark_dirty(*dirty)
        return (*tensors, *dirty)

    @staticmethod
    def backward(ctx: Any, *costates: torch.Tensor) -> Any:  # type: ignore[override]
        call, ctx.call = ctx.call, None  # the call's boundary is let go with its step
        if call is None:
            raise RuntimeError(
                "eae_func: a cut's reverse step ran already and let go of its saved input: a second backward "
                "through the same graph (retain_graph=True) is not supported at the cuts; run the forward again"
            )
        return (None, None, None, *ctx.sweep.reverse(call, list(costates)))


def walk(modules: Iterable[tuple[str, nn.Module]]) -> tuple[dict, dict, tuple]:
    """Over a cut module's ``named_modules(remove_duplicate=False)``: its parameters by name (aliases
    included, as ``named_parameters(remove_duplicate=False)``), clones of its buffers by name, its
    modes (``replay.modes_of``)."""
    params, buffers, modes = {}, {}, []
    for prefix, m in modules:
        modes.append((m, m.training))
        dot = f"{prefix}." if prefix else ""
        params.update((dot + n, p) for n, p in m._parameters.items() if p is not None)
        buffers.update((dot + n, b.detach().clone()) for n, b in m._buffers.items() if b is not None)
    return params, buffers, tuple(modes)


def routes(leaves: list, call: Call) -> tuple[tuple, tuple]:
    """For each output leaf, its tensor of the node or ``None`` (the leaf reaches the caller as the
    forward returned it: a non-tensor, an integer tensor, an input that requires no grad returned as
    it was given); and each node tensor's first position. A floating tensor returned twice is one
    tensor of the node, with one costate (the sum of both uses')."""
    given = {id(call.leaves[i]) for i in call.inputs}
    constant = {id(t) for t in call.leaves if isinstance(t, torch.Tensor)} - given
    first: dict[int, int] = {}  # a node tensor's id -> its index among the node's outputs
    route = tuple(
        first.setdefault(id(t), len(first))
        if isinstance(t, torch.Tensor) and B.is_differentiable(t) and id(t) not in constant
        else None
        for t in leaves
    )
    return route, tuple(route.index(k) for k in range(len(first)))


def refuse_caches(name: str, leaves: list, split_at: list[str]) -> None:
    """Refuse a call passed a key/value cache (what has ``update`` and ``get_seq_length``, as Hugging Face's
    ``Cache`` does): its forward fills it, so its rebuild would read its own keys and values back (twice as
    many, or silently another attention)."""
    cache = next(
        (t for t in leaves if callable(getattr(t, "update", None)) and callable(getattr(t, "get_seq_length", None))),
        None,
    )
    if cache is None:
        return
    others = [p for p in split_at if not matches(name, p)]
    instead = f"split_at={others}" if others else "a module that is not passed one"
    raise ValueError(
        f"cut {name!r} is passed a key/value cache ({type(cache).__name__}) that its forward fills: its rebuild "
        f"would attend to its own keys and values again. Call the model with use_cache=False; where it makes a "
        f"cache even then (XLM's and Flaubert's attentions), cut modules it is not passed to: {instead}"
    )


def sums(out: Any) -> list:
    """One number per floating output leaf, to tell whether a rebuild repeated its forward."""
    return [t.detach().sum() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and B.is_differentiable(t)]


def cut_modules(
    model: nn.Module, split_at: Sequence[str], modules: Iterable[tuple[str, nn.Module]] | None = None
) -> dict[str, nn.Module]:
    """The modules of ``model`` matched by a pattern of ``split_at`` (glob per dotted part), among
    ``modules`` (``model.named_modules()``, where the caller has it)."""
    if isinstance(split_at, str) or not split_at or not all(isinstance(p, str) for p in split_at):
        raise TypeError(f"split_at: expected a list of module paths (glob patterns), got {split_at!r}")
    modules = list(model.named_modules() if modules is None else modules)
    found = {n: m for n, m in modules if n and any(matches(n, p) for p in split_at)}
    if not found:
        shown = [n for n, _ in modules if n][:12]
        raise ValueError(
            f"split_at: no module of {type(model).__name__} matches {list(split_at)}; its modules include {shown}"
        )
    return found


def holding(module: nn.Module, tensors: Mapping[str, torch.Tensor]):
    """A context with ``module`` holding ``tensors`` in the places of its parameters and buffers of
    those names."""
    slots = Slots.of(module, tuple(tensors))
    if slots is None:
        raise RuntimeError(f"cuts: {type(module).__name__} no longer has the parameters it ran with")
    return slots.holding(tensors)
