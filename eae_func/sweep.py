"""The public entry points: ``sweep``, ``grad`` and ``value_and_grad``, a short composition of
the engine's parts (``eae_func.fold``) for each microbatch:

    tape          = forward(chain, 0, L, params, buffers, x)          keep x_0..x_{L-1}
    loss, carry   = boundary_condition(chain, x_L, loss_args)        p_L through the passes
    carry, outs   = reverse(step, carry, tape)                       p_{L-1}..p_0, grads
"""

from __future__ import annotations

import dataclasses
import numbers
import weakref
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import optree
import torch
from torch import nn

from . import boundary as B
from . import fold as F
from . import microbatch as M
from .capture import canonical_names
from .chain import Chain, from_module
from .estimators.base import Problem
from .passes import compose
from .physical import Meter, check_budget
from .update import Fused, Updater, fused
from .tree import NAMESPACE


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
    grads: tuple | None
    adjoints: tuple
    buffers: tuple
    pass_state: Any
    stats: Mapping[str, Any]
    params: Any = None
    update_state: Any = None


def options(chain: Chain, *, passes: Any = None, key: int = 0, boundary_dtype: torch.dtype | None = None,
            offload: bool = False, autocast: torch.dtype | None = None, estimator: Any = None,
            physical: Sequence | None = None, recompute: Any = True, keep_costates: bool = True,
            budget: int | None = None, timers: bool = True) -> F.Options:
    """The checked ``Options`` of a sweep of ``chain`` (shared by ``sweep`` and the pipeline)."""
    for name, dtype in (("boundary_dtype", boundary_dtype), ("autocast", autocast)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"sweep: {name} must be a floating torch.dtype (e.g. torch.bfloat16) or None, "
                            f"got {dtype!r}")
    if isinstance(key, bool) or not isinstance(key, numbers.Integral):
        raise TypeError(f"sweep: key must be an int seed, got {type(key).__name__}")
    if not (isinstance(recompute, (bool, int)) and recompute >= 0 or callable(recompute)):
        raise TypeError(f"sweep: recompute must be True, False, a predicate (index, name) -> bool or a byte budget "
                        f"(an int >= 0), got {recompute!r}")
    if estimator is not None and not all(callable(getattr(estimator, m, None)) for m in ("prepare", "stage_vjp")):
        raise TypeError(f"sweep: estimator must have prepare(problem) and stage_vjp(...) (eae_func.estimators), "
                        f"got {type(estimator).__name__}")
    if physical is None:
        physical = [i for i, s in enumerate(chain.stages) if s.physical]
    physical = tuple(sorted({chain.index(p) for p in physical}))
    digital_boxes = [chain.where(i) for i, s in enumerate(chain.stages) if not s.differentiable and i not in physical]
    if digital_boxes:
        raise ValueError(f"sweep: {', '.join(digital_boxes)} cannot be differentiated (a black box) but is not among "
                         f"physical={list(physical)}: its reverse step must come from an estimator")
    if physical and estimator is None:
        raise ValueError(f"sweep: {', '.join(chain.where(i) for i in physical)} is physical (run forward only) but no "
                         f"estimator was given: pass estimator= (E.zbp, E.node_perturbation, E.direct, E.twin, "
                         f"E.frozen), or estimator=E.exact() for a torch-differentiable simulation")
    if getattr(estimator, "differentiates", False):
        boxes = [chain.where(i) for i in physical if not chain.stages[i].differentiable]
        if boxes:
            raise ValueError(f"sweep: {estimator!r} differentiates the physical stages, but {', '.join(boxes)} "
                             f"cannot be differentiated (a black box); use a forward-only estimator (zbp with "
                             f"method='fd', node_perturbation or direct with form='fd', twin, frozen)")
    return F.Options(compose(passes) if passes is not None else compose(), int(key), B.Policy(boundary_dtype, offload),
                     autocast, estimator, physical, recompute, bool(keep_costates), check_budget(budget), bool(timers))


def merge_counters(*counters: Mapping) -> dict:
    total: dict = {}
    for c in counters:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total


