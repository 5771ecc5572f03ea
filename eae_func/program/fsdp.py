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
overlapping the passes, the fused update and the stages between. This module makes the stage and
runs its forward; ``fsdp_reverse`` its reverse step and the sweep's sync.

    model = nn.Sequential(*blocks); [fully_shard(b, mesh=mesh) for b in model]; fully_shard(model, mesh=mesh)
    grads = ef.grad(model, dict(model.named_parameters()), x, y, loss=F.mse_loss)   # DTensors
    ef.write_grads(model, grads); clip_grad_norm_(model.parameters(), 1.0); opt.step()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .. import compat

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
    """Whether ``model`` has FSDP2 (``fully_shard``) modules: none before ``fully_shard`` has made a
    class of them (a subclass of ``FSDPModule``, a plain class: no virtual subclasses), so no walk then."""
    return bool(FSDPModule.__subclasses__()) and any(isinstance(m, FSDPModule) for m in model.modules())


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
