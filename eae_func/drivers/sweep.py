"""The public entry points: ``sweep``, ``grad`` and ``value_and_grad``, a short composition:
the options checked once (``eae_func.core.options``), the batch cut into microbatches, and the one
per-range runner (``eae_func.core.runner``) over the whole chain for each of them:

    opts   = Options(**options).bind(chain)
    piece  = Range(chain, 0, L, params, opts).run(buffers, microbatch, pass_state)
    grads  = tie_grads(sum of the pieces' grads)
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..core.options import Options, Request, make
from ..core.result import SweepResult
from ..passes.combinators import stateful
from ..program import function
from ..program.chain import Chain
from .sweep_chain import on_chain
from .sweep_model import on_model, piece_of

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..core.options import SweepOptions


__all__ = ["grad", "sweep", "value_and_grad"]


def _python(entry: Callable[..., Any]) -> Callable[..., Any]:
    """An entry point that ``torch.compile`` around it runs as Python (the fold between stages, with
    its passes, RNG replay and checks, is not one graph); ``compile=`` compiles the stages instead."""
    return functools.wraps(entry)(torch.compiler.disable(entry, recursive=True))  # pyright: ignore[reportUnknownMemberType]


@_python
def sweep(
    chain: Chain | nn.Module,
    params: Sequence[Any] | Mapping[Any, Any],
    x: Any,
    *loss_args: Any,
    loss: Callable[..., Any] | None = None,
    split_at: Sequence[str] | None = None,
    pass_state: Any = None,
    buffers: Sequence[Any] | None = None,
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
                    (``eae_func.program.function``). Stages that are FSDP2 (``fully_shard``) modules run
                    through FSDP at their own sharded parameters, their gradients FSDP's
                    reduce-scattered shards (``eae_func.program.fsdp``).
    params:         one dict per stage, or, with a model, a flat ``{qualified name: tensor}``
                    dict as ``dict(model.named_parameters())`` gives, or, with a function, any
                    pytree; ``grads`` (and ``buffers``) come back in the structure given, a tied
                    parameter once with the summed gradient.
    x:              the input: a tensor, a tuple of positional inputs or (captured models) a
                    dict of keyword inputs.

    loss:           with a model or a function, ``loss(output, *loss_args)``.
    split_at:       with a model, the module paths (glob per dotted part) to cut at.
    pass_state:     the passes' state (``None``: ``passes.start(example)``, once the boundaries are known); the new one is returned.
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
        return _on_function(cast("Callable[..., Any]", model), req)
    if not isinstance(model, Chain):
        return on_model(model, req)
    if req.loss is not None or req.split_at is not None:
        raise TypeError("sweep: loss= and split_at= go with a model (nn.Module); a Chain has its own loss and stages")
    return on_chain(model, req)


def _on_ddp(ddp: DistributedDataParallel, req: Request) -> SweepResult:
    """``sweep`` of a DDP model: its module's, with the gradients averaged over DDP's process group
    (``data_parallel=``) as DDP would; a flat dict may name the parameters as the DDP model does
    (``module.``-prefixed), and the results come back so named."""
    params, opts = req.params, req.opts
    if opts.data_parallel is None:
        opts = dataclasses.replace(opts, data_parallel=ddp.process_group)  # pyright: ignore[reportUnknownMemberType]
    prefix = "module."
    named = (
        isinstance(cast(object, params), Mapping) and bool(params) and all(str(k).startswith(prefix) for k in params)
    )
    if named:
        params = {k[len(prefix) :]: v for k, v in params.items()}
    res = run(dataclasses.replace(req, model=ddp.module, params=params, opts=opts))  # pyright: ignore[reportUnknownMemberType]
    if not named:
        return res

    def named_as_ddp(tree: Any) -> Any:
        return {prefix + k: v for k, v in tree.items()} if isinstance(cast(object, tree), Mapping) else tree

    return dataclasses.replace(
        res, grads=named_as_ddp(res.grads), buffers=named_as_ddp(res.buffers), params=named_as_ddp(res.params)
    )


def _on_function(fn: Callable[..., Any], req: Request) -> SweepResult:
    """``sweep`` of a pure function ``fn(params, x)`` (``loss=`` given) or ``fn(params, x, *loss_args)``
    returning the loss, cut at its ``ef.cut`` marks (``eae_func.program.function``); ``grads``, ``params`` and a
    pure fused update's state come back in ``params``' structure."""
    params, x, loss_args, loss, opts = req.params, req.x, req.loss_args, req.loss, req.opts
    split_at, buffers = req.split_at, req.buffers
    if split_at is not None:
        raise TypeError("sweep: split_at= cuts a model's forward; a function is cut where it calls ef.cut(h, name)")
    if buffers is not None:
        raise TypeError("sweep: buffers= are a model's; a function reads only its params and inputs")
    inputs, rest = ((x,), loss_args) if loss is not None else ((x, *loss_args), ())
    captured = function.captured(fn, params, piece_of(inputs, opts, "a function"))
    chain = Chain(captured.stages, loss=loss or _returned, ties=captured.ties)
    # every leaf its own tensor object: two leaves that are one tensor get their own gradients, as in torch.func.grad
    detached: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.detach()
    per_stage = captured.per_stage(params, detached)
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
        zeros: Callable[[int], torch.Tensor] = lambda j: torch.zeros_like(flat[j])
        grads = None if res.grads is None else captured.assemble(res.grads, zeros)
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


def _per_leaf(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A pure update over a stage's leaves whose state is one entry per leaf of the stage."""

    def update(
        params: dict[Any, Any], grads: dict[Any, Any], state: dict[Any, Any]
    ) -> tuple[dict[Any, Any], dict[Any, Any]]:
        new, due = fn(params, grads, {n: state[n] for n in grads})
        return new, {**state, **due}

    return update


@_python
def value_and_grad(
    chain: Chain | nn.Module,
    params: Sequence[Any] | Mapping[Any, Any],
    x: Any,
    *loss_args: Any,
    loss: Callable[..., Any] | None = None,
    split_at: Sequence[str] | None = None,
    pass_state: Any = None,
    buffers: Sequence[Any] | None = None,
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
    params: Sequence[Any] | Mapping[Any, Any],
    x: Any,
    *loss_args: Any,
    loss: Callable[..., Any] | None = None,
    split_at: Sequence[str] | None = None,
    pass_state: Any = None,
    buffers: Sequence[Any] | None = None,
    has_state: bool = False,
    **options: Unpack[SweepOptions],
) -> Any:
    """Parameter gradients of ``chain`` (or a model with ``loss=``) at ``params``, in the structure
    of ``params``; options as ``value_and_grad``. ``has_state=True`` returns ``(grads, pass_state)``."""
    opts = make("grad", options, keep_costates=False, timers=False)
    dropping("grad", opts, has_state)
    res = run(Request(chain, params, x, loss_args, loss, split_at, pass_state, buffers, opts))
    return (res.grads, res.pass_state) if has_state else res.grads


def dropping(where: str, opts: Options, has_state: bool) -> None:
    """Refuse passes whose state ``where`` would drop (no ``has_state=True``), naming them."""
    if not isinstance(cast(object, has_state), bool):
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