def _one(chain: Chain, params: tuple, buffers: tuple, mb: M.Microbatch, opts: F.Options, pass_state: Any,
         device: torch.device, meter: Meter, updater: Updater | None = None) -> tuple:
    """One microbatch through the whole chain: ``(scaled loss, grads, trace, buffers, pass_state, stats)``."""
    L = len(chain)
    tape = F.forward(chain, 0, L, params, buffers, mb.x, opts, device, meter)
    loss_stats: dict = {}
    loss, carry = F.boundary_condition(chain, tape.take_output(), mb.loss_args, opts, pass_state, mb.scale,
                                       loss_stats)
    head = F.traced(carry.adj, opts)
    problem = Problem(chain, params, buffers, mb.x, mb.loss_args, opts.physical, opts.key, mb.scale,
                      lambda c: sweep(c, params, mb.x, *mb.loss_args, key=opts.key).adjoints, meter)
    carry, outs = F.reverse(F.make_step(chain, params, opts, device, problem, updater), carry, tape)
    trace = (head, *(o.record for o in reversed(outs)))
    stats = {s.name: merge_counters(tape.stats[s.name], o.stats) for s, o in zip(chain.stages, outs)}
    stats["loss"] = merge_counters({"forward_s": 0.0, "pass_s": 0.0} if opts.timers else {}, loss_stats)
    stats["boundaries"] = {a.index: dict(a.meta) for a in trace}
    buffers_out = tuple(tape.buffers[i] for i in range(L))
    return loss * mb.scale, tuple(o.grads for o in outs), trace, buffers_out, carry.pass_state, stats


