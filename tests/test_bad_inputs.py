"""Bad input through the public API: every malformed call either raises an error whose message
(or note) names the stage or argument at fault, or returns exactly the well-formed call's
result. Nothing is silent, and a failing call leaves the caller's tensors as they were."""

import re
from collections import OrderedDict
from unittest import mock

import numpy as np
import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import eae_func as ef
from eae_func import estimators as E
from eae_func import passes as P
from eae_func import remat
from eae_func.adjoint import NAMESPACE
from eae_func.core import early_stop as ES


def problem(depth, width, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])
    chain, params = ef.from_module(model, loss=F.mse_loss)
    return chain, params, torch.randn(4, width), torch.randn(4, width)


def replace_stage(params, i, new):
    return tuple(new if j == i else p for j, p in enumerate(params))


def wrong_shape_at(l):
    return lambda a: a.replace(value=a.value[:, :-1]) if a.index == l else a


# Each case: (what it breaks, how: (chain, params, x, y, i) -> (args, kwargs), what the error must name).
# ``i`` is a stage index drawn by hypothesis; ``None`` as the name means "must equal the well-formed result".
CASES = {
    "params: one entry short": (lambda c, p, x, y, i: ((p[:-1], x, y), {}), r"params: expected a tuple with one entry"),
    "params: a list, not a tuple": (lambda c, p, x, y, i: ((list(p), x, y), {}), None),
    "params: a missing name": (
        lambda c, p, x, y, i: ((replace_stage(p, i, {"0.weight": p[i]["0.weight"]}), x, y), {}),
        r"params of stage {i} \(.*missing \['0.bias'\]",
    ),
    "params: a wrong shape": (
        lambda c, p, x, y, i: ((replace_stage(p, i, {**p[i], "0.bias": p[i]["0.bias"][:1]}), x, y), {}),
        r"params of stage {i} \(.*'0.bias' has shape \(1,\)",
    ),
    "params: a wrong dtype": (
        lambda c, p, x, y, i: ((replace_stage(p, i, {**p[i], "0.bias": p[i]["0.bias"].double()}), x, y), {}),
        r"params of stage {i} \(.*torch.float64",
    ),
    "params: a non-tensor leaf": (
        lambda c, p, x, y, i: ((replace_stage(p, i, {**p[i], "0.bias": 0.0}), x, y), {}),
        r"params of stage {i} \(.*leaves must be tensors",
    ),
    "x: a float": (lambda c, p, x, y, i: ((p, 1.5, y), {}), r"input of stage 0 \(.*found a leaf of type float"),
    "x: None": (lambda c, p, x, y, i: ((p, None, y), {}), r"input of stage 0 \(.*got NoneType"),
    "x: the wrong width": (lambda c, p, x, y, i: ((p, x[:, :-1], y), {}), r"in the forward of stage 0 \("),
    "x: float64 into float32 stages": (lambda c, p, x, y, i: ((p, x.double(), y), {}), r"in the forward of stage 0"),
    "loss arg: the wrong batch": (lambda c, p, x, y, i: ((p, x, y[:-1]), {}), r"in the loss"),
    "boundary_dtype: an int dtype": (
        lambda c, p, x, y, i: ((p, x, y), {"boundary_dtype": torch.int8}),
        r"boundary_dtype must be a floating torch.dtype",
    ),
    "boundary_dtype: a string": (
        lambda c, p, x, y, i: ((p, x, y), {"boundary_dtype": "bfloat16"}),
        r"boundary_dtype must be a floating torch.dtype",
    ),
    "autocast: an int dtype": (
        lambda c, p, x, y, i: ((p, x, y), {"autocast": torch.int32}),
        r"autocast must be a floating torch.dtype",
    ),
    "key: a float": (lambda c, p, x, y, i: ((p, x, y), {"key": 1.7}), r"key must be an int seed"),
    "microbatches: zero": (lambda c, p, x, y, i: ((p, x, y), {"microbatches": 0}), r"microbatches must be a positive"),
    "microbatches: more than the rows": (
        lambda c, p, x, y, i: ((p, x, y), {"microbatches": 5}),
        r"microbatches=5 is more than the 4 rows",
    ),
    "microbatches: True": (
        lambda c, p, x, y, i: ((p, x, y), {"microbatches": True}),
        r"microbatches must be a positive",
    ),
    "reduction: unknown": (
        lambda c, p, x, y, i: ((p, x, y), {"reduction": "max"}),
        r"reduction must be 'mean' or 'sum'",
    ),
    "buffers: one short": (lambda c, p, x, y, i: ((p, x, y), {"buffers": c.buffers()[:-1]}), r"buffers: expected"),
    "buffers: a name stage i's module lacks": (
        lambda c, p, x, y, i: ((p, x, y), {"buffers": replace_stage(c.buffers(), i, {"runing_mean": x[0]})}),
        r"buffers: stage {i} \(.*\) has no buffer \['runing_mean'\]; its buffers are \[\]",
    ),
    "buffers: the modules' own": (lambda c, p, x, y, i: ((p, x, y), {"buffers": c.buffers()}), None),
    "pass: returns a tensor": (
        lambda c, p, x, y, i: ((p, x, y), {"passes": lambda a: a.value}),
        r"at boundary \d+ \(output of stage .*returned a Tensor",
    ),
    "pass: a wrong shape at boundary i": (
        lambda c, p, x, y, i: ((p, x, y), {"passes": wrong_shape_at(i)}),
        r"boundary {i}.*costate shape \(4, \d+\) differs",
    ),
    "pass: value=None at boundary i": (
        lambda c, p, x, y, i: ((p, x, y), {"passes": lambda a: a.replace(value=None) if a.index == i else a}),
        r"at boundary {i} \(.*\): returned value=None for a costate that was a tensor",
    ),
    "pass: not a pass": (lambda c, p, x, y, i: ((p, x, y), {"passes": "int8"}), r"compose: expected a pass"),
    "pass_state: the wrong structure": (
        lambda c, p, x, y, i: ((p, x, y), {"passes": ef.compose(P.int8(), P.stats()), "pass_state": (None,)}),
        r"compose: expected a pass state tuple of 2 entries",
    ),
    "physical: a missing stage": (
        lambda c, p, x, y, i: ((p, x, y), {"estimator": E.exact(), "physical": ["nope"]}),
        r"no stage named 'nope'",
    ),
    "physical: an index out of range": (
        lambda c, p, x, y, i: ((p, x, y), {"estimator": E.exact(), "physical": [99]}),
        r"no stage 99",
    ),
    "estimator: not an estimator": (
        lambda c, p, x, y, i: ((p, x, y), {"estimator": "zbp"}),
        r"estimator must have prepare",
    ),
    "passes: None is identity()": (lambda c, p, x, y, i: ((p, x, y), {"passes": ef.identity()}), None),
    "physical without estimator": (
        lambda c, p, x, y, i: ((p, x, y), {"physical": [i]}),
        r"stage {i} .* is physical \(run forward only\) but no estimator",
    ),
    "budget: zero rows": (lambda c, p, x, y, i: ((p, x, y), {"budget": 0}), r"budget must be None or an int >= 1"),
    "option: misspelt": (
        lambda c, p, x, y, i: ((p, x, y), {"recomptue": False}),
        r"unknown option 'recomptue'; the options are",
    ),
    "split_at: with a Chain": (
        lambda c, p, x, y, i: ((p, x, y), {"split_at": ["0"]}),
        r"loss= and split_at= go with a model",
    ),
    # the remat policy
    "recompute: a string": (
        lambda c, p, x, y, i: ((p, x, y), {"recompute": "yes"}),
        r"recompute must be True, False, a predicate",
    ),
    "recompute: a negative budget": (
        lambda c, p, x, y, i: ((p, x, y), {"recompute": -1}),
        r"recompute must be True, False, a predicate",
    ),
    "recompute: where(pred) is the same": (
        lambda c, p, x, y, i: ((p, x, y), {"recompute": remat.where(lambda k, name: k == i)}),
        None,
    ),
    "recompute: a byte budget is the same": (
        lambda c, p, x, y, i: ((p, x, y), {"recompute": remat.budget(100 * i)}),
        None,
    ),
    # fused updates: every check before the first update
    "update: a string": (lambda c, p, x, y, i: ((p, x, y), {"update": "sgd"}), r"fused: expected a torch.optim"),
    "update: a pure fn without state": (
        lambda c, p, x, y, i: ((p, x, y), {"update": lambda q, g, s: (q, s)}),
        r"fused: a pure update .* needs state=",
    ),
    "update: state of the wrong length": (
        lambda c, p, x, y, i: ((p, x, y), {"update": ef.fused(lambda q, g, s: (q, s), [()] * (len(c) + 1))}),
        r"fused: state has \d+ entries, the chain has",
    ),
    "update: an optimizer missing stage i": (
        lambda c, p, x, y, i: (
            (p, x, y),
            {
                "update": torch.optim.SGD(
                    [t for k, s in enumerate(c.stages) if k != i for t in s.module.parameters()]
                    or [torch.zeros(1, requires_grad=True)],
                    lr=0.1,
                )
            },
        ),
        r"parameter '0\.(weight|bias)' of stage {i} \(.*trainable but not among the optimizer's",
    ),
    "update: .grad already set": (
        lambda c, p, x, y, i: ((p, x, y), {"update": _optimizer_with_grads(c)}),
        r"already have .grad set",
    ),
}


