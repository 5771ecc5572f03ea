"""The public entry points: ``sweep``, ``grad`` and ``value_and_grad``, a short composition:
the options checked once (``eae_func.options``), the batch cut into microbatches, and the one
per-range runner (``eae_func.runner``) over the whole chain for each of them:

    opts   = Options(**options).bind(chain)
    piece  = Range(chain, 0, L, params, opts).run(buffers, microbatch, pass_state)
    grads  = tie_grads(sum of the pieces' grads)
"""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import optree
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import capture, fsdp, function, model_sweep
from . import fold as F
from . import microbatch as M
from . import replay as R
from .adjoint import Measurements
from .cache import kept, register
from .capture import canonical_names
from .captured_stage import layout as capture_layout
from .chain import Chain, hooked_grads
from .module_chain import from_module, ordered_children, trainable_names
from .options import Options, Request, make
from .passes import compose
from .physical import Meter
from .runner import Range
from .ties import tie_grads, tie_groups
from .tree import NAMESPACE
from .update import Updater
from .watch import Watch

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import SweepOptions


__all__ = ["SweepResult", "carries_state", "grad", "metered", "stateful", "sweep", "value_and_grad"]


def _python(entry: Callable) -> Callable:
    """An entry point that ``torch.compile`` around it runs as Python (the fold between stages, with
    its passes, RNG replay and checks, is not one graph); ``compile=`` compiles the stages instead."""
    return functools.wraps(entry)(torch.compiler.disable(entry, recursive=True))


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """loss: the scalar loss; grads: same tree as params (``None`` with fused updates: consumed
    in the fold); adjoints: one ``AdjointState`` per boundary, L down to 0, as they were after
    the passes; buffers: updated buffers, one dict per stage; pass_state: the threaded pass
    state; stats: per stage ``stats[name]`` the forward, recompute, vjp, pass (and update)
    seconds, the bytes of its stored input boundary and an estimator's costs, ``stats["loss"]``,
    and ``stats["boundaries"][l]``: what the passes recorded in ``meta`` at boundary l;
    params, update_state: with a fused pure update, the new params and its state (with a
    torch.optim optimizer, ``params`` are the ones given, updated in place)."""

    loss: torch.Tensor
    grads: Any  # params' structure: a tuple of per-stage dicts, or a flat dict; None when fused
    adjoints: tuple
    buffers: Any  # one dict per stage, or a flat dict
    pass_state: Any
    stats: Mapping[str, Any]
    params: Any = None
    update_state: Any = None


@_python
def sweep(
    chain: Chain | nn.Module,
    params: Sequence | Mapping,
    x: Any,
    *loss_args: Any,
    loss: Callable | None = None,
    split_at: Sequence[str] | None = None,
    pass_state: Any = None,
    buffers: Sequence | None = None,
    **options: Unpack[SweepOptions],
) -> SweepResult:
    """Loss, parameter gradients and the costate trace of ``chain`` at ``params`` on ``x``.

    chain:          a ``Chain``, or a model (``nn.Module``) with ``loss=``: an ``nn.Sequential`` /
                    ``nn.ModuleList`` runs one stage per child at each position (a module placed
                    twice is two stages, tied), any other model is cut at run time at the module
                    paths ``split_at``, each call of a matched module one stage
                    (``capture=``);
                    or a function ``model_fn(params, x)`` with ``loss=`` (``model_fn(params, x,
                    *loss_args)`` returning the loss without it), cut at its ``ef.cut`` marks
                    (``eae_func.function``). Stages that are FSDP2 (``fully_shard``) modules run
                    through FSDP at their own sharded parameters, their gradients FSDP's
                    reduce-scattered shards (``eae_func.fsdp``).
    params:         one dict per stage, or, with a model, a flat ``{qualified name: tensor}``
                    dict as ``dict(model.named_parameters())`` gives, or, with a function, any
                    pytree; ``grads`` (and ``buffers``) come back in the structure given, a tied
                    parameter once with the summed gradient.
    x:              the input: a tensor, a tuple of positional inputs or (captured models) a
                    dict of keyword inputs.

    loss:           with a model or a function, ``loss(output, *loss_args)``.
    split_at:       with a model, the module paths (glob per dotted part) to cut at.
    pass_state:     the passes' state (``None``: ``passes.init()``); the new one is returned.
    buffers:        one dict per stage (``None``: the modules' own); never modified,
                    updated ones come back in ``res.buffers``.
    options:        the fields of ``Options`` (``passes``, ``key``, ``recompute``, ``update``, ...),
                    each documented there.
    """
    return run(Request(chain, params, x, loss_args, loss, split_at, pass_state, buffers, make("sweep", options)))


