"""The fold over a plain range (``core/plain.py``) returns what the general fold returns, bit for bit:
loss, gradients, trace, buffers and counters, on chains with dropout, frozen and tied parameters,
buffers, integer inputs, tuple boundaries, stages that switch modes or draw from Python's RNG, and
a stage that stops drawing, several microbatches (each piece's fold plain, the earlier pieces'
gradients added), passes (stateless, stateful, random, at one boundary) and kept costates, the
passes' state threaded into a second sweep; the options that are not plain never reach it."""

from __future__ import annotations

import random

import optree
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import eae_func as ef
from eae_func import passes as P
from eae_func.core import plain
from eae_func.lazy import Lazy
from eae_func.tree import NAMESPACE

from helpers import mse


class Pair(nn.Module):
    """A stage whose boundary is a tuple (a tensor and a mask of integers)."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h):
        if isinstance(h, tuple):
            h = h[0] * h[1]
        return torch.tanh(self.lin(h)), (h > 0).long()


class Unpair(nn.Module):
    def forward(self, h):
        return h[0] * h[1] if isinstance(h, tuple) else h


class Constant(nn.Module):
    """Its output does not depend on its input: the costate of its input is zeros, not none."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h):
        return self.lin(torch.ones_like(h))


class Noisy(nn.Module):
    """Draws from Python's generator in its forward (replayed by the rebuild)."""

    def forward(self, h):
        return h * (1.0 + random.random())


def stage(kind: str, width: int) -> nn.Module:
    """A stage of ``kind``, taking a tuple boundary (a pair's) or a tensor."""
    return nn.Sequential(Unpair(), _kind(kind, width))


def _kind(kind: str, width: int) -> nn.Module:
    return {
        "linear": lambda: nn.Sequential(nn.Linear(width, width), nn.Tanh()),
        "dropout": lambda: nn.Sequential(nn.Linear(width, width), nn.Dropout(0.3)),
        "frozen": lambda: nn.Sequential(nn.Linear(width, width).requires_grad_(False), nn.GELU()),
        "batchnorm": lambda: nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width)),
        "pair": lambda: Pair(width),  # a tuple boundary: the next stage's Unpair reads it
        "noisy": lambda: nn.Sequential(nn.Linear(width, width), Noisy()),
        "eval dropout": lambda: nn.Sequential(nn.Linear(width, width), nn.Dropout(0.5).eval()),
        "constant": lambda: Constant(width),
    }[kind]()


def both(chain, params, x, *loss_args, **options):
    """The sweep's result through the plain fold and through the general one, from the same RNG
    states, and how many folds of the first were plain."""
    calls, run = [], plain.run
    with pytest.MonkeyPatch.context() as m:
        m.setattr(plain, "run", lambda *a: calls.append(1) or run(*a))
        torch.manual_seed(7)
        random.seed(7)
        options = {"timers": False, "keep_costates": False, **options}
        fast = ef.sweep(chain, params, x, *loss_args, **options)
        m.setattr(plain, "applies", lambda *a: False)
        torch.manual_seed(7)
        random.seed(7)
        general = ef.sweep(chain, params, x, *loss_args, **options)
    return fast, general, len(calls)


def assert_same(a, b) -> None:
    """Every tensor and every other leaf of two results equal, bit for bit (the same structure)."""
    fa, sa = optree.tree_flatten(a, none_is_leaf=True, namespace=NAMESPACE)
    fb, sb = optree.tree_flatten(b, none_is_leaf=True, namespace=NAMESPACE)
    assert sa == sb
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y or (x != x and y != y)  # nan, as a pass measures where p = 0


def results(res) -> tuple:
    records = [(r.index, r.stage, r.key, r.value, r.history, _read(dict(r.meta))) for r in res.adjoints]
    stats = {k: _timed(v) if isinstance(v, dict) and k != "boundaries" else v for k, v in res.stats.items()}
    return res.loss, res.grads, res.buffers, records, _read(stats), res.params, res.pass_state


def _timed(counters):
    """A stage's counters with each of its seconds as whether it was measured (two runs' differ)."""
    return {k: v > 0 if k.endswith("_s") else v for k, v in counters.items()}


def _read(tree):
    """Measurements as numbers: a pass's lazy device number read (two of them never compare equal)."""
    return optree.tree_map(
        lambda v: v.value if isinstance(v, Lazy) else v, tree, none_is_leaf=True, namespace=NAMESPACE
    )


KINDS = ["linear", "dropout", "frozen", "batchnorm", "pair", "noisy", "eval dropout", "constant"]
PASSES = {  # what the plain fold passes each boundary to, and keeps
    "none": lambda: {},
    "kept costates": lambda: {"keep_costates": True},
    "timers, passes": lambda: {"timers": True, "keep_costates": True, "passes": P.clip_by_global_norm(0.1)},
    "timers": lambda: {"timers": True},
    "int8, clip, stats": lambda: {"passes": ef.compose(P.int8(), P.clip_by_global_norm(0.1), P.stats())},
    "error feedback": lambda: {"passes": P.error_feedback(P.topk(0.5)), "keep_costates": True},
    "synthetic": lambda: {"passes": P.synthetic(warmup=0, replace=True)},
    "noise, at one boundary": lambda: {"passes": P.only(P.gaussian_noise(0.1), indices=1)},
}


