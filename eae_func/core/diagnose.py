"""Errors that name where they happened: a note on an exception naming the stage (or loss, or pass)
it came from, the explanation of a stage that failed, and the check that a stage's outputs close
over no tensor of its own it was not handed (a parameter read from Python state would be missed
by its vjp).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, cast

import optree
import torch

from ..program.chain import Chain
from ..tree import NAMESPACE

__all__ = ["check_closed_over", "closed_over", "explain", "naming", "note"]


def note(e: Exception, what: str) -> None:
    """Add ``what`` (the stage or boundary) as a note to ``e``."""
    e.add_note(f"(eae_func: in {what})")


@contextlib.contextmanager
def naming(what: str):
    """Add ``what`` as a note to any exception raised in the block (hot paths use ``note`` in an
    ``except``, which costs nothing until something fails)."""
    try:
        yield
    except Exception as e:
        note(e, what)
        raise


def explain(e: Exception, chain: Chain, i: int, params: Any, h: Any, autocast_dtype: torch.dtype | None) -> None:
    """When stage i failed on an input whose dtype or device differs from its params', add a note
    saying which stage made that input (a black box returning float64, or data on another device)."""
    floats = [
        t for t in optree.tree_leaves(h, namespace=NAMESPACE) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    weights = [
        t
        for t in optree.tree_leaves(params, namespace=NAMESPACE)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    if floats and weights:
        got, want = (floats[0].dtype, floats[0].device), (weights[0].dtype, weights[0].device)
        if got[1] != want[1] or (got[0] != want[0] and autocast_dtype is None):
            source = f"the output of {chain.where(i - 1)}" if i > 0 else "the chain's input"
            e.add_note(
                f"(eae_func: the input of {chain.where(i)} is {got[0]} on {got[1]}, its params are "
                f"{want[0]} on {want[1]}: {source} must be {want[0]} on {want[1]})"
            )


def check_closed_over(chain: Chain, i: int, outputs: list[Any], own: Sequence[torch.Tensor] = ()) -> None:
    """Refuse ``outputs`` (stage i's output leaves) that depend on a tensor requiring grad other than
    ``own`` (the stage's params and input as the sweep gave them): stage i then closes over, say, a
    module's weights, whose gradient the sweep would silently drop. With no ``own`` tensors, any output
    requiring grad is one."""
    leaves = closed_over(outputs, own)
    if leaves is None:
        return
    raise ValueError(
        f"{chain.where(i)}: its output depends on a tensor that requires grad but is not among its "
        f"params (shapes {leaves or 'unknown'}): a stage that closes over a module's weights would get "
        f"no gradient for them; pass them in params (ef.from_module, or functional_call on them)"
    )


def closed_over(outputs: Sequence[Any], own: Sequence[torch.Tensor] = (), data: Sequence[Any] = ()) -> list[Any] | None:
    """The shapes of up to three leaf tensors requiring grad, other than ``own``, that ``outputs``
    depend on (``[]``: some, unknown; ``None``: none). A view of one of the ``data`` tensors (the
    inputs) made a leaf that requires grad inside the forward (``x[:, None]``, as HuBERT's feature
    encoder makes) is not counted: no caller holds it."""
    grad_fns = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not grad_fns:
        return None
    mine = {id(t) for t in own}
    inputs = {t.untyped_storage().data_ptr() for t in data if isinstance(t, torch.Tensor)}
    leaves: list[tuple[int, ...]]
    leaves, seen, todo = [], cast("set[Any]", set()), [f for f in grad_fns if f is not None]
    while todo and len(leaves) < 3:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf tensor
        if (
            variable is not None
            and id(variable) not in mine
            and not (variable._base is not None and variable.untyped_storage().data_ptr() in inputs)
        ):
            leaves.append(tuple(variable.shape))
        todo += [f for f, _ in fn.next_functions if f is not None]
    return None if mine and not leaves else leaves
