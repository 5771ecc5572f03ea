"""The one pass type, and what a pass author needs.

A pass is a ``Pass(init, update)`` record, as an optax ``GradientTransformation``:

    state = p.init(example)
    adj, state = p.update(adj, state, ctx)

``example`` is what the pass will be applied to, as optax's ``init(params)`` sees the params: one
``AdjointState`` per boundary it will visit, its index, stage and a costate of the right
structure, shapes, dtypes and devices whose numbers are not to be read (``examples``). A stateful
pass makes its state for every boundary at once, so the state keeps one shape from the first call.
A sweep calls ``p.start(example)`` when it begins without a state, where its boundaries are known;
an ``init`` that takes no argument is called without one.

``adj`` is the ``AdjointState`` at one boundary; ``ctx`` (a ``Context``) is what a
pass may read besides the costate: the boundary state x_l, the stage whose output
it is, and the sweep's key. The state is any pytree, threaded by the caller.
``stateless(fn)`` lifts a plain ``adj -> adj`` function (its state is ``None``).

A built-in pass is a value, as a frozen dataclass of its arguments is: ``scale(2.0) == scale(2.0)``,
both hash alike, and a ``compose`` equals another whose members are equal. ``Pass.value`` is that
value (the factory's name and its arguments, ``valued``); a pass built from ``Pass(init, update)``
has none and equals only a pass of the same functions.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, ParamSpec

import optree
import torch

from ..adjoint import AdjointState, fold_in
from ..tree import NAMESPACE

__all__ = [
    "Context",
    "Pass",
    "examples",
    "global_norm",
    "identity",
    "map_costate",
    "map_costate_random",
    "stateless",
    "valued",
]


@dataclasses.dataclass(frozen=True)
class Context:
    """What a pass may read at boundary l besides the costate.

    boundary: the boundary state x_l (``None`` outside a sweep).
    stage:    the ``Stage`` whose output x_l is (``None`` at the input, l = 0, or outside a sweep).
    key:      the sweep's key (the record's own ``adj.key`` is ``fold_in(key, l)``).
    """

    boundary: Any = None
    stage: Any = None
    key: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class Pass:
    """``init(example) -> state`` (or ``init() -> state``); ``update(adj, state, ctx) -> (adj, state)``;
    pure functions.

    ``name`` is what ``repr`` shows; ``members`` lists the passes of a ``compose``
    (``()`` for ``identity()``, the empty composition; ``None`` for any other pass); ``stages``:
    the stage names the pass applies at (``only``'s), which a sweep checks against its own;
    ``value``: what the pass is, ``(factory name, arguments...)`` (``valued``), by which it
    compares and hashes (``None``: by its functions, name, members and stages).
    """

    init: Callable[..., Any]
    update: Callable[[AdjointState, Any, Context], tuple[Any, ...]]
    name: str = "pass"
    members: tuple[Any, ...] | None = None
    stages: frozenset[str] = frozenset()
    value: tuple[Any, ...] | None = None

    def _identity(self) -> Hashable:
        if self.value is not None:
            return self.value
        return (self.init, self.update, self.name, self.members, self.stages)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Pass):
            return NotImplemented
        return self is other or self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    @property
    def wants_example(self) -> bool:
        """Whether ``start`` reads its example (an ``init`` that takes one, or a member's of a
        ``compose``): a sweep builds the example only then."""
        if self.members is not None:
            return any(m.wants_example for m in self.members)
        return _takes_example(self.init)

    def start(self, example: Sequence[AdjointState] = ()) -> Any:
        """The state before the first boundary: ``init(example)``, or ``init()`` where ``init`` takes
        no argument (a pass written before ``example``); an error names the pass."""
        try:
            return self.init(example) if _takes_example(self.init) else self.init()
        except Exception as e:
            e.add_note(f"(eae_func: in the init of pass {self.name!r}, which starts its state)")
            raise

    def describe(self) -> str:
        """The pass as text two processes agree on when they built equal passes: its value with
        every number in full (``scale(1 + 1e-9)`` is not ``scale(1)``, as its name shows it) and a
        function by its qualified name (what a process can tell of another's); its name where it
        has no value."""
        if self.value is None:
            return self.name
        factory, *args = self.value
        return f"{factory}({', '.join(map(_described, args))})"

    def check_stages(self, names: Iterable[str]) -> None:
        """Refuse stage names of ``stages`` that are not among ``names`` (a sweep's boundary records'
        ``stage``): a pass restricted to them would silently apply nowhere."""
        names = list(names)
        unknown = sorted(self.stages - set(names))
        if unknown:
            raise ValueError(
                f"only: no stage is named {unknown} in this sweep (in {self.name}); the stage names are "
                f"{names} (exact names, as res.adjoints[k].stage shows, not patterns)"
            )

    def apply(self, adj: AdjointState, state: Any = None, ctx: Context | None = None) -> tuple[Any, ...]:
        """One application outside a sweep: ``update(adj, start([adj]) if state is None else state, ctx)``."""
        return self.update(adj, self.start([adj]) if state is None else state, Context() if ctx is None else ctx)

    def __repr__(self) -> str:
        return self.name


P = ParamSpec("P")


def _takes_example(init: Callable[..., Any]) -> bool:
    """Whether ``init`` takes a positional argument (the example): read off a function's code, else
    its signature (a builtin without one, as ``dict``, takes none)."""
    code = getattr(init, "__code__", None)
    if code is not None and not inspect.ismethod(init):
        return code.co_argcount > 0 or bool(code.co_flags & inspect.CO_VARARGS)
    try:
        parameters = inspect.signature(init).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)


def examples(costates: Iterable[tuple[int, str, Any]]) -> tuple[AdjointState, ...]:
    """The records ``init(example)`` sees, from ``(index, stage, costate-like tree)`` per boundary:
    each tensor leaf as one element of its dtype on its device, expanded to its shape (no copy of
    the boundary, nothing to read), every other leaf as ``None`` (no costate)."""
    return tuple(
        AdjointState(optree.tree_map(_spec, like, none_is_leaf=True, namespace=NAMESPACE), index, stage)
        for index, stage, like in costates
    )


def _spec(leaf: Any) -> torch.Tensor | None:
    if not isinstance(leaf, torch.Tensor) or not (leaf.is_floating_point() or leaf.is_complex()):
        return None
    return torch.empty((), dtype=leaf.dtype, device=leaf.device).expand(leaf.shape)


def valued(factory: Callable[P, Pass]) -> Callable[P, Pass]:
    """``factory`` whose passes are values: ``(factory name, its arguments, defaults filled in)``,
    so two passes built from equal arguments are equal and hash alike (``Pass.value``)."""
    signature = inspect.signature(factory)

    @functools.wraps(factory)
    def build(*args: P.args, **kwargs: P.kwargs) -> Pass:
        built = factory(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        value = (factory.__name__, *(_hashable(v) for v in bound.arguments.values()))
        return dataclasses.replace(built, value=value)

    return build


class _Same:
    """An argument compared by identity (a tensor, or anything that does not hash): what a frozen
    dataclass holding it would do where ``==`` has no single truth value."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _hashable(x: Any) -> Hashable:
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(v) for v in x)
    if isinstance(x, (set, frozenset)):
        return frozenset(_hashable(v) for v in x)
    if isinstance(x, dict):
        return frozenset((k, _hashable(v)) for k, v in x.items())
    if isinstance(x, torch.Tensor):
        return _Same(x)
    try:
        hash(x)
    except TypeError:
        return _Same(x)
    return x


def _described(x: Any) -> str:
    if isinstance(x, Pass):
        return x.describe()
    if isinstance(x, tuple):
        return "(" + ", ".join(map(_described, x)) + ")"
    if isinstance(x, frozenset):
        return "{" + ", ".join(sorted(map(_described, x))) + "}"
    if isinstance(x, _Same):
        return f"<{type(x.obj).__name__}>"
    if callable(x) and not isinstance(x, type):
        return f"<{getattr(x, '__module__', '?')}.{getattr(x, '__qualname__', type(x).__name__)}>"
    return repr(x)


def _no_state() -> None:
    return None


def _unchanged(adj: AdjointState, state: Any, ctx: Context) -> tuple[Any, ...]:
    return adj, state


def identity() -> Pass:
    """The pass that changes nothing: the empty ``compose()``, its neutral element."""
    return Pass(_no_state, _unchanged, "identity", members=(), value=("identity",))


def stateless(fn: Callable[[AdjointState], Any], name: str | None = None) -> Pass:
    """The pass ``adj -> fn(adj)`` with no state (its state is ``None``); ``fn`` must return an
    ``AdjointState``, which is checked at every call."""
    if isinstance(fn, Pass):
        return fn
    if not callable(fn):
        raise TypeError(f"stateless: expected a callable adj -> adj, got {type(fn).__name__}")
    label: str = name or getattr(fn, "__name__", "pass")

    def update(adj: AdjointState, state: Any, ctx: Context) -> tuple[Any, ...]:
        out = fn(adj)
        if not isinstance(out, AdjointState):
            raise TypeError(
                f"pass {label!r} at boundary {adj.index} (output of stage {adj.stage!r}) returned a "
                f"{type(out).__name__}, expected an AdjointState (return adj.applied(name, value) "
                f"or adj.replace(...))"
            )
        return out, state

    return Pass(_no_state, update, label, value=("stateless", _hashable(fn), label))


def map_costate(fn: Callable[[torch.Tensor], torch.Tensor], adj: AdjointState) -> Any:
    """``fn`` applied to every tensor leaf of the costate (``None`` leaves stay ``None``)."""
    return optree.tree_map(fn, adj.value, namespace=NAMESPACE)


def map_costate_random(fn: Callable[[torch.Tensor, torch.Generator], torch.Tensor], adj: AdjointState) -> Any:
    """``fn(leaf, generator)`` on every tensor leaf, leaf i drawing from ``fold_in(adj.seed(), i)``:
    the same key gives the same draws; two random passes at one boundary never share draws."""
    leaves, spec = optree.tree_flatten(adj.value, namespace=NAMESPACE)
    seed = adj.seed()
    return spec.unflatten(
        [fn(t, torch.Generator(device=t.device).manual_seed(fold_in(seed, i))) for i, t in enumerate(leaves)]
    )


def global_norm(tree: Any) -> torch.Tensor:
    """``sqrt(sum_i |t_i|^2)`` over every tensor leaf of ``tree``, in float32 (float64 stays float64)."""
    norms = [
        torch.linalg.vector_norm(t.float() if t.dtype != torch.float64 else t)
        for t in optree.tree_leaves(tree, namespace=NAMESPACE)
    ]
    if not norms:
        return torch.zeros(())
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack([n.double() for n in norms]))