@settings(max_examples=25, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=4),
    tokens=st.booleans(),
    microbatches=st.sampled_from([1, 1, 2, 3]),
    seed=st.integers(0, 2**16),
    passes=st.sampled_from(sorted(PASSES)),
)
# the first stage's rebuild replays its RNG; zeros, not none, flow upstream; a tuple boundary's pass
# state; each timer, and the pass's, over tokens and microbatches
@example(kinds=["dropout"], tokens=False, microbatches=1, seed=0, passes="none")
@example(kinds=["linear", "constant"], tokens=False, microbatches=1, seed=0, passes="none")
@example(kinds=["pair", "linear"], tokens=False, microbatches=2, seed=0, passes="error feedback")
@example(kinds=["linear", "pair", "linear"], tokens=True, microbatches=2, seed=0, passes="timers, passes")
def test_plain_fold_equals_general_fold(kinds, tokens, microbatches, seed, passes):
    """(With several microbatches each piece's fold is plain and adds the earlier pieces' gradients;
    the passes' state is threaded through the pieces, and through a second sweep.)"""
    torch.manual_seed(seed)
    width = 5
    head = [nn.Embedding(11, width)] if tokens else []
    model = nn.Sequential(*head, *(stage(k, width) for k in kinds), Unpair()).train()
    x = torch.randint(0, 11, (6,)) if tokens else torch.randn(6, width)
    target = torch.randn(6, width)
    chain, params = ef.from_module(model, loss=mse)
    options = PASSES[passes]()
    fast, general, used = both(chain, params, x, target, microbatches=microbatches, **options)
    assert used == microbatches
    assert_same(results(fast), results(general))
    if fast.pass_state is not None:  # the next sweep, from each one's state
        fast, _, _ = both(chain, params, x, target, microbatches=microbatches, pass_state=fast.pass_state, **options)
        _, general, _ = both(
            chain, params, x, target, microbatches=microbatches, pass_state=general.pass_state, **options
        )
        assert_same(results(fast), results(general))


def test_a_tied_weight_and_a_stage_that_stops_drawing():
    """A tensor in two stages (its gradients summed), and dropout's p set to 0 after a first sweep:
    the next sweep draws nothing there, and both folds agree on each."""
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    drop = nn.Dropout(0.4)
    model = nn.Sequential(nn.Sequential(first, nn.Tanh()), nn.Sequential(nn.Linear(4, 4), drop), last)
    chain, params = ef.from_module(model, loss=mse)
    x, target = torch.randn(3, 4), torch.randn(3, 4)
    for p in (0.4, 0.0):
        drop.p = p
        fast, general, used = both(chain, params, x, target)
        assert used
        assert_same(results(fast), results(general))
        assert (fast.adjoints[0].index, len(fast.grads)) == (3, 3)


def test_a_first_stage_on_a_batch_of_sequences():
    """(batch, tokens, width) boundaries through Linear's matmul, at the first stage and after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 16))
    chain, params = ef.from_module(model, loss=mse)
    fast, general, used = both(chain, params, torch.randn(3, 7, 16), torch.randn(3, 7, 16))
    assert used
    assert_same(results(fast), results(general))


@pytest.mark.parametrize("general", [{}, {"autocast": torch.bfloat16}], ids=["plain", "general"])
def test_a_first_stage_that_writes_into_its_input_is_refused_and_the_input_kept(general):
    model = nn.Sequential(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4)), nn.Linear(4, 4))
    chain, params = ef.from_module(model, loss=mse)
    x = torch.randn(3, 4)
    before = x.clone()
    with pytest.raises(ValueError, match="modified its input in place"):
        ef.value_and_grad(chain, params, x, torch.randn(3, 4), **general)
    assert torch.equal(x, before)


@pytest.mark.parametrize(
    "option",
    [
        {"recompute": False},
        {"boundary_dtype": torch.bfloat16},
        {"autocast": torch.bfloat16},
        {"physical": [1], "estimator": ef.estimators.frozen()},
    ],
    ids=lambda o: next(iter(o)),
)
def test_options_that_are_not_plain_take_the_general_fold(option, monkeypatch):
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    chain, params = ef.from_module(model, loss=mse)
    calls = []
    run = plain.run
    monkeypatch.setattr(plain, "run", lambda *a: calls.append(1) or run(*a))
    options = {"timers": False, "keep_costates": False, **option}
    ef.sweep(chain, params, torch.randn(4, 4), torch.randn(4, 4), **options)
    assert not calls
    ef.sweep(chain, params, torch.randn(4, 4), torch.randn(4, 4), timers=False, keep_costates=False)
    assert calls


def test_the_plain_rebuild_runs_in_the_modes_its_forward_saw():
    """A pass switching the model to eval between the forward and the reverse steps (as another thread
    could): each stage's rebuild still runs its dropout in train mode with the forward's mask, so the
    gradients are autograd's; the switch stands after."""
    torch.manual_seed(0)
    model = nn.Sequential(_kind("dropout", 5), _kind("linear", 5)).train()
    x, target = torch.randn(6, 5), torch.randn(6, 5)
    torch.manual_seed(1)
    reference = dict(
        zip(dict(model.named_parameters()), torch.autograd.grad(mse(model(x), target), model.parameters()))
    )
    chain, params = ef.from_module(model, loss=mse)

    def switch(adj):
        model.eval()
        return adj

    torch.manual_seed(1)
    res = ef.sweep(chain, params, x, target, passes=switch, timers=False)
    assert not model.training
    got = {f"{k}.{n}": g for k, stage in enumerate(res.grads) for n, g in stage.items()}
    assert got.keys() == reference.keys()
    for n, g in got.items():
        torch.testing.assert_close(g, reference[n], rtol=1e-6, atol=1e-7, msg=n)