def _optimizer_with_grads(chain):
    params = [t for s in chain.stages for t in s.module.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    params[0].grad = torch.zeros_like(params[0])
    return optimizer


def _message(e):
    return " ".join([str(e), *getattr(e, "__notes__", ())])


def _snapshot(*trees):
    return [(t, t.clone()) for t in optree.tree_leaves(trees, namespace=NAMESPACE) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("case", sorted(CASES))
@given(
    depth=st.integers(1, 4),
    width=st.integers(2, 5),
    seed=st.integers(0, 2**16),
    pick=st.integers(0, 100),
    entry=st.sampled_from(["sweep", "grad"]),
)
def test_bad_input_is_named_or_harmless(case, depth, width, seed, pick, entry):
    chain, params, x, y = problem(depth, width, seed)
    i = pick % depth
    make, names = CASES[case]
    args, kwargs = make(chain, params, x, y, i)
    before = _snapshot(params, x, y, chain.buffers(), [list(s.module.parameters()) for s in chain.stages])
    try:
        if entry == "sweep":
            res = ef.sweep(chain, *args, **kwargs)
            loss, grads = res.loss, res.grads
        else:
            loss, grads = ef.value_and_grad(chain, *args, **kwargs)
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as e:
        assert names is not None, f"{case}: the well-formed equivalent must not raise: {_message(e)}"
        assert re.search(names.format(i=i), _message(e)), f"{case}: {_message(e)!r} does not name {names!r}"
    else:
        assert names is None, f"{case}: silently accepted"
        ref = ef.sweep(chain, params, x, y, key=kwargs.get("key", 0))
        assert torch.equal(loss, ref.loss)
        for g, r in zip(
            optree.tree_leaves(grads, namespace=NAMESPACE), optree.tree_leaves(ref.grads, namespace=NAMESPACE)
        ):
            assert torch.equal(g, r), case
    assert all(torch.equal(t, c) for t, c in before), f"{case}: a caller's tensor was modified"


def test_bad_chain_definitions_are_refused_at_construction():
    chain, _ = ef.from_module(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), loss=F.mse_loss)
    with pytest.raises(ValueError, match=r"Chain: ties name parameter 'zz' of stage 1 \('Linear_1'\)"):
        ef.Chain(chain.stages, loss=F.mse_loss, ties=[((0, "weight"), (1, "zz"))])
    with pytest.raises(ValueError, match="Chain: ties name stage 5"):
        ef.Chain([ef.stage(lambda p, h: h, name="a")], loss=torch.sum, ties=[((0, "w"), (5, "w"))])
    with pytest.raises(ValueError, match=r"only: indices are boundary indices 0..L .*got \[-1\]"):
        P.only(P.int8(), indices=[-1])


def test_stages_that_return_no_floats_or_write_into_their_input_are_named():
    x = torch.randn(3, 4)
    ids = ef.Chain(
        [ef.stage(lambda p, h: (h @ p["w"]).long(), name="ids"), ef.stage(lambda p, h: h.float(), name="f")],
        loss=lambda out: out.sum(),
    )
    with pytest.raises(TypeError, match=r"output of stage 0 \('ids'\): only integer tensors"):
        ef.sweep(ids, ({"w": torch.ones(4, 4)}, {}), x)
    nothing = ef.Chain([ef.stage(lambda p, h: None, name="void")], loss=lambda out: out.sum())
    with pytest.raises(TypeError, match=r"output of stage 0 \('void'\).*got NoneType"):
        ef.sweep(nothing, ({},), x)
    before = x.clone()
    inplace = ef.from_module(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 2)), loss=F.mse_loss)
    with pytest.raises(ValueError, match=r"stage 0 \('ReLU_0'\) modified its input in place"):
        ef.sweep(*inplace, x, torch.randn(3, 2))
    assert torch.equal(x, before)  # the caller's input is never written
    python_float = ef.Chain([ef.stage(lambda p, h: h, name="id")], loss=lambda out: 1.0)
    with pytest.raises(ValueError, match=r"loss: expected a scalar floating-point tensor, got float"):
        ef.sweep(python_float, ({},), x)


