"""A sweep of a model (``ef.sweep(model, ..., loss=)``): cut at run time (``model_sweep``), or made
a chain (one stage per child of a Sequential, or captured by torch.export at ``split_at``: kept per
model and watched for changes) and swept as one, its names mapped back to the model's."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import optree
import torch
from torch import nn

from ..cache import kept, register
from ..core import microbatch as M
from ..core.options import Options, Request
from ..core.result import SweepResult
from ..program import exporting, fsdp
from ..program.capture import canonical_names
from ..program.captured_stage import layout as capture_layout
from ..program.chain import Chain
from ..program.module_chain import from_module, ordered_children, trainable_names
from ..program.watch import Watch
from ..tree import NAMESPACE
from . import model_sweep
from .sweep_chain import on_chain

__all__ = ["at_run_time", "chain_of", "on_model", "piece_of"]


_CAPTURED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
register("captured models", "capture='graph': the chains captured from a model (weakly), per cuts, options and "
         "input layout (the 8 used last per model)", lambda: _CAPTURED.clear())  # fmt: skip


def chain_of(
    model: nn.Module | Sequence[Any], loss: Callable[..., Any] | None, split_at: Sequence[str] | None, x: Any
) -> tuple[Any, ...]:
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

        def made() -> tuple[Any, ...]:
            chain, _ = cast("tuple[Chain, Any]", from_module(model, loss))
            prefixes = [n for n, _ in ordered_children(model)] if isinstance(model, nn.Module) else [None] * len(chain)
            return chain, _names(model, chain, prefixes)

        if not isinstance(model, nn.Module) or fsdp.holds_shards(model):
            return made()
        key: tuple[Any, ...] = ()
    else:
        if not isinstance(model, nn.Module):
            raise TypeError(f"sweep: split_at cuts a model's own forward, got a {type(model).__name__}")
        key = (tuple(split_at), tuple(capture_layout(optree.tree_leaves(x, namespace=NAMESPACE))))

        def made() -> tuple[Any, ...]:
            chain = from_module(model, loss, split_at=split_at, example=x)[0]
            return chain, _names(model, chain, [None] * len(chain))

    with exporting.LOCK:  # a second thread capturing the same model waits and finds this capture
        cache = _CAPTURED.setdefault(model, {})
        hit = cache.get(key)
        watch = hit[0].current() if hit is not None else Watch(model)
        chain, qualified = kept(cache, key, watch, made)
    return chain.ending_in(loss), qualified


def _names(model: nn.Module | Sequence[Any], chain: Chain, prefixes: list[Any]) -> list[dict[Any, Any]]:
    """``chain_of``'s ``qualified``: stage i's names under ``prefixes[i]`` in the model."""
    if not isinstance(model, nn.Module):
        return [{} for _ in chain.stages]
    names = {
        **canonical_names(model.named_parameters(remove_duplicate=False)),
        **canonical_names(model.named_buffers(remove_duplicate=False)),
    }
    qualified: list[dict[Any, Any]] = []
    for s, prefix in zip(chain.stages, prefixes):
        own = (
            [n for n, _ in s.module.named_parameters()] + [n for n, _ in s.module.named_buffers()]
            if s.module is not None
            else []
        )
        qualified.append({n: names.get(n if prefix is None else f"{prefix}.{n}") for n in own})
    return qualified


def on_model(model: nn.Module | Sequence[Any], req: Request) -> SweepResult:
    """``sweep`` of a model: cut at run time (``eae_func.drivers.model_sweep``), or its chain, params per stage from a
    flat dict, results back in its structure."""
    params, loss, split_at, opts = req.params, req.loss, req.split_at, req.opts
    if split_at is not None and at_run_time(model, params, opts):
        assert isinstance(model, nn.Module)  # at_run_time checked it
        return cut_at_run_time(model, req)
    if not isinstance(cast(object, params), Mapping) and not (
        isinstance(cast(object, params), (tuple, list)) and all(p is None or isinstance(p, Mapping) for p in params)
    ):
        got = (
            f"a {type(params).__name__} of {len(params)} tensors"
            if isinstance(cast(object, params), (tuple, list)) and all(isinstance(p, torch.Tensor) for p in params)
            else f"a {type(params).__name__}"
        )
        raise TypeError(
            f"params: a model ({type(model).__name__}) takes a flat {{name: tensor}} dict, "
            f"dict(model.named_parameters()), or one dict per stage as ef.from_module(model) gives; got {got}"
        )
    if split_at is not None and opts.data_parallel is not None and isinstance(cast(object, params), Mapping):
        # the replicas agree on the model before each captures it: one whose model differs (and whose
        # capture may fail on it) names the difference, as every other replica does
        model_sweep.replicas_of(opts.data_parallel, params)
    example = req.x if split_at is None else piece_of(req.x, opts, "a model cut with split_at")
    chain, qualified = chain_of(model, loss, split_at, example)
    flat = isinstance(cast(object, params), Mapping)
    given: Mapping[str, Any] = cast("Mapping[str, Any]", params) if flat else {}
    if flat:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"params: a flat {{name: tensor}} dict names a model's own parameters; give the model "
                f"(an nn.Module), got a {type(model).__name__}"
            )
        trainable_names(model, params)  # refuses a name that is not a parameter, and a trainable one left out
        full = {**{q: p.detach() for q, p in model.named_parameters() if q not in params}, **params}  # frozen
        params = tuple({n: full[q] for n, q in names.items() if q in full} for names in qualified)
    res = on_chain(chain, dataclasses.replace(req, model=chain, params=params, loss=None, split_at=None))
    if not flat:
        return res

    def flat_dict(per_stage: tuple[Any, ...]) -> dict[Any, Any]:
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


def cut_at_run_time(model: nn.Module, req: Request) -> SweepResult:
    """``sweep`` of a model cut at run time (``eae_func.drivers.model_sweep``), its params a flat dict."""
    assert isinstance(cast(object, req.params), Mapping)  # at_run_time checked it
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


def at_run_time(model: nn.Module | Sequence[Any], params: Sequence[Any] | Mapping[Any, Any], opts: Options) -> bool:
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


def piece_of(x: Any, opts: Options, what: str) -> Any:
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
