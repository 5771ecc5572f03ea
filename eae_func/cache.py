"""The library's caches of made things (captured chains, compiled graphs), each bounded.

    chain = kept(cache, key, fingerprint, lambda: capture(...))

``make()`` is kept under ``key`` while ``fingerprint`` is unchanged, and made again when it
changes; a cache holds the ``LIMIT`` entries used last (least recently used ones are dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

LIMIT = 8


def kept(cache: dict, key: Hashable, fingerprint: Any, make: Callable[[], Any], limit: int = LIMIT) -> Any:
    """``cache[key]``'s thing if made at ``fingerprint``, else ``make()`` kept there; at most ``limit``
    entries stay (dicts keep insertion order: each use moves its entry last)."""
    hit = cache.pop(key, None)
    hit = fingerprint, make() if hit is None or hit[0] != fingerprint else hit[1]  # the newest fingerprint kept
    cache[key] = hit
    while len(cache) > limit:
        del cache[next(iter(cache))]
    return hit[1]
