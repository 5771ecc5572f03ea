"""A torch module as a ``Chain``, and the results written back into it: ``from_module`` makes each
child of an ``nn.Sequential`` / ``nn.ModuleList`` at each position (a module placed twice is two
stages with tied parameters), or each module of a list, one stage run on the given parameters as
``torch.func.functional_call`` runs it; ``write_grads`` / ``write_buffers`` / ``write_back`` put a
sweep's gradients and buffers into the module's own tensors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from . import capture, exporting, fsdp
from .chain import Chain, Shown, Stage

__all__ = [
    "check_own",
    "check_same_tensor",
    "from_module",
    "ordered_children",
    "trainable_names",
    "write_back",
    "write_buffers",
    "write_grads",
]


def ordered_children(model: nn.Module | Sequence[Any]) -> list[tuple[str | None, Any]]:
    """``(name, child)`` for every position of a sequence of stages, in the order its forward runs
    them: an ``nn.Sequential`` / ``nn.ModuleList`` as it iterates (a module placed twice is at both
    positions, where ``named_children()`` would list it once), a list's entries (name ``None``)."""
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return list(model._modules.items())  # what __iter__ runs, each position kept
    if isinstance(model, (list, tuple)):
        return [(None, child) for child in model]
    if isinstance(model, nn.Module):
        raise TypeError(
            f"from_module: a {type(model).__name__} is not a sequence of stages; cut it at module paths "
            f"with split_at=[...] (e.g. split_at=['transformer.h.*'], with example= an input batch), "
            f"or give an nn.Sequential, an nn.ModuleList or a list of modules ([model] for one stage)"
        )
    raise TypeError(
        "from_module: expected an nn.Sequential, an nn.ModuleList, a list of modules or functions, "
        f"or a module with split_at, got {type(model).__name__}"
    )


def _function_stage(f: Callable[..., Any]) -> Callable[..., Any]:
    def apply(params, h):
        return f(h)

    apply.__name__ = getattr(f, "__name__", "function")
    return apply


def from_module(
    model: nn.Module | Sequence[Any],
    loss: Callable[..., Any],
    physical: Iterable[int | str] = (),
    split_at: Sequence[str] | None = None,
    example: Any = None,
):
    """``(chain, params)`` with one stage per position of ``model`` (a child placed twice is two stages
    whose parameters are tied), or, with ``split_at``, one per
    piece of ``model``'s own forward cut at those module paths (glob patterns, e.g.
    ``["transformer.h.*"]``) by graph capture on ``example`` (``eae_func.program.capture``).

    ``params`` is a tuple of ``{name: tensor}`` dicts, detached but sharing
    storage with the module's parameters, so an optimizer stepping the module
    is seen by the next sweep. A parameter shared by two stages is the same
    tensor object in both dicts and recorded in ``chain.ties``. Parameter-free
    plain functions ``f(h)`` may appear in the list too. A child that is an FSDP2 module
    (``fully_shard``) becomes a stage that runs through FSDP (``eae_func.program.fsdp``).
    """
    if split_at is not None:
        named_children, shown = _captured(model, split_at, example)
    else:
        named_children = [(n if isinstance(model, nn.Sequential) else None, c) for n, c in ordered_children(model)]
        shown = None
        if isinstance(model, nn.Module):
            fsdp.lazy_init(model)  # the root's, before its FSDP children run one by one
    detached: dict[int, torch.Tensor] = {}
    positions: dict[int, list[Any]] = {}
    stages, params = [], []
    for i, (child_name, child) in enumerate(named_children):
        name = child_name if child_name and not child_name.isdigit() else None
        if isinstance(child, nn.Module):
            stages.append(_module_stage(child, name))
            stage_params = {}
            for n, p in child.named_parameters():
                stage_params[n] = detached.setdefault(id(p), p.detach())
                positions.setdefault(id(p), []).append((i, n))
            params.append(stage_params)
        elif callable(child):
            stages.append(Stage(fn=_function_stage(child), name=name))
            params.append({})
        else:
            raise TypeError(f"from_module: child {i} is a {type(child).__name__}, not a module or function")
    chain = Chain(stages, loss=loss, ties=[group for group in positions.values() if len(group) > 1])
    marked = {chain.index(p) for p in physical}
    chain = Chain(
        [dataclasses.replace(s, physical=s.physical or i in marked) for i, s in enumerate(chain.stages)],
        loss=loss,
        ties=chain.ties,
        shown=shown,
    )
    return chain, tuple(params)