def run(req: Request) -> SweepResult:
    """``sweep`` with its options made: a DDP model, a function or a model passed on to its front end,
    a chain swept."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "sweep: called under torch.inference_mode(), which forbids the autograd graphs the reverse sweep "
            "builds stage by stage; call it outside inference_mode (the forward sweep itself runs without a graph)"
        )
    model = req.model
    if isinstance(model, DistributedDataParallel):
        return _on_ddp(model, req)
    if isinstance(model, types.FunctionType | functools.partial | types.MethodType):
        return _on_function(model, req)
    if not isinstance(model, Chain):
        return _on_model(model, req)
    if req.loss is not None or req.split_at is not None:
        raise TypeError("sweep: loss= and split_at= go with a model (nn.Module); a Chain has its own loss and stages")
    return _on_chain(model, req)


@dataclasses.dataclass
class Folded:
    """What the folds over a sweep's microbatches leave: each piece's loss, trace and counters, the
    gradients summed over the pieces (``None`` with a fused update), and the buffers, pass state and
    fused updates' ``pending`` the last fold returned."""

    buffers: Any
    pass_state: Any
    pending: Any
    grads: Any = None
    losses: list = dataclasses.field(default_factory=list)
    traces: list = dataclasses.field(default_factory=list)
    stats: list = dataclasses.field(default_factory=list)


def _on_chain(chain: Chain, req: Request) -> SweepResult:
    """``sweep`` of a chain: checked, one fold per microbatch over the whole chain (``runner.Range``),
    the ties' gradients summed, or the fused updates' results."""
    params = chain.check_params(req.params)
    buffers = chain.check_buffers(req.buffers)
    opts = req.opts.bind(chain)
    sharded = any(s.sharded is not None for s in chain.stages)
    if sharded:
        fsdp.check(chain, params, buffers, opts)
    state = opts.passes.init() if req.pass_state is None else req.pass_state
    meter = Meter(chain, opts.physical, opts.budget)
    groups = tie_groups(chain, params)
    hooks = {(i, n): p for i, s in enumerate(chain.stages) for n, p in s.hooked().items()}
    hold = min(opts.physical) if opts.budget is not None and opts.physical else None
    reducer = reducer_of(False if sharded else opts.data_parallel, chain, params, groups)  # FSDP: its own
    updater, pending = (  # checked first
        Updater.prepare(opts.update, chain, params, groups, hold, reducer, hooks)
        if opts.update is not None or reducer is not None
        else (None, None)
    )
    whole = Range(chain, 0, len(chain), params, opts, F.device_of(params, req.x), meter)
    pieces = M.split(req.x, req.loss_args, opts.microbatches, opts.reduction, opts.key)
    folded = _fold(whole, pieces, Folded(buffers, state, pending), updater, sharded)
    total = folded.losses[0] if len(folded.losses) == 1 else torch.stack(folded.losses).sum()
    stats = metered(M.sum_stats(folded.stats), chain, meter)
    if reducer is not None:
        stats["data_parallel"] = dict(reducer.stats)
    trace, stats, pending = M.join_adjoints(folded.traces), Measurements(stats), folded.pending
    if updater is None:
        grads = hooked_grads(tie_grads(params, folded.grads, groups), hooks)
        return SweepResult(total, grads, trace, folded.buffers, folded.pass_state, stats, params)
    assert pending is not None  # the folds carry it
    if updater.keeping:
        return SweepResult(total, updater.grads(pending), trace, folded.buffers, folded.pass_state, stats, params)
    pure = updater.spec.fn is not None
    new_params, update_state = (pending.params, pending.state) if pure else (params, None)
    return SweepResult(total, None, trace, folded.buffers, folded.pass_state, stats, new_params, update_state)


