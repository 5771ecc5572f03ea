"""The library's caches, in one registry: what each module keeps between calls to spare work
(captured chains, compiled graphs, what a kind of stage was learned to do), each bounded or held
by weak references, and all emptied by ``clear_caches()``. None changes a result: a call after
``clear_caches()`` pays the capture, compile or learning again.

    chain = kept(cache, key, fingerprint, lambda: capture(...))

``make()`` is kept under ``key`` while ``fingerprint`` is unchanged, and made again when it
changes; a cache holds the ``LIMIT`` entries used last (least recently used ones are dropped).
``register(name, what, clear)`` makes a module's cache known here (``caches()`` lists them).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["LIMIT", "caches", "clear_caches", "kept", "register"]

LIMIT = 8
_REGISTRY: dict[str, tuple[str, Callable[[], Any]]] = {}


def register(name: str, what: str, clear: Callable[[], Any]) -> None:
    """Make a module-level cache known to ``clear_caches``: ``what`` says its keys and its bound."""
    _REGISTRY[name] = (what, clear)


def caches() -> dict[str, str]:
    """Every registered cache by name: its keys and its bound."""
    return {name: what for name, (what, _) in _REGISTRY.items()}


def clear_caches() -> None:
    """Empty every cache eae_func keeps between calls (``caches()`` lists them); call it between steps,
    not while a sweep runs. Results do not change: the next call captures, compiles and learns again."""
    for _, clear in _REGISTRY.values():
        clear()


def kept(cache: dict[Any, Any], key: Hashable, fingerprint: Any, make: Callable[[], Any], limit: int = LIMIT) -> Any:
    """``cache[key]``'s thing if made at ``fingerprint``, else ``make()`` kept there; at most ``limit``
    entries stay (dicts keep insertion order: each use moves its entry last)."""
    hit = cache.pop(key, None)
    hit = fingerprint, make() if hit is None or hit[0] != fingerprint else hit[1]  # the newest fingerprint kept
    cache[key] = hit
    while len(cache) > limit:
        del cache[next(iter(cache))]
    return hit[1]
