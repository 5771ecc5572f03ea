"""Stages that are FSDP2 modules (``torch.distributed.fsdp.fully_shard``), run on FSDP's own engine.

An FSDP stage is never given tensors: it runs at its own sharded parameters, through its module,
so FSDP all-gathers them in its pre-forward and reshards them after, with its mixed-precision
policy. The forward sweep calls it under ``no_grad``; its reverse step rebuilds its graph from
the saved boundary (parameters kept unsharded from that recompute to its backward) and runs

    torch.autograd.backward(x_l, p_l)          p_{l-1} = x_{l-1}.grad

so FSDP's post-backward reduce-scatters (and averages) the parameter gradients into the sharded
``.grad`` and reshards, as in ``loss.backward()``. The sweep takes them from there: they come
back as DTensors sharded like the parameters (``torch.optim`` and ``clip_grad_norm_`` take them
as they are), and ``.grad`` is left as it was. Gradient sync is off during the sweep except in
each stage's own backward of the last microbatch's fold: FSDP accumulates the unsharded
gradients of the earlier folds and reduce-scatters their sum once. After each stage's backward
the next FSDP stage's all-gather is started (``unshard(async_op=True)``, on an accelerator),
overlapping the passes, the fused update and the stages between.

    model = nn.Sequential(*blocks); [fully_shard(b, mesh=mesh) for b in model]; fully_shard(model, mesh=mesh)
    grads = ef.grad(model, dict(model.named_parameters()), x, y, loss=F.mse_loss)   # DTensors
    ef.write_grads(model, grads); clip_grad_norm_(model.parameters(), 1.0); opt.step()
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from . import boundary as B
from . import compat
from .vjp import connected

__all__ = []


def sharded_params(module: nn.Module, own: list[tuple[str, nn.Parameter]]) -> tuple[nn.Parameter, ...] | None:
    """The sharded parameters of an FSDP2 ``module`` (a stage; ``own``: its ``named_parameters()``) in
    that order, ``None`` for another module; the module must be at rest (resharded: its parameters
    are DTensors). A stage holding sharded parameters that is not itself an FSDP module is refused:
    they belong to an enclosing ``fully_shard``, whose all-gather a stage by stage sweep never runs."""
    if not isinstance(module, FSDPModule):
        inside = [n for n, p in own if isinstance(p, DTensor)]
        if inside:
            raise TypeError(
                f"from_module: the parameters {inside[:3]} of a {type(module).__name__} stage are sharded by an "
                f"enclosing fully_shard, which a sweep does not run stage by stage; apply fully_shard to "
                f"this stage's module too (each stage with parameters its own FSDP module, then the root)"
            )
        return None
    unsharded = [n for n, p in own if not isinstance(p, DTensor)]
    if unsharded:
        raise ValueError(
            f"from_module: the parameters {unsharded[:3]} of the FSDP module {type(module).__name__} are not "
            f"sharded (not DTensors): it is unsharded, or holds parameters outside FSDP; call reshard() first"
        )
    return tuple(p for _, p in own)


def lazy_init(model: nn.Module) -> None:
    """FSDP's lazy initialisation from ``model`` as its root, as the root's first forward does, so
    that calling its FSDP submodules one by one finds them initialised (not each its own root)."""
    if isinstance(model, FSDPModule):
        compat.fsdp_lazy_init(model)  # what fully_shard's root pre-forward runs first


def holds_shards(model: nn.Module) -> bool:
    """Whether ``model`` has FSDP2 (``fully_shard``) modules."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def refuse_capture(model: nn.Module) -> None:
    """Refuse to capture a model with FSDP2 modules (``split_at``): its sharded parameters are
    all-gathered by module hooks that a captured graph does not run."""
    sharded = [name or "(the model)" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise TypeError(
            f"split_at: {type(model).__name__} has fully_shard (FSDP2) modules ({', '.join(sharded[:4])}"
            f"{', ...' if len(sharded) > 4 else ''}), which a graph capture cannot run; the model is left as "
            f"it was. A sweep runs FSDP modules as the stages of an nn.Sequential or nn.ModuleList "
            f"(each stage with parameters its own fully_shard, then the root)"
        )


def check(chain: Any, params: tuple, buffers: tuple, opts: Any) -> None:
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
    local = (lambda t: t.to_local()) if isinstance(own, DTensor) else (lambda t: t)
    if isinstance(own, DTensor) != isinstance(used, DTensor) or own.shape != used.shape:
        return False
    return not own.numel() or local(own).data_ptr() == local(used).data_ptr()


def call(module: nn.Module, buffers: Mapping[str, torch.Tensor], h: Any) -> Any:
    """``module(h)`` through FSDP; refused if it writes its buffers (BatchNorm's running statistics),
    which the recompute would write a second time."""
    versions = [b._version for b in buffers.values()]
    out = module(h)
    if [b._version for b in buffers.values()] != versions:
        raise ValueError(
            f"{type(module).__name__} (fully_shard) updated its buffers in place (running statistics); an "
            f"FSDP stage runs at its own buffers, and the sweep's recompute would update them twice"
        )
    return out


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
def unsharded_until_backward(module: nn.Module) -> Iterator[None]:
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


def local_vjp(stage: Any, buffers: Mapping, floats: list, rebuild: Callable) -> tuple:
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

    def pullback(cotangents: list, inputs_too: bool = True) -> tuple:
        graph, cots = connected(outputs, cotangents)
        if graph:  # FSDP's post-backward reduce-scatters into the sharded .grad and reshards
            with _synced(module):
                torch.autograd.backward(graph, cots)
        else:
            module.reshard()  # type: ignore[operator]
        grads = {}
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
    def fold(self, last: bool) -> Iterator[None]:
        """One microbatch's fold: the last one syncs each stage in its own backward."""
        token = _SYNCED.set(self.sync if last else {})
        try:
            yield
        finally:
            _SYNCED.reset(token)


_SYNCED: contextvars.ContextVar[Mapping] = contextvars.ContextVar("eae_func_fsdp_synced", default=MappingProxyType({}))


def _groups(module: nn.Module) -> list:
    return compat.fsdp_param_groups(module)


@contextlib.contextmanager
def _synced(module: nn.Module) -> Iterator[None]:
    """The module's own gradient sync during its backward in the last fold (``Sweep.fold``)."""
    settings = _SYNCED.get().get(module, ())
    for g, reduce, all_reduce in settings:
        g.reduce_grads, g.all_reduce_grads = reduce, all_reduce
    try:
        yield
    finally:
        for g, _, _ in settings:
            g.reduce_grads = g.all_reduce_grads = False
