"""The AdjointState record and the pass protocol: immutability, pytree registration, compose laws."""

import dataclasses

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import eae_func as ef
from eae_func import passes as P
from eae_func.adjoint import NAMESPACE, AdjointState


def record(value=None, index=2):
    return AdjointState(torch.arange(6.0).reshape(2, 3) if value is None else value, index, "blk", key=7)


def test_record_is_frozen_and_replace_returns_a_new_one():
    adj = record()
    with pytest.raises(dataclasses.FrozenInstanceError):
        adj.index = 3
    with pytest.raises(TypeError):
        adj.meta["x"] = 1
    new = adj.applied("double", adj.value * 2, scale=2.0)
    assert new.history == ("double",) and new.meta["scale"] == 2.0
    assert adj.history == () and dict(adj.meta) == {} and torch.equal(adj.value, torch.arange(6.0).reshape(2, 3))
    assert new.replace(meta={"norm": 1.0}).meta == {"scale": 2.0, "norm": 1.0}


def test_record_is_a_pytree_for_optree_and_torch_func():
    adj = record(value=(torch.ones(3), None, {"m": torch.zeros(2)}))
    leaves, spec = optree.tree_flatten(adj, namespace=NAMESPACE)
    assert len(leaves) == 2
    doubled = optree.tree_map(lambda t: t + 1, adj, namespace=NAMESPACE)
    assert isinstance(doubled, AdjointState) and doubled.index == 2 and doubled.key == 7
    assert torch.equal(doubled.value[2]["m"], torch.ones(2)) and doubled.value[1] is None
    out = torch.func.vmap(lambda a: a.replace(value=a.value * 3))(record())
    assert isinstance(out, AdjointState) and torch.equal(out.value, record().value * 3)
    (grad,) = torch.func.grad(lambda a: a.value.square().sum(), argnums=(0,))(record())
    assert isinstance(grad, AdjointState) and torch.equal(grad.value, 2 * record().value)


def scale_by(c):
    def scale(adj):
        return adj.applied(f"scale{c}", adj.value * c)

    return scale


def shift_by(c):
    return lambda adj: adj.applied(f"shift{c}", adj.value + c)


def counter(c):
    """Stateful: adds c * (number of calls so far) and counts."""
    return P.Pass(
        init=lambda: torch.zeros(()),
        update=lambda adj, n, ctx: (adj.applied(f"count{c}", adj.value + c * n), n + 1),
        name=f"count{c}",
    )


pass_strategy = st.builds(
    lambda kind, c: {"scale": scale_by, "shift": shift_by, "count": counter}[kind](c),
    st.sampled_from(["scale", "shift", "count"]),
    st.integers(-3, 3),
)


def run(p, adj, steps=3):
    p = P.compose(p)
    state, outs = p.init(), []
    for _ in range(steps):
        out, state = p.update(adj, state, P.Context())
        outs.append(out)
    return outs


def same(xs, ys):
    return all(torch.equal(x.value, y.value) and x.history == y.history for x, y in zip(xs, ys))


@given(a=pass_strategy, b=pass_strategy, c=pass_strategy)
def test_compose_is_associative_and_identity_is_neutral(a, b, c):
    adj = record()
    left, right, flat = P.compose(P.compose(a, b), c), P.compose(a, P.compose(b, c)), P.compose(a, b, c)
    assert same(run(left, adj), run(flat, adj)) and same(run(right, adj), run(flat, adj))
    assert same(run(P.compose(P.identity(), a, P.identity()), adj), run(a, adj))
    lifted = P.lift(a)
    assert P.compose() == P.identity() and P.compose(lifted) is lifted and P.compose(P.identity(), lifted) is lifted
    assert isinstance(P.compose(a, b), P.Pass) and isinstance(P.when(lambda r: True, a), P.Pass)


def test_composed_state_threads_through_sweeps():
    torch.manual_seed(0)
    chain, params = ef.from_module(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()), loss=torch.sum)
    x = torch.randn(2, 3)
    pipeline = P.compose(counter(1), scale_by(2), counter(0))
    res = ef.sweep(chain, params, x, passes=pipeline)
    counts = lambda state: (int(state[0]), state[1], int(state[2]))  # noqa: E731 - the plain pass has no state
    assert counts(res.pass_state) == (3, None, 3)  # three boundaries per sweep
    res = ef.sweep(chain, params, x, passes=pipeline, pass_state=res.pass_state)
    assert counts(res.pass_state) == (6, None, 6)
    assert res.adjoints[0].history == ("count1", "scale2", "count0")
    with pytest.raises(ValueError, match="pass state tuple of 3 entries"):
        ef.sweep(chain, params, x, passes=pipeline, pass_state=(1,))


def test_records_that_differ_only_in_costate_values_tree_map_together():
    a, b = record(), record(value=torch.ones(2, 3))
    total = ef.tree_map(torch.add, a, b)
    assert isinstance(total, AdjointState) and torch.equal(total.value, a.value + 1)
    assert (total.index, total.stage, total.key) == (a.index, a.stage, a.key)
    assert optree.tree_structure(a, namespace=NAMESPACE) == optree.tree_structure(b, namespace=NAMESPACE)
    hash(optree.tree_structure(a, namespace=NAMESPACE))  # static fields are hashable values


def test_generator_gives_independent_draws_at_each_position_of_the_history():
    adj = record()
    first, second = adj.generator(), adj.applied("noise", adj.value).generator()
    assert not torch.equal(torch.randn(8, generator=first), torch.randn(8, generator=second))
    assert torch.equal(torch.randn(8, generator=adj.generator()), torch.randn(8, generator=record().generator()))
