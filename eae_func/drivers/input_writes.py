"""Cut modules that write into their inputs during their forward (``x.mul_(2)``, ``nn.ReLU(inplace=True)``),
as eager PyTorch lets a module do: learned per module and training flag, the written inputs copied
before each call so the rebuild starts from the values the forward was given.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..cache import register
from ..compat import pytree

if TYPE_CHECKING:
    from .cut_call import Call

__all__ = ["InputWrites", "WRITES", "leaf_name", "param_name"]


class InputWrites:
    """Which cut modules write into their inputs during their forward (``x.mul_(2)``,
    ``nn.ReLU(inplace=True)``), as eager PyTorch lets a module do. A module's first call in each mode
    (training flag) is watched, its tensor inputs copied before it (a version read tells the writes);
    one that wrote then has the leaves it wrote copied before each call, so its rebuild starts from
    the values its forward was given. The caller's tensors are written as in eager PyTorch and
    autograd is told so (``mark_dirty``): a written input is an output of the call too. A write the
    module did not make on its first call is refused: the values the rebuild needs are gone."""

    def __init__(self):
        self.seen: weakref.WeakKeyDictionary[nn.Module, dict[bool, frozenset[int]]] = weakref.WeakKeyDictionary()

    def before(self, call: Call) -> dict[int, torch.Tensor] | None:
        """Copies of the call's leaves its module may write into (``None``: it writes none)."""
        seen = self.seen.get(call.module)
        written = None if seen is None else seen.get(call.module.training)
        if written is not None and not written:
            return None
        picks = range(len(call.leaves)) if written is None else written
        return {i: call.leaves[i].clone() for i in picks if i < len(call.leaves) and call.versions[i] >= 0}

    def after(self, call: Call, copies: dict[int, torch.Tensor] | None) -> None:
        """The leaves the forward wrote into replaced by their copies from before the call."""
        versions, leaves = call.versions, call.leaves
        written = tuple(i for i, v in enumerate(versions) if v >= 0 and leaves[i]._version != v)
        seen = self.seen.setdefault(call.module, {})
        if written or call.module.training not in seen:
            seen[call.module.training] = seen.get(call.module.training, frozenset()) | frozenset(written)
        if not written:
            return
        lost = [i for i in written if copies is None or i not in copies]
        if lost:
            raise ValueError(
                f"cut {call.name!r} wrote into its input {leaf_name(call, lost[0])} in place during its forward, "
                f"which its first call did not: the values its rebuild needs are gone. Run the step again "
                f"(that input is now copied before each call), or write out of place in the module"
            )
        for i in written:
            leaves[i] = copies[i]  # type: ignore[index]
            versions[i] = -1
        call.written = written


WRITES = InputWrites()
register("input writes", "run-time cuts: which inputs each cut module writes into, per training flag (weakly, "
         "per module); learned again with copies of every input", lambda: WRITES.seen.clear())  # fmt: skip


def param_name(call: Call, p: torch.Tensor) -> str:
    """The module's own name of the parameter tensor ``p`` of a call."""
    return next(n for n, q in call.params.items() if q is p)


def leaf_name(call: Call, i: int) -> str:
    """Leaf i of a call's ``(args, kwargs)``, as ``args[0]`` or ``kwargs['mask']``."""
    path = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(len(call.leaves))), call.spec))[0][i][0]
    return ("args" if path[0] == pytree.SequenceKey(0) else "kwargs") + pytree.keystr(path[1:])