def test_write_grads_refuses_gradients_of_the_wrong_shape():
    model = nn.Sequential(nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"write_grads: the gradient of stage 0's 'bias' has shape \(3,\)"):
        ef.write_grads(model, ({"weight": torch.zeros(2, 3), "bias": torch.zeros(3)},))


def _bad_pipeline_calls():
    """Bad calls of ``Pipeline.sweep`` on one rank: each message, or 'accepted'."""
    import eae_func.distributed as D

    chain, params, x, y = problem(3, 4, 0)
    pipe = D.Pipeline(chain, [(0, 3)], timeout=30)
    calls = {
        "misspelt option": lambda: pipe.sweep(params, x, y, recomptue=False),
        "no input on the first rank": lambda: pipe.sweep(params, None, y),
        "fused update": lambda: pipe.sweep(params, x, y, update=torch.optim.SGD(chain.stages[0].module.parameters())),
        "params one short": lambda: pipe.sweep(params[:-1], x, y),
        "a bad key": lambda: pipe.sweep(params, x, y, key="0"),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "accepted"
        except (TypeError, ValueError) as e:
            out[name] = _message(e)
    return out


def test_bad_pipeline_calls_are_named():
    import eae_func.distributed as D

    (out,) = D.run(_bad_pipeline_calls, 1, timeout=60)
    assert out["misspelt option"].startswith("Pipeline.sweep: unknown option 'recomptue'")
    assert "runs the first stage and needs the input x" in out["no input on the first rank"]
    assert out["fused update"].startswith("Pipeline.sweep: update= cannot cross ranks")
    assert "params: expected a tuple with one entry per stage" in out["params one short"]
    assert "key must be an int seed" in out["a bad key"]


def _last_rank_without_rows():
    """Two ranks, a loss of the output alone and a mean over 2 microbatches: the last rank, given no
    x, has nothing to weigh its microbatches by."""
    import torch.distributed as dist

    import eae_func.distributed as D

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])
    chain, params = ef.from_module(model, loss=lambda out: out.pow(2).mean())
    pipe = D.Pipeline(chain, [(0, 1), (1, 2)], timeout=10)
    x = torch.randn(4, 4) if dist.get_rank() == 0 else None
    try:
        pipe.sweep(params, x, microbatches=2)
    except (ValueError, D.PeerError) as e:
        return type(e).__name__, _message(e)
    return "accepted", ""


def test_the_last_rank_refuses_microbatches_it_cannot_weigh():
    import eae_func.distributed as D

    first, last = D.run(_last_rank_without_rows, 2, timeout=120)
    assert last[0] == "ValueError" and "needs a batched tensor to weigh the microbatches" in last[1], last
    assert first[0] == "PeerError", first  # the first rank waits for it, and says so within the timeout


# ----------------------------------------------------------------------------- black boxes and captures


class NanOnProbes:
    """A black box finite on the forward's 4 rows (its first calls), NaN on every later call: the
    probes'. A class: each example makes a fresh one."""

    def __init__(self):
        self.rows = 0

    def __call__(self, p, h):
        self.rows += len(h)
        return np.tanh(h) if self.rows <= 4 else np.full(h.shape, np.nan)


# Each case: (the black box, or a class to make one, what the error must name, whether the forward
# alone (E.frozen()) fails).
BOXES = {
    "returns a list": (lambda p, h: h.tolist(), r"black box 'box': returned list, expected a numpy array", True),
    "drops a row": (lambda p, h: np.tanh(h[1:]), r"black box 'box': returned \d+ rows for an input of \d+", True),
    "writes into its input": (lambda p, h: np.tanh(h, out=h), r"read-only", True),
    "returns complex": (lambda p, h: h * 1j, r"returned a complex", True),
    "returns a scalar per call": (
        lambda p, h: np.tanh(h).sum(),
        r"black box 'box': returned a 0-d tensor .* shape \(\d+, \.\.\.\)",
        True,
    ),
    "returns NaN on the probes": (NanOnProbes, r"estimator: stage 1 \('box'\) returned \d+ non-finite", False),
}


