"""Combinators: every one takes passes (or plain ``adj -> adj`` callables, lifted with
``stateless``) and returns a ``Pass``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ..adjoint import AdjointState
from .base import Context, Pass, identity, stateless, valued

__all__ = ["carries_state", "compose", "lift", "only", "stateful", "tap", "when"]


def lift(p: Any, where: str = "compose") -> Pass:
    """``p`` as a ``Pass``: a ``Pass`` as is, a plain callable through ``stateless``."""
    if isinstance(p, Pass):
        return p
    if callable(p):
        return stateless(p)
    raise TypeError(f"{where}: expected a pass (a Pass or a callable adj -> adj), got {type(p).__name__}")


def compose(*passes: Any) -> Pass:
    """Apply ``passes`` left to right. Plain callables are lifted, nested composes flatten and
    ``identity()`` drops out, so ``compose`` is associative with ``identity()`` as its neutral
    element. The state is a tuple with one entry per member (``None`` for a stateless one); two
    composes are equal when their members are, in order."""
    members = tuple(m for p in passes for m in _members(lift(p)))
    if not members:
        return identity()
    if len(members) == 1:
        return members[0]

    def init(example: Sequence[AdjointState] = ()) -> tuple[Any, ...]:
        return tuple(m.start(example) for m in members)

    def update(adj: AdjointState, state: Any, ctx: Context) -> tuple[Any, ...]:
        if not isinstance(state, tuple) or len(state) != len(members):
            raise ValueError(
                f"compose: expected a pass state tuple of {len(members)} entries (one per pass of "
                f"{name}), got {type(state).__name__}"
                f"{f' of {len(state)}' if isinstance(state, tuple) else ''}"
            )
        new_state = []
        for m, s in zip(members, state):
            out = m.update(adj, s, ctx)
            if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], AdjointState)):
                raise TypeError(
                    f"pass {m.name!r} at boundary {adj.index}: update must return (AdjointState, state), "
                    f"got {type(out).__name__}"
                )
            adj, s = out
            new_state.append(s)
        return adj, tuple(new_state)

    name = f"compose({', '.join(m.name for m in members)})"
    stages = frozenset().union(*(m.stages for m in members))
    return Pass(init, update, name, members, stages, value=("compose", *members))


def _members(p: Pass) -> tuple[Any, ...]:
    return (p,) if p.members is None else p.members


@valued
def when(predicate: Callable[[AdjointState], bool], p: Any) -> Pass:
    """``p`` where ``predicate(adj)`` is true, the record unchanged elsewhere (and ``p``'s state too)."""
    if not callable(predicate):
        raise TypeError(f"when: predicate must be callable adj -> bool, got {type(predicate).__name__}")
    p = lift(p, "when")

    def update(adj: AdjointState, state: Any, ctx: Context) -> tuple[Any, ...]:
        return p.update(adj, state, ctx) if predicate(adj) else (adj, state)

    return Pass(p.init, update, f"when({p.name})", stages=p.stages)


@valued
def only(p: Any, stages: Any = None, indices: Any = None) -> Pass:
    """``p`` at the boundaries whose ``adj.stage`` is in ``stages`` or whose ``adj.index`` is in
    ``indices`` (a name / int or a collection of them), the record unchanged elsewhere. A stage name
    that is none of the sweep's stages is refused by the sweep (``Pass.check_stages``)."""
    stages = _as_set("stages", stages, str)
    indices = _as_set("indices", indices, int)
    if any(i < 0 for i in indices):
        raise ValueError(
            f"only: indices are boundary indices 0..L (a pass does not know L, so none counts from "
            f"the end), got {sorted(indices)}"
        )
    if not stages and not indices:
        raise ValueError("only: give the stages (names) and/or the boundary indices where the pass applies")
    inner = lift(p, "only")

    def applies(adj: AdjointState) -> bool:
        return adj.stage in stages or adj.index in indices

    def init(example: Sequence[AdjointState] = ()) -> Any:
        return inner.start([adj for adj in example if applies(adj)])

    restricted = when(applies, inner)
    return dataclasses.replace(
        restricted,
        init=init if inner.wants_example else inner.init,
        name=f"only({inner.name})",
        stages=inner.stages | stages,
    )


def _as_set(arg: str, value: Any, kind: type) -> frozenset[Any]:
    if value is None:
        return frozenset()
    items = (value,) if isinstance(value, kind) else tuple(value)
    bad = [v for v in items if not isinstance(v, kind) or isinstance(v, bool)]
    if bad:
        raise TypeError(f"only: {arg} must be {kind.__name__}s, got {bad!r}")
    return frozenset(items)


@valued
def tap(fn: Callable[[AdjointState], Any]) -> Pass:
    """The pass that calls ``fn(adj)`` (to observe: print, plot, collect) and returns ``adj`` unchanged."""
    if not callable(fn):
        raise TypeError(f"tap: expected a callable fn(adj), got {type(fn).__name__}")

    def observe(adj: AdjointState) -> AdjointState:
        fn(adj)
        return adj

    return stateless(observe, f"tap({getattr(fn, '__name__', 'fn')})")


def carries_state(state: Any) -> bool:
    """Whether a pass state is more than ``None`` (a stateless pass) or a tuple of such (a compose of them)."""
    return state is not None and not (isinstance(state, tuple) and not any(carries_state(s) for s in state))


def stateful(passes: Any) -> list[str]:
    """The names of the members of ``passes`` (a pass, several to compose, or ``None``: none) whose
    state carries from call to call."""
    if passes is None:
        return []
    p = compose(passes)
    return [m.name for m in (p.members or (p,)) if carries_state(m.start())]
