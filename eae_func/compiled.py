"""``compile=``: each digital stage's forward, and its reverse step as one graph, by ``torch.compile``.

    forward:  x_l = h_l(W_l, x_{l-1})                                 one compiled graph
    reverse:  (J_W^T p_l, J_x^T p_l) = vjp(h_l at (W_l, x_{l-1}))(p_l)  the recompute and the local
                                                                        vjp in one compiled graph
                                                                        (``torch.func.vjp``), which
                                                                        AOTAutograd partitions and fuses

Both are module-level compiled functions of ``(module or fn, params, buffers, x, ...)``:
stages that run the same code on the same shapes (twelve layers of one class) share their graphs,
and a new step, key or microbatch of one shape recompiles nothing. The passes, the RNG replay,
the checks and the fold stay in Python between stages. Random ops run as eager ATen ops inside
the graphs (inductor's ``fallback_random``), so dropout draws from the global RNG exactly as the
uncompiled stage does and the recompute replays its masks bit for bit.

Compiled: module and function stages whose input boundary is one floating tensor and whose graph
the remat policy rebuilds; physical and FSDP stages, kept graphs and other boundaries run as
without ``compile=``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.func import functional_call, vjp

from .chain import module_lock


def eligible(stage: Any, i: int, opts: Any, h: Any) -> bool:
    """Whether stage i runs compiled: ``compile=`` given, a digital module or function stage, on one
    floating tensor."""
    return (
        opts.compile is not None
        and stage.sharded is None
        and i not in opts.physical
        and isinstance(h, torch.Tensor)
        and h.is_floating_point()
    )


def _run(target: Any, params: dict, buffers: dict, h: torch.Tensor) -> tuple[Any, dict]:
    """The stage's forward: a module on the given tensors (its buffers cloned, so updated ones come
    back), or a function stage."""
    if isinstance(target, torch.nn.Module):
        fresh = {n: b.clone() for n, b in buffers.items()}
        return functional_call(target, {**params, **fresh}, (h,), strict=False), fresh
    return target(params, h), {}


def _reverse(target: Any, trainable: dict, frozen: dict, buffers: dict, h: torch.Tensor, cotangents: list):
    def outputs(p: dict, x: torch.Tensor) -> list:
        out, _ = _run(target, {**p, **frozen}, buffers, x)
        return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]

    pullback = vjp(outputs, trainable, h)[1]
    return pullback(cotangents)


_COMPILED: dict[str, tuple] = {}


def _compiled(opts: Any) -> tuple:
    """The compiled forward and reverse for ``opts.compile`` (``torch.compile``'s keyword arguments,
    whose values may be dicts: keyed by their repr)."""
    key = repr(sorted(opts.compile.items()))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(_run, **opts.compile), torch.compile(_reverse, **opts.compile)
    return _COMPILED[key]


def _target(stage: Any) -> Any:
    return stage.module if stage.module is not None else stage.fn


def forward(stage: Any, opts: Any, params: Any, buffers: Mapping, h: torch.Tensor) -> tuple[Any, dict]:
    """``stage.call(params, buffers, h)``, compiled."""
    fn = _compiled(opts)[0]
    with _eager_random(), _lock(stage):
        return fn(_target(stage), dict(params), dict(buffers), h)


def reverse(
    stage: Any, opts: Any, params: Any, buffers: Mapping, h: torch.Tensor, cotangents: list, frozen: frozenset
) -> tuple:
    """``(J_W^T p, [J_x^T p])`` of the stage at ``params`` on ``h`` for the cotangents of its output's
    floating leaves, the recompute and the vjp one compiled graph. Only trainable parameters are
    differentiated: ``frozen`` ones (``requires_grad=False`` in the module) and integer ones get ``None``."""
    train = {n: t for n, t in params.items() if n not in frozen and t.is_floating_point()}
    rest = {n: t for n, t in params.items() if n not in train}
    fn = _compiled(opts)[1]
    with _eager_random(), _lock(stage):
        grads, g_in = fn(_target(stage), train, rest, dict(buffers), h, list(cotangents))
    return {n: grads.get(n) for n in params}, [g_in]


def _lock(stage: Any) -> Any:
    return module_lock(stage.module) if stage.module is not None else contextlib.nullcontext()


def _eager_random() -> Any:
    """Random ops as eager ATen ops inside the compiled graphs (the same draws as without compile=)."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(fallback_random=True)
