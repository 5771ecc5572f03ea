"""Pure functions ``model_fn(params, x)`` over any params pytree, cut at ``ef.cut`` marks: the
gradients are ``torch.func.grad``'s for every tree, cut and tie; every sweep option works as on a
chain; what a capture cannot keep is refused with the line that does it."""

import random
import typing

import numpy as np
import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import eae_func as ef
from eae_func import estimators as E
from eae_func import passes as P
from eae_func.program import function
from eae_func.tree import NAMESPACE

from live_bytes import LiveBytes

F64 = torch.float64
D, B = 3, 4


class Head(typing.NamedTuple):
    w: torch.Tensor
    b: torch.Tensor


@optree.dataclasses.dataclass(namespace="")
class Affine:
    w: torch.Tensor
    b: torch.Tensor


def reference_grad(loss_of, params):
    """``torch.func.grad`` over params' optree leaves (it does not know optree's registered classes)."""
    leaves, spec = optree.tree_flatten(params, namespace=NAMESPACE)
    grads = torch.func.grad(lambda ls: loss_of(spec.unflatten(ls)))(leaves)
    return spec.unflatten(grads)


def assert_trees_close(got, want, atol):
    assert optree.tree_structure(got, namespace=NAMESPACE) == optree.tree_structure(want, namespace=NAMESPACE)
    for g, w in zip(optree.tree_leaves(got, namespace=NAMESPACE), optree.tree_leaves(want, namespace=NAMESPACE)):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, atol=atol, rtol=0)