def sweep(chain: Chain | nn.Module, params: Sequence | Mapping, x: Any, *loss_args: Any, loss: Callable | None = None,
          split_at: Sequence[str] | None = None, passes: Any = None, pass_state: Any = None, key: int = 0,
          buffers: Sequence | None = None, boundary_dtype: torch.dtype | None = None, offload: bool = False,
          autocast: torch.dtype | None = None, microbatches: int = 1, reduction: str = "mean",
          estimator: Any = None, physical: Sequence | None = None, budget: int | None = None,
          recompute: Any = True, keep_costates: bool = True, update: Any = None, timers: bool = True) -> SweepResult:
    """Loss, parameter gradients and the costate trace of ``chain`` at ``params`` on ``x``.

    chain:          a ``Chain``, or a model (``nn.Module``) with ``loss=``: an ``nn.Sequential`` /
                    ``nn.ModuleList`` runs one stage per child, any other model is cut at the
                    module paths ``split_at`` by graph capture (once per input layout and mode).
    params:         one dict per stage, or, with a model, a flat ``{qualified name: tensor}``
                    dict as ``dict(model.named_parameters())`` gives; ``grads`` (and ``buffers``)
                    come back in the structure given, a tied parameter once with the summed gradient.
    x:              the input: a tensor, a tuple of positional inputs or (captured models) a
                    dict of keyword inputs.

    passes:         a pass (``compose(...)``, or a plain ``adj -> adj`` callable) applied to
                    every costate p_L..p_0 before use.
    pass_state:     the passes' state (``None``: ``passes.init()``); the new one is returned.
    key:            int seed; boundary l gets ``fold_in(key, l)``. Dropout draws from the
                    global torch RNG exactly as a plain forward would, and is replayed.
    buffers:        one dict per stage (``None``: the modules' own); never modified,
                    updated ones come back in ``res.buffers``.
    boundary_dtype: store boundary states in this floating dtype; offload: keep them on the CPU.
    autocast:       run stages under ``torch.autocast`` with this dtype.
    microbatches:   split x and the tensor loss_args on dim 0 into this many pieces and
                    sum their gradients; ``reduction`` ("mean" or "sum") says how the loss
                    reduces over dim 0, so the result equals the full batch's, unless a stage
                    mixes samples (BatchNorm's batch statistics) or draws random numbers
                    (dropout masks differ per piece), as in plain PyTorch.
    estimator:      how physical stages get their reverse step (``eae_func.estimators``);
                    digital stages always take the exact local vjp.
    physical:       names or indices of the physical stages (``None``: those made with
                    ``physical=True`` or ``ef.black_box``); they need an estimator (``E.exact()``
                    differentiates a torch simulation exactly).
    budget:         rows the physical stages may be run on in this call, forward included; a call
                    that would exceed it raises before it runs. ``res.stats[stage]`` has each
                    physical stage's ``rows`` and ``calls``.
    recompute:      ``True`` (the memory-saving sweep) rebuilds each stage's graph from its
                    saved input; ``False`` keeps every stage's graph from the forward (no second
                    forward, memory like plain autograd); a predicate ``(index, name) -> bool``
                    rebuilds the stages it is true for; an int is a byte budget for the graphs
                    kept (first to last, while their saved tensors fit). Same results at every setting.
    keep_costates:  ``False`` returns the trace records with ``value=None`` (history and meta
                    kept), saving L costates of memory; ``grad``/``value_and_grad`` use it.
    update:         fuse the optimizer step into the fold (``eae_func.update``): a torch.optim
                    optimizer (or one per stage) steps stage l's parameters in place as soon as
                    its gradients exist, or ``ef.fused(fn, state)`` for a pure
                    ``fn(params_l, grads_l, state_l) -> (params_l, state_l)``; ``res.grads`` is then
                    ``None`` and ``res.params`` / ``res.update_state`` hold the result.
    timers:         ``False`` leaves out the per-stage timers and profiler ranges (``stats`` then
                    hold no ``*_s`` seconds); ``grad`` and ``value_and_grad`` return no stats and
                    run without them.
    """
    if not isinstance(chain, Chain):
        return _on_model(chain, params, x, loss_args, loss, split_at, buffers, dict(
            passes=passes, pass_state=pass_state, key=key, boundary_dtype=boundary_dtype, offload=offload,
            autocast=autocast, microbatches=microbatches, reduction=reduction, estimator=estimator,
            physical=physical, budget=budget, recompute=recompute, keep_costates=keep_costates, update=update,
            timers=timers))
    if loss is not None or split_at is not None:
        raise TypeError("sweep: loss= and split_at= go with a model (nn.Module); a Chain has its own loss and stages")
    params = chain.check_params(params)
    buffers = chain.check_buffers(buffers)
    opts = options(chain, passes=passes, key=key, boundary_dtype=boundary_dtype, offload=offload,
                   autocast=autocast, estimator=estimator, physical=physical, recompute=recompute,
                   keep_costates=keep_costates, budget=budget, timers=timers)
    state = opts.passes.init() if pass_state is None else pass_state
    device = F.device_of(params, x)
    meter = Meter(chain, opts.physical, opts.budget)
    spec = fused(update) if update is not None and not isinstance(update, Fused) else update
    updater = Updater(spec, chain, params, tie_groups(chain, params)) if spec is not None else None  # checked first
    pieces = M.split(x, loss_args, microbatches, reduction, opts.key)
    losses, grads, traces, all_stats = [], [], [], []
    for j, mb in enumerate(pieces):
        last = j == len(pieces) - 1
        if updater is not None and last and grads:  # the last fold updates, the earlier folds' gradients added
            updater.carry = M.sum_grads(grads)
        piece_opts = opts if mb.key == opts.key else dataclasses.replace(opts, key=mb.key)
        loss, g, trace, buffers, state, stats = _one(chain, params, buffers, mb, piece_opts,
                                                     state, device, meter, updater if last else None)
        losses.append(loss)
        grads.append(g)
        traces.append(trace)
        all_stats.append(stats)
    loss = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
    stats = MappingProxyType(metered(M.sum_stats(all_stats), chain, meter))
    if updater is not None:
        new_params = tuple(updater.params) if spec.fn is not None else params
        return SweepResult(loss, None, M.join_adjoints(traces), buffers, state, stats, new_params,
                           tuple(updater.state) if spec.fn is not None else None)
    return SweepResult(loss, tie_grads(chain, params, M.sum_grads(grads)), M.join_adjoints(traces), buffers, state,
                       stats, params)


