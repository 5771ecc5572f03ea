"""Where a module keeps its tensors (``Slots``): given tensors put in those places for a call and the
module's own put back, as ``functional_call`` does, with the places found once; and the lock a
module is held under while given tensors sit in it."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..cache import register

__all__ = ["Slots", "module_lock"]


_LOCKS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

_LOCKS_LOCK = threading.Lock()


def module_lock(module: nn.Module) -> threading.RLock:
    """The lock a module stage holds while the given tensors sit in the module's places, so two
    threads sweeping one module never see (or leave) each other's tensors there."""
    lock = _LOCKS.get(module)
    if lock is None:
        with _LOCKS_LOCK:
            lock = _LOCKS.setdefault(module, threading.RLock())
    return lock


class Slots:
    """Where a module keeps the tensors of some of its dotted names: per name, the ``_parameters``
    or ``_buffers`` dict of the submodule that owns it. ``call`` puts given tensors in those places,
    runs the module and puts its own back, as ``functional_call`` does, but the places are found
    once per module and set of names, not on every call (that search cost as much as a tiny
    stage's arithmetic). Each use first checks that the path to every owner, and every name in
    its owner, is unchanged. The cache holds modules weakly, so it keeps none of them alive."""

    _cache: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def __init__(self, links: tuple[Any, ...], places: tuple[Any, ...]):
        self.links = links  # (parent, child name, child) along the paths to the owners, weakly; parent None: the root
        self.places = places  # (dict, key, dotted name) of every tensor

    @classmethod
    def of(cls, module: nn.Module, tensors: Mapping[str, torch.Tensor] | tuple[str, ...]) -> Slots | None:
        """The places of ``tensors``' names (or of a tuple of names) in ``module``; ``None`` if one is
        not a parameter or buffer."""
        per_module = cls._cache.get(module)  # a lookup makes no weakref; setdefault would, on every call
        if per_module is None:
            per_module = cls._cache.setdefault(module, {})
        names = tensors if isinstance(tensors, tuple) else tuple(tensors)
        slots = per_module.get(names)
        if slots is None or not slots.valid(module):
            slots = per_module[names] = cls.find(module, names)
        return slots

    def valid(self, module: nn.Module) -> bool:
        return all(
            (module if parent is None else parent())._modules.get(name) is child() for parent, name, child in self.links
        ) and all(key in store for store, key, _ in self.places)

    @classmethod
    def find(cls, module: nn.Module, names: tuple[Any, ...]) -> Slots | None:
        links, places = {}, []
        for dotted in names:
            *path, key = dotted.split(".")
            owner = module
            for part in path:
                child = owner._modules.get(part)
                if child is None:
                    return None
                links[id(owner), part] = (None if owner is module else weakref.ref(owner), part, weakref.ref(child))
                owner = child
            store = owner._parameters if key in owner._parameters else owner._buffers
            if key not in store:
                return None
            places.append((store, key, dotted))
        return cls(tuple(links.values()), tuple(places))

    @contextlib.contextmanager
    def holding(self, tensors: Mapping[str, torch.Tensor]):
        """The given tensors in their places for the block, the module's own put back after it."""
        own = self.put(tensors)
        try:
            yield
        finally:
            self.put_back(own)

    def call(self, module: nn.Module, tensors: Mapping[str, torch.Tensor], h: Any) -> Any:
        own = self.put(tensors)  # not through holding: a generator context costs a tiny stage's microseconds
        try:
            return module(h)
        finally:
            self.put_back(own)

    def put(self, tensors: Mapping[str, torch.Tensor]) -> list[Any]:
        """Put ``tensors`` in their places; the module's own tensors there, for ``put_back``."""
        own = [store[key] for store, key, _ in self.places]
        for store, key, dotted in self.places:
            store[key] = tensors[dotted]
        return own

    def put_back(self, own: list[Any]) -> None:
        for (store, key, _), tensor in zip(self.places, own):
            store[key] = tensor


register("module slots", "where a module keeps the tensors of each set of dotted names (weakly, per module)",
         lambda: Slots._cache.clear())  # fmt: skip
