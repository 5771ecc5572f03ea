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
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from .. import tree as T
from ..adjoint import AdjointState
from ..core import boundary as B
from ..core import compiled as C
from ..core import remat as R
from ..core import replay
from ..core.diagnose import note
from ..core.options import Options
from ..core.timing import timer
from ..program.physical import Meter
from . import cut_graphs as CG
from . import physical_cuts as PC
from .cut_call import ACTIVE, Call, cut_modules, holding, local_params, refuse_caches, routes, sums, walk
from .cut_reverse import CutReverse
from .input_writes import WRITES, leaf_name

__all__ = ["Sweep", "cutting"]


class Sweep(CutReverse):
    """One sweep over a model with run-time cuts (one microbatch's forward and backward): the cut
    modules' forwards replaced for its duration, the calls so far, the pass state, the trace and the
    stats; the physical cut modules by name (their place in the roster) and the ``meter`` of their rows.
    This module holds its forward side; ``CutReverse`` its reverse step."""

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
        if opts.cuda_graphs:
            CG.check_device(device)
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
        self.stats: dict[str, dict[Any, Any]] = {}
        # (index, name, (shape, dtype, device) of each output) of every call, where the passes start
        # at this sweep's first reverse step and read what they will be applied to
        self.outputs: list[tuple[int, str, list[Any]]] | None = (
            [] if pass_state is None and opts.passes.wants_example else None
        )
        # an input of every cut's node: autograd runs only the nodes on a path to an input it is asked
        # for, and a cut whose parameters no glue reads is on the path to this one alone
        self.anchor = torch.empty(0, requires_grad=True)

    @contextlib.contextmanager
    def installed(self):
        """The cut modules' ``forward`` replaced by a cut (an instance attribute, so the module's hooks
        run around it and a ``module.forward(x)`` call goes through it too), put back on exit."""
        replaced: list[tuple[nn.Module, Any]] = []
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

    def cut(self, name: str, module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        return cutting(lambda: self, name, module, forward)

    def stage(
        self, name: str, module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[Any, Any]
    ) -> Any:
        """The next stage: this call of ``module``, run without a graph, its output through one node."""
        k = self.calls[name] = self.calls.get(name, 0) + 1
        self.count += 1
        leaves, spec = T.flatten_call(args, kwargs)
        refuse_caches(name, leaves, self.split_at)
        params, buffers, modes = walk(module)
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
        tensors = cast(
            "tuple[torch.Tensor, ...]",
            StageCall.apply(self, call, self.anchor, *[leaves[i] for i in call.inputs], *call.trained),  # pyright: ignore[reportUnknownMemberType]
        )
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

    def run_forward(self, call: Call) -> list[Any]:
        """The call without a graph: its output's tensor leaves."""
        args, kwargs = T.unflatten(call.leaves, call.spec)
        stats = self.stats.setdefault(call.name, {})
        copies = WRITES.before(call)
        if call.physical is not None:
            PC.charge_forward(self.meter, call.physical, call)
        ACTIVE.depth = getattr(ACTIVE, "depth", 0) + 1
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
            ACTIVE.depth -= 1
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
    def remat(self, call: Call) -> Generator[Callable[[Any], None], None, None]:
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
        local, trained = local_params(call)
        inputs = [call.leaves[i].requires_grad_() for i in call.inputs]  # the call's own detached leaves
        saved = R.SavedBytes([*{id(p): p for p in local.values()}.values(), *inputs]) if plan.counts else None

        def keep(out: Any) -> None:
            if saving is not None:  # its graph was built to run the ops as the rebuild will: let go
                call.cached = saving.replay  # None where the forward wrote into a kept output
                return
            if saved is None or plan.kept(k, saved.bytes):
                call.graph = (out, inputs, trained)
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


def cutting(
    sweep_of: Callable[[], Sweep | None], name: str, module: nn.Module, forward: Callable[..., Any]
) -> Callable[..., Any]:
    """``module``'s forward cut: a call with grad enabled is the next stage of ``sweep_of()``; one
    inside another cut's call (its forward or rebuild) or without grad runs as written (and is noted
    in the sweep's ``ungraded``, if ``sweep_of()`` gives one then). Under ``torch.compile`` the cut call
    is a graph break: it and its reverse step run as Python, the glue between cuts is compiled."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if getattr(ACTIVE, "depth", 0):  # inside a cut: part of its call
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


@torch.compiler.disable(recursive=True)  # pyright: ignore[reportUnknownMemberType, reportUntypedFunctionDecorator]
def _eager(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[Any, Any]) -> Any:
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
        if sweep.outputs is not None:
            sweep.outputs.append((call.index, call.name, call.outs[: len(tensors)]))
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
