"""``ef.sweep`` of a model cut at run time: each microbatch's forward with the cuts installed
(``cuts.Sweep``), its loss and its backward, the gradients summed over the microbatches or stepped
inside the last backward (``update=``, ``in_backward``), the replicas' average (``data_parallel=``).

    for each microbatch j:  Sweep_j installed; loss_j = scale_j * loss(model(x_j), *args_j)
                            loss_j.backward() into the trained leaves' .grad (the glue by autograd,
                            each cut's reverse step by its node)
    grads = Σ_j .grad       (with update=: the last backward steps each stage as it completes)

Which options need a captured chain instead (``needs_graph``) is said here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..adjoint import Measurements
from ..compat import pytree
from ..core import boundary as B
from ..core import fold as F
from ..core import microbatch as M
from ..core import replay as R
from ..core.diagnose import closed_over, note
from ..core.options import Options, Request
from ..core.result import metered
from ..program.capture import as_call, canonical_names
from ..program.chain import through_hooks
from ..program.module_chain import trainable_names
from ..program.physical import Meter
from ..program.slots import module_lock
from . import physical_cuts as PC
from .cut_call import cut_modules, holding
from .cuts import Sweep
from .in_backward import InBackward

__all__ = ["multi_process", "needs_graph", "replicas_of", "sweep_model"]


def needs_graph(opts: Options) -> list[str]:
    """The options set in ``opts`` that only a chain (graph capture) implements, as ``name=``."""
    return PC.needs_graph(opts)


def replicas_of(group: Any, params: Mapping[str, torch.Tensor], beside: Sequence[torch.Tensor] = ()) -> Any:
    """The process group the gradients are averaged over (``None``: none), once its replicas agree on
    the model and the tensors a fused update steps ``beside`` it (before the forward, so a replica
    whose model differs fails there, as every other does); a multi-process run without
    ``data_parallel=`` is warned that its gradients are this rank's alone."""
    if group is None and multi_process():
        from ..distributed.data_parallel import warn_local_gradients

        warn_local_gradients("sweep")
    if group is None or group is False:
        return None
    from ..distributed import data_parallel as DP

    DP.agree(group, DP.model_layout({**params, **{f"beside the model #{k}": t for k, t in enumerate(beside)}}))
    return group


def multi_process() -> bool:
    """Whether this process is one of several in a ``torch.distributed`` run."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@dataclasses.dataclass(frozen=True)
class Swept:
    """What a run-time sweep returns: the loss, ``grads`` (``None`` with ``update=``), the trace, the
    buffers, the pass state, the stats, and a pure update's new params and state (``None`` otherwise)."""

    loss: torch.Tensor
    grads: dict[Any, Any] | None
    trace: tuple[Any, ...]
    buffers: dict[Any, Any]
    pass_state: Any
    stats: Measurements
    params: dict[Any, Any] | None = None
    update_state: dict[Any, Any] | None = None