def network(
    subs=(2, 1, 1), biased=(True, False, True), cuts=(True, True, False), tree_boundary=True, head="tied", seed=0
):
    """A residual tanh network as a function over ``{"embed", "layers": [{"w": [{"a"}], "b"?}], "head"}``
    (one layer per entry of ``subs``, with that many matrices) with cuts after some layers (a dict
    boundary or a tensor), the head tied to the embedding or a NamedTuple / registered dataclass of its own."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=F64) / D**0.5

    layers = []
    for k, b in zip(subs, biased):
        layer = {"w": [{"a": r(D, D)} for _ in range(k)]}
        if b:
            layer["b"] = r(D)
        layers.append(layer)
    params = {"embed": r(D, D), "layers": layers}
    if head != "tied":
        params["head"] = (Head if head == "namedtuple" else Affine)(r(D, D), r(D))

    def model_fn(p, x):
        h = x @ p["embed"]
        skip = h
        for i, layer in enumerate(p["layers"]):
            for sub in layer["w"]:
                h = torch.tanh(h @ sub["a"])
            if "b" in layer:
                h = h + layer["b"]
            if cuts[i]:
                if tree_boundary:
                    state = ef.cut({"h": h, "skip": 0.5 * skip + h}, f"layer{i}")
                    h, skip = state["h"], state["skip"]
                else:
                    h = ef.cut(h, f"layer{i}")
        out = h + skip
        return out @ p["embed"].T if head == "tied" else out @ p["head"].w + p["head"].b

    x, y = torch.randn(B, D, generator=g, dtype=F64), torch.randn(B, D, generator=g, dtype=F64)
    return model_fn, params, x, y, sum(cuts)


@st.composite
def networks(draw):
    depth = draw(st.integers(1, 4))
    return network(
        subs=draw(st.lists(st.integers(1, 2), min_size=depth, max_size=depth)),
        biased=draw(st.lists(st.booleans(), min_size=depth, max_size=depth)),
        cuts=draw(st.lists(st.booleans(), min_size=depth, max_size=depth).filter(any)),
        tree_boundary=draw(st.booleans()),
        head=draw(st.sampled_from(["tied", "namedtuple", "dataclass"])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=20, deadline=None)
@given(net=networks())
def test_grads_equal_torch_func_grad_for_every_tree_cut_and_tie(net):
    model_fn, params, x, y, n_cuts = net
    grads = ef.grad(model_fn, params, x, y, loss=F.mse_loss)
    assert_trees_close(grads, reference_grad(lambda p: F.mse_loss(model_fn(p, x), y), params), atol=1e-10)
    res = ef.sweep(model_fn, params, x, y, loss=F.mse_loss)
    assert len(res.adjoints) == n_cuts + 2  # boundaries: the output, one per cut, the input
    assert [n for n in res.stats if n.startswith("layer")] == [
        f"layer{i}" for i in range(20) if f"layer{i}" in res.stats
    ]


def test_cut_is_the_identity_outside_a_capture():
    h = {"a": torch.randn(2), "b": [torch.randn(3), 1]}
    assert ef.cut(h, "x") is h
    with pytest.raises(TypeError, match="cut: name must be a string"):
        ef.cut(h, 3)


def test_a_function_that_returns_its_loss_takes_the_loss_args():
    model_fn, params, x, y, _ = network()

    def loss_fn(p, x, y):
        return F.mse_loss(model_fn(p, x), y)

    loss, grads = ef.value_and_grad(loss_fn, params, x, y)
    torch.testing.assert_close(loss, loss_fn(params, x, y), atol=1e-12, rtol=0)
    assert_trees_close(grads, reference_grad(lambda p: loss_fn(p, x, y), params), atol=1e-10)
    with pytest.raises(ValueError, match="without loss=, the function must return a scalar loss"):
        ef.grad(model_fn, params, x)


def test_two_leaves_that_are_one_tensor_get_their_own_gradients_as_in_torch_func():
    w = torch.randn(D, D, dtype=F64)
    params = {"a": w, "b": w}

    def model_fn(p, x):
        return ef.cut(torch.tanh(x @ p["a"]), "first") @ p["b"] * 2.0

    x, y = torch.randn(B, D, dtype=F64), torch.randn(B, D, dtype=F64)
    want = reference_grad(lambda p: F.mse_loss(model_fn(p, x), y), params)
    assert_trees_close(ef.grad(model_fn, params, x, y, loss=F.mse_loss), want, atol=1e-12)
    assert not torch.equal(want["a"], want["b"])


def test_an_unused_leaf_gets_a_zero_gradient():
    params = {"w": torch.randn(D, D, dtype=F64), "unused": torch.randn(5, dtype=F64)}

    def model_fn(p, x):
        return ef.cut(x @ p["w"]).sin()

    x = torch.randn(B, D, dtype=F64)
    grads = ef.grad(model_fn, params, x, x, loss=F.mse_loss)
    assert torch.equal(grads["unused"], torch.zeros(5, dtype=F64))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin, self.drop = nn.LayerNorm(8), nn.Linear(8, 8), nn.Dropout(0.2)

    def forward(self, h):
        return h + self.drop(torch.tanh(self.lin(self.norm(h))))


def test_modules_called_through_functional_call_with_dropout_replayed():
    torch.manual_seed(0)
    blocks = [Block().double() for _ in range(3)]
    params = {"blocks": [dict(b.named_parameters()) for b in blocks], "head": torch.randn(8, 2, dtype=F64)}

    def model_fn(p, x):
        h = x
        for i, (block, bp) in enumerate(zip(blocks, p["blocks"])):
            h = ef.cut(functional_call(block, bp, (h,)), f"block{i}")
        return h @ p["head"]

    x, y = torch.randn(6, 8, dtype=F64), torch.randn(6, 2, dtype=F64)
    torch.manual_seed(1)
    grads = ef.grad(model_fn, params, x, y, loss=F.mse_loss)
    torch.manual_seed(1)
    want = reference_grad(lambda p: F.mse_loss(model_fn(p, x), y), params)
    assert_trees_close(grads, want, atol=1e-10)


def test_microbatches_passes_and_boundary_dtype_work_as_on_a_chain():
    model_fn, params, x, y, n_cuts = network(head="dataclass")
    whole = ef.grad(model_fn, params, x, y, loss=F.mse_loss)
    assert_trees_close(ef.grad(model_fn, params, x, y, loss=F.mse_loss, microbatches=2), whole, atol=1e-12)
    res = ef.sweep(model_fn, params, x, y, loss=F.mse_loss, passes=P.clip_by_value(1e-3), key=0)
    assert all(
        a.value is None or all(v.abs().max() <= 1e-3 for v in ef.tree_leaves(a.value)) for a in res.adjoints[1:-1]
    )
    assert len(res.adjoints) == n_cuts + 2
    cast = ef.grad(model_fn, params, x, y, loss=F.mse_loss, boundary_dtype=torch.float32)
    assert_trees_close(cast, whole, atol=1e-5)


def _box_network():
    g = torch.Generator().manual_seed(1)
    m = torch.randn(D, D, generator=g, dtype=F64)
    chain = ef.Chain(
        [
            ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name="in"),
            ef.stage(lambda p, h: torch.tanh(h @ m) * p["gain"], name="box"),
            ef.stage(lambda p, h: h @ p["w"], name="out"),
        ],
        loss=F.mse_loss,
    )
    params = (
        {"w": torch.randn(D, D, generator=g, dtype=F64)},
        {"gain": torch.tensor(1.3, dtype=F64)},
        {"w": torch.randn(D, D, generator=g, dtype=F64)},
    )

    def model_fn(p, x):
        h = ef.cut(torch.tanh(x @ p["in"]), "in")
        h = ef.cut(torch.tanh(h @ m) * p["gain"], "box")
        return h @ p["out"]

    tree = {"in": params[0]["w"], "gain": params[1]["gain"], "out": params[2]["w"]}
    x, y = torch.randn(B, D, generator=g, dtype=F64), torch.randn(B, D, generator=g, dtype=F64)
    return chain, params, model_fn, tree, x, y


@pytest.mark.parametrize(
    "estimator",
    [
        lambda: E.exact(),
        lambda: E.zbp(E.Probes(4, "rademacher"), method="fd", eps=1e-4),
        lambda: E.node_perturbation(E.Probes(3), form="fd", eps=1e-4),
        lambda: E.direct(E.Probes(3, "orthogonal"), form="jvp"),
    ],
    ids=["exact", "zbp", "np", "direct"],
)
def test_a_physical_cut_takes_the_estimator_as_the_chain_stage_does(estimator):
    chain, params, model_fn, tree, x, y = _box_network()
    want = ef.sweep(chain, params, x, y, estimator=estimator(), physical=["box"], key=3, budget=100)
    got = ef.sweep(model_fn, tree, x, y, loss=F.mse_loss, estimator=estimator(), physical=["box"], key=3, budget=100)
    for name, (i, leaf) in {"in": (0, "w"), "gain": (1, "gain"), "out": (2, "w")}.items():
        torch.testing.assert_close(got.grads[name], want.grads[i][leaf], atol=1e-12, rtol=0)
    assert got.stats["box"]["rows"] == want.stats["box"]["rows"]


def test_fused_updates_pure_over_the_params_tree_and_torch_optim():
    model_fn, params, x, y, _ = network()
    grads = ef.grad(model_fn, params, x, y, loss=F.mse_loss)

    def sgd(p, g, s):  # momentum: the state is one tensor per leaf
        s = {n: 0.9 * s[n] + g[n] for n in g}
        return {n: p[n] - 0.1 * s[n] for n in g}, s

    state = optree.tree_map(torch.ones_like, params, namespace=NAMESPACE)
    res = ef.sweep(model_fn, params, x, y, loss=F.mse_loss, update=ef.fused(sgd, state))
    want_state = optree.tree_map(lambda s, g: 0.9 * s + g, state, grads, namespace=NAMESPACE)
    want = optree.tree_map(lambda p, s: p - 0.1 * s, params, want_state, namespace=NAMESPACE)
    assert res.grads is None
    assert_trees_close(res.params, want, atol=1e-12)
    assert_trees_close(res.update_state, want_state, atol=1e-12)
    with pytest.raises(TypeError, match="fused: with a function, state is one tree in params' structure"):
        ef.sweep(model_fn, params, x, y, loss=F.mse_loss, update=ef.fused(sgd, [None, None]))

    leaves = [t.clone().requires_grad_() for t in optree.tree_leaves(params, namespace=NAMESPACE)]
    trainable = optree.tree_unflatten(optree.tree_structure(params, namespace=NAMESPACE), leaves)
    opt = torch.optim.SGD(leaves, lr=0.1)
    ef.sweep(model_fn, trainable, x, y, loss=F.mse_loss, update=opt)
    expected = optree.tree_map(lambda p, g: p - 0.1 * g, params, grads, namespace=NAMESPACE)
    assert_trees_close(optree.tree_map(torch.Tensor.detach, trainable, namespace=NAMESPACE), expected, atol=1e-12)


def test_captured_once_per_layout_and_again_when_what_it_reads_changes(monkeypatch):
    captures = []
    capture_function = function.capture_function
    monkeypatch.setattr(function, "capture_function", lambda *a: captures.append(1) or capture_function(*a))
    torch.manual_seed(0)
    block, scale = Block().double(), [2.0]

    def model_fn(p, x):
        return ef.cut(functional_call(block, p, (x,)), "block") * scale[0]

    params = {k: v.detach() for k, v in block.named_parameters()}
    x, y = torch.randn(6, 8, dtype=F64), torch.randn(6, 8, dtype=F64)

    def grads():
        torch.manual_seed(3)
        got = ef.grad(model_fn, params, x, y, loss=F.mse_loss)
        torch.manual_seed(3)
        assert_trees_close(got, reference_grad(lambda p: F.mse_loss(model_fn(p, x), y), params), atol=1e-10)

    grads()
    grads()
    assert len(captures) == 1
    block.eval()  # dropout off: a new graph
    grads()
    scale[0] = 3.0  # a number the function reads: a new graph
    grads()
    grads()
    ef.grad(model_fn, params, x[:3], y[:3], loss=F.mse_loss)  # another input layout
    assert len(captures) == 4


def test_what_a_capture_cannot_keep_is_refused_with_the_line_that_does_it():
    p = {"w1": torch.randn(4, 8), "w2": torch.randn(8, 2)}
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    trained = torch.randn(8, 8, requires_grad=True)
    layer = nn.Linear(8, 8)

    def no_cut(p, x):
        return torch.tanh(x @ p["w1"]) @ p["w2"]

    def branch(p, x):
        h = torch.tanh(x @ p["w1"])
        if h.sum() > 0:  # the branch
            h = ef.cut(h)
        return h @ p["w2"]

    def python_random(p, x):
        h = ef.cut(torch.tanh(x @ p["w1"]) * random.random())  # the draw
        return h @ p["w2"]

    def numpy_random(p, x):
        h = ef.cut(torch.tanh(x @ p["w1"]) * float(np.random.rand()))  # the numpy draw
        return h @ p["w2"]

    def closes_over_a_tensor(p, x):
        return ef.cut(torch.tanh(x @ p["w1"]) @ trained) @ p["w2"]

    def closes_over_a_module(p, x):
        return ef.cut(layer(torch.tanh(x @ p["w1"]))) @ p["w2"]

    cases = [
        (no_cut, r"no_cut \(.*test_function.py:\d+\) has no ef.cut: mark where one stage ends"),
        (branch, r"a branch on a tensor's value at .*test_function.py:\d+ \(if h.sum\(\) > 0:  # the branch\)"),
        (python_random, r"draws from Python's random at .*test_function.py:\d+ \(.*# the draw\)"),
        (numpy_random, r"draws from Python's numpy.random at .*test_function.py:\d+ \(.*# the numpy draw\)"),
        (closes_over_a_tensor, r"closes_over_a_tensor \(.*\) reads 'trained', a tensor that requires grad"),
        (closes_over_a_module, r"reads layer.weight, a tensor that requires grad, .*functional_call"),
    ]
    state = random.getstate(), np.random.get_state()[1].copy()
    for fn, message in cases:
        with pytest.raises(ValueError, match=message):
            ef.grad(fn, p, x, y, loss=F.mse_loss)
    assert random.getstate() == state[0] and np.array_equal(np.random.get_state()[1], state[1])
    with pytest.raises(TypeError, match="split_at= cuts a model's forward; a function is cut where it calls ef.cut"):
        ef.grad(no_cut, p, x, y, loss=F.mse_loss, split_at=["h.*"])
    with pytest.raises(TypeError, match="buffers= are a model's"):
        ef.grad(no_cut, p, x, y, loss=F.mse_loss, buffers=({},))
    with pytest.raises(TypeError, match=r"params: leaves must be tensors, 'n' is a int"):
        ef.grad(no_cut, {**p, "n": 3}, x, y, loss=F.mse_loss)


def _deep(depth, width=16, inner=256, batch=1024):
    torch.manual_seed(0)
    params = [
        {"a": torch.randn(width, inner) / 4, "b": torch.randn(inner, inner) / 16, "c": torch.randn(inner, width) / 16}
        for _ in range(depth)
    ]

    def model_fn(p, x):
        h = x
        for i, layer in enumerate(p):
            h = ef.cut(torch.tanh(torch.tanh(h @ layer["a"]) @ layer["b"]) @ layer["c"], f"block{i}")
        return h

    return model_fn, params, torch.randn(batch, width)


def test_live_bytes_of_a_function_do_not_grow_with_depth():
    """As tests/test_memory.py for a chain: beyond the parameter gradients, the sweep of a 1..8-block
    function peaks at the same bytes at every depth (one block's tape and a few boundaries), while
    autograd's tape on the same function grows by a block's tape per block."""
    stage_tape = 2 * 1024 * 256 * 4  # the two saved (1024, 256) float32 tanh outputs of a block

    def loss(out):
        return out.square().mean()

    sweep, tape = {}, {}
    for depth in (1, 2, 4, 8):
        model_fn, params, x = _deep(depth)
        ef.grad(model_fn, params, x, loss=loss)  # the capture, outside the measurement
        grads = sum(t.numel() * 4 for layer in params for t in layer.values())
        with LiveBytes() as eae:
            ef.grad(model_fn, params, x, loss=loss)
        sweep[depth] = eae.peak - grads
        trainable = [{k: v.requires_grad_() for k, v in layer.items()} for layer in params]
        with LiveBytes() as autograd:
            loss(model_fn(trainable, x)).backward()
        tape[depth] = autograd.peak - grads
    assert tape[8] - tape[1] > 7 * stage_tape * 0.75, tape
    assert max(sweep.values()) - min(sweep.values()) < 0.1 * stage_tape, sweep
    assert max(sweep.values()) < 2.5 * stage_tape, sweep


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"recompute": False},
        {"recompute": lambda i, name: name == "box"},
        {"offload": True},
        {"boundary_dtype": torch.float32},
        {"autocast": torch.bfloat16},
        {"microbatches": 2},
        {"passes": ef.compose(P.int8(), P.clip_by_global_norm(0.5)), "key": 4},
        {"passes": P.gaussian_noise(0.1), "key": 2, "keep_costates": False},
    ],
    ids=lambda o: ",".join(o) or "defaults",
)
def test_every_option_gives_what_it_gives_on_the_same_chain(options):
    chain, params, model_fn, tree, x, y = _box_network()
    want = ef.sweep(chain, params, x, y, **options)
    got = ef.sweep(model_fn, tree, x, y, loss=F.mse_loss, **options)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-12, rtol=0)
    for name, (i, leaf) in {"in": (0, "w"), "gain": (1, "gain"), "out": (2, "w")}.items():
        torch.testing.assert_close(got.grads[name], want.grads[i][leaf], atol=1e-12, rtol=0)
    assert [a.history for a in got.adjoints] == [a.history for a in want.adjoints]
