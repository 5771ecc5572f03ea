"""A boundary's costate between two reverse steps: checked against the boundary's layout, passed
through the passes where the chain shows the boundary (its record, its own part of the boundary),
and kept in the trace as the options say.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import optree
import torch

from ..adjoint import AdjointState, fold_in
from ..passes import Context, examples
from ..program.chain import Chain
from ..tree import NAMESPACE
from . import boundary as B
from .diagnose import note
from .options import Options
from .timing import timer

__all__ = ["boundary_name", "check_costate", "example", "part", "processed", "shown_as", "traced", "with_part"]


def boundary_name(chain: Chain, l: int) -> str:
    """The ``stage`` field of boundary l's record: the stage whose output it is, ``"input"`` at 0."""
    return chain.names[l - 1] if l > 0 else "input"


def check_costate(chain: Chain, l: int, adj: Any, layout: B.Layout) -> list[Any]:
    """The leaves of the costate at boundary ``l`` (``None`` where a boundary leaf has none),
    checked against the boundary's ``layout``: a record, of the boundary's structure and shapes."""
    where_ = (
        "costate at boundary 0 (the chain's input)"
        if l == 0
        else f"costate entering {chain.where(l - 1)} at boundary {l}"
    )
    what = "the chain's input" if l == 0 else "the stage output"
    if not isinstance(adj, AdjointState):
        raise TypeError(f"{where_}: a pass returned {type(adj).__name__}, expected an AdjointState")
    flat, spec = optree.tree_flatten(adj.value, none_is_leaf=True, namespace=NAMESPACE)
    if spec != layout.costate_spec:
        raise ValueError(f"{where_}: costate structure {spec} differs from {what} {layout.costate_spec}")
    for t, shape in zip(flat, layout.shapes):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where_}: costate shape {got} differs from {what} shape {tuple(shape)}")
    return flat


def processed(
    chain: Chain,
    opts: Options,
    adj: AdjointState,
    pass_state: Any,
    boundary: Any,
    layout: B.Layout,
    stats: dict[Any, Any],
) -> tuple[AdjointState, Any, AdjointState | None]:
    """``(adj, pass_state, record)``: boundary l's costate after the passes, where the chain shows the
    boundary (``Chain.showing``: the passes see the record of its shown part, under its shown index,
    name and key), checked against the boundary's ``layout``; ``record``: what the passes returned
    (``None``: the boundary is not shown, and nothing ran). The sweep skips this for a costate it
    built from the boundary itself when there are no passes."""
    l = adj.index
    shown = chain.showing(l)
    if shown is None:
        check_costate(chain, l, adj, layout)  # an estimator's or another rank's costate all the same
        return adj, pass_state, None
    record = (  # a chain that shows every boundary as itself passes the record it has
        adj
        if chain.shown is None
        else AdjointState(part(adj.value, shown.keys), shown.index, shown.name, fold_in(opts.key, shown.index))
    )
    ctx = Context(part(boundary, shown.keys), chain.stages[l - 1] if l > 0 else None, opts.key)
    try:
        with timer(opts, stats, "pass_s", f"eae/{shown.name}/passes", layout.placements[0][0]):
            out = opts.passes.update(record, pass_state, ctx)
    except Exception as e:
        note(e, f"the passes at boundary {shown.index} ({shown.name!r})")
        raise
    if not (isinstance(cast(object, out), tuple) and len(out) == 2):
        raise TypeError(
            f"pass {opts.passes.name!r} at boundary {shown.index} ({shown.name!r}): update must return "
            f"(AdjointState, state), got {type(out).__name__}"
        )
    if not isinstance(out[0], AdjointState):
        check_costate(chain, l, out[0], layout)  # raises, naming what it got
    full = adj.replace(value=with_part(adj.value, shown.keys, out[0].value))
    flat = check_costate(chain, l, full, layout)
    given = optree.tree_leaves(adj.value, none_is_leaf=True, namespace=NAMESPACE)
    if any(t is None and g is not None for t, g in zip(flat, given)):
        at = "the chain's input" if l == 0 else f"output of {chain.where(l - 1)}"
        raise ValueError(
            f"pass {opts.passes.name!r} at boundary {shown.index} ({at}): returned value=None for a costate that "
            f"was a tensor, which would silently zero every gradient upstream of it; return a costate "
            f"(adj.replace(value=torch.zeros_like(adj.value)) stops the signal on purpose)"
        )
    return full, out[1], out[0]


def shown_as(chain: Chain, adj: AdjointState, key: int) -> AdjointState | None:
    """The record of boundary ``adj.index`` as the chain shows it when no pass runs (``processed``)."""
    if chain.shown is None:
        return adj
    shown = chain.showing(adj.index)
    if shown is None:
        return None
    value = None if adj.value is None else part(adj.value, shown.keys)
    return AdjointState(value, shown.index, shown.name, fold_in(key, shown.index))


def part(tree: Any, keys: tuple[str, ...] | None) -> Any:
    """The entries ``keys`` of a boundary (its state or its costate): one as itself, several as a
    tuple; ``None``: the whole boundary."""
    if keys is None:
        return tree
    return tree[keys[0]] if len(keys) == 1 else tuple(tree[k] for k in keys)


def with_part(costate: Any, keys: tuple[str, ...] | None, value: Any) -> Any:
    """``costate`` with its entries ``keys`` replaced by ``value`` (as ``part`` gives them); a value of
    another structure is returned as it is, for ``check_costate`` to name."""
    if keys is None:
        return value
    parts = (value,) if len(keys) == 1 else value
    if not isinstance(cast(object, parts), tuple) or len(parts) != len(keys):
        return value
    return {**costate, **dict(zip(keys, parts))}


def traced(adj: AdjointState | None, opts: Options) -> AdjointState | None:
    """The record as the trace keeps it: without its costate unless ``keep_costates``."""
    if adj is None or opts.keep_costates:
        return adj
    return AdjointState(None, adj.index, adj.stage, adj.key, adj.history, adj.meta)


def example(chain: Chain, lo: int, hi: int, entries: Sequence[Any]) -> tuple[AdjointState, ...]:
    """What the passes of a fold over stages ``lo..hi-1`` will be applied to (``passes.examples``), from
    its forward's ``entries`` (``tape.Entry``, lo first): boundary L where the range ends the chain
    (else p_hi came through them on the next range), then hi-1 down to lo, as the chain shows them
    (``shown_as``), each costate's structure, shapes, dtypes and devices as the entries' layouts say."""
    layouts = {e.index: e.layout for e in entries} | {hi: entries[-1].out_layout}
    top = hi if hi == len(chain) else hi - 1
    every = (AdjointState(_like(layouts[l]), l, boundary_name(chain, l)) for l in range(top, lo - 1, -1))
    shown = (shown_as(chain, adj, 0) for adj in every)
    return examples((adj.index, adj.stage, adj.value) for adj in shown if adj is not None)


def _like(layout: B.Layout) -> Any:
    """A tree of the boundary's structure whose differentiable leaves are one-element tensors expanded
    to their shapes, in their dtypes and on their devices (``None`` where a leaf has no costate)."""
    leaves = [
        torch.empty((), dtype=dtype, device=device).expand(shape) if differentiable else None
        for shape, (device, dtype), differentiable in zip(layout.shapes, layout.placements, layout.mask)
    ]
    return layout.spec.unflatten(leaves)
