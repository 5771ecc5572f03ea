"""Error feedback: carry what a biased compressor dropped into the next step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

from ..adjoint import AdjointState
from ..lazy import Lazy
from ..tree import NAMESPACE, map_tensors
from .base import Context, Pass, global_norm, valued
from .combinators import lift

__all__ = ["error_feedback"]


@valued
def error_feedback(compressor: Any) -> Pass:
    """Error feedback (EF-SGD) around a ``compressor`` pass, per boundary index l:

        e = p + r_l,   sent = compressor(e),   r_l <- e - sent

    The state is ``{"residuals": {l: residual pytree}, "compressor": the compressor's state}``
    (``init(example)``: a zero residual at each boundary of the example), so
    ``sum_t sent_t = sum_t p_t - r_T``: nothing the compressor drops is lost for good. Records
    ``ef_residual_norm`` (``|r_l|`` after the step).
    """
    compressor = lift(compressor, "error_feedback")

    def init(example: Sequence[AdjointState] = ()) -> dict[Any, Any]:
        residuals = {adj.index: map_tensors(torch.zeros_like, adj.value) for adj in example}
        return {"residuals": residuals, "compressor": compressor.start(example)}

    def update(adj: AdjointState, state: Any, ctx: Context) -> tuple[Any, ...]:
        if not isinstance(state, dict) or set(state) != {"residuals", "compressor"}:
            raise TypeError(
                f"error_feedback: expected the state made by init() "
                f"({{'residuals': ..., 'compressor': ...}}), got {type(state).__name__}"
            )
        residual = state["residuals"].get(adj.index)
        if residual is None:
            corrected = adj
        else:
            _check_like(adj, residual)
            corrected = adj.replace(value=optree.tree_map(torch.add, adj.value, residual, namespace=NAMESPACE))
        sent, compressor_state = compressor.update(corrected, state["compressor"], ctx)
        residual = optree.tree_map(torch.sub, corrected.value, sent.value, namespace=NAMESPACE)
        norm = Lazy.of(global_norm(residual))
        new_state = {"residuals": {**state["residuals"], adj.index: residual}, "compressor": compressor_state}
        return sent.applied("error_feedback", sent.value, ef_residual_norm=norm), new_state

    return Pass(init, update, f"error_feedback({compressor.name})", stages=compressor.stages)


def _check_like(adj: AdjointState, residual) -> None:
    """The residual kept for boundary l must have the costate's structure and shapes."""
    shapes = lambda tree: optree.tree_map(lambda t: tuple(t.shape), tree, namespace=NAMESPACE)  # noqa: E731
    if shapes(adj.value) != shapes(residual):
        raise ValueError(
            f"error_feedback: residual kept for boundary {adj.index} has shapes {shapes(residual)}, "
            f"the costate has {shapes(adj.value)} (the batch size changed, or microbatches of unequal size? use a batch that microbatches divides, or reset the state with init())"
        )