def _fold(whole: Range, pieces: list, folded: Folded, updater: Any, sharded: bool) -> Folded:
    """One fold of ``whole`` per microbatch in turn, threading buffers, pass state and ``pending``;
    the last fold's steps run the fused ``updater``, which finishes after it (FSDP2 stages: under its
    sweep, each fold reduce-scattering as the last one must)."""
    try:
        with fsdp.Sweep(whole.chain) if sharded else R.NULL as on_fsdp:
            for j, mb in enumerate(pieces):
                last = j == len(pieces) - 1
                # each stage's step adds the earlier microbatches' gradients to its own and lets go of
                # them: one set of gradients is alive, not one per microbatch; the last fold updates
                # the last piece is let go too: it holds those gradients as well
                earlier, folded.grads, piece = None if folded.grads is None else list(folded.grads), None, None
                with on_fsdp.fold(last) if on_fsdp is not None else R.NULL:
                    piece = whole.run(
                        folded.buffers, mb, folded.pass_state, updater if last else None, folded.pending, earlier
                    )
                folded.buffers, folded.pass_state, folded.pending = piece.buffers, piece.pass_state, piece.pending
                assert piece.loss is not None  # the range ends the chain
                folded.losses.append(piece.loss)
                folded.grads = piece.grads
                folded.traces.append(piece.trace)
                folded.stats.append(piece.stats)
            if updater is not None:
                assert folded.pending is not None  # the folds carry it
                folded.pending = updater.finish(folded.pending)
    except BaseException as e:  # KeyboardInterrupt too: say which stages a fused update already stepped
        if updater is not None and folded.pending is not None:
            updater.note(folded.pending, e)
        raise
    return folded


def reducer_of(group: Any, chain: Chain, params: tuple, groups: list) -> Any:
    """The ``Reducer`` of ``data_parallel=group`` (``None``: none), once the replicas agree on the chain
    (``data_parallel.agree``); a multi-process run without ``data_parallel=`` is warned that its
    gradients are this rank's alone (``False`` says so on purpose)."""
    if group is None and model_sweep.multi_process():
        from .distributed.data_parallel import warn_local_gradients

        warn_local_gradients("sweep")
    if group is None or group is False:
        return None
    from .distributed.data_parallel import Reducer, agree, replica_layout

    agree(group, replica_layout(chain, params, groups))
    return Reducer(group)


def metered(stats: dict, chain: Chain, meter: Meter) -> dict:
    """``stats`` with each physical stage's rows and calls of the whole step (forward included)."""
    for i, counts in meter.counts.items():
        stats[chain.stages[i].name] = M.merge_counters(stats[chain.stages[i].name], counts)
    return stats


_CAPTURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
register("captured models", "capture='graph': the chains captured from a model (weakly), per cuts, options and "
         "input layout (the 8 used last per model)", lambda: _CAPTURED.clear())  # fmt: skip


