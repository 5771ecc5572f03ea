"""An FSDP2 stage in the reverse sweep (``fsdp`` makes the stage): its vjp on FSDP's own backward,
the next stage's all-gather started early, and a sweep's gradient sync (see ``fsdp``'s module doc)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Generator, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .. import compat
from . import boundary as B
from .vjp import connected

__all__ = ["PREFETCH_ON_CPU", "Sweep", "check", "local_vjp", "prefetch_below", "unsharded_until_backward"]


def check(chain: Any, params: tuple[Any, ...], buffers: tuple[Any, ...], opts: Any) -> None:
    """Refuse what an FSDP stage cannot run: params or buffers other than its module's own, options
    whose arithmetic FSDP does itself (``data_parallel=``) or that need to write the parameters
    (a pure fused update), and a physical FSDP stage."""
    stages = [i for i, s in enumerate(chain.stages) if s.sharded is not None]
    if not stages:
        return
    if opts.data_parallel not in (None, False):
        raise TypeError(
            "sweep: data_parallel= averages replicated gradients; FSDP stages reduce-scatter their own "
            "over their mesh: leave data_parallel= out"
        )
    if opts.update is not None and opts.update.fn is not None:
        raise TypeError(
            "fused: a pure update returns new parameters, but FSDP stages keep their own sharded ones; "
            "fuse a torch.optim optimizer over the model's parameters (update=optimizer)"
        )
    for i in stages:
        s = chain.stages[i]
        if i in opts.physical:
            raise TypeError(f"{chain.where(i)}: an FSDP module cannot be a physical stage (its reverse step is FSDP's)")
        own = dict(zip(s.param_names, s.sharded))
        for name, t in params[i].items():
            if not _same(own[name], t):
                raise ValueError(
                    f"params of {chain.where(i)}: {name!r} is not the FSDP module's own sharded parameter; an "
                    f"FSDP stage runs at its own parameters (give dict(model.named_parameters()) or "
                    f"ef.from_module(model)'s params)"
                )
        for name, b in buffers[i].items():
            if not _same(s.module.get_buffer(name), b):
                raise ValueError(
                    f"buffers of {chain.where(i)}: {name!r} is not the FSDP module's own buffer; an FSDP "
                    f"stage runs with its own buffers"
                )


def _same(own: torch.Tensor, used: torch.Tensor) -> bool:
    local: Callable[[Any], torch.Tensor] = (lambda t: t.to_local()) if isinstance(own, DTensor) else (lambda t: t)
    if isinstance(own, DTensor) != isinstance(used, DTensor) or own.shape != used.shape:
        return False
    return not own.numel() or local(own).data_ptr() == local(used).data_ptr()


PREFETCH_ON_CPU = False  # gloo's threads share the cores with the fold: the overlap measured 7% slower on 2 cores


def prefetch_below(chain: Any, i: int) -> None:
    """Start all-gathering the parameters of the next FSDP stage the reverse sweep reaches below
    stage i (``unshard(async_op=True)``; its recompute's pre-forward waits for it), so the
    all-gather overlaps the passes, the fused update and the stages between. Issued after stage i's
    backward: FSDP finalises every group at the end of each backward, which would drop it. Not on
    the CPU, unless ``PREFETCH_ON_CPU``."""
    for j in range(i - 1, -1, -1):
        s = chain.stages[j]
        if s.sharded is not None:
            if s.sharded and (PREFETCH_ON_CPU or s.sharded[0].device.type != "cpu"):
                s.module.unshard(async_op=True)
            return


@contextlib.contextmanager
def unsharded_until_backward(module: nn.Module) -> Generator[None, None, None]:
    """Keep ``module``'s parameters unsharded after this forward (its backward follows at once, and
    would all-gather them again); FSDP's own setting is put back after."""
    groups = _groups(module)
    before = [(g, g.post_forward_mesh_info) for g in groups]
    module.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
    try:
        yield
    finally:
        for g, info in before:
            g.post_forward_mesh_info = info