@pytest.mark.parametrize("case", sorted(BOXES))
@given(
    width=st.integers(2, 5),
    seed=st.integers(0, 2**16),
    method=st.sampled_from(["zbp", "direct", "frozen"]),
    max_rows=st.sampled_from([None, 3]),
)
def test_a_misbehaving_black_box_is_named(case, width, seed, method, max_rows):
    """Every misbehaving black box is named with the stage (split into calls of ``max_rows`` or
    not); one that fails only on the probes runs as well-formed without them (``E.frozen()``)."""
    fn, names, on_forward = BOXES[case]
    chain, params, x, y = problem(2, width, seed)
    box = ef.black_box(fn() if isinstance(fn, type) else fn, name="box", numpy=True, max_rows=max_rows)
    chain = ef.Chain([chain.stages[0], box, chain.stages[1]], loss=chain.loss)
    params = (params[0], {}, params[1])
    estimator = {
        "zbp": E.zbp(E.Probes(2), method="fd"),
        "direct": E.direct(E.Probes(2), form="fd"),
        "frozen": E.frozen(),
    }[method]
    before = _snapshot(params, x, y)
    if method == "frozen" and not on_forward:
        res = ef.sweep(chain, params, x, y, estimator=estimator)
        assert res.grads[0]["0.weight"] is None and torch.isfinite(res.grads[2]["0.weight"]).all()
    else:
        with pytest.raises((TypeError, ValueError, FloatingPointError)) as info:
            ef.sweep(chain, params, x, y, estimator=estimator)
        message = _message(info.value)
        assert re.search(names, message) and "stage 1 ('box')" in message, message
    with pytest.raises(ValueError, match=r"differentiates the physical stages, but stage 1 \('box'\)"):
        ef.sweep(chain, params, x, y, estimator=E.exact())
    assert all(torch.equal(t, c) for t, c in before)


@given(pattern=st.sampled_from(["nope.*", "0.*.x", "[a-z]"]), as_string=st.booleans())
def test_a_split_at_that_matches_nothing_lists_the_modules(pattern, as_string):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))

        def forward(self, x):
            return self.blocks[1](self.blocks[0](x))

    model = Net()
    split_at = pattern if as_string else [pattern]
    expected = r"split_at: expected a list of module paths" if as_string else r"no module of Net matches .* include"
    with pytest.raises((TypeError, ValueError), match=expected):
        ef.grad(
            model,
            dict(model.named_parameters()),
            torch.randn(2, 3),
            torch.randn(2, 3),
            loss=F.mse_loss,
            split_at=split_at,
        )


# ----------------------------------------------------------------------------- parameter hooks

HOOKS = {
    "mask": lambda g: g * (torch.arange(g.numel()).reshape(g.shape) % 2),
    "scale by its norm": lambda g: g * g.norm(),  # not linear: it must see the whole gradient, once
    "observe": lambda g: None,  # returns None: the gradient stays
}


@given(
    depth=st.integers(1, 3),
    width=st.integers(2, 5),
    seed=st.integers(0, 2**16),
    hooks=st.lists(st.tuples(st.integers(0, 100), st.sampled_from(sorted(HOOKS))), min_size=1, max_size=3),
    microbatches=st.sampled_from([1, 2]),
    recompute=st.booleans(),
    entry=st.sampled_from(["sweep", "grad", "fused"]),
)
def test_parameter_hooks_give_autograds_gradients(depth, width, seed, hooks, microbatches, recompute, entry):
    """Tensor hooks on the modules' parameters (``p.register_hook(fn)``, two on one parameter run in
    order): the gradients, and a fused SGD step, are plain autograd's with the same hooks."""
    chain, params, x, y = problem(depth, width, seed)
    modules = [s.module for s in chain.stages]
    own = [p for m in modules for p in m.parameters()]
    for k, kind in hooks:
        own[k % len(own)].register_hook(HOOKS[kind])
    h = x
    for m in modules:
        h = m(h)
    reference = dict(zip(own, torch.autograd.grad(F.mse_loss(h, y), own)))
    options = {"microbatches": microbatches, "recompute": recompute}
    if entry == "fused":
        before = [p.detach().clone() for p in own]
        ef.sweep(chain, params, x, y, update=torch.optim.SGD(own, lr=1.0), **options)
        for p, old in zip(own, before):
            torch.testing.assert_close(p.detach(), old - reference[p])
        return
    grads = (
        ef.sweep(chain, params, x, y, **options).grads if entry == "sweep" else ef.grad(chain, params, x, y, **options)
    )
    for m, stage in zip(modules, grads):
        for name, p in m.named_parameters():
            torch.testing.assert_close(stage[name], reference[p])


# ----------------------------------------------------------------------------- across ranks, without ranks

LEAF = st.tuples(
    st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bool]), st.lists(st.integers(1, 3), max_size=2)
)


@given(
    leaves=st.lists(LEAF, min_size=1, max_size=4),
    as_dict=st.booleans(),
    present=st.lists(st.booleans(), min_size=4, max_size=4),
    codec=st.sampled_from(["raw", "int8", "topk"]),
    broken=st.sampled_from([None, "shape", "structure"]),
    seed=st.integers(0, 2**16),
)
def test_a_pytree_costate_crosses_a_rank_boundary_as_sent_or_is_named(leaves, as_dict, present, codec, broken, seed):
    """What a pipeline rank sends for a boundary's costate (a flag per leaf, a payload per floating leaf)
    fills exactly what its neighbour receives into, and carries the codec's round trip of every floating
    leaf that has a costate, ``None`` elsewhere; a costate of another shape or structure is named."""
    import eae_func.distributed as D
    from eae_func.distributed import stage as S

    torch.manual_seed(seed)
    state = [torch.zeros(shape, dtype=dtype) for dtype, shape in leaves]
    boundary = {f"v{k}": t for k, t in enumerate(state)} if as_dict else tuple(state)
    metas, spec = optree.tree_flatten(boundary, namespace=NAMESPACE)
    costate = [
        torch.randn(t.shape, dtype=t.dtype) if t.is_floating_point() and on else None for t, on in zip(metas, present)
    ]
    wire = {"raw": D.codecs.Raw(), "int8": D.codecs.int8(), "topk": D.codecs.topk(0.5)}[codec]
    what = "the costate at boundary 2 (the input of rank 1, stage 2 ('s'))"
    given_costate = spec.unflatten(costate)
    floats = [k for k, t in enumerate(costate) if t is not None]
    if broken == "shape" and floats:
        costate[floats[0]] = torch.zeros(7, *costate[floats[0]].shape)
        given_costate = spec.unflatten(costate)
    elif broken == "structure":
        given_costate = [*costate, None]
    if broken is not None and (broken == "structure" or floats):
        with pytest.raises(ValueError, match=re.escape(what) + " has (a leaf of shape|another structure)"):
            S.costate_leaves(given_costate, spec, metas, what)
        return
    values = S.costate_leaves(given_costate, spec, metas, what)
    encoded = [None if v is None else wire.encode(v) for v in values]
    flags, sent = S.costate_message(encoded, metas, wire, torch.device("cpu"))
    inbox_flags, inbox = S.costate_inbox(metas, wire, torch.device("cpu"))
    sending, receiving = [flags, *S.wire_tensors(sent)], [inbox_flags, *S.wire_tensors(inbox)]
    assert [(t.shape, t.dtype) for t in sending] == [(t.shape, t.dtype) for t in receiving]
    for into, t in zip(receiving, sending):
        into.copy_(t)
    received = optree.tree_leaves(
        S.received_costate(inbox_flags.tolist(), inbox, spec), none_is_leaf=True, namespace=NAMESPACE
    )
    for got, t in zip(received, costate):
        assert (got is None) == (t is None)
        assert got is None or torch.equal(got, wire.encode(t).decode())