def chain_of(model: nn.Module | Sequence, loss: Callable | None, split_at: Sequence[str] | None, x: Any) -> tuple:
    """``(chain, qualified)`` for a model: ``qualified[i]`` maps stage i's parameter and buffer names
    to the model's own (canonical: a tied tensor has one name). A module's chain (one stage per
    position, or captured: per cut and input layout) and its names are kept per model with a
    ``watch.Watch`` of it (its fingerprint:
    modules, tensors, hooks, modes and plain attributes at any depth): a training loop builds them
    once, and a model changed since (a module replaced, a flag toggled, ``.double()``, a hook added)
    is built again. A list of stages, and a model with FSDP modules (the build runs FSDP's lazy
    initialisation from the root), are built at every call."""
    if loss is None:
        raise TypeError(f"sweep: a model ({type(model).__name__}) needs loss=loss_fn(output, *loss_args)")
    if split_at is None:

        def made() -> tuple:
            chain, _ = from_module(model, loss)
            prefixes = [n for n, _ in ordered_children(model)] if isinstance(model, nn.Module) else [None] * len(chain)
            return chain, _names(model, chain, prefixes)

        if not isinstance(model, nn.Module) or fsdp.holds_shards(model):
            return made()
        key: tuple = ()
    else:
        if not isinstance(model, nn.Module):
            raise TypeError(f"sweep: split_at cuts a model's own forward, got a {type(model).__name__}")
        key = (tuple(split_at), tuple(capture_layout(optree.tree_leaves(x, namespace=NAMESPACE))))

        def made() -> tuple:
            chain = from_module(model, loss, split_at=split_at, example=x)[0]
            return chain, _names(model, chain, [None] * len(chain))

    with capture.LOCK:  # a second thread capturing the same model waits and finds this capture
        cache = _CAPTURED.setdefault(model, {})
        hit = cache.get(key)
        watch = hit[0].current() if hit is not None else Watch(model)
        chain, qualified = kept(cache, key, watch, made)
    return chain.ending_in(loss), qualified


def _names(model: nn.Module | Sequence, chain: Chain, prefixes: list) -> list[dict]:
    """``chain_of``'s ``qualified``: stage i's names under ``prefixes[i]`` in the model."""
    if not isinstance(model, nn.Module):
        return [{} for _ in chain.stages]
    names = {
        **canonical_names(model.named_parameters(remove_duplicate=False)),
        **canonical_names(model.named_buffers(remove_duplicate=False)),
    }
    qualified = []
    for s, prefix in zip(chain.stages, prefixes):
        own = (
            [n for n, _ in s.module.named_parameters()] + [n for n, _ in s.module.named_buffers()]
            if s.module is not None
            else []
        )
        qualified.append({n: names.get(n if prefix is None else f"{prefix}.{n}") for n in own})
    return qualified


def _on_model(model: nn.Module | Sequence, req: Request) -> SweepResult:
    """``sweep`` of a model: cut at run time (``eae_func.model_sweep``), or its chain, params per stage from a
    flat dict, results back in its structure."""
    params, loss, split_at, opts = req.params, req.loss, req.split_at, req.opts
    if split_at is not None and at_run_time(model, params, opts):
        assert isinstance(model, nn.Module)  # at_run_time checked it
        return _cut_at_run_time(model, req)
    if not isinstance(params, Mapping) and not (
        isinstance(params, (tuple, list)) and all(p is None or isinstance(p, Mapping) for p in params)
    ):
        got = (
            f"a {type(params).__name__} of {len(params)} tensors"
            if isinstance(params, (tuple, list)) and all(isinstance(p, torch.Tensor) for p in params)
            else f"a {type(params).__name__}"
        )
        raise TypeError(
            f"params: a model ({type(model).__name__}) takes a flat {{name: tensor}} dict, "
            f"dict(model.named_parameters()), or one dict per stage as ef.from_module(model) gives; got {got}"
        )
    if split_at is not None and opts.data_parallel is not None and isinstance(params, Mapping):
        # the replicas agree on the model before each captures it: one whose model differs (and whose
        # capture may fail on it) names the difference, as every other replica does
        model_sweep.replicas_of(opts.data_parallel, params)
    example = req.x if split_at is None else _piece_of(req.x, opts, "a model cut with split_at")
    chain, qualified = chain_of(model, loss, split_at, example)
    flat = isinstance(params, Mapping)
    if flat:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"params: a flat {{name: tensor}} dict names a model's own parameters; give the model "
                f"(an nn.Module), got a {type(model).__name__}"
            )
        trainable_names(model, params)  # refuses a name that is not a parameter, and a trainable one left out
        full = {**{q: p.detach() for q, p in model.named_parameters() if q not in params}, **params}  # frozen
        given, params = params, tuple({n: full[q] for n, q in names.items() if q in full} for names in qualified)
    res = run(dataclasses.replace(req, model=chain, params=params, loss=None, split_at=None))
    if not flat:
        return res

    def flat_dict(per_stage: tuple) -> dict:
        return {
            q: t
            for stage, names in zip(per_stage, qualified)
            for n, t in stage.items()
            for q in [names[n]]
            if q is not None
        }

    # every name given comes back: one the forward never reads (an input embedding fed
    # inputs_embeds) has no gradient (None, as autograd leaves its .grad) and keeps its value
    grads, updated = (None if res.grads is None else flat_dict(res.grads)), flat_dict(res.params)
    return dataclasses.replace(
        res,
        grads=None if grads is None else {q: grads.get(q) for q in given},
        buffers=flat_dict(res.buffers),
        params={q: updated.get(q, given[q]) for q in given},
    )


