"""Error feedback: carry what a biased compressor dropped into the next step."""

from __future__ import annotations

import optree
import torch

from ..adjoint import NAMESPACE, AdjointState
from ._common import global_norm
from .combinators import StatefulPass, is_stateful


def error_feedback(compressor) -> StatefulPass:
    """Error feedback (EF-SGD) around a stateless ``compressor`` pass, per boundary index:

        e = p + r_l,   sent = compressor(e),   r_l <- e - sent

    The state is a dict ``{boundary index: residual pytree}`` (empty at ``init``), so
    ``sum_t sent_t = sum_t p_t - r_T``: nothing the compressor drops is lost for good.
    Records ``ef_residual_norm`` (``|r_l|`` after the step).
    """
    if is_stateful(compressor) or not callable(compressor):
        raise TypeError(f"error_feedback: compressor must be a stateless pass (adj -> adj), "
                        f"got {type(compressor).__name__}")

    def init() -> dict:
        return {}

    def update(adj: AdjointState, state: dict) -> tuple[AdjointState, dict]:
        if not isinstance(state, dict):
            raise TypeError(f"error_feedback: expected a dict state (boundary index -> residual), "
                            f"got {type(state).__name__}")
        residual = state.get(adj.index)
        if residual is None:
            corrected = adj
        else:
            _check_like(adj, residual)
            corrected = adj.replace(value=optree.tree_map(torch.add, adj.value, residual, namespace=NAMESPACE))
        sent = compressor(corrected)
        residual = optree.tree_map(torch.sub, corrected.value, sent.value, namespace=NAMESPACE)
        norm = global_norm(optree.tree_leaves(residual, namespace=NAMESPACE)).item()
        return sent.applied("error_feedback", sent.value, ef_residual_norm=norm), {**state, adj.index: residual}

    return StatefulPass(init, update)


def _check_like(adj: AdjointState, residual) -> None:
    """The residual kept for boundary l must have the costate's structure and shapes."""
    shapes = lambda tree: optree.tree_map(lambda t: tuple(t.shape), tree, namespace=NAMESPACE)  # noqa: E731
    if shapes(adj.value) != shapes(residual):
        raise ValueError(f"error_feedback: residual kept for boundary {adj.index} has shapes {shapes(residual)}, "
                         f"the costate has {shapes(adj.value)} (batch size changed? reset the state with init())")
