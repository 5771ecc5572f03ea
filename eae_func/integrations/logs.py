"""What the training integrations log of a sweep: per boundary, named by its stage, a chosen set.

    eae/<stage>/norm        |p|, the 2-norm of the costate of the stage's output after the passes
    eae/<stage>/<key>       what the passes recorded there (``meta``): clip_norm, clipped, scale, ...

The input's costate (boundary 0) is not logged. Nothing is read off the device here: the values
are device scalars and ``Lazy`` numbers, read when the logger formats them.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..adjoint import AdjointState
from ..core.result import SweepResult
from ..lazy import Lazy
from ..passes import global_norm

__all__ = ["DEFAULT", "boundary_logs", "chosen", "record_logs"]


DEFAULT = ("norm",)


def chosen(log: str | Sequence[str], options: Mapping[str, Any], where: str) -> str | tuple[str, ...]:
    """``log`` checked: ``"all"`` (the norm and every number the passes record) or a sequence of names;
    the norm needs the costates, which ``keep_costates=False`` drops."""
    if not (log == "all" or (not isinstance(log, str) and all(isinstance(n, str) for n in log))):
        raise TypeError(f'{where}: expected "all" or a sequence of names such as ("norm", "clip_norm"), got {log!r}')
    if options.get("keep_costates") is False and (log == "all" or "norm" in log):
        raise ValueError(
            f"{where}: logging the costate norm reads the costates, which keep_costates=False drops; "
            f"leave keep_costates at True or log no 'norm'"
        )
    return "all" if log == "all" else tuple(log)


def boundary_logs(res: SweepResult, log: str | tuple[str, ...]) -> dict[str, Any]:
    """``{"eae/<stage>/<name>": value}`` for every boundary of ``res``'s trace but the input
    (``record_logs`` of each)."""
    out: dict[str, Any] = {}
    for adj in res.adjoints:
        if adj.index:
            out.update(record_logs(adj, res.stats["boundaries"].get(adj.index, {}), log))
    return out


def record_logs(adj: AdjointState, meta: Mapping[str, Any], log: str | tuple[str, ...]) -> dict[str, Any]:
    """``{"eae/<stage>/<name>": value}`` of one boundary's record: ``norm`` the costate's 2-norm (a
    device scalar), any other name the number the passes recorded under it in ``meta`` (absent where
    none did)."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(("norm", *meta) if log == "all" else log):
        if name == "norm":
            out[f"eae/{adj.stage}/norm"] = global_norm(adj.value).detach()
        elif isinstance(value := meta.get(name), numbers.Real | Lazy) or (
            isinstance(value, torch.Tensor) and value.numel() == 1
        ):
            out[f"eae/{adj.stage}/{name}"] = value
    return out
