"""A rebuild stopped early (the kernels after the graph's last saved tensor skipped) gives the full
rebuild's gradients bit for bit, on the fold and on run-time cuts; a rebuild that goes another way
than the learned tail runs again in full; a tail that is not safe to skip is never skipped."""

import contextlib
import gc
import weakref
from typing import cast
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import eae_func as ef
from eae_func.core import early_stop as ES

from live_bytes import LiveBytes

pytestmark = pytest.mark.usefixtures("one_thread")


@contextlib.contextmanager
def stopping():
    """Tiny stages: every tail is worth stopping; the kinds start unlearned; yields the list of the
    outputs whose kernels were skipped."""
    skipped: list = []
    allocated = ES.allocated
    with (
        mock.patch.object(ES, "WORTH", 0),
        mock.patch.object(ES, "_KINDS", {}),
        mock.patch.object(ES, "allocated", lambda *a: skipped.append(a) or allocated(*a)),
    ):
        yield skipped


class Tail(nn.Module):
    """``x + b(tanh(a(x)))`` and a variant tail: b's product and the tail's ops after it save nothing."""

    def __init__(self, dim: int, tail: str):
        super().__init__()
        self.a, self.b, self.tail = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim), tail
        self.kept = None

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        if self.tail == "scaled":
            h = 0.5 * h
        elif self.tail == "reshaped":
            h = h.reshape(-1).reshape(x.shape)
        elif self.tail == "random":
            h = h + 1e-3 * torch.rand_like(h)
        elif self.tail == "kept":
            self.kept = h.detach()
        elif self.tail == "item":
            h = h * 2.0 if h.abs().max().item() > 1e9 else h
        elif self.tail == "function":
            h = Halve.apply(h)
        elif self.tail in ("mean over rows", "mean over columns"):  # the same ops on other arguments
            h = h + h.mean(dim=0 if self.tail == "mean over rows" else 1, keepdim=True)
        elif self.tail == "hooked":
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                h = self.b(torch.tanh(self.a(h)))
        return x + h


class Halve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 0.5

    @staticmethod
    def backward(ctx, g):
        return g * 0.5


def grads(model, x, **options):
    """The sweep's gradients, the global RNG seeded alike for every call (the random tail draws)."""
    params = [dict(m.named_parameters()) for m in model]
    torch.manual_seed(7)
    return ef.grad(model, params, x, loss=lambda h: h.pow(3).mean(), **options)


def assert_bitwise(a, b):
    assert all(torch.equal(ga[n], gb[n]) for ga, gb in zip(a, b) for n in ga)


