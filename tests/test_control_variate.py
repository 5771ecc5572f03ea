"""The twin as a control variate (E.control_variate, docs/estimators.md): a zero twin or β = 0 is
the wrapped zbp bit for bit, an exact twin gives the exact gradients, β "ema" reads earlier steps
only, the stats pool over microbatches, and the estimate is unbiased with zbp's error at g − βs."""

from __future__ import annotations

import copy
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import eae_func as ef
from eae_func import estimators as E
from eae_func.estimators.model_level import ModelLevel

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
    pytest.mark.usefixtures("one_thread"),
]

F64 = torch.float64
D, B = 6, 5
BETAS = [1.0, 0.5, "ema", "xfit"]


class Medium:
    """``tanh(x M) * gain`` in numpy (a black box), and the same in torch (its exact twin)."""

    def __init__(self, seed: int = 0):
        self.m = np.random.default_rng(seed).standard_normal((D, D)) / D**0.5
        self.rows = 0

    def __call__(self, params, x):
        self.rows += len(x)
        return np.tanh(x @ self.m) * params["gain"]

    def torch(self, params, h):
        return torch.tanh(h @ torch.from_numpy(self.m).to(h.dtype)) * params["gain"]


def network(*boxes):
    """digital, box, digital[, box, digital]: each box with a scalar parameter ``gain``."""
    g = torch.Generator().manual_seed(1)
    stages, params = [], []
    for j, box in enumerate((*boxes, None)):
        stages.append(ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name=f"digital{j}"))
        params.append({"w": torch.randn(D, D, generator=g, dtype=F64)})
        if box is not None:
            stages.append(box)
            params.append({"gain": torch.tensor(1.3 + 0.1 * j, dtype=F64)})
    x, y = torch.randn(B, D, generator=g, dtype=F64), torch.randn(B, D, generator=g, dtype=F64)
    return ef.Chain(stages, loss=F.mse_loss), tuple(params), x, y


def same_bits(a, b) -> bool:
    return all(
        torch.equal(s, t) for s, t in zip(ef.tree_leaves(a.grads), ef.tree_leaves(b.grads), strict=True)
    ) and all(torch.equal(s.value, t.value) for s, t in zip(a.adjoints, b.adjoints) if s.value is not None)


COUNTERS = ("queries", "param_queries", "rows", "calls", "forward_calls", "jvp_calls", "backward_calls")


@settings(max_examples=12, deadline=None)
@given(
    method=st.sampled_from(["jvp", "fd"]),
    beta=st.sampled_from(BETAS),
    twin_directional=st.sampled_from(["exact", "fd"]),
    kind=st.sampled_from(["gaussian", "rademacher", "sphere"]),
    antithetic=st.booleans(),
    n=st.integers(4, 7),
    chunk=st.sampled_from([None, 1, 3]),
    key=st.integers(0, 1000),
)
def test_a_zero_twin_or_beta_zero_is_the_wrapped_zbp_bit_for_bit(
    method, beta, twin_directional, kind, antithetic, n, chunk, key
):
    """Same probes, same rows and calls, the same numbers: the input costate and (fd) the probed
    parameter gradient; with β = 0 any twin drops out."""
    medium = Medium()
    chain, params, x, y = network(ef.stage(medium.torch, name="box", physical=True))
    zbp = E.zbp(E.Probes(n, kind, chunk=chunk, antithetic=antithetic), method=method, eps=1e-4)
    ref = ef.sweep(chain, params, x, y, estimator=zbp, key=key)
    zero = lambda p, h: 0 * medium.torch(p, h)  # noqa: E731
    for twin, b in ((zero, beta), (lambda p, h: 1.7 * medium.torch(p, h), 0.0)):
        res = ef.sweep(chain, params, x, y, estimator=E.control_variate(zbp, twin, b, twin_directional), key=key)
        assert same_bits(res, ref)
        assert {k: res.stats["box"].get(k) for k in COUNTERS} == {k: ref.stats["box"].get(k) for k in COUNTERS}
        assert res.stats["box"]["twin_calls"] == 1


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("method,twin_directional", [("jvp", "exact"), ("fd", "fd"), ("fd", "exact")])
def test_an_exact_twin_gives_the_exact_gradients(beta, method, twin_directional):
    """The twin equal to the stage: ĝ = s = g for β = 1, "ema" (1 before any step) and "xfit" (fitted
    to 1); β = 0.5 keeps half of zbp's error. With fd, the twin's own central differences cancel the
    stage's truncation exactly; with exact <u, s> it is left, O(ε²)."""
    medium = Medium()
    box = (
        ef.black_box(medium, name="box", numpy=True)
        if method == "fd"
        else ef.stage(medium.torch, name="box", physical=True)
    )
    chain, params, x, y = network(box)
    exact = ef.sweep(network(ef.stage(medium.torch, name="box"))[0], params, x, y)
    zbp = E.zbp(E.Probes(6, "rademacher"), method=method, eps=1e-4)
    res = ef.sweep(chain, params, x, y, estimator=E.control_variate(zbp, medium.torch, beta, twin_directional), key=4)
    tol = (
        {"rtol": 1e-6, "atol": 1e-8}
        if twin_directional == "exact" and method == "fd"
        else {"rtol": 1e-10, "atol": 1e-12}
    )
    grads, ref = ef.tree_leaves(res.grads), ef.tree_leaves(exact.grads)
    if beta == 0.5:
        assert not torch.allclose(grads[0], ref[0], **tol)
        return
    for g, h in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, h, **tol)
    stats = res.stats["box"]
    assert float(stats["twin_error"]) < 1e-5 and float(stats["cv_residual"]) < 1e-5
    assert abs(float(stats["beta_fit"]) - 1) < 1e-6
    if method == "fd":
        assert medium.rows == stats["rows"] == B * (1 + 2 * 6 + 2 * 6)  # forward, input probes, gain probes


MODEL_LEVEL = [(make, form) for make in (E.node_perturbation, E.direct) for form in ("oracle", "jvp", "fd")]