def metered(stats: dict, chain: Chain, meter: Meter) -> dict:
    """``stats`` with each physical stage's rows and calls of the whole step (forward included)."""
    for i, counts in meter.counts.items():
        stats[chain.stages[i].name] = merge_counters(stats[chain.stages[i].name], counts)
    return stats


_CAPTURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chain_of(model: nn.Module | Sequence, loss: Callable, split_at: Sequence[str] | None, x: Any) -> tuple:
    """``(chain, qualified)`` for a model: ``qualified[i]`` maps stage i's parameter and buffer
    names to the model's own (canonical: a tied tensor has one name). A captured chain is kept
    per model, cut, mode and input layout, so a training loop captures once."""
    if loss is None:
        raise TypeError(f"sweep: a model ({type(model).__name__}) needs loss=loss_fn(output, *loss_args)")
    if split_at is None:
        chain, _ = from_module(model, loss)
        prefixes = [n for n, _ in model.named_children()] if isinstance(model, nn.Module) else [None] * len(chain)
    else:
        layout = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
                       for t in optree.tree_leaves(x, namespace=NAMESPACE))
        cache = _CAPTURED.setdefault(model, {})
        cache_key = (tuple(split_at), model.training, layout)
        if cache_key not in cache:
            cache[cache_key] = from_module(model, loss, split_at=split_at, example=x)[0]
        chain = Chain(cache[cache_key].stages, loss=loss, ties=cache[cache_key].ties)
        prefixes = [None] * len(chain)
    names = {}
    if isinstance(model, nn.Module):
        names = {**canonical_names(model.named_parameters(remove_duplicate=False)),
                 **canonical_names(model.named_buffers(remove_duplicate=False))}
    qualified = []
    for s, prefix in zip(chain.stages, prefixes):
        own = [n for n, _ in s.module.named_parameters()] + [n for n, _ in s.module.named_buffers()] \
            if s.module is not None else []
        qualified.append({n: names.get(n if prefix is None else f"{prefix}.{n}") for n in own})
    return chain, qualified


def _on_model(model, params, x, loss_args, loss, split_at, buffers, options_) -> SweepResult:
    """``sweep`` of a model: its chain, params per stage from a flat dict, results back in its structure."""
    example = x
    if split_at is not None and options_["microbatches"] != 1:  # the graph is captured for one piece's shapes
        pieces = M.split(x, (), options_["microbatches"], options_["reduction"], 0)
        layouts = {tuple(tuple(t.shape) for t in optree.tree_leaves(mb.x, namespace=NAMESPACE)) for mb in pieces}
        if len(layouts) > 1:
            raise ValueError(f"sweep: a model cut with split_at is captured for one input shape; microbatches="
                             f"{options_['microbatches']} cuts the batch into pieces of different sizes "
                             f"{sorted(layouts)}")
        example = pieces[0].x
    chain, qualified = chain_of(model, loss, split_at, example)
    flat = isinstance(params, Mapping)
    if flat:
        own = {name for name, _ in model.named_parameters()}
        missing = sorted({q for names in qualified for q in names.values() if q in own and q not in params})
        if missing:
            raise ValueError(f"params: the flat dict lacks {missing[:5]}{'...' if len(missing) > 5 else ''} "
                             f"(expected the names of dict(model.named_parameters()))")
        params = tuple({n: params[q] for n, q in names.items() if q in params} for names in qualified)
    res = sweep(chain, params, x, *loss_args, buffers=buffers, **options_)
    if not flat:
        return res

    def flat_dict(per_stage: tuple) -> dict:
        return {q: t for stage, names in zip(per_stage, qualified) for n, t in stage.items()
                for q in [names[n]] if q is not None}

    return dataclasses.replace(res, grads=None if res.grads is None else flat_dict(res.grads),
                               buffers=flat_dict(res.buffers), params=flat_dict(res.params))