def sweep_model(model: nn.Module, req: Request) -> Swept:
    """``model`` cut at run time at ``req.split_at``, at ``req.params``, a flat ``{qualified name: tensor}``
    dict as ``dict(model.named_parameters())`` gives (a frozen parameter it lacks is used as the module
    holds it; a trainable one is differentiated whatever the given tensor's ``requires_grad``).
    ``grads`` has the names of ``params``, ``buffers`` every buffer's, updated, the module's own never
    written. Microbatches run in turn (``run_pieces``), their gradients summed; with ``data_parallel=``
    ``grads`` are the replicas' average (``data_parallel.average_model_grads``)."""
    params, x, loss_args, loss, split_at, opts = req.params, req.x, req.loss_args, req.loss, req.split_at, req.opts
    assert loss is not None and split_at is not None  # sweep checked them
    pass_state, buffers = req.pass_state, req.buffers
    first, trainable, kept, hooked, unique = walked(model, params)
    wrong = sorted(set(buffers or {}) - set(kept))
    if wrong:
        raise ValueError(f"buffers: {wrong[:5]} are not buffers of {type(model).__name__} (named_buffers' names)")
    names = cut_modules(model, split_at, unique)  # once for every piece
    roster = PC.roster(opts, names)
    meter = None if roster is None else Meter(roster, tuple(range(len(roster))), opts.budget)  # over every piece
    leaves = {n: p.detach().requires_grad_(n in trainable and B.is_differentiable(p)) for n, p in params.items()}
    wanted = [n for n, t in leaves.items() if t.requires_grad]
    update = (
        None if opts.update is None else InBackward.prepare(opts.update, model, params, wanted, list(names), hooked)
    )
    replicas = replicas_of(opts.data_parallel, params, [] if update is None else update.outside)
    if replicas is not None and update is not None:
        from ..distributed.data_parallel import Reducer

        update.averaging(Reducer(replicas))
    fresh = {n: b.detach().clone() for n, b in cast("dict[Any, Any]", {**kept, **(buffers or {})}).items()}
    given = {**leaves, **fresh}
    device = B.device_of(leaves, x)
    state = pass_state  # None: the passes start at the first cut reverse step, from the cuts (CutReverse.passes)
    pieces = M.split(x, loss_args, opts.microbatches, opts.reduction, opts.key)

    def sweep_of(mb: M.Microbatch, state: Any) -> Sweep:
        mb_opts = opts if mb.key == opts.key else dataclasses.replace(opts, key=mb.key)
        return Sweep(model, split_at, mb_opts, state, device, names, meter=meter)

    with module_lock(model), holding(model, {n: given[f] for n, f in first.items() if f in given}):
        values, traces, all_stats, state = run_pieces(model, pieces, loss, state, sweep_of, leaves, wanted, update)
    value = values[0] if len(values) == 1 else torch.stack(values).sum()
    stats, trace = M.sum_stats(all_stats), M.join_adjoints(traces)
    if meter is not None and roster is not None:  # the physical modules' rows, over every piece
        stats = metered(stats, roster, meter)
    if update is not None:
        pure = update.spec.fn is not None
        new = {n: update.params.get(n, t) for n, t in params.items()} if pure else None
        if update.reducer is not None:
            stats["data_parallel"] = dict(update.reducer.stats)
        return Swept(value, None, trace, fresh, state, Measurements(stats), new, update.state if pure else None)
    grads: dict[str, Any] = dict.fromkeys(params)
    for n in wanted:  # what autograd accumulated: the glue's, the cuts', a custom Function's own
        grads[n] = through_hooks(hooked[n], leaves[n].grad) if n in hooked else leaves[n].grad
    if replicas is not None:
        # each replica's stages are the calls it made (a MoE replica calls other experts): the
        # model's final gradients are averaged over the fixed layout of its trained parameters
        from ..distributed.data_parallel import average_model_grads

        grads, stats["data_parallel"] = average_model_grads(replicas, params, grads)
    return Swept(value, grads, trace, fresh, state, Measurements(stats))


def run_pieces(
    model: nn.Module,
    pieces: list[Any],
    loss: Callable[..., Any],
    state: Any,
    sweep_of: Callable[[M.Microbatch, Any], Sweep],
    leaves: dict[Any, Any],
    wanted: list[Any],
    update: Any,
) -> tuple[list[Any], list[Any], list[Any], Any]:
    """Each microbatch's forward and backward in turn (``sweep_of(mb, pass state)``: its ``Sweep``),
    the pass state threaded; with ``update``, the last one's backward steps each stage as its
    gradients are complete. ``(losses, traces, stats, pass state)``."""
    values: list[Any]
    traces: list[Any]
    all_stats: list[Any]
    handles: list[Any]
    values, traces, all_stats, handles = [], [], [], []
    try:
        for j, mb in enumerate(pieces):
            run = sweep_of(mb, state)
            if update is not None and j == len(pieces) - 1:
                handles = update.install(leaves)
            values.append(piece(run, model, mb, loss, [leaves[n] for n in wanted], update))
            state = run.pass_state
            traces.append(tuple(run.trace))
            all_stats.append({**run.stats, "boundaries": {a.index: dict(a.meta) for a in run.trace}})
        if update is not None:
            update.finish()
    except BaseException as e:  # KeyboardInterrupt too: say which stages a fused update already stepped
        if update is not None:
            update.failed(e)
        raise
    finally:
        for h in handles:
            h.remove()
    return values, traces, all_stats, state


