"""What a model and the process around it look like to a captured program: ``fingerprint``, one
comparable value that keys the captures' caches; ``Watch``, which tells in a few C loops whether
that value may have changed; ``numpy_drew``, whether numpy's global generator moved."""

from __future__ import annotations

import itertools
import operator
import types
import weakref
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["DEPTH", "GLOBAL_HOOKS", "HOOKS", "PLAIN", "Watch", "described", "fingerprint", "global_hooks", "numpy_drew"]

PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # its parameters, buffers, children and hooks: read apart


def fingerprint(model: nn.Module, seen: dict[int, Any] | None = None, depth: int = 0) -> tuple[Any, ...]:
    """What a capture of ``model`` depends on, as one comparable value: the module tree (paths,
    classes, identities, training flags, hooks), every parameter and buffer (identity, shape,
    dtype, device, requires_grad) and every module's other attributes by ``described`` (numbers,
    strings, flags, a Hugging Face config and what it holds, at any depth). A capture whose
    fingerprint differs from the model's is stale."""
    seen = {} if seen is None else seen

    def attributes(module: nn.Module) -> tuple[Any, ...]:
        return tuple((k, described(v, seen, depth + 1)) for k, v in vars(module).items() if k not in _MODULE_INTERNALS)

    modules = tuple(
        (name, id(m), type(m), m.training, attributes(m), tuple(tuple(getattr(m, h).keys()) for h in HOOKS))
        for name, m in model.named_modules(remove_duplicate=False)
    )
    tensors = tuple(
        (name, id(t), t.shape, t.dtype, t.device, t.requires_grad)
        for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    )
    hooks = tuple(tuple(d.keys()) for d in global_hooks())
    return modules, tensors, hooks


DEPTH = 64  # levels ``described`` follows into containers and objects; deeper ones count by identity


def described(v: Any, seen: dict[int, Any], depth: int = 0) -> Any:
    """``v`` as a comparable value that changes when anything a captured program may read of it
    changes: plain values as they are, tensors by identity, shape, dtype, device and requires_grad,
    modules by ``fingerprint``, containers and objects' attributes at every depth (``cfg.sub.scale``),
    functions, classes and Python modules by identity (and anything ``DEPTH`` levels down). ``seen``
    holds what was described (an object met again gets the same description, whatever the order; one
    met inside itself, a cycle mark)."""
    if isinstance(v, PLAIN):
        return v
    key = id(v)
    if key in seen:
        return seen[key] if seen[key] is not None else ("cycle", key)
    seen[key] = None
    inner = depth + 1
    if isinstance(v, torch.Tensor):
        out: Any = (key, v.shape, v.dtype, v.device, v.requires_grad)
    elif depth >= DEPTH:
        out = key
    elif isinstance(v, nn.Module):  # one the model holds beside its children: in the same walk
        out = fingerprint(v, seen, inner)
    elif isinstance(v, (types.ModuleType, type)) or callable(v):
        out = key
    elif isinstance(v, (list, tuple)):
        out = type(v), tuple(described(e, seen, inner) for e in v)
    elif isinstance(v, (set, frozenset)):
        out = type(v), tuple(described(e, seen, inner) for e in sorted(v, key=repr))
    elif isinstance(v, dict):
        out = type(v), tuple((k, described(e, seen, inner)) for k, e in v.items())
    elif hasattr(v, "__dict__"):
        out = key, type(v), tuple((k, described(e, seen, inner)) for k, e in vars(v).items())
    else:
        out = key
    seen[key] = out
    return out


_TENSOR = operator.attrgetter("shape", "dtype", "device", "requires_grad")

_FLAT = itertools.chain.from_iterable


class Watch:
    """``fingerprint(model)`` with what it was read from: every object the walk met (modules and
    objects with a ``__dict__``: their class), every container (their ``__dict__``, a module's
    parameter, buffer, child and hook dicts, dicts, lists and sets: their lengths, keys and, by
    identity, what they hold, kept alive so no identity is reused) and every tensor (shape, dtype,
    device, requires_grad). While all of these are as they were, the fingerprint is too: ``current()``
    checks a model in a few C loops of identity comparisons and walks it again only when something
    moved (a plain value re-assigned an equal one walks again and keeps the capture). An object's
    ``__dict__`` replaced wholesale is not seen."""

    def __init__(self, model: nn.Module):
        self.model = weakref.ref(model)
        self.fingerprint = fingerprint(model)
        self.objects: list[Any] = []
        self.dicts: list[Any] = list(global_hooks())
        self.sequences: list[Any] = []
        self.tensors: list[Any] = []
        self._reach(model)
        self.kind = type(self.objects.pop(0))  # the model itself is held weakly
        self.filled_dicts = [d for d in self.dicts if d]
        self.filled_sequences = [s for s in self.sequences if s]
        self.held = list(self._held())
        self.state = self._state()

    def _reach(self, root: Any) -> None:
        """Collect what ``fingerprint`` reads from ``root`` (a superset: at every depth, every key)."""
        seen: set[Any] = set()
        todo = [root]
        while todo:
            v = todo.pop()
            if isinstance(v, PLAIN) or id(v) in seen:
                continue
            seen.add(id(v))
            if isinstance(v, torch.Tensor):
                self.tensors.append(v)
            elif isinstance(v, nn.Module):
                self.objects.append(v)
                own = vars(v)
                self.dicts += [own, own["_parameters"], own["_buffers"], own["_modules"], *(own[h] for h in HOOKS)]
                todo += [e for k, e in own.items() if k not in _MODULE_INTERNALS]
                todo += [*own["_parameters"].values(), *own["_buffers"].values(), *own["_modules"].values()]
            elif isinstance(v, (types.ModuleType, type)) or callable(v):
                continue
            elif isinstance(v, (list, set)):
                self.sequences.append(v)
                todo += v
            elif isinstance(v, (tuple, frozenset)):
                todo += v
            elif isinstance(v, dict):
                self.dicts.append(v)
                todo += v.values()
            elif hasattr(v, "__dict__"):
                self.objects.append(v)
                self.dicts.append(vars(v))
                todo += vars(v).values()

    def _held(self) -> Any:
        return itertools.chain(_FLAT(map(dict.values, self.filled_dicts)), _FLAT(self.filled_sequences))

    def _state(self) -> tuple[Any, ...]:
        return (
            list(map(len, self.dicts)) + list(map(len, self.sequences)),
            list(_FLAT(self.filled_dicts)),
            list(map(type, self.objects)),
            list(map(_TENSOR, self.tensors)),
        )

    def current(self) -> Watch:
        """This watch while the model is as it was, else a new one (whose fingerprint may be equal)."""
        model = self.model()
        if model is None or (
            type(model) is self.kind and self._state() == self.state and all(map(operator.is_, self._held(), self.held))
        ):
            return self
        return Watch(model)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Watch) and (self is other or self.fingerprint == other.fingerprint)

    __hash__ = None  # type: ignore[assignment]


def numpy_drew(before: dict[Any, Any]) -> bool:
    """Whether numpy's global generator moved since ``before`` (``get_state(legacy=False)``)."""
    now = np.random.get_state(legacy=False)
    return (
        now["state"]["pos"] != before["state"]["pos"]
        or now["has_gauss"] != before["has_gauss"]
        or not np.array_equal(now["state"]["key"], before["state"]["key"])
    )


GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks")


def global_hooks() -> tuple[Any, ...]:
    from torch.nn.modules import module as M

    return tuple(getattr(M, name) for name in GLOBAL_HOOKS)