def _captured(model: Any, split_at: Sequence[str], example: Any) -> tuple[list[Any], dict[Any, Any]]:
    """``(named pieces, shown boundaries)`` of ``model``'s forward on ``example`` captured and cut at
    ``split_at`` (``capture.cut_model``, one capture at a time)."""
    if example is None:
        raise ValueError(
            "from_module: split_at captures the model's forward on an input: give example= (a "
            "tensor, a tuple of positional inputs or a dict of keyword inputs)"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"from_module: split_at cuts a model's own forward, got a {type(model).__name__}")
    fsdp.refuse_capture(model)
    with exporting.LOCK:
        stages, names, calls = capture.cut_model(model, example, split_at)
    return list(zip(names, stages)), {l: Shown(*call) for l, call in calls.items()}


def _module_stage(child: nn.Module, name: str | None) -> Stage:
    """The stage of a module: its parameters' names and layouts, whether a tensor of it has two names
    (``aliased``), its FSDP2 shards, its buffers' names."""
    own = list(child.named_parameters())
    tensors = [*child.named_parameters(remove_duplicate=False), *child.named_buffers(remove_duplicate=False)]
    return Stage(
        fn=None,
        name=name,
        module=child,
        param_names=tuple(n for n, _ in own),
        param_layout=tuple((t.shape, t.dtype) for _, t in own),
        aliased=len({id(t) for _, t in tensors}) < len(tensors),
        sharded=fsdp.sharded_params(child, own),
        buffer_names=tuple(n for n, _ in child.named_buffers()),
    )


def _entries(model: nn.Module | Sequence[Any], tree: Any, what: str):
    """``(label, owner module, name, value)`` for every entry of a grads or buffers tree: a flat dict
    of the model's names, one dict per stage of a captured model (the model's names too), or one dict
    per child of a sequence (the child's names)."""
    if isinstance(tree, Mapping):
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{what}: a flat {{name: tensor}} dict names a model's own tensors; give the model "
                f"(an nn.Module), got a {type(model).__name__}"
            )
        for name, value in tree.items():
            yield repr(name), model, name, value
    elif isinstance(model, nn.Module) and not isinstance(model, (nn.Sequential, nn.ModuleList)):
        for i, stage in enumerate(tree):
            for name, value in stage.items():
                yield f"stage {i}'s {name!r}", model, name, value
    else:
        children = [child for _, child in ordered_children(model)]
        if len(children) != len(tree):
            raise ValueError(f"{what}: the model has {len(children)} stages but got {len(tree)} entries")
        for i, (child, stage) in enumerate(zip(children, tree)):
            for name, value in stage.items() if isinstance(child, nn.Module) else ():
                yield f"stage {i}'s {name!r}", child, name, value


def _target(owner: nn.Module, name: str, label: str, value: Any, what: str, kind: str) -> torch.Tensor:
    try:
        target = owner.get_parameter(name) if kind == "parameter" else owner.get_buffer(name)
    except AttributeError as e:
        raise KeyError(f"{what}: the model has no {kind} {label}") from e
    if value is None and kind == "parameter":
        return target
    if not isinstance(value, torch.Tensor) or value.shape != target.shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"{what}: the {'gradient' if kind == 'parameter' else 'value'} of {label} has shape {got}, "
            f"the {kind} has {tuple(target.shape)}"
        )
    return target


def trainable_names(
    model: nn.Module, params: Mapping[str, Any], own: Mapping[str, torch.Tensor] | None = None
) -> frozenset[str]:
    """The names of ``params`` (a flat dict as ``dict(model.named_parameters())`` gives) to
    differentiate: those whose module parameter has ``requires_grad=True``, read from the module,
    never from the given tensor (a detached or computed value is differentiated, as
    ``torch.func.grad`` differentiates what it is given). Refuses a name that is not a parameter of
    ``model`` and a trainable parameter left out (a frozen one may be: the module's own is used).
    ``own``: ``dict(model.named_parameters())``, where the caller has it."""
    own = dict(model.named_parameters()) if own is None else own
    unknown = sorted(set(params) - set(own))
    missing = [n for n, p in own.items() if p.requires_grad and n not in params]
    if unknown or missing:
        kind = type(model).__name__
        lacks = f"lacks the trainable parameters {_shown(missing)}" if missing else ""
        extra = f"names {_shown(unknown)}, which are not parameters of {kind}" if unknown else ""
        raise ValueError(
            f"params: the flat dict {' and '.join(w for w in (lacks, extra) if w)} (expected the names of "
            f"dict(model.named_parameters()): {_shown(list(own))}; a frozen parameter, requires_grad=False, "
            f"may be left out)"
        )
    return frozenset(n for n, p in own.items() if p.requires_grad)


