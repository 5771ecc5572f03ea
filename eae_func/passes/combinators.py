"""Pass protocol and combinators.

A pass maps an ``AdjointState`` to a new one. A stateless pass is any callable
``adj -> adj``; a stateful pass is a ``StatefulPass(init, update)`` with
``init() -> state`` and ``update(adj, state) -> (adj, state)``, the state a
pytree threaded by the caller (as in optax). ``compose`` mixes both kinds.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from ..adjoint import AdjointState

Pass = Callable[[AdjointState], AdjointState]


class StatefulPass(NamedTuple):
    """``init() -> state``; ``update(adj, state) -> (adj, state)``."""

    init: Callable[[], Any]
    update: Callable[[AdjointState, Any], tuple[AdjointState, Any]]


def is_stateful(p: Any) -> bool:
    return isinstance(p, StatefulPass)


def init(p: Any) -> Any:
    """The initial state of pass ``p`` (``None`` for a stateless pass)."""
    return p.init() if is_stateful(p) else None


def apply(p: Any, adj: AdjointState, state: Any) -> tuple[AdjointState, Any]:
    """Run ``p`` on ``adj`` with ``state``; a stateless pass leaves ``state`` unchanged."""
    if p is None:
        return adj, state
    if is_stateful(p):
        return p.update(adj, state)
    return p(adj), state


def identity(adj: AdjointState) -> AdjointState:
    """The pass that changes nothing (the neutral element of ``compose``)."""
    return adj


class Composed:
    """Stateless passes applied left to right."""

    def __init__(self, passes: tuple):
        self.passes = passes

    def __call__(self, adj: AdjointState) -> AdjointState:
        for p in self.passes:
            adj = p(adj)
        return adj

    def __repr__(self) -> str:
        return f"compose({', '.join(getattr(p, '__name__', repr(p)) for p in self.passes)})"


class ComposedStateful(StatefulPass):
    """Passes applied left to right; the state is a tuple with one entry per stateful member."""

    @property
    def passes(self) -> tuple:
        return self.update.passes


class _ComposedUpdate:
    def __init__(self, passes: tuple):
        self.passes = passes
        self.stateful = tuple(p for p in passes if is_stateful(p))

    def init(self) -> tuple:
        return tuple(p.init() for p in self.stateful)

    def __call__(self, adj: AdjointState, state: tuple):
        if not isinstance(state, tuple) or len(state) != len(self.stateful):
            raise ValueError(f"compose: expected a pass state tuple of {len(self.stateful)} entries "
                             f"(one per stateful pass), got {type(state).__name__}")
        new_state, it = [], iter(state)
        for p in self.passes:
            if is_stateful(p):
                adj, s = p.update(adj, next(it))
                new_state.append(s)
            else:
                adj = p(adj)
        return adj, tuple(new_state)


def _members(p: Any) -> tuple:
    if isinstance(p, Composed):
        return p.passes
    if isinstance(p, ComposedStateful):
        return p.passes
    if p is identity:
        return ()
    if not callable(p) and not is_stateful(p):
        raise TypeError(f"compose: expected passes (callables or StatefulPass), got {type(p).__name__}")
    return (p,)


def compose(*passes: Any):
    """Apply ``passes`` left to right. Nested composes flatten and ``identity`` drops out,
    so ``compose`` is associative with ``identity`` as its neutral element."""
    members = tuple(m for p in passes for m in _members(p))
    if not members:
        return identity
    if len(members) == 1:
        return members[0]
    if any(is_stateful(m) for m in members):
        update = _ComposedUpdate(members)
        return ComposedStateful(update.init, update)
    return Composed(members)
