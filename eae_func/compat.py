"""torch's private parts that eae_func calls, each behind one function here, with the torch versions
it has run on (``tests/test_compat.py`` fails loudly, by name, where a torch changes one). Run on torch
2.13 (this machine's, CI's); the device checks run 2.11.

    pull_back_unchecked        torch.autograd.graph._engine_run_backward: ``torch.autograd.grad``
                               without its Python checks of the cotangents (a symbolic shape
                               comparison per output, 20 us a stage on the CPU)
    saved_hooks_enabled        torch._C._autograd._saved_tensors_hooks_is_enabled
    saved_hooks_on_top         torch._C._autograd._top_saved_tensors_default_hooks
    functorch_wrapped          torch._C._functorch.is_functorch_wrapped_tensor
    fsdp_lazy_init             FSDPModule._get_fsdp_state()._lazy_init()
    fsdp_param_groups          FSDPModule._get_fsdp_state()._fsdp_param_groups
    dispatch_modes_on          torch.utils._python_dispatch._len_torch_dispatch_stack
    innermost_dispatch_mode    torch.utils._python_dispatch._get_current_dispatch_mode
    unhooked_step              ``Optimizer.step.__wrapped__``: a step without its step hooks
    eager_random_compile       torch._inductor.config.fallback_random, torch._dynamo.config.recompile_limit
    TorchDispatchMode          torch.utils._python_dispatch.TorchDispatchMode, the mode early stop
                               and remat.save watch the ops with (documented, in a private module)
    OpOverload                 torch._ops.OpOverload, what ``remat.save(ops=...)`` names an op by
    pytree                     torch.utils._pytree, torch's own pytrees (what export, FSDP2 and
                               pipelining flatten with, its registered nodes): tree_flatten /
                               _unflatten / _leaves / _structure / _flatten_with_path, keystr,
                               register_pytree_node, GetAttrKey, SequenceKey, SUPPORTED_NODES

Not here, because they are overrides, not calls: ``distributed/stage.py`` subclasses pipelining's
``PipelineStage`` and overrides its ``_compute_outputs``, ``_send_meta`` and ``_recv_meta``, and
``program/exporting.py`` swaps a custom ``autograd.Function``'s public ``apply`` for the length of an export
(run on torch 2.13).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._ops import OpOverload
from torch.autograd.graph import GradientEdge
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _len_torch_dispatch_stack,  # pyright: ignore[reportPrivateImportUsage]
)

__all__ = [
    "OpOverload",
    "TorchDispatchMode",
    "dispatch_modes_on",
    "eager_random_compile",
    "fsdp_lazy_init",
    "fsdp_param_groups",
    "functorch_wrapped",
    "innermost_dispatch_mode",
    "pull_back_unchecked",
    "pytree",
    "saved_hooks_enabled",
    "saved_hooks_on_top",
    "unhooked_step",
]


def pull_back_unchecked(
    outputs: Sequence[torch.Tensor | GradientEdge], cotangents: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> tuple[Any, ...]:
    """``torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)`` for cotangents that
    already have their outputs' shapes (the caller's promise: the engine reduces a cotangent that
    broadcasts to its output's shape instead of refusing it)."""
    return torch.autograd.graph._engine_run_backward(  # pyright: ignore[reportPrivateUsage]
        tuple(outputs), tuple(cotangents), False, False, tuple(inputs), True, accumulate_grad=False
    )


def saved_hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be set (``torch.autograd.graph.disable_saved_tensors_hooks`` is off)."""
    return torch._C._autograd._saved_tensors_hooks_is_enabled()  # pyright: ignore[reportAttributeAccessIssue]


def saved_hooks_on_top() -> tuple[Any, ...]:
    """``(pack, unpack)`` of the innermost saved-tensor hooks now set (``()``: none)."""
    return tuple(torch._C._autograd._top_saved_tensors_default_hooks(False) or ())  # pyright: ignore[reportAttributeAccessIssue]


def functorch_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a torch.func transform's tensor (jvp, vjp, vmap), not plain data."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)  # pyright: ignore[reportAttributeAccessIssue]


def dispatch_modes_on() -> int:
    """How many ``TorchDispatchMode``s are on (entered and not exited) on this thread."""
    return _len_torch_dispatch_stack()


def innermost_dispatch_mode() -> Any:
    """The ``TorchDispatchMode`` entered last and still on (``None``: none)."""
    return _get_current_dispatch_mode()


def fsdp_lazy_init(module: Any) -> None:
    """FSDP2's lazy initialisation with ``module`` (an ``FSDPModule``) as the root, as its first forward runs it."""
    module._get_fsdp_state()._lazy_init()


def fsdp_param_groups(module: Any) -> list[Any]:
    """The ``FSDPParamGroup``s of an ``FSDPModule`` (its all-gather and reduce-scatter units)."""
    return module._get_fsdp_state()._fsdp_param_groups


def unhooked_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without its step pre- and post-hooks (which ``step`` is wrapped to run)."""
    step = type(optimizer).step
    getattr(step, "__wrapped__", step)(optimizer)


def eager_random_compile(recompile_limit: int) -> contextlib.ExitStack:
    """A context in which ``torch.compile`` runs random ops as eager ATen ops inside its graphs (the
    draws of the uncompiled code, so a recompute replays them) and keeps up to ``recompile_limit``
    graphs per compiled function."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch(fallback_random=True))
    stack.enter_context(dynamo_config.patch(recompile_limit=recompile_limit))
    return stack