def _shown(names: list[str]) -> str:
    return f"{names[:8]}{f' and {len(names) - 8} more' if len(names) > 8 else ''}"


def write_grads(model: nn.Module | Sequence[Any], grads: Any, accumulate: bool = False) -> None:
    """Set ``.grad`` of ``model``'s parameters from ``grads`` (overwriting, like ``optimizer.zero_grad`` + backward;
    ``accumulate=True``: added to the ``.grad`` there, as ``backward`` does, for gradient accumulation): one dict per
    stage, or a flat ``{name: grad}`` dict as ``ef.grad(model, dict(model.named_parameters()), ...)`` returns. A tied
    parameter appears in several stages' dicts with the summed gradient; it is written once. Overwriting, ``.grad``
    is the given tensor itself where its dtype and device are the parameter's (no copy, so writing costs no
    memory: an in-place change of one, as clipping makes, shows in the other); accumulating adds out of place,
    so it never writes into a tensor the caller holds.
    """
    pairs = [
        (_target(owner, name, label, g, "write_grads", "parameter"), g)
        for label, owner, name, g in _entries(model, grads, "write_grads")
    ]  # every check before any write
    written: set[int] = set()
    for p, g in pairs:
        if id(p) in written:
            continue
        written.add(id(p))
        if g is None:  # no gradient (frozen or unused): as autograd leaves .grad
            if not accumulate:
                p.grad = None
            continue
        g = g.detach().to(dtype=p.dtype, device=p.device)
        if accumulate and p.grad is not None:
            p.grad = p.grad + g  # out of place: the .grad there may be a tensor the caller holds
        else:
            p.grad = g.clone() if accumulate else g


def write_buffers(model: nn.Module | Sequence[Any], buffers: Any) -> None:
    """Copy updated buffers (``res.buffers``: BatchNorm running statistics) into ``model``'s own."""
    pairs = [
        (_target(owner, name, label, b, "write_buffers", "buffer"), b)
        for label, owner, name, b in _entries(model, buffers, "write_buffers")
    ]
    with torch.no_grad():
        for target, b in pairs:
            target.copy_(b)


def write_back(model: nn.Module | Sequence[Any], res: Any) -> None:
    """Put a sweep's result into ``model``: ``res.grads`` into ``.grad`` (for a ``torch.optim``
    optimizer; none after fused updates) and ``res.buffers`` into its buffers, so nothing the
    step computed is lost."""
    if res.grads is not None:  # None after fused updates: the optimizer already stepped
        if res.params is not None:
            check_own(model, res.params, "write_back")
        write_grads(model, res.grads)
    write_buffers(model, res.buffers)


def check_own(model: nn.Module | Sequence[Any], params: Any, what: str) -> None:
    """Refuse ``params`` (as a sweep used them) that are no longer ``model``'s own tensors: gradients
    computed at other weights (after ``load_state_dict(assign=True)`` or a replaced module, the
    ``from_module`` params still hold the old ones) must not be installed as the model's."""
    for label, owner, name, used in _entries(model, params, what):
        try:
            own = owner.get_parameter(name)
        except AttributeError as e:
            raise KeyError(f"{what}: the model has no parameter {label}") from e
        check_same_tensor(own, used, f"{what}: the gradients were computed at", label)


def check_same_tensor(own: torch.Tensor, used: torch.Tensor, what: str, label: str) -> None:
    """Refuse ``used`` unless it is the module's parameter ``own`` (the same storage and shape)."""
    if own.numel() and (own.data_ptr() != used.data_ptr() or own.shape != used.shape):
        raise ValueError(
            f"{what} a tensor that is no longer the model's parameter {label} (after "
            f"load_state_dict(assign=True), to(), or a replaced module, params from ef.from_module still hold "
            f"the old weights); make params again with ef.from_module(model)"
        )
