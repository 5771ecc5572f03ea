"""The caches of made things keep what was made at the same fingerprint, remake it when the
fingerprint changes, and hold at most their limit, dropping the least recently used."""

import gc
import types
import weakref
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eae_func.cache import kept
from eae_func.program import watch as W


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


# ----------------------------------------------------------------------------- the capture's watch


class _Box:
    """An object with a ``__dict__`` and a value equality (a dataclass would have one too)."""

    def __init__(self, scale):
        self.scale = scale

    def __eq__(self, other):
        return isinstance(other, _Box) and self.scale == other.scale

    __hash__ = None


class _Linear(torch.nn.Linear):
    pass


class _Watched(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.seq = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
        self.cfg = types.SimpleNamespace(sub=types.SimpleNamespace(scale=1.0, table={"a": [1, 2]}, box=_Box(1.0)))
        self.items = [1, (2, [3])]
        self.tags = {"x"}
        self.t = torch.zeros(3)

    def forward(self, x):
        return self.seq(self.lin(x) * self.cfg.sub.scale + self.t)


def _mutations():
    return [
        lambda m, v: setattr(m.cfg.sub, "scale", float(v % 3)),  # often the same value again
        lambda m, v: m.cfg.sub.table["a"].append(v),
        lambda m, v: m.cfg.sub.table.__setitem__(f"k{v % 2}", v),
        lambda m, v: m.items[1][1].__setitem__(0, v % 2),
        lambda m, v: m.tags.add(f"t{v % 2}"),
        lambda m, v: setattr(m.cfg.sub, "box", _Box(m.cfg.sub.box.scale)),  # an equal, other object
        lambda m, v: setattr(m.cfg.sub.box, "scale", float(v % 2)),
        lambda m, v: m.t.requires_grad_(bool(v % 2)),
        lambda m, v: setattr(m.t, "data", m.t.data.to(torch.float64 if v % 2 else torch.float32)),
        lambda m, v: setattr(m, "t", torch.zeros(3)),  # an equal tensor, another object
        lambda m, v: m.lin.weight.requires_grad_(bool(v % 2)),
        lambda m, v: m.train(bool(v % 2)),
        lambda m, v: m.seq[0].register_forward_hook(lambda *a: None),
        lambda m, v: setattr(m.seq[0], "__class__", _Linear if v % 2 else torch.nn.Linear),
        lambda m, v: m.seq.append(torch.nn.Identity()),
        lambda m, v: setattr(m, "items", m.items),  # the same object again: nothing changed
        lambda m, v: m(torch.ones(2, 3)),  # a forward changes nothing the capture reads
    ]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_mutations()) - 1), st.integers(0, 5)), max_size=12))
def test_a_watch_says_unchanged_only_when_the_fingerprint_is_unchanged(steps):
    """``Watch.current()`` is the watch itself only if the model's fingerprint is what it was, after
    any sequence of changes at any depth (and it is, while nothing changed)."""
    model = _Watched()
    watch = W.Watch(model)
    assert watch.current() is watch
    for which, v in steps:
        before = W.fingerprint(model)
        _mutations()[which](model, v)
        now = watch.current()
        assert now.fingerprint == W.fingerprint(model)
        if now is watch:
            assert before == now.fingerprint
        watch = now
        assert watch.current() is watch


def test_a_watch_does_not_keep_the_model_alive():
    model = _Watched()
    watch = W.Watch(model)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None and watch.current() is watch


class _Buffered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_a_watch_sees_a_buffers_dtype_changed_in_place_or_replaced():
    """A capture bakes its buffers' dtypes: ``buf.data = buf.data.double()`` (the same tensor object)
    or a new buffer of another dtype makes the watch stale, with another fingerprint."""
    for change in (
        lambda m: setattr(m.scale, "data", m.scale.data.double()),
        lambda m: setattr(m, "scale", torch.ones(3, dtype=torch.float64)),
    ):
        model = _Buffered()
        watch = W.Watch(model)
        change(model)
        now = watch.current()
        assert now is not watch and now != watch
        assert now.fingerprint == W.fingerprint(model)


# ----------------------------------------------------------------------------- a module's chain, kept


def _linear(m, v):
    linears = [c for c in m if isinstance(c, torch.nn.Linear)]
    return linears[v % len(linears)]


def _changes():
    return [
        lambda m, v: None,
        lambda m, v: m.__setitem__(v % len(m), torch.nn.Linear(3, 3)),  # a child replaced
        lambda m, v: _linear(m, v).weight.requires_grad_(bool(v % 2)),  # frozen, or trainable again
        lambda m, v: m.append(torch.nn.Linear(3, 3)),
        lambda m, v: setattr(_linear(m, v), "weight", m[0].weight),  # tied to the first child's
        lambda m, v: _linear(m, v).register_forward_hook(lambda mod, args, out: out * 2.0),
    ]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_changes()) - 1), st.integers(0, 5)), max_size=8))
def test_a_sequential_chain_is_built_once_and_again_after_any_change(steps):
    """A sweep of an ``nn.Sequential`` builds its chain on the first call and again only when the model
    changed; after any changes its gradients are autograd's."""
    import torch.nn.functional as F

    import eae_func as ef
    from eae_func.drivers import sweep_model as S

    builds = []
    build = S.from_module
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3)).double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    for which, v in [(0, 0), *steps]:
        before = W.fingerprint(model)
        _changes()[which](model, v)
        model.double()
        changed, count = W.fingerprint(model) != before, len(builds)
        params = dict(model.named_parameters())
        with mock.patch.object(S, "from_module", lambda *a, **k: builds.append(1) or build(*a, **k)):
            grads = ef.grad(model, params, x, y, loss=F.mse_loss)
        assert len(builds) == count + (1 if changed or count == 0 else 0)
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        assert grads.keys() == params.keys()
        for n, p in params.items():
            if p.requires_grad:
                torch.testing.assert_close(grads[n], p.grad, rtol=1e-12, atol=1e-12)
            else:
                assert grads[n] is None


def test_clear_caches_empties_every_cache_and_changes_no_result():
    """``ef.clear_caches()`` empties each registered cache (a captured model, learned early stops and
    input writes, boundary keys), and the sweeps after it give the same gradients, bit for bit."""
    import torch.nn.functional as F
    from torch import nn

    import eae_func as ef
    from eae_func import adjoint
    from eae_func.cache import caches
    from eae_func.core import early_stop
    from eae_func.drivers import input_writes, sweep_model
    from eae_func.program.capture import matches

    class Doubles(nn.Module):  # writes into its input: learned by run-time cuts
        def forward(self, h):
            return torch.tanh(h.mul_(2))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 64), Doubles()), nn.Linear(64, 4))
    x, y = torch.randn(8, 64), torch.randn(8, 4)
    params = dict(model.named_parameters())

    def both():
        run = ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["1"])
        graph = ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["1"], capture="graph")
        return run, graph

    before = both()
    assert len(sweep_model._CAPTURED) and len(input_writes.WRITES.seen) and adjoint.fold_in.cache_info().currsize
    assert matches.cache_info().currsize
    assert {
        "captured models",
        "compiled",
        "early_stop",
        "input writes",
        "boundary keys",
        "module paths matched",
    } <= set(caches())
    ef.clear_caches()
    assert not len(sweep_model._CAPTURED) and not len(input_writes.WRITES.seen) and not early_stop._KINDS
    assert adjoint.fold_in.cache_info().currsize == 0 and matches.cache_info().currsize == 0
    after = both()
    for got, want in zip(after, before):
        assert all(torch.equal(got[n], want[n]) for n in want)