def walked(
    model: nn.Module, params: Mapping[str, torch.Tensor]
) -> tuple[dict[Any, Any], frozenset[Any], dict[Any, Any], dict[Any, Any], list[Any]]:
    """The one walk of ``model`` a sweep makes: ``(first, trainable, kept, hooked, modules)``, each
    parameter's and buffer's name -> its first name (a tied tensor has one), the names that train
    (the module's flags, not the given tensors'), the buffers by their first names, the parameters
    with hooks of their own (``p.register_hook(fn)``: run on the summed gradient) and
    ``named_modules()``."""
    every = list(cast("Iterable[tuple[str, nn.Module]]", model.named_modules(remove_duplicate=False)))
    own_params = [(f"{m}.{n}" if m else n, p) for m, mod in every for n, p in mod._parameters.items() if p is not None]  # pyright: ignore[reportPrivateUsage]
    own_buffers = [(f"{m}.{n}" if m else n, b) for m, mod in every for n, b in mod._buffers.items() if b is not None]  # pyright: ignore[reportPrivateUsage]
    first = canonical_names([*own_params, *own_buffers])
    seen: set[int] = set()
    unique = [(n, m) for n, m in every if not (id(m) in seen or seen.add(id(m)))]
    named: dict[Any, Any] = {}  # named_parameters(): each tensor under its first name
    for n, p in own_params:
        named.setdefault(first[n], p)
    trainable = trainable_names(model, params, named)
    kept = {n: b for n, b in own_buffers if first[n] == n}
    hooked = {first[n]: p for n, p in own_params if p._backward_hooks}
    return first, trainable, kept, hooked, unique


def piece(
    run: Sweep, model: nn.Module, mb: M.Microbatch, loss: Callable[..., Any], inputs: list[Any], update: Any
) -> torch.Tensor:
    """One microbatch: the forward with the cuts installed, its loss times the piece's scale, and the
    backward, accumulated into the ``.grad`` of ``inputs`` (the sweep's trained leaves) and of the
    tensors ``update`` steps beside the model; the loss (times the scale) returned."""
    args, kwargs = as_call(mb.x)
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:  # a Hugging Face model: a KV
        kwargs.setdefault("use_cache", False)  # cache the forward fills would be read again by the rebuilds
    # the cuts are in place for the forward alone: a matched module run again by a custom Function's
    # own backward (a reversible layer's recompute) runs as written
    with run.installed(), R.autocast(run.opts.autocast, run.device):  # the loss too, as AMP computes it
        output = model(*args, **kwargs)
        try:
            value = loss(output, *mb.loss_args)
        except Exception as e:
            note(e, "the loss")
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
            f"split_at: no module matched by {run.split_at} ({list(run.names)[:4]}) ran as a stage in "
            f"{type(model).__name__}'s forward, so nothing would be cut: {why}"
        )
    scale = 1.0 if mb.scale is None else mb.scale
    if value.requires_grad:
        beside: list[Any] = update.outside if update is not None else []
        given = [t for t in pytree.tree_leaves((mb.x, mb.loss_args)) if isinstance(t, torch.Tensor)]
        outside = closed_over([value], [*inputs, *beside, *given, run.anchor], data=given)
        if outside is not None:
            raise ValueError(
                f"sweep: the loss depends on tensors that require grad outside params (shapes {outside}), such as "
                f"a head the loss reads beside the swept module, whose gradients the sweep would drop: sweep the "
                f"module that holds them (their names in params), or give update= an optimizer over them, "
                f"which steps them as glue"
            )
        seed = None if scale == 1.0 else torch.full_like(value, scale)
        torch.autograd.backward(value, seed, inputs=[*inputs, *beside, run.anchor])
    return value.detach() if scale == 1.0 else value.detach() * scale