def _cut_at_run_time(model: nn.Module, req: Request) -> SweepResult:
    """``sweep`` of a model cut at run time (``eae_func.model_sweep``), its params a flat dict."""
    assert isinstance(req.params, Mapping)  # at_run_time checked it
    if req.loss is None:
        raise TypeError(f"sweep: a model ({type(model).__name__}) needs loss=loss_fn(output, *loss_args)")
    if req.buffers is not None and not isinstance(req.buffers, Mapping):
        raise TypeError("sweep: with a flat params dict, buffers= is a flat {name: tensor} dict too")
    out = model_sweep.sweep_model(model, req)
    req.opts.passes.check_stages(dict.fromkeys(a.stage for a in out.trace))  # the cuts' names, known once they ran
    return SweepResult(
        out.loss,
        out.grads,
        out.trace,
        out.buffers,
        out.pass_state,
        out.stats,
        out.params or req.params,
        out.update_state,
    )


def at_run_time(model: nn.Module | Sequence, params: Sequence | Mapping, opts: Options) -> bool:
    """Whether a model with ``split_at`` is cut at run time (``capture="run"``) or captured (``"graph"``):
    as ``capture=`` says, or, with ``capture=None``, at run time unless its params come as one dict
    per stage or it holds FSDP2 shards. An option only a chain implements is never a reason to
    capture: it is refused, naming it, unless ``capture="graph"`` is given."""
    if opts.capture == "graph" or not isinstance(model, nn.Module):  # chain_of names what a list lacks
        return False
    options = model_sweep.needs_graph(opts)
    if options:
        raise ValueError(
            f"sweep: {', '.join(options)} runs only on a chain captured by torch.export, and "
            f"{type(model).__name__} is cut at run time (capture={opts.capture!r}); give capture='graph' to "
            f"capture it (the same boundaries and records; a capture on the first call), or leave out {options[0]}"
        )
    needs = [] if isinstance(params, Mapping) else ["params as one dict per stage"]
    needs += ["FSDP2 (fully_shard) modules"] if fsdp.holds_shards(model) else []
    if needs and opts.capture == "run":
        raise ValueError(
            f"sweep: capture='run' cuts {type(model).__name__} at run time, which does not take {needs[0]} "
            f"(run-time cuts take dict(model.named_parameters())); give capture='graph' (a chain captured by "
            f"torch.export, the same boundaries and records) or capture=None"
        )
    return not needs


