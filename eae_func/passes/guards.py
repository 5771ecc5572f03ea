"""Guards against non-finite costates."""

from __future__ import annotations

import torch

from ..adjoint import AdjointState
from ..lazy import Lazy
from .base import Pass, map_costate, stateless, valued

__all__ = ["check_finite"]


_POLICIES = ("raise", "zero", "skip")


def _where(adj: AdjointState) -> str:
    if adj.index == 0:
        return "boundary 0 (the chain's input)"
    return f"boundary {adj.index} (output of stage {adj.stage!r})"


@valued
def check_finite(policy: str = "raise") -> Pass:
    """Check that every entry of the costate is finite. On a NaN or inf:
    policy="raise": ``FloatingPointError`` naming the boundary and stage (reading the count is
                    one host sync per boundary: raising needs it);
    policy="zero":  ``p <- 0`` (the whole costate: this boundary sends no signal);
    policy="skip":  ``p`` unchanged. Records ``finite``, ``nonfinite`` (count), read lazily
    under "zero" and "skip" (no host sync)."""
    if policy not in _POLICIES:
        raise ValueError(f"check_finite: policy must be one of {_POLICIES}, got {policy!r}")

    def check_finite_pass(adj: AdjointState) -> AdjointState:
        tensors = adj.tensors()
        if not tensors:
            return adj.applied("check_finite", adj.value, finite=True, nonfinite=0)
        nonfinite = torch.stack([(~torch.isfinite(t)).sum() for t in tensors]).sum()
        value = adj.value
        if policy == "raise":
            count = int(nonfinite.item())
            if count:
                raise FloatingPointError(
                    f"check_finite: non-finite costate at {_where(adj)}: "
                    f"{count} of {sum(t.numel() for t in tensors)} entries are NaN or inf "
                    f"(passes applied before: {list(adj.history)})"
                )
            return adj.applied("check_finite", value, finite=True, nonfinite=0)
        if policy == "zero":
            value = map_costate(lambda t: torch.where(nonfinite > 0, torch.zeros_like(t), t), adj)
        return adj.applied("check_finite", value, finite=Lazy.of(nonfinite == 0), nonfinite=Lazy.of(nonfinite))

    return stateless(check_finite_pass, f"check_finite({policy!r})")
