"""The per-stage fast paths (issue 14) compute what the general ones do: a module stage runs on the
given tensors in the module's own places (``Slots``) exactly as ``functional_call`` runs it, the
chain input's costate is skipped only where nothing can read it, and with no passes an estimator's
costate is still checked."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call
from torch.nn.utils.parametrizations import weight_norm
from torch.utils._python_dispatch import TorchDispatchMode

import eae_func as ef
from eae_func import estimators as E
from eae_func import passes as P
from eae_func.models import Block
from eae_func.program.slots import Slots

from helpers import TiedInside, mlp, mse


def modules():
    return {
        "mlp": (lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)), (5, 6)),
        "conv+batchnorm": (
            lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.GELU()),
            (2, 3, 5, 5),
        ),
        "transformer block": (lambda: Block(16, n_heads=4, n_kv_heads=2, ffn_hidden=24), (2, 7, 16)),
        "weight_norm (a parametrization)": (lambda: nn.Sequential(weight_norm(nn.Linear(6, 6)), nn.Tanh()), (5, 6)),
    }


@settings(max_examples=15, deadline=None)
@given(kind=st.sampled_from(sorted(modules())), seed=st.integers(0, 2**16), train=st.booleans())
def test_a_module_stage_computes_what_functional_call_computes(kind, seed, train):
    torch.manual_seed(seed)
    make, shape = modules()[kind]
    module = make().train(train)
    own = {n: t for n, t in [*module.named_parameters(), *module.named_buffers()]}
    chain, (params,) = ef.from_module([module], loss=mse)
    params = {n: torch.randn_like(t) for n, t in params.items()}  # not the module's own values
    buffers = {n: b.clone() + 0.5 if b.is_floating_point() else b.clone() for n, b in module.named_buffers()}
    given_buffers = {n: b.clone() for n, b in buffers.items()}
    x = torch.randn(shape)
    out, updated = chain.stages[0].call(params, buffers, x)
    reference_buffers = {n: b.clone() for n, b in buffers.items()}
    reference = functional_call(module, {**params, **reference_buffers}, (x,))
    assert torch.equal(out, reference)
    for n, b in reference_buffers.items():  # BatchNorm's running statistics, updated in the returned copies
        assert torch.equal(updated[n], b)
    for n, b in buffers.items():
        assert torch.equal(b, given_buffers[n])  # the given buffers are not written
    assert all(t is own[n] for n, t in [*module.named_parameters(), *module.named_buffers()])


def test_the_module_gets_its_own_tensors_back_when_the_call_raises():
    class Failing(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, h):
            self.lin(h)
            raise RuntimeError("stage failed")

    module = Failing()
    weight = module.lin.weight
    chain, params = ef.from_module([module], loss=mse)
    with pytest.raises(RuntimeError, match="stage failed"):
        chain.stages[0].call(params[0], {}, torch.randn(2, 3))
    assert module.lin.weight is weight and isinstance(module.lin.weight, nn.Parameter)


def test_a_replaced_submodule_is_found_again():
    model = mlp(2)
    chain, params = ef.from_module(model, loss=mse)
    x = torch.randn(5, 6)
    chain.stages[0].call(params[0], {}, x)  # places found for the first submodule
    model[0][0] = nn.Linear(6, 6)  # a new owner under the same name
    assert Slots.of(model[0], params[0]).places[0][0] is model[0][0]._parameters
    out, _ = chain.stages[0].call(params[0], {}, x)
    assert torch.equal(out, functional_call(model[0], params[0], (x,)))


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def test_the_input_costate_is_skipped_only_where_nothing_reads_it():
    torch.manual_seed(0)
    model, x, y = mlp(3), torch.randn(5, 6), torch.randn(5, 6)
    chain, params = ef.from_module(model, loss=mse)
    with Ops() as autograd:
        mse(model(x), y).backward()
    with Ops() as grads_only:
        ef.value_and_grad(chain, params, x, y)
    with Ops() as traced:
        res = ef.sweep(chain, params, x, y)
    # backward: one mm for each weight's gradient and one for each input gradient but the chain input's
    assert autograd.counts["mm"] == grads_only.counts["mm"] == 5
    assert traced.counts["mm"] == 6
    x_ = x.clone().requires_grad_()
    mse(model(x_), y).backward()
    assert torch.allclose(res.adjoints[-1].value, x_.grad, atol=1e-7)
    seen = []
    ef.value_and_grad(chain, params, x, y, passes=P.tap(lambda a: seen.append(a.value)))
    assert torch.allclose(seen[-1], x_.grad, atol=1e-7)  # a pass reads p_0, so it is computed


class WrongShape:
    """An estimator whose costate has the wrong shape: refused though there are no passes."""

    def prepare(self, problem):
        return None

    def stage_vjp(self, problem, prepared, i, h_in, costate):
        grads, costate_in = E.exact().stage_vjp(problem, prepared, i, h_in, costate)[:2]
        return grads, costate_in[:1], {}


def test_an_estimators_costate_is_checked_without_passes():
    torch.manual_seed(0)
    model, x, y = mlp(3), torch.randn(5, 6), torch.randn(5, 6)
    chain, params = ef.from_module(model, loss=mse, physical=[1])
    with pytest.raises(ValueError, match=r"costate shape \(1, 6\) differs from the stage output shape \(5, 6\)"):
        ef.value_and_grad(chain, params, x, y, estimator=WrongShape())


def test_without_timers_the_stats_hold_no_seconds_and_the_gradients_are_the_same():
    torch.manual_seed(0)
    model, x, y = mlp(3), torch.randn(5, 6), torch.randn(5, 6)
    chain, params = ef.from_module(model, loss=mse)
    timed, untimed = ef.sweep(chain, params, x, y), ef.sweep(chain, params, x, y, timers=False)
    for name in chain.names:
        assert timed.stats[name]["vjp_s"] > 0 and timed.stats[name]["forward_s"] > 0
        assert not [k for k in untimed.stats[name] if k.endswith("_s")]
        assert untimed.stats[name]["boundary_bytes"] == timed.stats[name]["boundary_bytes"]
        for n, g in timed.grads[chain.index(name)].items():
            assert torch.equal(untimed.grads[chain.index(name)][n], g)


def test_the_places_found_keep_no_module_alive():
    import gc
    import weakref

    model = mlp(2)
    chain, params = ef.from_module(model, loss=mse)
    ef.value_and_grad(chain, params, torch.randn(5, 6), torch.randn(5, 6))
    assert len(Slots._cache.get(model[0], {})) == 1
    stage_module = weakref.ref(model[0])
    del model, chain, params
    gc.collect()
    assert stage_module() is None


def test_a_stage_with_one_tensor_under_two_names_gets_both_uses_gradients():
    """Such a stage runs through ``functional_call`` (which ties the names), not the fast ``Slots``
    path (which would put the given tensor in one place and leave the module's own in the other):
    its weight's gradient sums both uses, as autograd's does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), TiedInside(), nn.Linear(6, 3)).double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    chain, params = ef.from_module(model, loss=mse)
    assert chain.stages[1].aliased
    grads = ef.grad(chain, params, x, y)
    mse(model(x), y).backward()
    for (_, g), (_, p) in zip(((n, g) for stage in grads for n, g in stage.items()), model.named_parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-14)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_modes_are_every_module_once_in_the_order_modules_gives(data):
    """``replay.modes_of`` walks ``_modules`` itself: the same modules as ``module.modules()``, in its
    order, each once (a module shared by two parents, a ``None`` child), with their training flags."""
    from eae_func.core.replay import modes_of

    pool = [nn.Linear(2, 2), nn.Tanh(), nn.Dropout(0.1)]
    for _ in range(data.draw(st.integers(1, 6))):
        children = data.draw(st.lists(st.sampled_from(pool), max_size=3))
        parent = nn.Sequential(*children) if data.draw(st.booleans()) else nn.ModuleList(children)
        if data.draw(st.booleans()):
            parent.register_module("empty", None)
        pool.append(parent)
    root = pool[-1]
    for m in root.modules():
        m.training = data.draw(st.booleans())
    assert modes_of(root) == tuple((m, m.training) for m in root.modules())


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_a_cut_call_walks_its_module_as_named_modules_does(data):
    """``cut_call.walk`` visits ``_modules`` itself: the parameters (aliases included), buffers and
    modes that ``named_modules(remove_duplicate=False)`` gives, in its order, a shared submodule once
    per place it sits in."""
    from eae_func.drivers.cut_call import walk

    pool = [nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Tanh()]
    for _ in range(data.draw(st.integers(1, 5))):
        children = data.draw(st.lists(st.sampled_from(pool), max_size=3))
        parent = nn.Sequential(*children)
        if data.draw(st.booleans()):
            parent.register_module("empty", None)
            parent.register_buffer("none", None)
        pool.append(parent)
    root = pool[-1]
    params, buffers, modes = walk(root)
    named = list(root.named_modules(remove_duplicate=False))
    assert modes == tuple((m, m.training) for _, m in named)
    assert list(params.items()) == list(root.named_parameters(remove_duplicate=False))
    assert list(buffers) == [n for n, _ in root.named_buffers(remove_duplicate=False)]
    own = dict(root.named_buffers(remove_duplicate=False))
    assert all(torch.equal(b, own[n]) and b.data_ptr() != own[n].data_ptr() for n, b in buffers.items())  # copies