@given(
    widths=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    change=st.sampled_from([None, "freeze", "widen", "double", "extra layer", "tie"]),
    pick=st.integers(0, 3),
    ranks=st.integers(2, 4),
)
def test_replicas_that_differ_are_named_and_the_same_ones_agree(widths, change, pick, ranks):
    """The check ``data_parallel=`` makes at its first step, without ranks: equal layouts have one
    digest and no difference; a replica changed in one way is named, with its rank and the stage."""
    from eae_func.core.ties import tie_groups
    from eae_func.distributed import data_parallel as DP

    def layout(changed):
        torch.manual_seed(0)
        layers = [nn.Linear(a, b) for a, b in zip([3, *widths], widths)]
        layers += [nn.Linear(widths[-1], widths[-1]) for _ in range(2)]  # a pair that may be tied
        i = pick % len(widths)
        if changed == "freeze":
            layers[i].requires_grad_(False)
        elif changed == "widen":
            layers[i] = nn.Linear(layers[i].in_features, layers[i].out_features + 1)
        elif changed == "double":
            layers[i].double()
        elif changed == "extra layer":
            layers.append(nn.Linear(widths[-1], 2))
        elif changed == "tie":
            layers[-1].weight = layers[-2].weight
        chain, params = ef.from_module(nn.Sequential(*layers), loss=F.mse_loss)
        return DP.replica_layout(chain, params, tie_groups(chain, params))

    same, other = layout(None), layout(change)
    assert torch.equal(DP.digest(same), DP.digest(layout(None)))
    differences = DP.replica_differences([same] * (ranks - 1) + [other], list(range(ranks)))
    if change is None:
        assert differences == []
        return
    assert not torch.equal(DP.digest(other), DP.digest(same))
    assert differences and all(f"rank {ranks - 1}" in d for d in differences), differences
    stage = {"extra layer": len(widths) + 2, "tie": len(widths)}.get(change, pick % len(widths))
    assert any(f"stage {stage} " in d for d in differences), differences


