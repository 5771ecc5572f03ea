"""Synthetic gradients (decoupled neural interfaces): predict the costate from the boundary state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

from ..adjoint import AdjointState
from ..checks import check_real
from ..lazy import Lazy
from ..tree import NAMESPACE
from .base import Context, Pass, valued

__all__ = ["synthetic"]


def _features(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[x / rms(x), 1]`` of the boundary state, ``x`` seen as ``(N, D)`` over its last dim."""
    rows = x.detach().float().reshape(-1, x.shape[-1] if x.ndim else 1)
    rms = rows.square().mean(-1, keepdim=True).add(1e-12).sqrt()
    return torch.cat([rows / rms, rows.new_ones(rows.shape[0], 1)], dim=-1)


@valued
def synthetic(lr: float = 0.5, momentum: float = 0.9, warmup: int = 100, replace: bool = False) -> Pass:
    """A linear synthetic-gradient model per boundary and per costate leaf, trained inside the pass.

    Features ``phi = [x / rms(x), 1]`` of the boundary state ``x_l`` (``ctx.boundary``) per
    row of its last dim; prediction ``p_hat = phi W`` (``W`` of shape ``(D_in + 1, D_out)``,
    zero at first). Each visit takes one normalised-LMS step with heavy-ball momentum on
    ``1/2 mean_rows |phi W - p|^2``:

        g = phi^T (phi W - p) / (N (D_in + 1)),   v <- momentum v + g,   W <- W - lr v

    Every row of ``phi`` has ``|phi|^2 = D_in + 1``, so the normalised curvature is at most 1 and
    the step is stable for any scale of ``x`` and ``p`` when ``lr < 2 (1 + momentum)``.
    After ``warmup`` steps at a boundary, ``replace=True`` sends ``p_hat`` (from W before this
    step's update) instead of ``p``; the true ``p`` is still the regression target, so this
    simulates a predictor whose target arrives later. The state is
    ``{boundary index: {"step": int, "W": (...), "v": (...)}}`` (one W and v per tensor leaf;
    ``init(example)``: step 0 and zeros at each boundary of the example).
    Records ``synthetic_error`` (``|p_hat - p|^2 / |p|^2``, nan when p = 0), ``synthetic_cosine``,
    ``synthetic_step`` and ``synthetic_used``.
    """
    lr = check_real("synthetic", "lr", lr, low=0.0, low_open=True)
    momentum = check_real("synthetic", "momentum", momentum, low=0.0)
    if momentum >= 1.0:
        raise ValueError(f"synthetic: momentum must be in [0, 1), got {momentum!r}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"synthetic: warmup must be an int >= 0, got {warmup!r}")
    if not isinstance(replace, bool):
        raise TypeError(f"synthetic: replace must be a bool, got {type(replace).__name__}")

    def init(example: Sequence[AdjointState] = ()) -> dict[Any, Any]:
        return {adj.index: _unvisited(adj) for adj in example}

    def update(adj: AdjointState, state: Any, ctx: Context) -> tuple[Any, ...]:
        costates, spec, boundaries = _leaves(adj, state, ctx)
        entry = state.get(adj.index)
        step = entry["step"] if entry else 0
        use = replace and step >= warmup
        sent, weights, velocities, sums = [], [], [], []
        for i, (p, x) in enumerate(zip(costates, boundaries)):
            if p is None:
                for kept in (sent, weights, velocities):
                    kept.append(None)
                continue
            prediction, W, v, leaf_sums = _lms_step(p, x, entry, i, adj.index, lr, momentum)
            weights.append(W)
            velocities.append(v)
            sums.append(leaf_sums)
            sent.append(prediction.reshape(p.shape).to(p.dtype) if use else p)
        new_entry = {"step": step + 1, "W": tuple(weights), "v": tuple(velocities)}
        meta = _meta(sums, step + 1, use)
        return adj.applied("synthetic", spec.unflatten(sent), **meta), {**state, adj.index: new_entry}

    return Pass(init, update, f"synthetic(lr={lr:g}, momentum={momentum:g}, warmup={warmup}, replace={replace})")


def _unvisited(adj: AdjointState) -> dict[str, Any]:
    """A boundary's entry before its first step: step 0, ``W = v = 0`` of shape ``(D + 1, D)`` in float32
    per costate leaf (``D`` its last dim, 1 for a scalar; ``None`` for a leaf with no costate)."""
    leaves = optree.tree_leaves(adj.value, none_is_leaf=True, namespace=NAMESPACE)
    dims = [None if p is None else (p.shape[-1] if p.ndim else 1) for p in leaves]
    W = tuple(None if d is None else torch.zeros(d + 1, d, device=p.device) for d, p in zip(dims, leaves))
    return {"step": 0, "W": W, "v": tuple(None if w is None else torch.zeros_like(w) for w in W)}


def _leaves(adj: AdjointState, state: Any, ctx: Context) -> tuple[Any, ...]:
    """``(costate leaves, their spec, boundary leaves)`` at ``adj``'s boundary, refused where the state
    is not the pass's, there is no boundary state, or the two trees differ in length."""
    if not isinstance(state, dict):
        raise TypeError(f"synthetic: expected a dict state (boundary index -> predictor), got {type(state).__name__}")
    if ctx.boundary is None:
        raise ValueError(
            f"synthetic: boundary {adj.index} has no boundary state (ctx.boundary is None); "
            f"the pass predicts the costate from it: run it inside ef.sweep on a chain, or on a model with "
            f"split_at and capture='graph' (run-time cuts keep no boundary state for the passes)"
        )
    costates, spec = optree.tree_flatten(adj.value, none_is_leaf=True, namespace=NAMESPACE)
    boundaries = optree.tree_leaves(ctx.boundary, none_is_leaf=True, namespace=NAMESPACE)
    if len(boundaries) != len(costates):
        raise ValueError(
            f"synthetic: at boundary {adj.index} the costate has {len(costates)} leaves "
            f"but the boundary state has {len(boundaries)}"
        )
    return costates, spec, boundaries


def _lms_step(
    p: torch.Tensor, x: torch.Tensor, entry: Any, i: int, index: int, lr: float, momentum: float
) -> tuple[Any, ...]:
    """Leaf i's step: ``(p_hat as rows, new W, new v, [|p_hat - p|^2, |p|^2, <p_hat, p>, |p_hat|^2])``,
    ``p_hat = phi W`` from W before the step (``entry``: the boundary's state, ``None`` at first)."""
    phi, target = _features(x), p.detach().float().reshape(-1, p.shape[-1] if p.ndim else 1)
    if phi.shape[0] != target.shape[0]:
        raise ValueError(
            f"synthetic: at boundary {index}, leaf {i}: boundary state {tuple(x.shape)} "
            f"and costate {tuple(p.shape)} differ in their leading dims"
        )
    W = entry["W"][i] if entry else phi.new_zeros(phi.shape[1], target.shape[1])
    v = entry["v"][i] if entry else torch.zeros_like(W)
    prediction = phi @ W
    error = prediction - target
    v = momentum * v + phi.T @ error / (phi.shape[0] * phi.shape[1])
    sums = torch.stack(
        [error.square().sum(), target.square().sum(), (prediction * target).sum(), prediction.square().sum()]
    )
    return prediction, W - lr * v, v, sums


def _meta(sums: list[Any], step: int, use: bool) -> dict[str, Any]:
    """The records of a visit: the prediction's relative error and cosine over every leaf (lazily)."""
    meta: dict[str, Any] = dict(
        synthetic_error=float("nan"), synthetic_cosine=0.0, synthetic_step=step, synthetic_used=use
    )
    if sums:
        err, norm2, dot, pred2 = torch.stack(sums).sum(0)
        meta.update(
            synthetic_error=Lazy.of(torch.where(norm2 > 0, err / norm2, torch.full_like(err, float("nan")))),
            synthetic_cosine=Lazy.of(
                torch.where(norm2 * pred2 > 0, dot / (norm2 * pred2).sqrt(), torch.zeros_like(dot))
            ),
        )
    return meta