def _on_ddp(ddp: DistributedDataParallel, req: Request) -> SweepResult:
    """``sweep`` of a DDP model: its module's, with the gradients averaged over DDP's process group
    (``data_parallel=``) as DDP would; a flat dict may name the parameters as the DDP model does
    (``module.``-prefixed), and the results come back so named."""
    params, opts = req.params, req.opts
    if opts.data_parallel is None:
        opts = dataclasses.replace(opts, data_parallel=ddp.process_group)
    prefix = "module."
    named = isinstance(params, Mapping) and bool(params) and all(str(k).startswith(prefix) for k in params)
    if named:
        params = {k[len(prefix) :]: v for k, v in params.items()}
    res = run(dataclasses.replace(req, model=ddp.module, params=params, opts=opts))
    if not named:
        return res

    def named_as_ddp(tree: Any) -> Any:
        return {prefix + k: v for k, v in tree.items()} if isinstance(tree, Mapping) else tree

    return dataclasses.replace(
        res, grads=named_as_ddp(res.grads), buffers=named_as_ddp(res.buffers), params=named_as_ddp(res.params)
    )


def _piece_of(x: Any, opts: Options, what: str) -> Any:
    """The input of one microbatch, as a capture (fixed to one input shape) sees it; all must agree."""
    if opts.microbatches == 1:
        return x
    pieces = M.split(x, (), opts.microbatches, opts.reduction, 0)
    layouts = {tuple(tuple(t.shape) for t in optree.tree_leaves(mb.x, namespace=NAMESPACE)) for mb in pieces}
    if len(layouts) > 1:
        raise ValueError(
            f"sweep: {what} is captured for one input shape; microbatches={opts.microbatches} cuts the "
            f"batch into pieces of different sizes {sorted(layouts)}"
        )
    return pieces[0].x


def _on_function(fn: Callable, req: Request) -> SweepResult:
    """``sweep`` of a pure function ``fn(params, x)`` (``loss=`` given) or ``fn(params, x, *loss_args)``
    returning the loss, cut at its ``ef.cut`` marks (``eae_func.function``); ``grads``, ``params`` and a
    pure fused update's state come back in ``params``' structure."""
    params, x, loss_args, loss, opts = req.params, req.x, req.loss_args, req.loss, req.opts
    split_at, buffers = req.split_at, req.buffers
    if split_at is not None:
        raise TypeError("sweep: split_at= cuts a model's forward; a function is cut where it calls ef.cut(h, name)")
    if buffers is not None:
        raise TypeError("sweep: buffers= are a model's; a function reads only its params and inputs")
    inputs, rest = ((x,), loss_args) if loss is not None else ((x, *loss_args), ())
    captured = function.captured(fn, params, _piece_of(inputs, opts, "a function"))
    chain = Chain(captured.stages, loss=loss or _returned, ties=captured.ties)
    # every leaf its own tensor object: two leaves that are one tensor get their own gradients, as in torch.func.grad
    per_stage = captured.per_stage(params, lambda t: t.detach())
    spec = opts.update
    if spec is not None and spec.fn is not None:  # the state in params' structure: per stage, per leaf
        try:
            state = captured.per_stage(spec.state)
        except (ValueError, TypeError) as e:
            raise TypeError(
                f"fused: with a function, state is one tree in params' structure (an entry per leaf), got "
                f"{type(spec.state).__name__}: {e}"
            ) from e
        opts = dataclasses.replace(opts, update=dataclasses.replace(spec, fn=_per_leaf(spec.fn), state=state))
    res = run(Request(chain, per_stage, inputs, rest, None, None, req.pass_state, None, opts))
    flat = captured.spec.flatten_up_to(params)
    if res.update_state is None:
        grads = None if res.grads is None else captured.assemble(res.grads, lambda j: torch.zeros_like(flat[j]))
        return dataclasses.replace(res, grads=grads, buffers=(), params=params)
    assert spec is not None
    return dataclasses.replace(
        res,
        buffers=(),
        params=captured.assemble(res.params, flat.__getitem__),
        update_state=captured.assemble(res.update_state, captured.spec.flatten_up_to(spec.state).__getitem__),
    )