@pytest.mark.parametrize("make,form", MODEL_LEVEL)
def test_at_the_model_level_a_zero_twin_is_the_wrapped_estimator_and_an_exact_twin_is_exact(make, form):
    """np and direct with two physical stages (black boxes under fd), a twin per stage: zero twins
    give the wrapped estimate bit for bit with the same rows and calls (the twins' sweep and
    probing run no black box); exact twins give the exact gradients for β 1, "ema" and "xfit"."""
    first, second = Medium(0), Medium(1)
    if form == "fd":
        boxes = [ef.black_box(first, name="a", numpy=True), ef.black_box(second, name="b", numpy=True)]
    else:
        boxes = [ef.stage(first.torch, name="a", physical=True), ef.stage(second.torch, name="b", physical=True)]
    chain, params, x, y = network(*boxes)
    exact = ef.sweep(network(ef.stage(first.torch, name="a"), ef.stage(second.torch, name="b"))[0], params, x, y)
    wrapped = make(E.Probes(5, "rademacher", chunk=2), form=form, eps=1e-4)
    ref = ef.sweep(chain, params, x, y, estimator=wrapped, key=3)
    zero = {"a": lambda p, h: 0 * first.torch(p, h), "b": lambda p, h: 0 * second.torch(p, h)}
    twins = {"a": first.torch, "b": second.torch}
    directional = "fd" if form == "fd" else "exact"
    for beta in (1.0, "ema", "xfit"):
        res = ef.sweep(chain, params, x, y, estimator=E.control_variate(wrapped, zero, beta, directional), key=3)
        assert same_bits(res, ref)
        for name in "ab":
            assert {k: res.stats[name].get(k) for k in COUNTERS} == {k: ref.stats[name].get(k) for k in COUNTERS}
        res = ef.sweep(chain, params, x, y, estimator=E.control_variate(wrapped, twins, beta, directional), key=3)
        for g, h in zip(ef.tree_leaves(res.grads), ef.tree_leaves(exact.grads), strict=True):
            torch.testing.assert_close(g, h, rtol=1e-9, atol=1e-11)


def test_a_twin_per_stage_by_name():
    """Two physical stages, each with its own twin: PAT and the control variate are exact with the
    right twin for each; a mapping that misses one is refused before anything is simulated."""
    first, second = Medium(0), Medium(1)
    boxes = [ef.black_box(first, name="a", numpy=True), ef.black_box(second, name="b", numpy=True)]
    chain, params, x, y = network(*boxes)
    exact = ef.sweep(network(ef.stage(first.torch, name="a"), ef.stage(second.torch, name="b"))[0], params, x, y)
    twins = {"a": first.torch, "b": second.torch}
    zbp = E.zbp(E.Probes(3, "rademacher"), method="fd", eps=1e-4)
    for estimator in (E.twin(twins), E.control_variate(zbp, twins, twin_directional="fd")):
        res = ef.sweep(chain, params, x, y, estimator=estimator, key=2)
        for g, h in zip(ef.tree_leaves(res.grads), ef.tree_leaves(exact.grads), strict=True):
            torch.testing.assert_close(g, h, rtol=1e-10, atol=1e-12)
    swapped = ef.sweep(chain, params, x, y, estimator=E.twin({"a": second.torch, "b": first.torch}))
    assert not torch.allclose(swapped.grads[0]["w"], exact.grads[0]["w"])
    rows = first.rows
    for estimator in (E.twin({"a": first.torch}), E.control_variate(zbp, {"a": first.torch})):
        with pytest.raises(ValueError, match=r"no twin for the physical stage\(s\) \['b'\]; the mapping names \['a'\]"):
            ef.sweep(chain, params, x, y, estimator=estimator)
    assert first.rows == rows  # refused before the forward


def test_ema_beta_is_fitted_on_earlier_steps_only():
    """β = 1 before any step; ``observe`` returns a new estimator (the old one unchanged) whose β is
    the decayed ratio of the earlier steps' fits; a sweep with it equals the control variate with
    that β fixed, so the step's own probes do not enter β."""
    medium = Medium()
    chain, params, x, y = network(ef.stage(medium.torch, name="box", physical=True))
    wrong = lambda p, h: medium.torch({"gain": 1.5 * p["gain"]}, h)  # noqa: E731
    zbp = E.zbp(E.Probes(4, "rademacher"))
    cv = E.control_variate(zbp, wrong, "ema", decay=0.5)
    fits, betas = [], []
    for key in range(3):
        res = ef.sweep(chain, params, x, y, estimator=cv, key=key)
        fixed = ef.sweep(
            chain, params, x, y, estimator=E.control_variate(zbp, wrong, float(res.stats["box"]["beta"])), key=key
        )
        assert_trees_close(res.adjoints[-2].value, fixed.adjoints[-2].value)
        betas.append(float(res.stats["box"]["beta"]))
        fits.append(res.stats["box"]["beta_fit"])
        before, cv = cv, cv.observe(res)
        assert len(before.state) == min(key, 1) and list(cv.state) == [("box", "input")]
    assert betas[0] == 1.0
    num = [float(f.num) for f in fits]
    den = [float(f.den) for f in fits]
    assert betas[1] == pytest.approx(num[0] / den[0], rel=1e-12)
    assert betas[2] == pytest.approx((0.5 * num[0] + num[1]) / (0.5 * den[0] + den[1]), rel=1e-12)
    # the fitted βs (4 probes a step: noisy) lie nearer β* = <g, s> / ‖s‖² than the starting 1, with
    # g and s the exact and the twin's input costates (s = 1.5 g here: β* = 2/3)
    g = ef.sweep(chain, params, x, y, estimator=E.exact()).adjoints[-2].value
    s = ef.sweep(chain, params, x, y, estimator=E.twin(wrong)).adjoints[-2].value
    best = float((g * s).sum() / (s * s).sum())
    assert best == pytest.approx(1 / 1.5, rel=1e-9)
    assert all(abs(b - best) < abs(1.0 - best) / 2 for b in betas[1:]), (betas, best)


def assert_trees_close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_stats_are_pooled_over_microbatches():
    """β, the residual and the twin's error are ratios of sums over all probes and positions: over
    two microbatches, those of the pooled sums (β stays 0.5 rather than adding up)."""
    medium = Medium()
    chain, params, x, y = network(ef.stage(medium.torch, name="box", physical=True))
    wrong = lambda p, h: medium.torch({"gain": 1.2 * p["gain"]}, h)  # noqa: E731
    cv = E.control_variate(E.zbp(E.Probes(8, "rademacher")), wrong, 0.5)
    whole = ef.sweep(chain, params, x, y, estimator=cv, key=1).stats["box"]
    split = ef.sweep(chain, params, x, y, estimator=cv, key=1, microbatches=2).stats["box"]
    assert float(split["beta"]) == 0.5 and split["twin_calls"] == 2 and split["queries"] == 2 * whole["queries"]
    for k in ("cv_residual", "twin_error"):
        ratio = split[k]
        assert float(ratio) == pytest.approx((float(ratio.num) / float(ratio.den)) ** 0.5, rel=1e-12)
        assert 0.05 < float(ratio) < 1 and float(ratio) == pytest.approx(float(whole[k]), rel=0.5)