@given(
    st.lists(st.sampled_from(["residual", "scaled", "reshaped"]), min_size=1, max_size=3),
    st.integers(2, 5),
    st.integers(1, 4),
    st.sampled_from([1, 2]),
    st.integers(0, 2**16),
)
def test_a_stopped_rebuild_gives_the_full_rebuilds_gradients_bit_for_bit(tails, dim, rows, microbatches, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(*[Tail(dim, t) for t in tails]).double()
    x = torch.randn(2 * rows, dim, dtype=torch.float64)
    full = grads(model, x, early_stop=False, microbatches=microbatches)
    with stopping() as skipped:
        assert_bitwise(full, grads(model, x, microbatches=microbatches))  # learns (then stops, microbatch 2)
        assert ES._KINDS and all(k is not None for k in ES._KINDS.values())
        learning = len(skipped)
        assert_bitwise(full, grads(model, x, microbatches=microbatches))  # stops
        assert len(skipped) - learning >= 2 * len(tails) * microbatches  # b's product and the residual add


def test_the_tail_is_learned_once_then_skipped():
    torch.manual_seed(0)
    model = nn.Sequential(Tail(4, "residual"), Tail(4, "residual")).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    full = grads(model, x, early_stop=False)
    with stopping() as skipped:
        assert_bitwise(full, grads(model, x))  # learns (a kind per module)
        assert skipped == []
        assert [[str(op.func) for op in kind.tail] for kind in ES._KINDS.values()] == [
            ["aten.addmm.default", "aten.add.Tensor"]
        ] * 2
        assert_bitwise(full, grads(model, x))
        assert len(skipped) == 4  # two stages, addmm and add each


def test_a_rebuild_that_goes_another_way_runs_again_in_full_and_twice_stops_the_kind():
    torch.manual_seed(0)
    model = nn.Sequential(Tail(4, "residual")).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    with stopping() as skipped:
        grads(model, x)  # learned with the residual tail
        for k, tail in enumerate(["scaled", "reshaped"]):
            model[0].tail = tail
            full = grads(model, x, early_stop=False)
            assert_bitwise(full, grads(model, x))
            (kind,) = ES._KINDS.values()
            assert (kind is None) == (k == 1)
        assert len(skipped) == 2  # each skipped b's product, then missed and ran again in full
        model[0].tail = "residual"
        grads(model, x)
        assert len(skipped) == 2  # never again


def test_a_tail_of_the_same_ops_on_other_arguments_runs_again_in_full():
    """Learned as a mean over rows, then a mean over columns: the same ops, whose arguments (the
    dim) and outputs' shapes differ, so the stopped rebuild misses at that op and runs in full."""
    torch.manual_seed(0)
    model = nn.Sequential(Tail(4, "mean over rows")).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    with stopping():
        grads(model, x)
        model[0].tail = "mean over columns"
        full = grads(model, x, early_stop=False)
        assert_bitwise(full, grads(model, x))


def test_a_skipped_kernels_output_is_nan_where_it_is_floating():
    """What a read of a skipped output would see (the module docstring): NaN, never a stale value."""
    t = ES.allocated(torch.Size([2, 3]), (3, 1), torch.float32, torch.device("cpu"))
    assert t.shape == (2, 3) and t.stride() == (3, 1) and t.isnan().all()
    assert ES.allocated(torch.Size([2]), (1,), torch.int64, torch.device("cpu")).dtype == torch.int64


@pytest.mark.parametrize("tail", ["random", "kept", "item", "function", "hooked"])
def test_a_tail_that_is_not_safe_to_skip_is_never_skipped(tail):
    torch.manual_seed(0)
    model = nn.Sequential(Tail(4, tail)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    full = grads(model, x, early_stop=False)
    with stopping() as skipped:
        for _ in range(2):
            assert_bitwise(full, grads(model, x))
        assert list(ES._KINDS.values()) == [None]
        assert skipped == []
    if tail == "kept":
        assert not model[0].kept.isnan().any()


class Stack(nn.Module):
    """An embedding, layers cut at run time, a head: the glue differentiated by autograd."""

    def __init__(self, dim: int, depth: int):
        super().__init__()
        self.embed = nn.Linear(3, dim)
        self.layers = nn.ModuleList(Tail(dim, "residual") for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@given(st.integers(1, 3), st.integers(2, 5), st.integers(0, 2**16))
def test_run_time_cuts_stopped_early_give_the_full_rebuilds_gradients(depth, dim, seed):
    torch.manual_seed(seed)
    model = Stack(dim, depth).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    params = dict(model.named_parameters())

    def run(**options):
        return ef.grad(model, params, x, loss=lambda y: y.pow(2).mean(), split_at=["layers.*"], **options)

    full = run(early_stop=False)
    with stopping() as skipped:
        for _ in range(2):
            got = run()
            assert all(torch.equal(full[n], got[n]) for n in full)
        assert [k is not None for k in ES._KINDS.values()] == [True] * depth
        assert len(skipped) == 2 * depth  # the second step's: addmm and add per layer


def test_a_stopped_rebuild_holds_no_more_memory_than_a_full_one_and_lets_it_all_go():
    """Live bytes (exact): the step's peak, and what is still alive after it with the collector off
    (a tail output held in a reference cycle would stay until a collection)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Tail(8, "residual") for _ in range(3)]).double()
    x = torch.randn(16, 8, dtype=torch.float64)
    seen = {}
    for early_stop in (False, True):
        with stopping() as skipped:
            grads(model, x, early_stop=early_stop)  # learns
            gc.collect()
            gc.disable()
            try:
                with LiveBytes() as live:
                    g = grads(model, x, early_stop=early_stop)
                    del g
            finally:
                gc.enable()
            seen[early_stop] = live.peak, live.live, len(skipped)
    assert seen[True][0] <= seen[False][0]
    assert seen[True][1] == seen[False][1] == 0
    assert seen[True][2] == 6 and seen[False][2] == 0


class _Cache:
    """An object a layer is called with (as a Hugging Face cache is)."""


def test_a_kind_keeps_no_argument_of_the_call_alive():
    """The kind's key holds an object argument's type, not the object (nor its tensors)."""

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tail = Tail(4, "residual")

        def forward(self, x, cache):
            return self.tail(x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(2))

        def forward(self, x, cache):
            for layer in self.layers:
                x = layer(x, cache)
            return x

    model = Model().double()
    cache = _Cache()
    alive = weakref.ref(cache)
    with stopping():
        inputs = {"x": torch.randn(3, 4, dtype=torch.float64), "cache": cache}
        ef.grad(model, dict(model.named_parameters()), inputs, loss=lambda y: y.sum(), split_at=["layers.*"])
        del inputs
        del cache
        assert alive() is None and len(ES._KINDS) == 2


@given(st.integers(1, 3), st.integers(2, 5), st.integers(0, 2**16))
def test_the_zero_bubble_halves_stopped_early_give_the_full_backward(depth, dim, seed):
    """The I half and the W half of a zero-bubble backward, each a rebuild of its own kind, learn
    and then stop early, and still give the full reverse step's gradients bit for bit."""
    from eae_func.core import fold as Fold
    from eae_func.core import microbatch as M
    from eae_func.core.options import make
    from eae_func.core.runner import Range

    g = torch.Generator().manual_seed(seed)
    stage = ef.stage(lambda p, h: h + torch.tanh(h @ p["a"]) @ p["b"])
    chain = ef.Chain([stage] * depth, loss=lambda out, y: out.pow(3).mean())
    params = tuple(
        {"a": torch.randn(dim, dim, generator=g), "b": torch.randn(dim, dim, generator=g)} for _ in range(depth)
    )
    x, y = torch.randn(3, dim, generator=g), torch.randn(3, dim, generator=g)

    def backward(defer: bool, early_stop: bool) -> tuple:
        opts = make("test", {"early_stop": early_stop}).bind(chain)
        runner = Range(chain, 0, depth, params, opts, torch.device("cpu"))
        mb = M.split(x, (y,), 1, "mean", seed)[0]
        buffers = chain.check_buffers(None)
        piece = runner.backward(runner.forward(buffers, mb), mb, None, defer_weights=defer)
        return tuple(g.compute() if isinstance(g, Fold.Deferred) else g for g in piece.grads)

    full = backward(False, False)
    with stopping() as skipped:
        for _ in range(2):  # learns, then stops
            assert_bitwise(full, backward(True, True))
        assert len(ES._KINDS) == 2 and all(k is not None for k in ES._KINDS.values())
        assert skipped


class ExpOfInput(nn.Module):
    """``b(tanh(a(x))) + exp(x)``: ``exp`` saves its output only where ``x`` requires grad."""

    def __init__(self, dim: int):
        super().__init__()
        self.a, self.b = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + torch.exp(x)


def test_a_stopped_rebuild_that_saves_more_than_the_learned_one_runs_again_in_full():
    """The tail (b's product, ``exp``, the add) learned while the cut's input needed no gradient (the
    embedding frozen); unfrozen, the rebuild saves more tensors (a's weight, and ``exp``'s output in
    the tail): a miss, run again in full, never a NaN from a skipped kernel."""
    torch.manual_seed(0)
    model = Stack(4, 1).double()
    model.layers[0] = ExpOfInput(4).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    params = dict(model.named_parameters())

    def run(**options):
        return ef.grad(model, params, x, loss=lambda y: y.pow(2).mean(), split_at=["layers.*"], **options)

    with stopping():
        model.embed.requires_grad_(False)
        run()  # learned with an input that requires no grad
        (kind,) = ES._KINDS.values()
        assert kind is not None and [str(op.func) for op in kind.tail][-2:] == ["aten.exp.default", "aten.add.Tensor"]
        model.embed.requires_grad_(True)
        full = run(early_stop=False)
        got = run()
        assert all(not g.isnan().any() for g in got.values())
        assert all(torch.equal(full[n], got[n]) for n in full)


@pytest.mark.parametrize("where", ["submodule", "global"])
@pytest.mark.parametrize("driver", ["fold", "cuts"])
def test_no_forward_hook_sees_a_skipped_tail(where, driver):
    """A forward hook that keeps what it sees (feature extraction, logging) runs in the rebuilds too,
    as in ``torch.utils.checkpoint``'s recompute: while one is registered on a module the rebuild calls,
    or globally, the kind is not stopped, so it never sees NaN and the gradients are the full rebuild's;
    once removed, the kind stops again. A cut module's own hook runs around its call, not in its
    rebuild, and does not keep it from stopping."""
    torch.manual_seed(0)
    if driver == "cuts":
        model = Stack(4, 2).double()
        layers = [cast(Tail, m) for m in model.layers]
    else:
        layers = [Tail(4, "residual").double() for _ in range(2)]
        model = nn.Sequential(*layers)
    x = torch.randn(4, 3 if driver == "cuts" else 4, dtype=torch.float64)

    def run(**options):
        if driver == "fold":
            return grads(model, x, **options)
        params = dict(model.named_parameters())
        return [ef.grad(model, params, x, loss=lambda y: y.pow(2).mean(), split_at=["layers.*"], **options)]

    seen: list = []

    def keep(module, args, out):
        if isinstance(out, torch.Tensor):
            seen.append(out.detach())

    full = run(early_stop=False)
    with stopping() as skipped:
        run()  # learns
        hooks = [
            layers[0].b.register_forward_hook(keep)
            if where == "submodule"
            else nn.modules.module.register_module_forward_hook(keep)
        ]
        if driver == "cuts":
            hooks.append(layers[1].register_forward_hook(keep))  # the cut's own
        try:
            for _ in range(2):
                assert_bitwise(full, run())
        finally:
            for h in hooks:
                h.remove()
        assert seen and not any(t.isnan().any() for t in seen)
        stopped = 4 if where == "submodule" else 0  # the second layer's, two steps, addmm and add
        assert len(skipped) == stopped
        assert_bitwise(full, run())
        assert len(skipped) == stopped + 4