def local_vjp(
    stage: Any, buffers: Mapping[Any, Any], floats: list[Any], rebuild: Callable[..., Any]
) -> tuple[Any, ...]:
    """``vjp.local_vjp`` of an FSDP stage, at its own sharded parameters: ``(output, pullback)``;
    ``pullback(cotangents, inputs_too)`` runs FSDP's backward into ``.grad`` (``torch.autograd.grad``
    would not run FSDP's post-backward) and returns the stage's gradients taken from the sharded
    ``.grad`` (``None`` where FSDP left none: frozen, or no sync in this fold) and ``J_x^T p``."""
    module = stage.module
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in floats]
        with unsharded_until_backward(module):
            out = stage.call({}, buffers, rebuild(inputs))[0]
    outputs = [
        t if t.requires_grad else None for t in B.leaves(out, "output of an FSDP stage")[0] if B.is_differentiable(t)
    ]

    def pullback(cotangents: list[Any], inputs_too: bool = True) -> tuple[Any, ...]:
        graph, cots = connected(outputs, cotangents)
        if graph:  # FSDP's post-backward reduce-scatters into the sharded .grad and reshards
            with _synced(module):
                torch.autograd.backward(graph, cots)
        else:
            module.reshard()  # type: ignore[operator]
        grads: dict[Any, Any] = {}
        for name, p in zip(stage.param_names, stage.sharded):
            grads[name], p.grad = p.grad, None
        if not inputs_too:
            return grads, None
        return grads, [torch.zeros_like(t) if t.grad is None else t.grad for t in inputs]

    return out, pullback


class Sweep:
    """What a sweep does to its chain's FSDP stages, undone after: their sharded ``.grad`` set aside
    (FSDP writes this sweep's gradients there and the fold takes them; ``.grad`` is then put back
    as it was), and their gradient sync off, except for one stage's own backward in the last
    microbatch's fold (``fold(last)``), which gets the module's own setting. FSDP finalises every
    group at the end of each ``autograd.backward``, so with sync on elsewhere a stage's gradients
    accumulated over the earlier folds would be reduce-scattered before its own backward added the
    last fold's."""

    def __init__(self, chain: Any):
        stages = [s for s in chain.stages if s.sharded is not None]
        self.params = [p for s in stages for p in s.sharded]
        self.sync = {s.module: [(g, g.reduce_grads, g.all_reduce_grads) for g in _groups(s.module)] for s in stages}

    def __enter__(self) -> Sweep:
        self.kept = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        for module in self.sync:
            module.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
        return self

    def __exit__(self, *exc: Any) -> None:
        for p, g in zip(self.params, self.kept):
            p.grad = g
        for settings in self.sync.values():
            for g, reduce, all_reduce in settings:
                g.reduce_grads, g.all_reduce_grads = reduce, all_reduce

    @contextlib.contextmanager
    def fold(self, last: bool) -> Generator[None, None, None]:
        """One microbatch's fold: the last one syncs each stage in its own backward."""
        token = _SYNCED.set(self.sync if last else {})
        try:
            yield
        finally:
            _SYNCED.reset(token)


_SYNCED: contextvars.ContextVar[Mapping[Any, Any]] = contextvars.ContextVar(
    "eae_func_fsdp_synced", default=MappingProxyType({})
)


def _groups(module: nn.Module) -> list[Any]:
    return compat.fsdp_param_groups(module)


@contextlib.contextmanager
def _synced(module: nn.Module) -> Generator[None, None, None]:
    """The module's own gradient sync during its backward in the last fold (``Sweep.fold``)."""
    settings = _SYNCED.get().get(module, ())
    for g, reduce, all_reduce in settings:
        g.reduce_grads, g.all_reduce_grads = reduce, all_reduce
    try:
        yield
    finally:
        for g, _, _ in settings:
            g.reduce_grads = g.all_reduce_grads = False