def tie_groups(chain: Chain, params: tuple) -> list:
    """The groups of ``(stage, path)`` (an optree path into that stage's params) that are one tensor:
    the same object in several places of ``params``, or a group of ``chain.ties`` (which survives a
    pure update that unties the objects); groups that share a member are one."""
    if not chain.ties:  # the common case, checked in one pass: no tensor object used twice
        ids = [id(t) for p in params for t in optree.tree_leaves(p, namespace=NAMESPACE)]
        if len(set(ids)) == len(ids):
            return []
    uses: dict = {}
    for i, p in enumerate(params):
        paths, leaves, _ = optree.tree_flatten_with_path(p, namespace=NAMESPACE)
        for path, t in zip(paths, leaves):
            uses.setdefault(id(t), set()).add((i, path))
    groups = [g for g in uses.values() if len(g) > 1] + [{(i, (name,)) for i, name in g} for g in chain.ties]
    merged: list = []
    for g in groups:
        overlapping = [m for m in merged if m & g]
        merged = [m for m in merged if not m & g] + [set(g).union(*overlapping)]
    return merged


def tie_grads(chain: Chain, params: tuple, grads: tuple) -> tuple:
    """Give every use of a shared tensor (``tie_groups``) the sum of all its uses' gradients."""
    groups = tie_groups(chain, params)
    if not groups:
        return grads
    paths = [optree.tree_paths(p, namespace=NAMESPACE) for p in params]
    original, specs = zip(*(optree.tree_flatten(g, namespace=NAMESPACE) for g in grads))
    flat = [list(g) for g in original]
    for group in groups:
        members = [(i, paths[i].index(path)) for i, path in group]
        total = sum(original[i][j] for i, j in members)
        for i, j in members:
            flat[i][j] = total
    return tuple(spec.unflatten(f) for spec, f in zip(specs, flat))


def value_and_grad(chain: Chain | nn.Module, params: Sequence | Mapping, x: Any, *loss_args: Any,
                   loss: Callable | None = None, split_at: Sequence[str] | None = None, passes: Any = None,
                   pass_state: Any = None, key: int = 0, buffers: Sequence | None = None,
                   boundary_dtype: torch.dtype | None = None, offload: bool = False,
                   autocast: torch.dtype | None = None, microbatches: int = 1, reduction: str = "mean",
                   estimator: Any = None, physical: Sequence | None = None, budget: int | None = None,
                   recompute: Any = True):
    """``(loss, grads)`` of ``chain`` (or a model with ``loss=``) at ``params``: ``sweep``'s loss and
    grads (the same options), without keeping the costates of the trace or timing the stages."""
    res = sweep(chain, params, x, *loss_args, loss=loss, split_at=split_at, passes=passes, pass_state=pass_state,
                key=key, buffers=buffers,
                boundary_dtype=boundary_dtype, offload=offload, autocast=autocast, microbatches=microbatches,
                reduction=reduction, estimator=estimator, physical=physical, budget=budget, recompute=recompute,
                keep_costates=False, timers=False)
    return res.loss, res.grads


def grad(chain: Chain | nn.Module, params: Sequence | Mapping, x: Any, *loss_args: Any, loss: Callable | None = None,
         split_at: Sequence[str] | None = None, passes: Any = None, pass_state: Any = None, key: int = 0,
         buffers: Sequence | None = None, boundary_dtype: torch.dtype | None = None, offload: bool = False,
         autocast: torch.dtype | None = None, microbatches: int = 1, reduction: str = "mean",
         estimator: Any = None, physical: Sequence | None = None, budget: int | None = None,
         recompute: Any = True):
    """Parameter gradients of ``chain`` (or a model with ``loss=``) at ``params``, in the structure
    of ``params``; options as ``sweep``."""
    return value_and_grad(chain, params, x, *loss_args, loss=loss, split_at=split_at, passes=passes,
                          pass_state=pass_state, key=key,
                          buffers=buffers, boundary_dtype=boundary_dtype, offload=offload, autocast=autocast,
                          microbatches=microbatches, reduction=reduction, estimator=estimator, physical=physical,
                          budget=budget, recompute=recompute)[1]