def _returned(loss: Any) -> torch.Tensor:
    """The loss a function returned itself (no ``loss=``)."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"sweep: without loss=, the function must return a scalar loss, got {got}; or give loss=")
    return loss


def _per_leaf(fn: Callable) -> Callable:
    """A pure update over a stage's leaves whose state is one entry per leaf of the stage."""

    def update(params: dict, grads: dict, state: dict) -> tuple[dict, dict]:
        new, due = fn(params, grads, {n: state[n] for n in grads})
        return new, {**state, **due}

    return update


@_python
def value_and_grad(
    chain: Chain | nn.Module,
    params: Sequence | Mapping,
    x: Any,
    *loss_args: Any,
    loss: Callable | None = None,
    split_at: Sequence[str] | None = None,
    pass_state: Any = None,
    buffers: Sequence | None = None,
    has_state: bool = False,
    **options: Unpack[SweepOptions],
) -> Any:
    """``(loss, grads)`` of ``chain`` (or a model with ``loss=``) at ``params``: ``sweep``'s loss and
    grads, with every option of ``sweep``; by default without keeping the costates of the trace
    or timing the stages (``keep_costates=False``, ``timers=False``). ``has_state=True`` returns
    ``((loss, grads), pass_state)``, the passes' new state to give the next call (as ``has_aux``
    does in JAX); passes that carry state are refused without it, since their state would be lost."""
    opts = make("value_and_grad", options, keep_costates=False, timers=False)
    dropping("value_and_grad", opts, has_state)
    res = run(Request(chain, params, x, loss_args, loss, split_at, pass_state, buffers, opts))
    return ((res.loss, res.grads), res.pass_state) if has_state else (res.loss, res.grads)


@_python
def grad(
    chain: Chain | nn.Module,
    params: Sequence | Mapping,
    x: Any,
    *loss_args: Any,
    loss: Callable | None = None,
    split_at: Sequence[str] | None = None,
    pass_state: Any = None,
    buffers: Sequence | None = None,
    has_state: bool = False,
    **options: Unpack[SweepOptions],
) -> Any:
    """Parameter gradients of ``chain`` (or a model with ``loss=``) at ``params``, in the structure
    of ``params``; options as ``value_and_grad``. ``has_state=True`` returns ``(grads, pass_state)``."""
    opts = make("grad", options, keep_costates=False, timers=False)
    dropping("grad", opts, has_state)
    res = run(Request(chain, params, x, loss_args, loss, split_at, pass_state, buffers, opts))
    return (res.grads, res.pass_state) if has_state else res.grads


def carries_state(state: Any) -> bool:
    """Whether a pass state is more than ``None`` (a stateless pass) or a tuple of such (a compose of them)."""
    return state is not None and not (isinstance(state, tuple) and not any(carries_state(s) for s in state))


def stateful(passes: Any) -> list[str]:
    """The names of the members of ``passes`` (``None``: none) whose state carries from call to call."""
    if passes is None:
        return []
    p = compose(passes)
    return [m.name for m in (p.members or (p,)) if carries_state(m.init())]


def dropping(where: str, opts: Options, has_state: bool) -> None:
    """Refuse passes whose state ``where`` would drop (no ``has_state=True``), naming them."""
    if not isinstance(has_state, bool):
        raise TypeError(f"{where}: has_state must be True or False, got {has_state!r}")
    if has_state:
        return
    if names := stateful(opts.passes):
        raise ValueError(
            f"{where}: the passes {', '.join(names)} carry state from call to call, which {where} would drop "
            f"(error feedback would quietly become plain quantisation); thread it: "
            f"{'grads' if where == 'grad' else '(loss, grads)'}, state = ef.{where}(..., passes=p, "
            f"pass_state=state, has_state=True), starting from state = None"
        )
