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


def when(predicate: Callable[[AdjointState], bool], p: Any):
    """``p`` where ``predicate(adj)`` is true, the record unchanged elsewhere. For a stateful
    ``p`` the state passes through unchanged where it is skipped."""
    if not callable(predicate):
        raise TypeError(f"when: predicate must be callable adj -> bool, got {type(predicate).__name__}")
    if not callable(p) and not is_stateful(p):
        raise TypeError(f"when: expected a pass (callable or StatefulPass), got {type(p).__name__}")
    if is_stateful(p):
        def update(adj: AdjointState, state: Any):
            return p.update(adj, state) if predicate(adj) else (adj, state)
        return StatefulPass(p.init, update)

    def conditional(adj: AdjointState) -> AdjointState:
        return p(adj) if predicate(adj) else adj
    conditional.__name__ = conditional.__qualname__ = f"when({getattr(p, '__name__', 'pass')})"
    return conditional


def only(p: Any, stages: Any = None, indices: Any = None):
    """``p`` at the boundaries whose ``adj.stage`` is in ``stages`` or whose ``adj.index`` is in
    ``indices`` (a name / int or a collection of them), the record unchanged elsewhere."""
    stages = _as_set("stages", stages, str)
    indices = _as_set("indices", indices, int)
    if not stages and not indices:
        raise ValueError("only: give the stages (names) and/or the boundary indices where the pass applies")
    return when(lambda adj: adj.stage in stages or adj.index in indices, p)


def _as_set(arg: str, value: Any, kind: type) -> frozenset:
    if value is None:
        return frozenset()
    items = (value,) if isinstance(value, kind) else tuple(value)
    bad = [v for v in items if not isinstance(v, kind) or isinstance(v, bool)]
    if bad:
        raise TypeError(f"only: {arg} must be {kind.__name__}s, got {bad!r}")
    return frozenset(items)


def tap(fn: Callable[[AdjointState], Any]):
    """The pass that calls ``fn(adj)`` (to observe: print, plot, collect) and returns ``adj`` unchanged."""
    if not callable(fn):
        raise TypeError(f"tap: expected a callable fn(adj), got {type(fn).__name__}")

    def observe(adj: AdjointState) -> AdjointState:
        fn(adj)
        return adj
    observe.__name__ = observe.__qualname__ = f"tap({getattr(fn, '__name__', 'fn')})"
    return observe