@given(
    shapes=st.lists(st.lists(st.integers(1, 3), max_size=2), min_size=1, max_size=5),
    dtypes=st.lists(st.sampled_from([torch.float32, torch.float64]), min_size=5, max_size=5),
    used=st.lists(st.lists(st.booleans(), min_size=5, max_size=5), min_size=2, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_replicas_with_different_used_parameters_pair_the_same_tensors(shapes, dtypes, used, seed):
    """Replicas that used different parameters (MoE routing, a branch) send buckets of one layout (the
    same members, sizes and dtypes on every replica, whatever each used), and their sum gives DDP's
    (find_unused_parameters) average: (1/R) sum_r g_r with zeros where unused, none where no replica
    used the parameter."""
    from eae_func.distributed import data_parallel as DP

    torch.manual_seed(seed)
    like = {f"p{k}": torch.zeros(shape, dtype=dtypes[k]) for k, shape in enumerate(shapes)}
    R = len(used)
    grads = [{n: torch.randn_like(t) for k, (n, t) in enumerate(like.items()) if used[r][k]} for r in range(R)]
    sent = [DP.buckets(g, like, R) for g in grads]
    layouts = [[(members, b.shape, b.dtype) for members, b in buckets] for buckets in sent]
    assert all(layout == layouts[0] for layout in layouts)
    summed = [(members, sum(buckets[j][1] for buckets in sent)) for j, (members, _) in enumerate(sent[0])]
    counts = {n: sum(n in g for g in grads) for n in like}
    got = DP.averaged(summed, like, counts)
    for n, t in like.items():
        if counts[n] == 0:
            assert n not in got, n
            continue
        want = sum(g[n] / R if n in g else torch.zeros_like(t) for g in grads)
        torch.testing.assert_close(got[n], want, rtol=0, atol=1e-6 if t.dtype == torch.float32 else 1e-12)


# ----------------------------------------------------------------------------- in-place writes into a cut's inputs

WRITES = {  # what a cut module does to its input during its forward, as eager PyTorch lets it
    "none": lambda x: x,
    "x.mul_(2)": lambda x: x.mul_(2),
    "x.add_(1)": lambda x: x.add_(1),
    "x[0].zero_()": lambda x: x[0].zero_(),  # through a view
}
OUT_OF_PLACE = {  # the same, written out of place
    "none": lambda x: x,
    "x.mul_(2)": lambda x: x * 2,
    "x.add_(1)": lambda x: x + 1,
    "x[0].zero_()": lambda x: torch.cat([torch.zeros_like(x[:1]), x[1:]]),
}


class Writer(nn.Module):
    def __init__(self, width, write):
        super().__init__()
        self.lin, self.write = nn.Linear(width, width), write

    def forward(self, x):
        WRITES[self.write](x)
        return torch.tanh(self.lin(x))


class Writers(nn.Module):
    """Blocks cut at run time that may write into their inputs; their input requires grad (an
    embedding before them) or not, and was written before the first call; the glue reads a block's (written) input again after its call
    (``reuse``), or writes into it (``glue_write``)."""

    def __init__(self, width, writes, embed, reuse=False, glue_write=False):
        super().__init__()
        self.embed = nn.Linear(width, width) if embed else None
        self.blocks = nn.ModuleList(Writer(width, w) for w in writes)
        self.head = nn.Linear(width, 1)
        self.reuse, self.glue_write = reuse, glue_write

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x * 1.0
        h.mul_(1.0)  # written once before the first call: its version is not 0
        for block in self.blocks:
            y = block(h)
            if self.glue_write:
                h.mul_(3)
            h = y + h if self.reuse else y
        return self.head(h)


def _out_of_place(model, x):
    """What eager PyTorch computes, where its graph allows (a later write into a saved tensor does not)."""
    h = model.embed(x) if model.embed is not None else x * 1.0
    for block in model.blocks:
        h = OUT_OF_PLACE[block.write](h)
        y = torch.tanh(block.lin(h))
        h = y + h if model.reuse else y
    return model.head(h)


def _cut_grads(model, x, early_stop):
    params = dict(model.named_parameters())
    return ef.grad(model, params, x, loss=lambda y: y.pow(2).mean(), split_at=["blocks.*"], early_stop=early_stop)


@given(
    writes=st.lists(st.sampled_from(sorted(WRITES)), min_size=1, max_size=3),
    width=st.integers(2, 4),
    embed=st.booleans(),
    reuse=st.booleans(),
    early_stop=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_cut_that_writes_into_its_input_gives_autograds_gradients(writes, width, embed, reuse, early_stop, seed):
    """Each cut rebuilt from the values its forward was given, the written input seen by the glue
    after the call as in eager PyTorch (its gradient through the write too), step after step (the
    second one stopped early where ``early_stop`` is on): the gradients of the same model written out
    of place (eager PyTorch refuses a block that writes into the previous block's saved output)."""
    torch.manual_seed(seed)
    model = Writers(width, writes, embed, reuse).double()
    x = torch.randn(3, width, dtype=torch.float64)
    own = list(model.parameters())
    reference = torch.autograd.grad(_out_of_place(model, x).pow(2).mean(), own)
    with mock.patch.object(ES, "WORTH", 0), mock.patch.object(ES, "_KINDS", {}):
        for _ in range(2):
            grads = _cut_grads(model, x.clone(), early_stop)
            for (name, _), r in zip(model.named_parameters(), reference):
                torch.testing.assert_close(grads[name], r, rtol=1e-12, atol=1e-12, msg=name)


@given(write=st.sampled_from(sorted(WRITES)), embed=st.booleans(), seed=st.integers(0, 2**16))
def test_a_cut_input_written_after_the_call_is_named(write, embed, seed):
    """The glue writes into a cut's input after the call: the rebuild would see the new values.
    Plain autograd refuses it (the block's product saved that input); the sweep gives autograd's
    gradients where the block wrote the input itself (it keeps a copy), else names the cut."""
    torch.manual_seed(seed)
    model = Writers(3, [write], embed, reuse=True, glue_write=True).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x.clone()).sum().backward()
    if write != "none":
        return  # its rebuild starts from its own copy
    with pytest.raises(ValueError, match=r"cut 'blocks.0': its input args\[0\] was written in place after the call"):
        _cut_grads(model, x.clone(), early_stop=False)


def test_a_parameter_written_between_the_forward_and_the_backward_is_named():
    """An optimizer step between an enabled model's forward and its backward: the rebuild would run at
    the new values, so the cut names the parameter (plain autograd refuses it too: the block's product
    saved the weight)."""
    torch.manual_seed(0)
    model = Writers(3, ["none", "none"], embed=True).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    loss = model(x).pow(2).mean()
    with torch.no_grad():
        model.blocks[1].lin.weight.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with ef.enable(model, split_at=["blocks.*"]):
        loss = model(x).pow(2).mean()
        with torch.no_grad():
            model.blocks[1].lin.weight.add_(1)
        with pytest.raises(ValueError, match=r"cut 'blocks.1': its parameter 'lin.weight' was written in place after"):
            loss.backward()


def test_a_write_its_first_call_did_not_make_is_refused_then_copied():
    torch.manual_seed(0)
    model = Writers(3, ["none"], embed=True).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    _cut_grads(model, x, early_stop=False)
    model.blocks[0].write = "x.mul_(2)"
    with pytest.raises(ValueError, match=r"cut 'blocks.0' wrote into its input args\[0\] in place .* Run the step"):
        _cut_grads(model, x, early_stop=False)
    reference = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
    grads = _cut_grads(model, x, early_stop=False)
    for (name, _), r in zip(model.named_parameters(), reference):
        torch.testing.assert_close(grads[name], r, rtol=1e-12, atol=1e-12)


def test_an_in_place_relu_cut_gives_autograds_gradients():
    """``nn.ReLU(inplace=True)`` as the cut: its output is its written input, which the glue reads again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    reference = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
    grads = ef.grad(model, dict(model.named_parameters()), x, loss=lambda y: y.pow(2).mean(), split_at=["1"])
    for (name, _), r in zip(model.named_parameters(), reference):
        torch.testing.assert_close(grads[name], r, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- repeated children

POOL = {  # a small pool of modules, float64; a pick that repeats puts one module at several positions
    "lin": lambda: nn.Linear(3, 3),
    "tanh": nn.Tanh,
    "block": lambda: nn.Sequential(nn.Linear(3, 3), nn.Tanh()),
    "norm": lambda: nn.LayerNorm(3),
}


def repeated(picks, container, seed):
    """A container of ``picks`` (indices into a pool of up to 4 modules, each made once, so a repeated
    index is one module at several positions) and a head, float64, and autograd's gradients of it."""
    torch.manual_seed(seed)
    kinds = sorted(POOL)
    pool = [POOL[kinds[k % len(kinds)]]().double() for k in range(4)]
    modules = [pool[k] for k in picks] + [nn.Linear(3, 2).double()]
    model = (
        nn.Sequential(*modules)
        if container == "sequential"
        else nn.ModuleList(modules)
        if container == "modulelist"
        else modules
    )
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    h = x
    for m in modules:  # as Sequential.forward runs them: every position
        h = m(h)
    own = list(dict.fromkeys(p for m in modules for p in m.parameters()))
    reference = dict(zip(own, torch.autograd.grad(F.mse_loss(h, y), own)))
    return model, modules, x, y, reference


@given(
    picks=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    container=st.sampled_from(["sequential", "modulelist", "list"]),
    seed=st.integers(0, 2**16),
)
def test_a_module_repeated_in_a_container_is_one_stage_per_position(picks, container, seed):
    """One stage per position, as the container's forward iterates; a repeated module's parameters are
    tied across its stages: autograd's summed gradient on the chain path and the flat-dict path."""
    model, modules, x, y, reference = repeated(picks, container, seed)
    chain, params = ef.from_module(model, loss=F.mse_loss)
    assert len(chain) == len(modules)
    res = ef.sweep(chain, params, x, y)
    for m, stage in zip(modules, res.grads):
        for name, p in m.named_parameters():
            torch.testing.assert_close(stage[name], reference[p], rtol=0, atol=1e-12)
    if container == "list":
        return
    flat = ef.grad(model, dict(model.named_parameters()), x, y, loss=F.mse_loss)
    assert set(flat) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(flat[name], reference[p], rtol=0, atol=1e-12)
    ef.write_grads(model, res.grads)
    for p, g in reference.items():
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-12)


def test_a_repeated_module_is_stepped_once_with_its_summed_gradient():
    """``Sequential(shared, act, shared, act, head)``: five stages, and a fused SGD step (torch.optim or
    a pure ``ef.fused``) and ``write_grads`` + ``optimizer.step()`` step ``shared`` once, by autograd's
    summed gradient."""
    model, modules, x, y, reference = repeated([0, 1, 0, 1], "sequential", 3)
    shared = modules[0]
    assert len(ef.from_module(model, loss=F.mse_loss)[0]) == 5 and sum(1 for _ in shared.parameters()) == 2
    before = {p: p.detach().clone() for p in reference}
    stepped = {p: before[p] - 0.5 * g for p, g in reference.items()}

    def restore():
        with torch.no_grad():
            for p, b in before.items():
                p.copy_(b)
                p.grad = None

    chain, params = ef.from_module(model, loss=F.mse_loss)
    ef.sweep(chain, params, x, y, update=torch.optim.SGD(model.parameters(), lr=0.5))
    for p in reference:
        torch.testing.assert_close(p.detach(), stepped[p], rtol=0, atol=1e-12)
    restore()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ef.write_grads(model, ef.grad(model, dict(model.named_parameters()), x, y, loss=F.mse_loss))
    optimizer.step()
    for p in reference:
        torch.testing.assert_close(p.detach(), stepped[p], rtol=0, atol=1e-12)
    restore()
    calls = []

    def sgd(p, g, s):
        calls.extend(id(p[n]) for n in g if g[n] is not None)
        return {n: t - 0.5 * g[n] if g.get(n) is not None else t for n, t in p.items()}, s

    res = ef.sweep(chain, params, x, y, update=ef.fused(sgd, (None,) * len(chain)))
    assert len(calls) == len(set(calls)) == len(reference)  # every tensor stepped once
    for m, stage in zip(modules, res.params):
        for name, p in m.named_parameters():
            torch.testing.assert_close(stage[name], stepped[p], rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- given values


def pair(seed):
    """``b(tanh(a(x)))`` in float64, as an ``nn.Sequential`` with named children ``a``, ``act``, ``b``."""
    torch.manual_seed(seed)
    model = nn.Sequential(OrderedDict(a=nn.Linear(3, 4), act=nn.Tanh(), b=nn.Linear(4, 2))).double()
    return model, torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)


def grads_by_path(path, model, given, x, y):
    """``ef.grad`` of ``model`` at the flat dict ``given`` on one path, as a flat dict of the model's names."""
    if path == "chain":  # one dict per stage: the frozen ones it lacks are the module's own
        full = {**{n: p.detach() for n, p in model.named_parameters()}, **given}
        chain, _ = ef.from_module(model, loss=F.mse_loss)
        per_stage = tuple({n: full[f"{c}.{n}"] for n, _ in m.named_parameters()} for c, m in model.named_children())
        grads = ef.grad(chain, per_stage, x, y)
        named = {f"{c}.{n}": g for c, stage in zip(["a", "act", "b"], grads) for n, g in stage.items()}
        return {n: g for n, g in named.items() if n in given}
    options = {
        "flat": {},
        "cuts": {"split_at": ["a", "b"]},
        "graph": {"split_at": ["a", "b"], "capture": "graph"},
    }[path]
    return ef.grad(model, given, x, y, loss=F.mse_loss, **options)


PATHS = ["chain", "flat", "cuts", "graph"]


@given(
    seed=st.integers(0, 2**16),
    path=st.sampled_from(PATHS),
    scale=st.floats(0.5, 2.0),
    how=st.sampled_from(["detached", "requires grad", "computed from the module's"]),
    frozen=st.sets(st.sampled_from(["a.weight", "a.bias", "b.weight", "b.bias"]), max_size=3),
    leave_out=st.booleans(),
)
def test_given_values_are_differentiated_and_the_modules_flags_say_what_is_frozen(
    seed, path, scale, how, frozen, leave_out
):
    """Parameters given as other tensors (detached copies, scaled, requiring grad or not) are
    differentiated, as ``torch.func.grad`` differentiates what it is given; a parameter is frozen (its
    gradient ``None``) where the module's own has ``requires_grad=False``, whatever the given tensor's
    flag, and a frozen one may be left out (the module's own is used), on every path."""
    model, x, y = pair(seed)
    for n in frozen:
        model.get_parameter(n).requires_grad_(False)
    values = {
        "detached": lambda p: p.detach() * scale,
        "requires grad": lambda p: (p.detach() * scale).requires_grad_(),
        "computed from the module's": lambda p: p * scale,  # in the caller's graph
    }[how]
    given = {n: values(p) for n, p in model.named_parameters() if not (leave_out and n in frozen)}
    full = {**{n: p.detach() for n, p in model.named_parameters()}, **{n: t.detach() for n, t in given.items()}}
    reference = torch.func.grad(lambda p: F.mse_loss(torch.func.functional_call(model, p, (x,)), y))(full)
    grads = grads_by_path(path, model, given, x, y)
    assert set(grads) == set(given)
    for n in given:
        if n in frozen:
            assert grads[n] is None, n
        else:
            torch.testing.assert_close(grads[n], reference[n], rtol=0, atol=1e-12)


@given(seed=st.integers(0, 2**16), scale=st.floats(0.5, 2.0), requires_grad=st.booleans())
def test_a_functions_leaves_are_all_differentiated(seed, scale, requires_grad):
    """A function ``model_fn(params, x)`` cut with ``ef.cut``: every leaf of its params is differentiated,
    whether it requires grad or not, as ``torch.func.grad`` does."""
    model, x, y = pair(seed)
    given = {n: (p.detach() * scale).requires_grad_(requires_grad) for n, p in model.named_parameters()}

    def model_fn(p, h):
        h = ef.cut(torch.tanh(F.linear(h, p["a.weight"], p["a.bias"])), "a")
        return F.linear(h, p["b.weight"], p["b.bias"])

    reference = torch.func.grad(lambda p: F.mse_loss(model_fn(p, x), y))({n: t.detach() for n, t in given.items()})
    grads = ef.grad(model_fn, given, x, y, loss=F.mse_loss)
    for n in given:
        torch.testing.assert_close(grads[n], reference[n], rtol=0, atol=1e-12)


@given(
    seed=st.integers(0, 2**16),
    path=st.sampled_from(["flat", "cuts", "graph"]),
    drop=st.sets(st.sampled_from(["a.weight", "a.bias", "b.weight", "b.bias"]), min_size=1),
    extra=st.booleans(),
)
def test_a_flat_dict_that_lacks_a_trainable_parameter_is_refused_naming_it(seed, path, drop, extra):
    """A flat dict that leaves out a trainable parameter (or names one the model lacks) is refused on
    every path, naming the key and the names expected, never a gradient for the rest."""
    model, x, y = pair(seed)
    given = {n: p for n, p in model.named_parameters() if n not in drop}
    if extra:
        given["a.wieght"] = torch.zeros(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError) as info:
        grads_by_path(path, model, given, x, y)
    message = str(info.value)
    assert f"lacks the trainable parameters {sorted(drop, key=list(dict(model.named_parameters())).index)}" in message
    assert "['a.weight', 'a.bias', 'b.weight', 'b.bias']" in message
    assert ("'a.wieght'" in message) == extra


# ----------------------------------------------------------------------------- passes restricted to stages


@given(
    seed=st.integers(0, 2**16),
    path=st.sampled_from(["chain", "flat", "cuts", "function"]),
    stage=st.sampled_from(["Linear_*", "a*", "lin", "b#2", None]),
    wrap=st.sampled_from(["alone", "composed", "error feedback"]),
)
def test_a_stage_name_only_never_meets_is_refused_naming_it(seed, path, stage, wrap):
    """``P.only(p, stages=name)`` with a name that is none of the sweep's stages (a pattern, a misspelt
    name, a second call that never happens) is refused, naming it and the stage names; with a real
    stage name it applies there alone (``scale(0)`` zeroes what flows below that stage)."""
    model, x, y = pair(seed)
    restricted = P.only(P.scale(0.0), stages="b" if stage is None else stage)  # b: the last stage on every path
    passes = {
        "alone": restricted,
        "composed": ef.compose(P.clip_by_value(1e6), restricted),
        "error feedback": P.error_feedback(restricted),
    }[wrap]

    def model_fn(p, h):
        h = ef.cut(torch.tanh(F.linear(h, p["a.weight"], p["a.bias"])), "a")
        return ef.cut(F.linear(h, p["b.weight"], p["b.bias"]), "b")

    def run():
        if path == "chain":
            chain, params = ef.from_module(model, loss=F.mse_loss)
            res = ef.sweep(chain, params, x, y, passes=passes, pass_state=None)
            return {f"{c}.{n}": g for c, s in zip(["a", "act", "b"], res.grads) for n, g in s.items()}
        given = dict(model.named_parameters())
        if path == "function":
            return ef.sweep(model_fn, given, x, y, loss=F.mse_loss, passes=passes).grads
        split_at = {"flat": None, "cuts": ["a", "b"]}[path]
        return ef.sweep(model, given, x, y, loss=F.mse_loss, split_at=split_at, passes=passes).grads

    if stage is not None:
        with pytest.raises(
            ValueError, match=rf"only: no stage is named \[{re.escape(repr(stage))}\].* stage names are"
        ):
            run()
        return
    grads = run()
    assert all(not g.any() for g in grads.values())  # the costate at b's output zeroed: nothing flows


@given(cut=st.booleans(), kind=st.sampled_from(["list", "tuple", "generator"]))
def test_a_list_of_parameters_given_to_a_model_says_what_a_model_takes(cut, kind):
    model, x, y = pair(0)
    options = {"split_at": ["a", "b"]} if cut else {}
    params = {"list": list, "tuple": tuple, "generator": iter}[kind](model.parameters())
    with pytest.raises(TypeError, match=r"params: a model \(Sequential\) takes a flat \{name: tensor\} dict, dict\("):
        ef.grad(model, params, x, y, loss=F.mse_loss, **options)
