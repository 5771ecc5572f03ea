"""The caches of made things keep what was made at the same fingerprint, remake it when the
fingerprint changes, and hold at most their limit, dropping the least recently used."""

from hypothesis import given
from hypothesis import strategies as st

from eae_func.cache import kept


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1)), max_size=40), st.integers(1, 4))
def test_kept_is_a_bounded_least_recently_used_cache(uses, limit):
    cache: dict = {}
    made: list = []
    order: list = []  # keys, least recently used first
    current: dict = {}  # key -> (fingerprint, thing) of the model cache
    for key, fingerprint in uses:
        thing = kept(cache, key, fingerprint, lambda: made.append(object()) or made[-1], limit)
        fresh = key not in current or current[key][0] != fingerprint
        assert (thing is made[-1]) if fresh else (thing is current[key][1])
        current[key] = fingerprint, thing
        order = [k for k in order if k != key] + [key]
        for dropped in order[:-limit]:
            current.pop(dropped)
        order = order[-limit:]
        assert list(cache) == order and len(cache) <= limit