def test_bad_arguments_name_the_entry_point():
    zbp = E.zbp(E.Probes(4))
    with pytest.raises(TypeError, match=r"control_variate: wraps E.zbp\(...\) .* or E.direct\(...\) .* got Twin"):
        E.control_variate(E.twin(torch.tanh), torch.tanh)
    with pytest.raises(TypeError, match=r"control_variate: expected a differentiable function twin\(params, h\)"):
        E.control_variate(zbp, 3)
    with pytest.raises(TypeError, match=r"twin: expected a differentiable function .* got dict"):
        E.twin({"box": 3})
    with pytest.raises(ValueError, match=r"control_variate: beta must be a finite number, 'ema' or 'xfit', got 'auto'"):
        E.control_variate(zbp, torch.tanh, "auto")
    with pytest.raises(ValueError, match=r"control_variate: beta must be .* got True"):
        E.control_variate(zbp, torch.tanh, True)
    with pytest.raises(ValueError, match=r"control_variate: twin_directional must be one of \('exact', 'fd'\)"):
        E.control_variate(zbp, torch.tanh, twin_directional="jvp")
    with pytest.raises(ValueError, match=r"control_variate: decay must be a number in \[0, 1\], got 2"):
        E.control_variate(zbp, torch.tanh, "ema", decay=2)
    with pytest.raises(ValueError, match=r"beta='xfit' .* independent probes, got Probes\(n=4, kind='orthogonal'"):
        E.control_variate(E.zbp(E.Probes(4, "orthogonal")), torch.tanh, "xfit")
    with pytest.raises(ValueError, match=r"beta='xfit' .* two non-empty halves"):
        E.control_variate(E.zbp(E.Probes(2, antithetic=True)), torch.tanh, "xfit")


# ---- statistics: the estimate is unbiased, with zbp's error at g − βs ----


def mlp(width: int = 8, batch: int = 128, depth: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]).to(F64)
    chain, params = ef.from_module(model, loss=F.mse_loss)
    x, y = torch.randn(batch, width, dtype=F64), 2 * torch.randn(batch, width, dtype=F64)
    error = 0.4 * torch.randn(width, width, dtype=F64) / width**0.5

    def twin(p, h):  # stage 2 with its weight off by ``error``
        return torch.tanh(F.linear(h, p["0.weight"] + error, p["0.bias"]))

    return chain, params, x, y, twin


def estimates(chain, params, x, y, estimator, keys: int, stage: int = 2) -> torch.Tensor:
    """``(keys, B, d)``: stage 2's estimated input costate for keys 0..keys-1 (``observe`` threaded)."""
    out = []
    for k in range(keys):
        res = ef.sweep(chain, params, x, y, estimator=estimator, physical=[stage], key=k)
        out.append(res.adjoints[len(chain) - stage].value)
        estimator = estimator.observe(res) if hasattr(estimator, "observe") else estimator
    return torch.stack(out)


