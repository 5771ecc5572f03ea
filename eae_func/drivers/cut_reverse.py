"""The reverse step of a run-time cut's call (``cuts.Sweep``'s, as a mixin): the passes on its
output costate, the module rebuilt at the params it ran with (RNG, modes, autocast and Python's
generators replayed; ``early_stop`` where it pays), one local vjp; a physical cut's step from its
estimator instead.

    costates p_l of the call's outputs  ->  passes  ->  rebuild  ->  (J_a^T p_l, J_W^T p_l)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable
from typing import Any, cast

import torch

from .. import tree as T
from ..adjoint import AdjointState, fold_in
from ..core import boundary as B
from ..core import compiled as C
from ..core import early_stop as ES
from ..core import microbatch as M
from ..core import replay
from ..core import vjp as V
from ..core.costates import traced
from ..core.diagnose import note
from ..core.options import Options
from ..core.timing import timer
from ..passes import Context, examples
from ..program.physical import Meter
from ..program.slots import module_lock
from . import cut_graphs as CG
from . import physical_cuts as PC
from .cut_call import ACTIVE, Call, holding, local_params, sums
from .input_writes import leaf_name, param_name

__all__ = ["CutReverse"]


class CutReverse:
    """A sweep's reverse step for each cut call: what it reads of the sweep are its options, device,
    stats, pass state (threaded), trace, boundary prefetcher and physical meter."""

    opts: Options
    device: Any
    stats: dict[str, dict[Any, Any]]
    pass_state: Any
    trace: list[AdjointState]
    prefetch: B.Prefetcher | None
    meter: Meter | None
    outputs: list[tuple[int, str, list[Any]]] | None

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

    def example(self) -> tuple[AdjointState, ...]:
        """What the passes will be applied to (``passes.examples``): each call's costate, one tensor or a
        tuple for several outputs; none where the passes read no example."""
        if self.outputs is None:
            return ()
        specs = [
            (i, name, [torch.empty((), dtype=d, device=v).expand(s) for s, d, v in outs])
            for i, name, outs in self.outputs
        ]
        return examples((i, name, outs[0] if len(outs) == 1 else tuple(outs)) for i, name, outs in specs)

    def passes(self, call: Call, costates: list[Any]) -> list[Any]:
        """The costate of the call's output after the passes (one tensor, or a tuple for several)."""
        value = costates[0] if len(costates) == 1 else tuple(costates)
        adj = AdjointState(value, call.index, call.name, fold_in(self.opts.key, call.index))
        if self.opts.no_passes:  # the record alone
            self.record(adj)
            return costates
        stats = self.stats.setdefault(call.name, {})
        if self.pass_state is None:
            self.pass_state = self.opts.passes.start(self.example())
        try:
            with timer(self.opts, stats, "pass_s", f"eae/{call.name}/passes"):
                out = self.opts.passes.update(adj, self.pass_state, Context(None, None, self.opts.key))
        except Exception as e:
            note(e, f"the passes at cut {call.name!r}")
            raise
        if not (isinstance(out, tuple) and len(cast("tuple[Any, ...]", out)) == 2 and isinstance(out[0], AdjointState)):
            raise TypeError(
                f"pass {self.opts.passes.name!r} at cut {call.name!r}: update must return (AdjointState, state), "
                f"got {type(cast(object, out)).__name__}"
            )
        adj, self.pass_state = cast("tuple[AdjointState, Any]", out)
        got = (
            [adj.value]
            if len(costates) == 1
            else list(adj.value)
            if isinstance(cast(object, adj.value), tuple)
            else None
        )
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
        kept = traced(adj, self.opts)
        assert kept is not None  # a record in, a record out
        self.trace.append(kept)

    def reverse(self, call: Call, costates: list[Any]) -> list[Any]:
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
        if self.opts.cuda_graphs and call.graph is None:
            eager = functools.partial(self.eager, call, leaves, costates, stats)
            return CG.graphed(call, leaves, costates, self.device, self.opts, stats, eager)
        return self.eager(call, leaves, costates, stats)[0]

    def eager(
        self, call: Call, leaves: list[Any], costates: list[Any], stats: dict[Any, Any]
    ) -> tuple[list[Any], list[Any]]:
        """The call's reverse step as it runs without a graph: its kept graph or the module rebuilt, one
        local vjp; ``(the input costates and trained gradients, the leaves its graph's parameters are)``
        (a leaf's ``.grad`` set: a custom Function's backward accumulated into it)."""
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
        return [*grads[: len(inputs)], *(M.add(g, p.grad) for g, p in zip(grads[len(inputs) :], trained))], trained

    def rebuild(
        self, call: Call, leaves: list[Any], stats: dict[Any, Any]
    ) -> tuple[Any, tuple[Any, ...], list[Any], list[Any]]:
        """The call's module run again with its graph at the params it ran with, on ``leaves`` (its
        inputs as the forward had them), RNG, modes, Python's generators and autocast replayed, the
        ops' outputs the forward kept (``remat.save``) reused: ``(output, the leaves it wrote into,
        the inputs and the parameters its graph starts from)``."""
        local, trained = local_params(call)
        inputs = [leaves[i].requires_grad_() for i in call.inputs]  # detached when kept
        args, kwargs = T.unflatten(leaves, call.spec)
        cached, call.cached = call.cached, None
        forward = functools.partial(C.call, self.opts, call.forward) if call.compiled else call.forward

        def rebuild(run: Callable[..., Any]) -> Any:
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

        ACTIVE.depth = getattr(ACTIVE, "depth", 0) + 1
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
            ACTIVE.depth -= 1
        check_rebuilt(call, out, written)
        return out, written, inputs, trained

    def estimate(self, call: Call, leaves: list[Any], costates: list[Any]) -> list[Any]:
        """A physical cut's reverse step from the estimator (``physical_cuts``): the call run again at
        the inputs and parameters the estimator gives, its modes and autocast replayed, its randomness
        drawn afresh, as a chain's physical stage."""
        names = [param_name(call, p) for p in call.trained]
        # the inputs that require grad; with none (the data), the first tensor, as a chain's first stage has it
        probed = call.inputs or [next(i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor))]

        def run(params: dict[Any, Any], h: tuple[Any, ...]) -> tuple[Any, ...]:
            fed = list(leaves)
            for i, t in zip(probed, h):
                fed[i] = t
            args, kwargs = T.unflatten(fed, call.spec)
            held = {**call.params, **params, **{n: b.clone() for n, b in call.buffers.items()}}
            ACTIVE.depth = getattr(ACTIVE, "depth", 0) + 1  # a cut inside it is part of its call
            try:
                with replay.in_modes(call.modes), replay.replay_autocast(call.autocast), module_lock(call.module):
                    with holding(call.module, held):
                        out = call.forward(*args, **kwargs)
            finally:
                ACTIVE.depth -= 1
            flat = T.flatten_output(out)[0]
            return tuple(flat[i] for i in call.through)

        stats = self.stats.setdefault(call.name, {})
        h = tuple(leaves[i] for i in probed)
        params = {n: call.params[n].detach() for n in names}
        try:
            with timer(self.opts, stats, "vjp_s", f"eae/{call.name}/estimate"):
                g_in, grads, cost = PC.estimate(call, run, h, params, costates, self.opts, self.meter)
        except Exception as e:
            note(e, f"the estimator at physical cut {call.name!r}")
            raise
        stats.update(cost)
        return [*g_in[: len(call.inputs)], *(grads.get(n) for n in names)]


def check_rebuilt(call: Call, out: Any, written: tuple[Any, ...]) -> None:
    """Refuse a rebuild that did not repeat its forward: other outputs after a reseed of torch's
    generator, another output structure, or a write into an input that requires no grad of a
    value that depends on the parameters."""
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
