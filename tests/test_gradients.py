"""The first property: with no passes, EAE gradients equal torch.autograd's."""

import optree
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import eae_func as ef
from eae_func.adjoint import NAMESPACE

from helpers import assert_grads_match, autograd_grads, build, mse

TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=1e-4, atol=1e-6)}


@given(
    kind=st.sampled_from(["mlp", "conv", "transformer"]),
    depth=st.integers(1, 8),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_gradients_equal_autograd(kind, depth, dtype, seed):
    model, x, target = build(kind, depth, dtype, seed)
    chain, params = ef.from_module(model, loss=mse)
    res = ef.sweep(chain, params, x, target)
    loss, reference = autograd_grads(model, mse, x, target)
    torch.testing.assert_close(res.loss, loss, **TOL[dtype])
    assert_grads_match(chain, res.grads, reference, **TOL[dtype])


@given(kind=st.sampled_from(["mlp", "conv"]), depth=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_grads_keep_the_tree_of_params_and_costates_mirror_boundaries(kind, depth, seed):
    model, x, target = build(kind, depth, torch.float64, seed)
    chain, params = ef.from_module(model, loss=mse)
    res = ef.sweep(chain, params, x, target)
    assert optree.tree_structure(res.grads, namespace=NAMESPACE) == optree.tree_structure(params, namespace=NAMESPACE)
    assert [a.index for a in res.adjoints] == list(range(depth, -1, -1))
    assert [a.stage for a in res.adjoints] == [*reversed(chain.names), "input"]
    assert all(not hasattr(a, "boundary") for a in res.adjoints)  # the boundary state is not in the record
    # p_0 is the input gradient
    x_leaf = x.clone().requires_grad_(True)
    mse(model(x_leaf), target).backward()
    torch.testing.assert_close(res.adjoints[-1].value, x_leaf.grad, rtol=1e-9, atol=1e-11)


@given(depth=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_pure_function_chain_with_pytree_boundaries(depth, seed):
    """Stages ``fn(params, (h, memory))`` with a tuple boundary: costates mirror it, grads match autograd."""
    g = torch.Generator().manual_seed(seed)
    params = tuple(
        {
            "w": torch.randn(4, 4, generator=g, dtype=torch.float64),
            "u": torch.randn(4, 4, generator=g, dtype=torch.float64),
        }
        for _ in range(depth)
    )

    def cross(p, state):
        h, memory = state
        return torch.tanh(h @ p["w"] + memory @ p["u"]), memory

    chain = ef.Chain(
        [ef.stage(cross, name=f"cross{i}") for i in range(depth)],
        loss=lambda state: state[0].square().sum() + state[1].sin().sum(),
    )
    h = torch.randn(3, 4, generator=g, dtype=torch.float64)
    memory = torch.randn(3, 4, generator=g, dtype=torch.float64)
    res = ef.sweep(chain, params, (h, memory))

    leaves = [{k: v.clone().requires_grad_(True) for k, v in p.items()} for p in params]
    state = (h.clone().requires_grad_(True), memory.clone().requires_grad_(True))
    out = state
    for p in leaves:
        out = cross(p, out)
    loss = chain.loss(out)
    flat = [t for p in leaves for t in p.values()] + list(state)
    expected = torch.autograd.grad(loss, flat)
    got = [t for g_ in res.grads for t in (g_["w"], g_["u"])] + list(res.adjoints[-1].value)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert isinstance(res.adjoints[0].value, tuple) and len(res.adjoints[0].value) == 2


def test_a_tensor_shared_by_two_function_stages_inside_nested_params_gets_the_summed_gradient():
    w = torch.randn(4, 4, dtype=torch.float64)

    def layer(p, h):
        return torch.tanh(h @ p["a"]["w"])

    chain = ef.Chain([ef.stage(layer, name="s0"), ef.stage(layer, name="s1")], loss=lambda h: h.square().sum())
    x = torch.randn(3, 4, dtype=torch.float64)
    grads = ef.grad(chain, ({"a": {"w": w}}, {"a": {"w": w}}), x)
    leaf = w.clone().requires_grad_()
    torch.tanh(torch.tanh(x @ leaf) @ leaf).square().sum().backward()
    assert all(torch.allclose(g["a"]["w"], leaf.grad, rtol=1e-12, atol=0) for g in grads)


class DrawsWhenOn(nn.Module):
    """Adds noise from torch's generator only while ``on``: a stage that starts (or stops) drawing
    after its first call."""

    def __init__(self):
        super().__init__()
        self.on = False

    def forward(self, h):
        return h + 0.1 * torch.randn_like(h) if self.on else h


@settings(max_examples=12, deadline=None)
@given(
    schedule=st.lists(st.tuples(st.sampled_from([0.0, 0.4]), st.booleans(), st.booleans()), min_size=2, max_size=4),
    driver=st.sampled_from(["grad", "sweep", "cuts", "enable"]),
)
def test_a_stage_that_starts_or_stops_drawing_between_sweeps_gets_autograds_gradients(schedule, driver):
    """Sweep after sweep, a dropout's p changed from 0 and back, the model switched between train and
    eval, a stage that starts drawing after its first call: each sweep's gradients are autograd's on
    the same RNG state (the rebuild replays exactly what the forward drew, and nothing where it drew
    nothing); with ``ef.enable`` the model is switched to the other mode between the forward and the
    backward, which the rebuild must not see."""
    torch.manual_seed(0)
    drop, noise = nn.Dropout(0.0), DrawsWhenOn()
    model = nn.Sequential(
        nn.Sequential(nn.Linear(5, 5), nn.Tanh()), nn.Sequential(nn.Linear(5, 5), drop, noise), nn.Linear(5, 5)
    ).double()
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    chain, params = ef.from_module(model, loss=mse)
    for step, (p, train, on) in enumerate(schedule):
        drop.p, noise.on = p, on
        model.train(train)
        torch.manual_seed(step)
        _, reference = autograd_grads(model, mse, x, y)
        torch.manual_seed(step)
        if driver == "enable":
            with ef.enable(model, split_at=["*"]):
                model.zero_grad(set_to_none=True)
                loss = mse(model(x), y)
                model.train(not train)
                loss.backward()
            for q in model.parameters():
                torch.testing.assert_close(q.grad, reference[q], rtol=1e-12, atol=1e-14)
            continue
        if driver == "cuts":
            grads = ef.grad(model, dict(model.named_parameters()), x, y, loss=mse, split_at=["*"])
            for name, q in model.named_parameters():
                torch.testing.assert_close(grads[name], reference[q], rtol=1e-12, atol=1e-14)
            continue
        grads = ef.grad(chain, params, x, y) if driver == "grad" else ef.sweep(chain, params, x, y).grads
        assert_grads_match(chain, grads, reference, rtol=1e-12, atol=1e-14)