def z_scores(samples: torch.Tensor, g: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
    return (samples.mean(0) - g) / (variance / samples.shape[0]).sqrt()


def unbiased(z: torch.Tensor) -> bool:
    """Every coordinate's mean within 6 SE, and mean z² ≈ 1 (a bias of about one SE anywhere fails)."""
    return bool(z.abs().max() < 6 and (z * z).mean() < 1.5)


KEYS = 60


def test_control_variate_is_unbiased_with_the_error_of_zbp_at_g_minus_beta_s():
    """Rademacher probes, exact directional derivatives (jvp), a twin off by r ≈ 0.5. Fixed β: per
    coordinate variance (|v|² − v_j²)/n with v = g − βs per sample, and E|ĝ − g|² = (d−1)/n Σ|v|²
    within 10%; "xfit" and "ema": unbiased (their measured variance) and better than β = 1. The
    bound has power: two biased variants fail it, the twin's costate s (PAT, bias s − g) and zbp fd
    at ε = 1 with exact <u, s> (the O(ε²) truncation of its central differences; mean z² ≈ 7)."""
    chain, params, x, y, twin = mlp()
    g = ef.sweep(chain, params, x, y).adjoints[len(chain) - 2].value
    s = ef.sweep(chain, params, x, y, estimator=E.twin(twin), physical=[2]).adjoints[len(chain) - 2].value
    r = ((s - g).norm() / g.norm()).item()
    assert 0.3 < r < 0.7
    n, d = 4, g.shape[-1]
    zbp = E.zbp(E.Probes(n, "rademacher"))
    errors = {}
    for beta in (1.0, 0.5, "xfit", "ema"):
        samples = estimates(chain, params, x, y, E.control_variate(zbp, twin, beta), KEYS)
        errors[beta] = ((samples - g) ** 2).sum().item() / KEYS
        if isinstance(beta, float):
            v = g - beta * s
            variance = ((v * v).sum(-1, keepdim=True) - v * v) / n
            assert unbiased(z_scores(samples, g, variance)), beta
            assert 0.9 < errors[beta] / ((d - 1) / n * (v * v).sum().item()) < 1.1, beta
        else:
            assert unbiased(z_scores(samples, g, samples.var(0))), beta
    assert errors["xfit"] < errors[1.0] and errors["ema"] < errors[1.0]
    pat = s.expand(KEYS, *s.shape) + 1e-3 * torch.randn(KEYS, *s.shape, dtype=F64)
    assert not unbiased(z_scores(pat, g, pat.var(0)))
    coarse = E.zbp(E.Probes(n, "rademacher"), method="fd", eps=1.0)
    truncated = estimates(chain, params, x, y, E.control_variate(coarse, twin), KEYS)
    assert not unbiased(z_scores(truncated, g, truncated.var(0)))


def test_node_perturbation_with_twins_is_unbiased_with_its_cross_stage_error_at_g_minus_beta_s():
    """np (oracle), physical stages 1 and 3 each with a twin off by r ≈ 0.5: every stage's estimate
    is unbiased, and its error is np's formula with v = g − βs in place of g (rademacher):
    (1/n) Σ_b [m |V_b|² − |v_{l,b}|²], |V_b|² over both stages; within 10%."""
    chain, params, x, y, twin = mlp()
    twins = {chain.names[1]: twin, chain.names[3]: twin}
    physical, n, m = [1, 3], 4, 8
    g = {i: v for i, v in ((i, ef.sweep(chain, params, x, y).adjoints[len(chain) - i].value) for i in physical)}
    pat = ef.sweep(chain, params, x, y, estimator=E.twin(twins), physical=physical)
    s = {i: pat.adjoints[len(chain) - i].value for i in physical}
    est = E.control_variate(E.node_perturbation(E.Probes(n, "rademacher")), twins)
    runs = [ef.sweep(chain, params, x, y, estimator=est, physical=physical, key=k) for k in range(KEYS)]
    v = {i: g[i] - s[i] for i in physical}
    total = sum((v[i] ** 2).sum(-1) for i in physical)
    for i in physical:
        assert 0.3 < ((s[i] - g[i]).norm() / g[i].norm()).item() < 0.9
        samples = torch.stack([r.adjoints[len(chain) - i].value for r in runs])
        variance = (total.unsqueeze(-1) - v[i] ** 2) / n  # per coordinate: (|V_b|² − v_j²) / n
        assert unbiased(z_scores(samples, g[i], variance))
        theory = (m * total - (v[i] ** 2).sum(-1)).sum().item() / n
        assert 0.9 < ((samples - g[i]) ** 2).sum().item() / KEYS / theory < 1.1


@pytest.mark.parametrize("make", [E.node_perturbation, E.direct])
def test_at_the_model_level_an_exact_twin_is_exact_over_microbatches(make):
    """Two microbatches (each a share ``loss_scale`` = 1/2 of the mean loss): the twins' costates s
    carry the share as the measured scalars do, so exact twins still give the exact gradients."""
    first, second = Medium(0), Medium(1)
    chain, params, x, y = network(
        ef.stage(first.torch, name="a", physical=True), ef.stage(second.torch, name="b", physical=True)
    )
    exact = ef.sweep(network(ef.stage(first.torch, name="a"), ef.stage(second.torch, name="b"))[0], params, x, y)
    twins = {"a": first.torch, "b": second.torch}
    for form in ("oracle", "jvp"):
        wrapped = make(E.Probes(4, "rademacher"), form=form)
        for beta in (1.0, "xfit"):
            cv = E.control_variate(wrapped, twins, beta)
            res = ef.sweep(chain, params, x, y, estimator=cv, key=3, microbatches=2)
            for g, h in zip(ef.tree_leaves(res.grads), ef.tree_leaves(exact.grads), strict=True):
                torch.testing.assert_close(g, h, rtol=1e-9, atol=1e-11)


def test_xfit_with_antithetic_probes_is_unbiased():
    """``beta="xfit"`` with antithetic pairs (u, −u): each half of the probes must hold whole pairs,
    else both halves see the same directions (exact directional derivatives give a pair's members
    the same u (u·g)), each β is fitted on the directions it weighs, and the estimate is biased:
    its error along s and along g − s over two positions and 200 keys has z = 8.4 and −7.8 with
    the pairs split, −0.2 and −0.3 with them kept (bound 4)."""
    chain, params, x, y, twin = mlp(batch=2)
    g = ef.sweep(chain, params, x, y).adjoints[len(chain) - 2].value
    s = ef.sweep(chain, params, x, y, estimator=E.twin(twin), physical=[2]).adjoints[len(chain) - 2].value
    zbp = E.zbp(E.Probes(4, "rademacher", antithetic=True))
    keys = 200
    samples = estimates(chain, params, x, y, E.control_variate(zbp, twin, "xfit"), keys)
    for direction in (s, g - s):
        along = ((samples - g) * direction).sum((1, 2)) / direction.norm()
        assert abs(along.mean() / (along.var() / keys).sqrt()) < 4


class Offset:
    """A black box ``tanh(x M) * gain`` (physical) and its twin off by a constant ``offset``: the
    twin's Jacobians are exact, its values 20-30% off."""

    def __init__(self, offset: float):
        self.medium, self.offset = Medium(0), offset

    def twin(self, params, h):
        return self.medium.torch(params, h) + self.offset


def test_the_twins_shifted_to_the_measured_outputs_give_the_exact_gradients_for_a_twin_off_in_value():
    """A twin off by a constant: shifted to the measured output (``out − twin(h)`` added), the
    network of twins runs through the measured states, its Jacobians are the stage's, so s = g and
    the control variate is exact (β = 1) for any probes; a shift of the wrong sign would put the
    downstream stages at ``2 twin − out``, off by twice the offset (the downstream stage squares its
    input: its Jacobian depends on the state), and s ≠ g."""
    box = Offset(0.3)
    g = torch.Generator().manual_seed(1)
    chain = ef.Chain(
        [
            ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name="digital0"),
            ef.stage(box.medium.torch, name="box", physical=True),
            ef.stage(lambda p, h: (h @ p["w"]) ** 2, name="square"),
        ],
        loss=F.mse_loss,
    )
    params = (
        {"w": torch.randn(D, D, generator=g, dtype=F64)},
        {"gain": torch.tensor(1.3, dtype=F64)},
        {"w": torch.randn(D, D, generator=g, dtype=F64)},
    )
    x, y = torch.randn(B, D, generator=g, dtype=F64), torch.randn(B, D, generator=g, dtype=F64)
    out = box.medium.torch(params[1], torch.tanh(x @ params[0]["w"]))
    assert 0.2 < (0.3 / out.abs().mean()).item() < 1.0  # the twin's values are well off
    exact = ef.sweep(
        ef.Chain([s if s.name != "box" else ef.stage(s.fn, name="box") for s in chain.stages], F.mse_loss), params, x, y
    )
    for make in (E.node_perturbation, E.direct):
        cv = E.control_variate(make(E.Probes(3, "rademacher")), box.twin, 1.0)
        res = ef.sweep(chain, params, x, y, estimator=cv, key=5)
        for got, want in zip(ef.tree_leaves(res.grads), ef.tree_leaves(exact.grads), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


# ---- shrinkage: s + λ (ĝ − s), never worse than the twin or the probes ----


def test_shrink_one_is_the_control_variate_and_zero_the_twin():
    chain, params, x, y, twin = mlp()
    zbp = E.zbp(E.Probes(4, "rademacher"))
    for beta in (1.0, "ema"):
        want = ef.sweep(chain, params, x, y, estimator=E.control_variate(zbp, twin, beta), physical=[2], key=3)
        got = ef.sweep(
            chain, params, x, y, estimator=E.control_variate(zbp, twin, beta, shrink=1.0), physical=[2], key=3
        )
        assert same_bits(want, got), beta
        assert float(got.stats[chain.names[2]]["shrink"]) == 1.0
    pat = ef.sweep(chain, params, x, y, estimator=E.twin(twin), physical=[2])
    zero = ef.sweep(chain, params, x, y, estimator=E.control_variate(zbp, twin, shrink=0.0), physical=[2], key=3)
    at = len(chain) - 2
    torch.testing.assert_close(zero.adjoints[at].value, pat.adjoints[at].value, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"shrink must be None, a number in \[0, 1\] or 'auto'"):
        E.control_variate(zbp, twin, shrink=1.5)
    with pytest.raises(ValueError, match=r"horizon= sets shrink='auto''s lambda"):
        E.control_variate(zbp, twin, horizon=10)


def test_auto_shrinkage_has_less_error_than_the_twin_the_control_variate_and_zbp():
    """One stage, d = 8, n = 2 gaussian probes, a twin off by r ≈ 0.5: λ* = n h / (n h + d + 1) is 2/11
    for one step and 20/29 over h = 10 steps. Its one-step error (1 − λ)² + λ² v (times ‖g − s‖²) is
    below PAT's (bias ‖g − s‖², 1 in those units), the control variate's (v = 4.5) and zbp's (4.5 ‖g‖²),
    and the mean of 10 estimates beats PAT's and the 10-step average of the control variate's by the
    formula's margins: 0.82 against 1 and 0.45. The stats state λ and the shares."""
    chain, params, x, y, twin = mlp()
    at = len(chain) - 2
    g = ef.sweep(chain, params, x, y).adjoints[at].value
    s = ef.sweep(chain, params, x, y, estimator=E.twin(twin), physical=[2]).adjoints[at].value
    e2 = ((g - s) ** 2).sum().item()
    zbp = E.zbp(E.Probes(2, "gaussian"))
    keys = 400

    def mse(estimator, average=1):
        samples = estimates(chain, params, x, y, estimator, keys)
        means = samples.reshape(keys // average, average, *samples.shape[1:]).mean(1)
        return ((means - g) ** 2).sum().item() / len(means)

    one = mse(E.control_variate(zbp, twin, shrink="auto"))
    assert 0.75 * e2 < one < 0.9 * e2  # formula: (9/11)² + (2/11)² 4.5 = 0.818
    assert one < 0.9 * min(e2, mse(E.control_variate(zbp, twin)), mse(zbp))  # PAT, cv (4.5 e2), zbp (4.5 g2)
    ten = mse(E.control_variate(zbp, twin, shrink="auto", horizon=10), average=10)
    assert 0.25 * e2 < ten < 0.38 * e2  # (9/29)² + (20/29)² 0.45 = 0.31
    assert ten < 0.8 * min(e2, mse(E.control_variate(zbp, twin), average=10))  # PAT 1, cv 0.45
    res = ef.sweep(chain, params, x, y, estimator=E.control_variate(zbp, twin, shrink="auto"), physical=[2])
    stats = res.stats[chain.names[2]]
    assert float(stats["shrink"]) == pytest.approx(2 / 11)
    assert float(stats["shrink_bias"]) == pytest.approx((9 / 11) ** 2 * float(stats["cv_residual"]) ** 2)
    assert float(stats["shrink_variance"]) == pytest.approx((2 / 11) ** 2 * 4.5 * float(stats["cv_residual"]) ** 2)


# ---- twin-guided probes: one probe along the twin's costate, the rest orthogonal ----


def test_guided_probes_are_unbiased_with_the_error_of_the_orthogonal_part():
    """Gaussian probes, exact directional derivatives, a twin off by r ≈ 0.5: every coordinate's mean
    within the z-bounds, and E‖ĝ − g‖² = d/(n−1) Σ_b ‖g_b − ŝ_b(ŝ_b·g_b)‖² within 10%, far below zbp's
    (d+1)/n ‖g‖². Weighing the orthogonal probes by 1/n (as zbp weighs its own) is biased, and fails."""
    chain, params, x, y, twin = mlp()
    at = len(chain) - 2
    g = ef.sweep(chain, params, x, y).adjoints[at].value
    s = ef.sweep(chain, params, x, y, estimator=E.twin(twin), physical=[2]).adjoints[at].value
    n, d = 4, g.shape[-1]
    hat = s / s.norm(dim=-1, keepdim=True)
    across = g - hat * (hat * g).sum(-1, keepdim=True)
    samples = estimates(chain, params, x, y, E.guided(E.zbp(E.Probes(n)), twin), KEYS)
    assert unbiased(z_scores(samples, g, samples.var(0)))
    mse = ((samples - g) ** 2).sum().item() / KEYS
    assert 0.85 < mse / (d / (n - 1) * (across * across).sum().item()) < 1.15
    assert mse < 0.5 * (d + 1) / n * (g * g).sum().item()
    along = hat * (hat * samples).sum(-1, keepdim=True)
    wrong = along + (samples - along) * (n - 1) / n
    assert not unbiased(z_scores(wrong, g, wrong.var(0)))


def joint_error(g: dict, s: dict) -> float:
    """``Σ_b ‖G_b − ŝ_b(ŝ_b·G_b)‖²``: the part of the exact costates ``G_b`` (a sample's, joint over
    the stages of ``g``) orthogonal to the twins' ``ŝ_b`` (joint too)."""
    big_g, big_s = torch.cat(list(g.values()), -1), torch.cat(list(s.values()), -1)
    hat = big_s / big_s.norm(dim=-1, keepdim=True)
    across = big_g - hat * (hat * big_g).sum(-1, keepdim=True)
    return (across * across).sum().item()


@pytest.mark.parametrize("make", [E.node_perturbation, E.direct])
def test_guided_np_and_direct_are_unbiased_with_the_error_of_the_orthogonal_part(make):
    """Gaussian probes, oracle scalars, physical stages 1 and 3 each with a twin off by r ≈ 0.5:
    every stage's estimate is unbiased, and the error is d/(n−1) ‖G − ŝ(ŝ·G)‖² summed over samples,
    where np's scalar (and so G, ŝ and d) is a sample's over both stages and direct's each stage's
    alone; within 15%, far below the unguided (d+1)/n ‖G‖². ŝ taken per stage for np (not jointly)
    misses the formula."""
    chain, params, x, y, twin = mlp()
    physical, n = [1, 3], 4
    twins = {chain.names[i]: twin for i in physical}
    exact, pat = (
        ef.sweep(chain, params, x, y),
        ef.sweep(chain, params, x, y, estimator=E.twin(twins), physical=physical),
    )
    g = {i: exact.adjoints[len(chain) - i].value for i in physical}
    s = {i: pat.adjoints[len(chain) - i].value for i in physical}
    est = E.guided(make(E.Probes(n)), twins)
    runs = [ef.sweep(chain, params, x, y, estimator=est, physical=physical, key=k) for k in range(KEYS)]
    samples = {i: torch.stack([r.adjoints[len(chain) - i].value for r in runs]) for i in physical}
    error = sum(((samples[i] - g[i]) ** 2).sum().item() for i in physical) / KEYS
    for i in physical:
        assert unbiased(z_scores(samples[i], g[i], samples[i].var(0)))
    groups = [physical] if make is E.node_perturbation else [[i] for i in physical]
    d = {tuple(group): sum(g[i].shape[-1] for i in group) for group in groups}
    theory = sum(d[tuple(group)] / (n - 1) * joint_error({i: g[i] for i in group}, {i: s[i] for i in group})
                 for group in groups)  # fmt: skip
    assert 0.85 < error / theory < 1.15
    assert error < 0.5 * sum((d[tuple(gr)] + 1) / n * sum((g[i] ** 2).sum().item() for i in gr) for gr in groups)
    if make is E.node_perturbation:
        apart = sum(g[i].shape[-1] / (n - 1) * joint_error({i: g[i]}, {i: s[i]}) for i in physical)
        assert not 0.85 < error / apart < 1.15


def test_guided_probes_are_unit_on_average_orthogonal_to_the_guide_and_chunk_invariant():
    """``probes.guide``: probe 0 is √n ŝ, the others have no ŝ component (jointly over the stages, per
    scalar), the same probes whatever the chunking, and (1/n) Σ ũ ũᵀ averages to I over draws (a
    weight of 1 on the orthogonal probes, as unguided probes weigh theirs, averages to n/(n−1) off ŝ)."""
    from eae_func.estimators.probes import guide

    g = torch.Generator().manual_seed(0)
    s = {0: torch.randn(3, 4, generator=g, dtype=F64), 1: torch.randn(3, 2, generator=g, dtype=F64)}
    s[0][1] = 0.0
    s[1][1] = 0.0  # a sample with no guide: its probes are all isotropic
    n = 5
    probes = E.Probes(n, chunk=2)
    total = torch.zeros(3, 6, 6, dtype=F64)
    draws = 4000
    for seed in range(draws):
        rows = []
        first = 0
        for u0, u1 in zip(probes.chunks(seed, (3,), 4, F64, "cpu"), probes.chunks(seed + draws, (3,), 2, F64, "cpu")):
            chunk = guide({0: u0, 1: u1}, s, first, n, 1)
            rows.append(torch.cat([chunk[0], chunk[1]], -1))
            first += len(u0)
        u = torch.cat(rows)  # (n, 3, 6)
        whole = guide(
            {0: torch.cat(list(probes.chunks(seed, (3,), 4, F64, "cpu"))),
             1: torch.cat(list(probes.chunks(seed + draws, (3,), 2, F64, "cpu")))},
            s, 0, n, 1,
        )  # fmt: skip
        assert torch.equal(u, torch.cat([whole[0], whole[1]], -1))
        total += torch.einsum("nbi,nbj->bij", u, u) / n
    joint = torch.cat([s[0], s[1]], -1)
    hat = joint / joint.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    torch.testing.assert_close(u[0], n**0.5 * hat)
    assert (u[1:] * hat).sum(-1).abs().max() < 1e-12
    mean = total / draws
    assert (mean - torch.eye(6, dtype=F64)).abs().max() < 0.1
    off = torch.eye(6, dtype=F64) - hat.unsqueeze(-1) * hat.unsqueeze(-2)
    too_heavy = hat.unsqueeze(-1) * hat.unsqueeze(-2) + off * n / (n - 1)
    assert (mean - too_heavy)[[0, 2]].abs().max() > 0.2


def linear_box(dim: int, off: float, seed: int):
    """A chain whose physical stage is linear in its parameters (h W, so central differences are
    exact), with a twin ((h A) W, A = I + off · noise) whose parameter gradient s_W is off; returns
    ``(chain, params, x, y, twin, g_W, s_W)``, the last two flat."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(dim, dtype=F64) + off * torch.randn(dim, dim, generator=g, dtype=F64)
    chain = ef.Chain(
        [
            ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name="digital0"),
            ef.stage(lambda p, h: h @ p["w"], name="box", physical=True),
            ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name="digital1"),
        ],
        loss=F.mse_loss,
    )
    params = tuple({"w": torch.randn(dim, dim, generator=g, dtype=F64)} for _ in range(3))
    x, y = torch.randn(B, dim, generator=g, dtype=F64), torch.randn(B, dim, generator=g, dtype=F64)

    def twin(p, h):
        return (h @ mix) @ p["w"]

    want = ef.sweep(chain, params, x, y, estimator=E.exact()).grads[1]["w"].flatten()
    s = ef.sweep(chain, params, x, y, estimator=E.twin(twin)).grads[1]["w"].flatten()
    return chain, params, x, y, twin, want, s


def test_guided_parameter_probes_are_unbiased_with_the_error_of_the_orthogonal_part():
    """fd probes a physical stage's parameters along directions shared by the batch; guided, one goes
    along the twin's parameter gradient s_W. With a stage linear in its parameters and a twin whose
    s_W is off, the parameter estimate is unbiased with error d/(n−1) ‖g_W − ŝ_W(ŝ_W·g_W)‖²
    (gaussian, d = 36), within 15%, far under fd's own (d+1)/n ‖g_W‖²; the control variate over it
    (exact twin directions) is the same estimate. Guiding by an unrelated direction would miss the
    formula."""
    chain, params, x, y, twin, want, s = linear_box(D, 0.3, 3)
    assert 0.2 < ((s - want).norm() / want.norm()).item() < 0.8
    n, d, keys = 4, D * D, 200
    guided = E.guided(E.zbp(E.Probes(n), method="fd", eps=1e-2), twin)
    runs = [ef.sweep(chain, params, x, y, estimator=guided, key=k) for k in range(keys)]
    samples = torch.stack([r.grads[1]["w"].flatten() for r in runs])
    assert unbiased(z_scores(samples, want, samples.var(0)))
    hat = s / s.norm()
    across = want - hat * (hat @ want)
    error = ((samples - want) ** 2).sum().item() / keys
    assert 0.85 < error / (d / (n - 1) * (across @ across).item()) < 1.15
    assert error < 0.25 * (d + 1) / n * (want @ want).item()
    cv = ef.sweep(chain, params, x, y, estimator=E.control_variate(guided, twin, 0.5), key=5)
    torch.testing.assert_close(cv.grads[1]["w"], runs[5].grads[1]["w"], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(
    "make", [lambda p: E.zbp(p, method="fd", eps=1e-2), lambda p: E.direct(p, form="fd", eps=1e-2)]
)
def test_guided_parameter_probes_with_history_are_unbiased_and_follow_the_last_estimates(make):
    """``history=k``: the parameter probes also go along the last k estimates, made orthogonal to
    s_W (Q: the m = 1 + k orthonormal guides). Given the guides the estimate is unbiased with error
    (d−m+1)/(n−m) ‖(I − QQᵀ) g_W‖² (within 15%); threaded by ``observe``, the span of the last
    estimates closes on g_W, so at fixed parameters the error falls far under the twin-guided one.
    ``observe`` keeps the newest first, at most k, from ``stats["param_estimate"]``."""
    chain, params, x, y, twin, want, s = linear_box(3, 1.0, 4)
    n, d, keys = 8, 9, 200
    guided = E.guided(make(E.Probes(n)), twin, history=1)
    first = ef.sweep(chain, params, x, y, estimator=guided, key=10_000)
    torch.testing.assert_close(first.stats["box"]["param_estimate"], first.grads[1]["w"].flatten())
    fixed = guided.observe(first)  # one earlier estimate guides every key below
    assert guided.past == {} and fixed.past["box"][0] is first.stats["box"]["param_estimate"]
    samples = torch.stack(
        [ef.sweep(chain, params, x, y, estimator=fixed, key=k).grads[1]["w"].flatten() for k in range(keys)]
    )
    assert unbiased(z_scores(samples, want, samples.var(0)))
    q = torch.linalg.qr(torch.stack([s, first.grads[1]["w"].flatten()], 1)).Q
    across = want - q @ (q.T @ want)
    error = ((samples - want) ** 2).sum().item() / keys
    assert 0.85 < error / ((d - 2 + 1) / (n - 2) * (across @ across).item()) < 1.15
    errors = {}
    for history in (0, 2):
        estimator, seen = E.guided(make(E.Probes(n)), twin, history=history), []
        for k in range(30):
            res = ef.sweep(chain, params, x, y, estimator=estimator, key=k)
            seen.append(((res.grads[1]["w"].flatten() - want) ** 2).sum().item())
            estimator = estimator.observe(res)
        assert len(estimator.past.get("box", ())) == history
        errors[history] = sum(seen[10:]) / 20
    assert errors[2] < 0.02 * errors[0], errors
    threaded = E.control_variate(E.guided(make(E.Probes(n)), twin, history=2), twin, shrink="auto")
    for k in range(3):
        res = ef.sweep(chain, params, x, y, estimator=threaded, key=k)
        threaded = threaded.observe(res)
        m = 1 + min(k, 2)  # the guides this sweep had: s_W and the estimates observed before it
        assert float(res.stats["box"]["param_shrink"]) == pytest.approx(1 / (1 + (d - m + 1) / (n - m)))
    assert len(threaded.guided.past["box"]) == 2 and threaded.estimator is threaded.guided


def test_guided_parameter_probes_by_the_mean_of_the_last_estimates():
    """``combine="mean"``: one guide after the twin's, the mean of the last k estimates; a sweep
    equals the span form given that mean as its one earlier estimate, bit for bit. Threaded at fixed
    parameters (d = 36, n = 8, where the span of single estimates is too noisy to pay), the mean of
    the last 16 brings the error far under the twin-guided one."""
    chain, params, x, y, twin, want, _ = linear_box(D, 1.0, 4)
    fd = E.zbp(E.Probes(8), method="fd", eps=1e-2)
    mean = E.guided(fd, twin, history=16, combine="mean")
    for k in range(3):
        mean = mean.observe(ef.sweep(chain, params, x, y, estimator=mean, key=k))
    average = torch.stack(mean.past["box"]).mean(0)
    one = E.guided(fd, twin, history=1).observe(types.SimpleNamespace(stats={"box": {"param_estimate": average}}))
    a, b = (ef.sweep(chain, params, x, y, estimator=e, key=9).grads[1]["w"] for e in (mean, one))
    assert torch.equal(a, b)
    errors = {}
    for history, combine in ((0, "span"), (16, "mean")):
        estimator, seen = E.guided(fd, twin, history=history, combine=combine), []
        for k in range(60):
            res = ef.sweep(chain, params, x, y, estimator=estimator, key=k)
            seen.append(((res.grads[1]["w"].flatten() - want) ** 2).sum().item())
            estimator = estimator.observe(res)
        errors[combine] = sum(seen[30:]) / 30
    assert errors["mean"] < 0.3 * errors["span"], errors


def test_guided_probes_along_several_guides_are_unit_on_average_and_chunk_invariant():
    """``guided_draw`` with earlier estimates: probes 0..m−1 are √n times an orthonormal basis of the
    guides (s first, then each estimate made orthogonal to those before), the others have no part
    in their span, chunking draws the same probes, and (1/n) Σ ũ ũᵀ averages to I (a guide probe
    left at guide's √(n−j) would not)."""
    from eae_func.estimators.guided import guided_draw

    g = torch.Generator().manual_seed(0)
    d, n, draws = 6, 5, 4000
    s = torch.randn(d, generator=g, dtype=F64)
    past = [torch.randn(d, generator=g, dtype=F64), torch.randn(d, generator=g, dtype=F64), 2 * s]
    whole, chunked = guided_draw(E.Probes(n), s, past), guided_draw(E.Probes(n, chunk=2), s, past)
    total = torch.zeros(d, d, dtype=F64)
    for seed in range(draws):
        u = torch.cat(list(chunked(seed, (), d, F64, "cpu")))
        assert torch.equal(u, torch.cat(list(whole(seed, (), d, F64, "cpu"))))
        total += u.T @ u / n
    q = torch.linalg.qr(torch.stack([s, past[0], past[1]], 1)).Q
    basis = u[:3] / n**0.5
    torch.testing.assert_close(basis @ basis.T, torch.eye(3, dtype=F64))
    torch.testing.assert_close(basis.T @ basis, q @ q.T)  # the same span
    assert u[3].abs().max() == 0  # 2 s adds no direction: its probe is zero
    assert (u[4:] @ q).abs().max() < 1e-12
    assert ((total / draws) - torch.eye(d, dtype=F64)).abs().max() < 0.1


@pytest.mark.parametrize("make", [E.zbp, E.node_perturbation, E.direct])
def test_the_control_variate_of_guided_probes_is_the_guided_estimate_and_shrinks_it(make):
    """With exact twin directional derivatives, ŝ·(g − βs) + ŝ·βs = ŝ·g and u⊥·s = 0: the control
    variate over guided probes is the guided estimate for any β (to rounding); ``shrink="auto"`` takes
    λ = h / (h + v) with v = d/(n−1), the guided probes' error factor (gaussian)."""
    chain, params, x, y, twin = mlp()
    n, d = 4, 8
    for form in ("oracle", "jvp") if make is not E.zbp else ("jvp",):
        guided = E.guided(make(E.Probes(n)) if make is E.zbp else make(E.Probes(n), form=form), twin)
        want = ef.sweep(chain, params, x, y, estimator=guided, physical=[2], key=7)
        for beta, directional in ((1.0, "exact"), (0.3, "exact"), (0.3, "fd")):  # "fd" under jvp: the twin's jvp
            cv = E.control_variate(guided, twin, beta, twin_directional=directional)
            got = ef.sweep(chain, params, x, y, estimator=cv, physical=[2], key=7)
            for a, b in zip(ef.tree_leaves(got.grads), ef.tree_leaves(want.grads), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    shrunk = ef.sweep(chain, params, x, y, estimator=E.control_variate(guided, twin, shrink="auto"), physical=[2])
    assert float(shrunk.stats[chain.names[2]]["shrink"]) == pytest.approx(1 / (1 + d / (n - 1)))


def test_guided_probes_cost_what_the_estimator_costs_and_refuse_what_they_cannot_guide():
    chain, params, x, y, twin = mlp()
    wrapped = [E.zbp(E.Probes(4), method=m) for m in ("jvp", "fd")]
    wrapped += [make(E.Probes(4), form=f) for make in (E.node_perturbation, E.direct) for f in ("oracle", "jvp", "fd")]
    for estimator in wrapped:
        plain = ef.sweep(chain, params, x, y, estimator=estimator, physical=[2], key=1)
        res = ef.sweep(chain, params, x, y, estimator=E.guided(estimator, twin), physical=[2], key=1)
        for counter in COUNTERS:
            assert res.stats[chain.names[2]].get(counter) == plain.stats[chain.names[2]].get(counter), (
                estimator,
                counter,
            )
        guided_params = isinstance(estimator, ModelLevel) and estimator.fd  # and its vjp for the parameters
        assert res.stats[chain.names[2]]["twin_calls"] == 1 + guided_params
        probes = estimator.probes
        one_by_one = copy.copy(estimator)
        one_by_one.probes = E.Probes(probes.n, probes.kind, 1, probes.batch_dims)
        chunked = ef.sweep(chain, params, x, y, estimator=E.guided(one_by_one, twin), physical=[2], key=1)
        for a, b in zip(ef.tree_leaves(chunked.grads), ef.tree_leaves(res.grads), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)  # the same probes, a chunk at a time
    other = ef.sweep(chain, params, x, y, estimator=E.control_variate(E.guided(wrapped[0], twin), lambda p, h: twin(p, h)),
                     physical=[2], key=1)  # fmt: skip
    assert other.stats[chain.names[2]]["twin_calls"] == 2  # a guide of its own: one more twin vjp
    other = E.control_variate(E.guided(E.direct(E.Probes(4)), twin), lambda p, h: twin(p, h))
    res = ef.sweep(chain, params, x, y, estimator=other, physical=[2], key=1)
    assert res.stats[chain.names[2]]["twin_calls"] == 2  # and at the model level one more twin sweep
    for probes in (E.Probes(1), E.Probes(4, "orthogonal"), E.Probes(4, "sphere"), E.Probes(4, antithetic=True)):
        with pytest.raises(ValueError, match=r"guided: needs n >= 2 independent gaussian or rademacher probes"):
            E.guided(E.zbp(probes), twin)
    for bad in (E.twin(twin), E.guided(E.zbp(E.Probes(4)), twin), E.control_variate(E.zbp(E.Probes(4)), twin)):
        with pytest.raises(TypeError, match=r"guided: wraps E.zbp\(...\), E.node_perturbation\(...\) or E.direct"):
            E.guided(bad, twin)
    with pytest.raises(ValueError, match=r"beta='xfit' needs halves of probes of one law"):
        E.control_variate(E.guided(E.zbp(E.Probes(4)), twin), twin, "xfit")
    with pytest.raises(ValueError, match=r"history=1 guides the probed parameter directions, which only fd probes"):
        E.guided(E.zbp(E.Probes(4)), twin, history=1)
    with pytest.raises(ValueError, match=r"history=3, combine='span' takes 4 of the n probes .* needs n >= 5"):
        E.guided(E.zbp(E.Probes(4), method="fd"), twin, history=3)
    with pytest.raises(ValueError, match=r"history=8, combine='mean' takes 2 of the n probes .* needs n >= 3"):
        E.guided(E.zbp(E.Probes(2), method="fd"), twin, history=8, combine="mean")
    E.guided(E.zbp(E.Probes(3), method="fd"), twin, history=8, combine="mean")
    with pytest.raises(ValueError, match=r"guided: combine is 'span' or 'mean'"):
        E.guided(E.zbp(E.Probes(4), method="fd"), twin, history=2, combine="sum")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"guided: history is how many earlier estimates guide"):
            E.guided(E.zbp(E.Probes(4), method="fd"), twin, history=bad)
