"""Guards against non-finite costates."""

from __future__ import annotations

import torch

from ..adjoint import AdjointState
from .base import Pass, map_costate, stateless

_POLICIES = ("raise", "zero", "skip")


def _where(adj: AdjointState) -> str:
    if adj.index == 0:
        return "boundary 0 (the chain's input)"
    return f"boundary {adj.index} (output of stage {adj.stage!r})"


def check_finite(policy: str = "raise") -> Pass:
    """Check that every entry of the costate is finite. On a NaN or inf:
    policy="raise": ``FloatingPointError`` naming the boundary and stage;
    policy="zero":  ``p <- 0`` (the whole costate: this boundary sends no signal);
    policy="skip":  ``p`` unchanged. Records ``finite``, ``nonfinite`` (count)."""
    if policy not in _POLICIES:
        raise ValueError(f"check_finite: policy must be one of {_POLICIES}, got {policy!r}")

    def check_finite_pass(adj: AdjointState) -> AdjointState:
        tensors = adj.tensors()
        counts = [(~torch.isfinite(t)).sum() for t in tensors]
        nonfinite = int(torch.stack(counts).sum().item()) if counts else 0
        value = adj.value
        if nonfinite and policy == "raise":
            numel = sum(t.numel() for t in tensors)
            raise FloatingPointError(f"check_finite: non-finite costate at {_where(adj)}: "
                                     f"{nonfinite} of {numel} entries are NaN or inf "
                                     f"(passes applied before: {list(adj.history)})")
        if nonfinite and policy == "zero":
            value = map_costate(torch.zeros_like, adj)
        return adj.applied("check_finite", value, finite=not nonfinite, nonfinite=nonfinite)

    return stateless(check_finite_pass, f"check_finite({policy!r})")
