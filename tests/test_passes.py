"""Properties of the built-in passes and combinators (eae_func.passes)."""

import logging
import math
import operator

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import eae_func as ef
from eae_func import passes as P
from eae_func.adjoint import NAMESPACE, AdjointState
from eae_func.lazy import Lazy

from helpers import build, mse

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


# ----------------------------------------------------------------------------- strategies


def _randn(shape, magnitude, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * magnitude


shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)
magnitudes = st.floats(-3, 3).map(lambda e: 10.0**e)
seeds = st.integers(0, 2**31 - 1)
tensors = st.builds(_randn, shapes, magnitudes, seeds)


@st.composite
def costates(draw):
    """A tensor, a tuple with a ``None`` leaf (an integer input), or a nested dict."""
    a, b = draw(tensors), draw(tensors)
    return draw(st.sampled_from([a, (a, None), {"h": a, "aux": (b, None)}]))


def record(value, index=2, key=0):
    return AdjointState(value, index, f"stage_{index}", key=key)


def context(adj):
    """A pass context whose boundary state mirrors the costate (integer tokens where it has none),
    drawn from the record's key."""
    g = torch.Generator().manual_seed(adj.key)
    boundary = optree.tree_map(lambda t: torch.randn(t.shape, generator=g), adj.value, namespace=NAMESPACE)
    return P.Context(boundary=_fill_none(adj.value, boundary))


def _fill_none(value, boundary):
    flat, spec = optree.tree_flatten(boundary, none_is_leaf=True, namespace=NAMESPACE)
    return spec.unflatten([torch.zeros(3, dtype=torch.long) if t is None else t for t in flat])


def leaves(tree):
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def norm(tree):
    return math.sqrt(sum(t.double().square().sum().item() for t in leaves(tree)))


def run(p, adj, state=None, ctx=None):
    """One application of a pass (or plain callable); returns (record, state)."""
    return P.compose(p).apply(adj, state, context(adj) if ctx is None else ctx)


def apply1(p, adj):
    """The record after one application of ``p`` from its initial state."""
    return run(p, adj)[0]


def counter():
    """A stateful pass that counts visits per boundary and records the count."""

    def update(adj, state, ctx):
        count = state.get(adj.index, 0) + 1
        return adj.applied("counter", adj.value, count=count), {**state, adj.index: count}

    return P.Pass(dict, update, "counter")


def all_passes():
    return {
        "clip": P.clip_by_global_norm(0.5),
        "clip_by_value": P.clip_by_value(0.5),
        "scale": P.scale(-2.0),
        "gaussian_noise": P.gaussian_noise(0.1),
        "cast16": P.cast(torch.float16),
        "castbf16": P.cast(torch.bfloat16),
        "fp8_e4m3": P.fp8(),
        "fp8_e5m2": P.fp8(torch.float8_e5m2),
        "int8": P.int8(),
        "int8_channel": P.int8("channel"),
        "int8_stochastic": P.int8(stochastic=True),
        "topk": P.topk(0.3),
        "randk": P.randk(0.3),
        "check_finite": P.check_finite("zero"),
        "stats": P.stats(),
        "log": P.log(),
        "error_feedback": P.error_feedback(P.topk(0.3)),
        "synthetic": P.synthetic(warmup=0, replace=True),
        "when": P.when(lambda a: a.index > 0, P.int8()),
        "only": P.only(P.clip_by_global_norm(0.1), indices=2),
        "tap": P.tap(lambda a: None),
    }


# ----------------------------------------------------------------------------- clip, scale, noise


@given(value=costates(), max_norm=st.floats(1e-2, 1e2))
def test_clip_bounds_the_global_norm_and_is_identity_below_it(value, max_norm):
    out = apply1(P.clip_by_global_norm(max_norm), record(value))
    before = norm(value)
    assert out.meta["clip_norm"] == pytest.approx(before, rel=1e-5)
    if before <= max_norm * (1 - 1e-5):
        assert all(torch.equal(a, b) for a, b in zip(leaves(out.value), leaves(value)))  # bit for bit
        assert bool(out.meta["clipped"]) is False
    else:
        assert norm(out.value) <= max_norm * (1 + 1e-5)  # float32 rounding of the scale
    if before > max_norm * (1 + 1e-5):
        assert bool(out.meta["clipped"]) is True
        assert norm(out.value) == pytest.approx(max_norm, rel=1e-4)


@given(value=costates(), factor=st.floats(-10, 10))
def test_scale_multiplies_every_leaf(value, factor):
    out = apply1(P.scale(factor), record(value))
    for a, b in zip(leaves(out.value), leaves(value)):
        torch.testing.assert_close(a, b * factor)


@given(value=costates(), key=seeds)
def test_gaussian_noise_same_key_same_noise(value, key):
    noise = P.gaussian_noise(0.5)
    a, b, c = (
        apply1(noise, record(value, key=key)),
        apply1(noise, record(value, key=key)),
        apply1(noise, record(value, key=key + 1)),
    )
    assert all(torch.equal(u, v) for u, v in zip(leaves(a.value), leaves(b.value)))
    assert not all(torch.equal(u, v) for u, v in zip(leaves(a.value), leaves(c.value)))


def test_two_random_passes_at_one_boundary_draw_independent_noise():
    zero = record(torch.zeros(1000))
    once = apply1(P.gaussian_noise(1.0), zero).value
    twice = apply1(ef.compose(P.gaussian_noise(1.0), P.gaussian_noise(1.0)), zero).value
    # same draws would give twice == 2 * once; independent ones have variance 2, correlation 1/sqrt(2)
    assert not torch.allclose(twice, 2 * once)
    assert twice.var().item() == pytest.approx(2.0, rel=0.2)


# ----------------------------------------------------------------------------- precision


@given(value=tensors, per=st.sampled_from(["tensor", "channel"]))
def test_int8_round_trip_error_at_most_half_a_step(value, per):
    out = apply1(P.int8(per), record(value))
    dims = tuple(range(value.ndim - 1)) if per == "channel" else tuple(range(value.ndim))
    step = value.abs().amax(dim=dims, keepdim=True) / 127 if dims or per == "tensor" else value.abs() / 127
    assert ((out.value - value).abs() <= step * (0.5 + 1e-4)).all()
    assert out.meta["int8_scale"] == pytest.approx(step.max().item(), rel=1e-6)
    levels = out.value / torch.where(step > 0, step, 1)  # integers in [-127, 127]
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-3)


def test_int8_per_channel_scales_each_index_of_the_last_dim():
    value = torch.tensor([[1.0, 100.0, 0.0], [-0.5, 3.0, 0.0]])
    out = apply1(P.int8("channel"), record(value)).value
    # channel 0 has its own step 1/127, so -0.5 survives to within half a step; one step
    # of 100/127 for the whole tensor rounds it to -100/127
    assert abs(out[1, 0].item() + 0.5) <= 0.5 / 127 * (1 + 1e-5)
    assert apply1(P.int8("tensor"), record(value)).value[1, 0].item() == pytest.approx(-100 / 127)
    assert torch.equal(out[:, 2], torch.zeros(2))


@pytest.mark.parametrize(
    "p",
    [P.int8(), P.int8("channel"), P.int8(stochastic=True), P.fp8(), P.fp8(torch.float8_e5m2), P.cast(torch.float16)],
)
def test_quantisers_leave_zero_costates_zero(p):
    out = apply1(p, record(torch.zeros(4, 5)))
    assert torch.equal(out.value, torch.zeros(4, 5))


@given(
    value=tensors,
    magnitude=st.floats(-3, 6).map(lambda e: 10.0**e),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
)
def test_cast_round_trip_is_idempotent(value, magnitude, dtype):
    p = P.cast(dtype)
    once = apply1(p, record(value * magnitude))
    twice = apply1(p, once)
    assert torch.equal(once.value, twice.value)
    assert once.value.dtype == value.dtype
    assert once.meta["cast_overflow"] == int((torch.isinf(once.value)).sum())


@given(value=tensors, dtype=st.sampled_from(FP8))
def test_fp8_round_trip_is_idempotent(value, dtype):
    once = apply1(P.fp8(dtype), record(value))
    twice = apply1(P.fp8(dtype), once)
    torch.testing.assert_close(twice.value, once.value, rtol=1e-6, atol=0)


@given(value=tensors, dtype=st.sampled_from(FP8))
def test_fp8_is_a_real_float8_format(value, dtype):
    """Entries in float8's normal range keep relative error <= eps/2 (2^-4 for e4m3fn, 2^-3 for
    e5m2): small entries survive next to large ones, which an int8 grid would round to zero."""
    finfo = torch.finfo(dtype)
    out = apply1(P.fp8(dtype), record(value)).value
    scale = value.abs().max() / finfo.max
    normal = value.abs() >= finfo.tiny * scale * (1 + 1e-6)
    error = (out - value).abs()
    assert (error[normal] <= value.abs()[normal] * (finfo.eps / 2) * (1 + 1e-5)).all()
    spread = torch.tensor([1.0, 1e-3, -3e-4])
    assert (apply1(P.fp8(dtype), record(spread)).value != 0).all()


# ----------------------------------------------------------------------------- unbiased randomness


def _mean_over_keys(p, value, n_keys):
    return torch.stack([apply1(p, record(value, key=k)).value for k in range(n_keys)]).mean(0)


@pytest.mark.parametrize("seed", [0, 1])
def test_int8_stochastic_rounding_is_unbiased(seed):
    """One draw errs by less than one step s, variance <= s^2 / 4; the mean of K draws is within
    6 standard errors s / (2 sqrt K) of p (deterministic rounding misses by up to s / 2 = 20 se)."""
    value, n_keys = _randn((8, 8), 1.0, seed), 400
    step = value.abs().max() / 127
    mean = _mean_over_keys(P.int8(stochastic=True), value, n_keys)
    assert ((mean - value).abs() <= 6 * step / (2 * math.sqrt(n_keys)) + 1e-6).all()
    assert not torch.equal(
        apply1(P.int8(stochastic=True), record(value, key=0)).value, apply1(P.int8(), record(value)).value
    )


def test_int8_stochastic_rounding_stays_on_the_grid_at_its_largest_entry():
    """In float32, 119/997 over its own step max|t| / 127 is 127 and an ulp: a uniform draw above
    1 - 1.5e-5 floors it to 128, which int8 cannot hold (it would wrap to -128, a sign flip). The
    levels are clamped to [-127, 127], so every entry stays within one step; key 121 draws one."""
    value = torch.full((1000,), 119 / 997.0)
    step = value.abs().max() / 127
    assert (value / step).max().item() > 127
    out = apply1(P.int8(stochastic=True), record(value, key=121)).value
    assert ((out - value).abs() <= step * (1 + 1e-5)).all()


@pytest.mark.parametrize("seed,ratio", [(0, 0.25), (1, 0.5)])
def test_randk_is_unbiased(seed, ratio):
    """sent_i = p_i n/k with probability k/n: variance p_i^2 (n/k - 1), so the mean of K draws is
    within 6 standard errors |p_i| sqrt((n/k - 1) / K) of p_i."""
    value, n_keys = _randn((64,), 1.0, seed), 2000
    k = math.ceil(ratio * value.numel())
    one = apply1(P.randk(ratio), record(value))
    assert int((one.value != 0).sum()) == k and one.meta["randk_kept"] == k / value.numel()
    mean = _mean_over_keys(P.randk(ratio), value, n_keys)
    se = value.abs() * math.sqrt((value.numel() / k - 1) / n_keys)
    assert ((mean - value).abs() <= 6 * se + 1e-6).all()


@pytest.mark.parametrize("n, ratio", [(10, 0.25), (7, 0.5), (64, 0.3), (3, 0.9)])
def test_randk_scales_what_it_keeps_by_n_over_k(n, ratio):
    """Each kept entry is ``p_i n / k`` with ``k = ceil(ratio n)``: sizes where ``n / k`` is not
    ``1 / ratio`` (the scale that would be biased there)."""
    value = _randn((n,), 1.0, n)
    k = math.ceil(ratio * n)
    assert n / k != pytest.approx(1 / ratio)
    out = apply1(P.randk(ratio), record(value))
    kept = out.value != 0
    assert int(kept.sum()) == k
    torch.testing.assert_close(out.value[kept], value[kept] * (n / k), rtol=1e-6, atol=0)


@given(value=tensors, ratio=st.floats(0.01, 1.0))
def test_topk_keeps_the_largest_entries(value, ratio):
    out = apply1(P.topk(ratio), record(value))
    k = math.ceil(ratio * value.numel() - 1e-9)
    kept = out.value != 0
    assert int(kept.sum()) <= k and torch.equal(out.value[kept], value[kept])
    if k < value.numel():
        assert value.abs()[kept].min() >= value.abs()[~kept].max()
    assert out.meta["topk_energy"] == pytest.approx(
        out.value.square().sum().item() / value.square().sum().item(), rel=1e-4
    )


# ----------------------------------------------------------------------------- guards


def test_check_finite_policies():
    value = (torch.tensor([1.0, float("nan")]), None, torch.tensor([float("inf")]))
    adj = AdjointState(value, 3, "mlp_2")
    with pytest.raises(FloatingPointError, match=r"boundary 3 \(output of stage 'mlp_2'\).*2 of 3"):
        apply1(P.check_finite("raise"), adj)
    zeroed = apply1(P.check_finite("zero"), adj)
    assert bool(zeroed.meta["finite"]) is False and all((t == 0).all() for t in leaves(zeroed.value))
    assert zeroed.value[1] is None
    skipped = apply1(P.check_finite("skip"), adj)
    assert skipped.value is value and skipped.meta == {"finite": False, "nonfinite": 2}
    fine = apply1(P.check_finite("raise"), AdjointState(torch.ones(2), 0, "input"))
    assert bool(fine.meta["finite"]) is True


def test_check_finite_inside_a_sweep_names_the_stage():
    model, x, target = build("mlp", 3, torch.float32, 0)
    chain, params = ef.from_module(model, loss=mse)
    nan_at_2 = P.only(lambda a: a.applied("poison", a.value * float("nan")), indices=2)
    with pytest.raises(FloatingPointError, match=r"boundary 2 \(output of stage 'Sequential_1'\)"):
        ef.sweep(chain, params, x, target, passes=ef.compose(nan_at_2, P.check_finite()))


# ----------------------------------------------------------------------------- error feedback


@given(seed=seeds, ratio=st.floats(0.05, 0.9), steps=st.integers(1, 30))
def test_error_feedback_residual_bounded_and_sums_track(seed, ratio, steps):
    """With e = p + r, sent = topk(e), r' = e - sent: sum sent = sum p - r_T exactly, and
    |r'| <= q |e| with q = sqrt(1 - k/n), so |r_t| <= q / (1 - q) max |p|."""
    g = torch.Generator().manual_seed(seed)
    ef_topk = P.error_feedback(P.topk(ratio))
    state = ef_topk.init()
    true_sum, sent_sum, largest = torch.zeros(4, 5), torch.zeros(4, 5), 0.0
    n, k = 20, math.ceil(ratio * 20 - 1e-9)
    q = math.sqrt(1 - k / n)
    for _ in range(steps):
        p = torch.randn(4, 5, generator=g)
        largest = max(largest, norm(p))
        out, state = run(ef_topk, record(p, index=1), state)
        true_sum, sent_sum = true_sum + p, sent_sum + out.value
        residual = state["residuals"][1]
        assert norm(residual) <= q / (1 - q) * largest * (1 + 1e-5) + 1e-6
        assert out.meta["ef_residual_norm"] == pytest.approx(norm(residual), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(sent_sum, true_sum - state["residuals"][1], rtol=1e-5, atol=1e-5)
    assert out.history == ("topk", "error_feedback")


def test_error_feedback_keeps_one_residual_per_boundary():
    ef_int8 = P.error_feedback(P.int8())
    state = ef_int8.init()
    _, state = run(ef_int8, record(torch.randn(3, 4), index=1), state)
    _, state = run(ef_int8, record((torch.randn(2), None), index=0), state)
    assert set(state["residuals"]) == {0, 1} and state["residuals"][0][1] is None
    with pytest.raises(ValueError, match="error_feedback: residual kept for boundary 1"):
        run(ef_int8, record(torch.randn(5, 4), index=1), state)


def test_error_feedback_threads_the_state_of_its_compressor():
    """The compressor may be any pass: its state is threaded inside error feedback's."""
    fb = P.error_feedback(counter())
    state = fb.init()
    for n in (1, 2):
        out, state = run(fb, record(torch.randn(3), index=1), state)
        assert out.meta["count"] == n and state["compressor"] == {1: n}


# ----------------------------------------------------------------------------- synthetic gradients


def test_synthetic_learns_a_linear_costate_and_replaces_after_warmup():
    """p = [x / rms(x), 1] A is realisable by the linear predictor: its error falls to ~0."""
    g = torch.Generator().manual_seed(0)
    A = torch.randn(5, 3, generator=g)
    p_syn = P.synthetic(lr=0.5, momentum=0.9, warmup=150, replace=True)
    state, errors = p_syn.init(), []
    for step in range(200):
        x = torch.randn(16, 4, generator=g) * 10
        rows = x / x.square().mean(-1, keepdim=True).sqrt()
        p = torch.cat([rows, torch.ones(16, 1)], -1) @ A * 1e-4  # tiny costates: the step is scale-free
        adj = AdjointState(p, 1, "block_0")
        out, state = p_syn.update(adj, state, P.Context(boundary=x))
        errors.append(out.meta["synthetic_error"])
        assert out.meta["synthetic_used"] is (step >= 150)
        assert (out.value is p) is (step < 150)
    assert errors[0] == 1.0 and errors[-1] < 1e-3
    torch.testing.assert_close(out.value, p, rtol=0.05, atol=1e-5 * p.abs().max().item())
    assert state[1]["step"] == 200


def test_synthetic_needs_the_boundary_state():
    with pytest.raises(ValueError, match="synthetic: boundary 4 has no boundary state"):
        P.synthetic().update(AdjointState(torch.ones(2, 3), 4, "s"), {}, P.Context())


# ----------------------------------------------------------------------------- observation


@given(value=costates())
def test_stats_records_summary_of_all_leaves(value):
    out = apply1(P.stats(), record(value))
    flat = torch.cat([t.reshape(-1) for t in leaves(value)])
    assert out.meta["numel"] == flat.numel()
    assert out.meta["norm"] == pytest.approx(flat.norm().item(), rel=1e-5)
    assert out.meta["mean"] == pytest.approx(flat.mean().item(), rel=1e-4, abs=1e-6 * flat.abs().max().item())
    assert out.meta["min"] == flat.min().item() and out.meta["max"] == flat.max().item()
    assert bool(out.meta["has_nan"]) is False and bool(out.meta["has_inf"]) is False
    assert out.value is value and out.history == ("stats",)


def test_log_emits_structured_records(caplog):
    logger = logging.getLogger("test_passes.log")
    adj = AdjointState(torch.tensor([3.0, 4.0]), 2, "mlp_1")
    with caplog.at_level(logging.INFO, logger="test_passes.log"):
        out = apply1(P.log(logger), adj)
        apply1(P.log(logger, level="DEBUG"), adj)  # below the level: nothing emitted
    (rec,) = caplog.records
    assert rec.eae["index"] == 2 and rec.eae["stage"] == "mlp_1" and rec.eae["norm"] == pytest.approx(5.0)
    assert "boundary 2" in rec.getMessage() and out.value is adj.value and out.history == ("log",)


# ----------------------------------------------------------------------------- combinators


def test_when_only_tap():
    seen = []
    a1, a2 = AdjointState(torch.ones(3), 1, "mlp_0"), AdjointState(torch.ones(3), 2, "mlp_1")
    double = P.scale(2.0)
    assert torch.equal(apply1(P.only(double, stages="mlp_1"), a2).value, 2 * torch.ones(3))
    assert apply1(P.only(double, stages=["mlp_1"]), a1) is a1
    assert apply1(P.only(double, indices=1), a2) is a2 and apply1(P.only(double, indices={1}), a1).history == ("scale",)
    assert apply1(P.tap(seen.append), a1) is a1 and seen == [a1]
    count = P.when(lambda a: a.index == 2, counter())
    state = count.init()
    out, new_state = count.update(a1, state, P.Context())
    assert out is a1 and new_state is state  # skipped: record and state pass through
    out, new_state = count.update(a2, state, P.Context())
    assert out.meta["count"] == 1 and new_state == {2: 1}


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: P.clip_by_global_norm(-1), r"clip_by_global_norm: max_norm must be a finite number and > 0, got -1"),
        (lambda: P.clip_by_global_norm(float("inf")), "clip_by_global_norm: max_norm"),
        (lambda: P.clip_by_value(0), "clip_by_value: limit must be"),
        (lambda: P.scale(True), "scale: factor"),
        (lambda: P.gaussian_noise(-0.1), "gaussian_noise: std must be"),
        (lambda: P.int8(per="row"), r"int8: per must be 'tensor' or 'channel', got 'row'"),
        (lambda: P.cast(torch.int8), "cast: dtype must be torch.float16 or torch.bfloat16"),
        (lambda: P.fp8(torch.float16), "fp8: dtype must be torch.float8_e4m3fn or torch.float8_e5m2"),
        (lambda: P.topk(0), r"topk: ratio must be a finite number and > 0 and <= 1, got 0"),
        (lambda: P.randk(1.5), "randk: ratio"),
        (lambda: P.check_finite("warn"), "check_finite: policy must be one of"),
        (lambda: P.synthetic(momentum=1.0), r"synthetic: momentum must be in \[0, 1\)"),
        (lambda: P.synthetic(warmup=-1), "synthetic: warmup"),
        (lambda: P.only(P.clip_by_global_norm(1)), "only: give the stages"),
        (lambda: P.log(level="LOUD"), "log: unknown level"),
    ],
)
def test_bad_arguments_name_the_pass(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: P.error_feedback(3), "error_feedback: expected a pass"),
        (lambda: P.compose(P.int8(), "clip"), "compose: expected a pass"),
        (lambda: P.int8(stochastic=1), "int8: stochastic must be a bool"),
        (lambda: P.only(P.clip_by_global_norm(1), indices="1"), "only: indices must be ints"),
        (lambda: P.tap(3), "tap: expected a callable"),
        (lambda: P.when(True, P.clip_by_global_norm(1)), "when: predicate must be callable"),
    ],
)
def test_bad_argument_types_name_the_pass(make, match):
    with pytest.raises(TypeError, match=match):
        make()


POOL = sorted(all_passes()) + ["counter"]


def _make(name):
    return counter() if name == "counter" else all_passes()[name]


def _thread(p, records, steps=2):
    state, outs = p.init(), []
    for _ in range(steps):
        for adj in records:
            out, state = p.update(adj, state, context(adj))
            outs.append(out)
    return outs, state


@given(names=st.lists(st.sampled_from(POOL), min_size=3, max_size=3), value=costates())
def test_compose_is_associative_for_both_kinds(names, value):
    a, b, c = (_make(n) for n in names)
    records = [record(value, index=2, key=5), record(value, index=1, key=6)]
    left, s_left = _thread(ef.compose(ef.compose(a, b), c), records)
    right, s_right = _thread(ef.compose(a, ef.compose(b, c)), records)
    flat, s_flat = _thread(ef.compose(a, P.identity(), b, c), records)
    for outs in (right, flat):
        for x, y in zip(left, outs):
            assert x.history == y.history and dict(x.meta).keys() == dict(y.meta).keys()
            assert all(torch.equal(u, v) for u, v in zip(leaves(x.value), leaves(y.value)))
    assert optree.tree_structure(s_left, namespace=NAMESPACE) == optree.tree_structure(s_right, namespace=NAMESPACE)
    assert all(torch.equal(u, v) if torch.is_tensor(u) else u == v for u, v in zip(leaves(s_left), leaves(s_right)))


# ----------------------------------------------------------------------------- init(example)


def _threaded(p, records, state, steps):
    outs = []
    for _ in range(steps):
        for adj in records:
            out, state = p.update(adj, state, context(adj))
            outs.append(out)
    return outs, state


def _shapes(tree):
    """A state's structure with each tensor leaf as its shape and dtype and every other leaf as its type."""
    return optree.tree_map(
        lambda x: (tuple(x.shape), x.dtype) if torch.is_tensor(x) else type(x),
        tree,
        none_is_leaf=True,
        namespace=NAMESPACE,
    )


@pytest.mark.parametrize("name", sorted(all_passes()))
@given(value=costates(), steps=st.integers(1, 3))
def test_a_state_started_from_the_example_keeps_its_shape_and_changes_no_costate(name, value, steps):
    """``start(example)`` makes every boundary's state at once: threading the records from it sends
    the costates threading from ``start()`` sends (equal, as ``torch.equal`` reads a signed zero),
    and the state has ``start(example)``'s structure, shapes and dtypes after every sweep."""
    p = _make(name)
    records = [record(value, index=i, key=10 + i) for i in (2, 1, 0)]
    started = p.start(P.examples((adj.index, adj.stage, adj.value) for adj in records))
    lazy, lazy_state = _threaded(p, records, p.start(), steps)
    eager, eager_state = _threaded(p, records, started, steps)
    for x, y in zip(lazy, eager):
        assert x.history == y.history
        assert all(torch.equal(u, v) for u, v in zip(leaves(x.value), leaves(y.value)))
    assert _shapes(eager_state) == _shapes(started) == _shapes(lazy_state)


def test_the_example_holds_each_boundarys_structure_and_nothing_to_read():
    """``examples``: per boundary a record of its index and stage whose costate leaves have the
    shape, dtype and device of the given tree's and one element of storage; an integer leaf (no
    costate) is ``None``."""
    like = {"h": torch.randn(4, 3, dtype=torch.float64), "ids": torch.zeros(4, dtype=torch.long)}
    (adj,) = P.examples([(2, "block", like)])
    assert (adj.index, adj.stage, adj.value["ids"]) == (2, "block", None)
    h = adj.value["h"]
    assert (h.shape, h.dtype, h.device) == (like["h"].shape, torch.float64, like["h"].device)
    assert h.untyped_storage().nbytes() == h.element_size()


def test_start_calls_an_init_that_takes_no_example_without_one_and_only_restricts_the_example():
    """A pass written before ``example`` (``init()``, or a builtin such as ``dict``) starts as it did;
    ``only`` starts its pass on the boundaries it applies at."""
    example = P.examples((i, f"stage_{i}", torch.randn(2, 3)) for i in (2, 1, 0))
    assert counter().start(example) == {}
    assert P.Pass(lambda: 7, lambda adj, state, ctx: (adj, state)).start(example) == 7
    seen = []
    P.Pass(lambda ex: seen.extend(ex), lambda adj, state, ctx: (adj, state)).start(example)
    assert [adj.index for adj in seen] == [2, 1, 0]
    restricted = P.only(P.error_feedback(P.int8()), indices=1).start(example)
    assert set(restricted["residuals"]) == {1} and torch.equal(restricted["residuals"][1], torch.zeros(2, 3))
    composed = P.compose(P.synthetic(), P.int8(), P.error_feedback(P.int8())).start(example)
    assert set(composed[0]) == {0, 1, 2} and composed[1] is None and set(composed[2]["residuals"]) == {0, 1, 2}


# ----------------------------------------------------------------------------- purity and pytrees


def _snapshot(tree):
    return [(t, t._version, t.clone()) for t in leaves(tree) if torch.is_tensor(t)]


def _untouched(snapshot):
    return all(t._version == v and torch.equal(t, c) for t, v, c in snapshot)


@pytest.mark.parametrize("name", sorted(all_passes()))
@given(value=costates())
def test_passes_leave_input_record_and_state_untouched_and_keep_structure(name, value):
    p = all_passes()[name]
    adj = record(value, key=3)
    _, state = run(p, record(optree.tree_map(torch.randn_like, value, namespace=NAMESPACE), key=4))
    ctx = context(adj)
    before = (_snapshot(adj.value), _snapshot(ctx.boundary), _snapshot(state), adj.history, dict(adj.meta))
    out, _ = run(p, adj, state, ctx)
    assert _untouched(before[0]) and _untouched(before[1]) and _untouched(before[2])
    assert (adj.history, dict(adj.meta)) == before[3:]
    assert optree.tree_structure(out.value, none_is_leaf=True, namespace=NAMESPACE) == optree.tree_structure(
        value, none_is_leaf=True, namespace=NAMESPACE
    )
    for o, v in zip(leaves(out.value), leaves(value)):
        assert o.shape == v.shape and o.dtype == v.dtype
    # plain values, or device values read when used (no host sync in the sweep)
    assert all(isinstance(m.value if isinstance(m, Lazy) else m, (bool, int, float, str)) for m in out.meta.values())


@pytest.mark.parametrize("make", [P.int8, lambda: P.cast(torch.bfloat16), P.fp8, lambda: P.topk(0.5)])
@given(value=costates())
def test_leafwise_passes_act_on_each_leaf_alone(make, value):
    out = apply1(make(), record(value))
    for o, v in zip(leaves(out.value), leaves(value)):
        assert torch.equal(o, apply1(make(), record(v)).value)


# ----------------------------------------------------------------------------- end to end


def test_sweep_threads_the_state_of_a_stateful_composite_and_fills_stats():
    model, x, target = build("mlp", 3, torch.float32, 0)
    chain, params = ef.from_module(model, loss=mse)
    pipeline = ef.compose(P.check_finite(), P.error_feedback(P.topk(0.25)), P.synthetic(warmup=1), P.stats())
    true_pL = ef.sweep(chain, params, x, target).adjoints[0].value
    state, sent = None, []
    for step in range(3):
        res = ef.sweep(chain, params, x, target, passes=pipeline, pass_state=state, key=step)
        state = res.pass_state
        sent.append(res.adjoints[0].value)
        assert isinstance(state, tuple) and len(state) == 4  # one entry per member
        assert state[0] is None and state[3] is None  # the stateless members'
        residuals, predictors = state[1]["residuals"], state[2]
        assert set(residuals) == set(predictors) == {0, 1, 2, 3}
        assert all(entry["step"] == step + 1 for entry in predictors.values())
        for adj in res.adjoints:
            recorded = res.stats["boundaries"][adj.index]
            assert adj.history == ("check_finite", "topk", "error_feedback", "synthetic", "stats")
            assert recorded["norm"] == pytest.approx(norm(adj.value), rel=1e-5)
            assert {"finite", "topk_kept", "ef_residual_norm", "synthetic_error", "numel"} <= recorded.keys()
    # p_L does not depend on the passes: the costates sent at L sum to 3 p_L minus the last residual
    torch.testing.assert_close(sum(sent), 3 * true_pL - state[1]["residuals"][3], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("make", [P.int8, lambda: P.int8("channel"), P.fp8])
def test_quantisers_keep_float64_costates_beyond_float32_range_finite(make):
    """Computed in the costate's dtype: 1e300 does not overflow to inf / nan through float32."""
    value = torch.tensor([[1e300, -3e299], [5e299, 1.0]], dtype=torch.float64)
    out = apply1(make(), record(value)).value
    assert out.dtype == torch.float64 and torch.isfinite(out).all()
    assert torch.allclose(out, value, rtol=0.1, atol=1e298)


@given(value=costates(), limit=st.floats(1e-3, 1e3))
def test_clip_by_value_clamps_each_entry(value, limit):
    out = apply1(P.clip_by_value(limit), record(value))
    for o, v in zip(leaves(out.value), leaves(value)):
        assert torch.equal(o, v.clamp(-limit, limit))
    changed = sum(int((v.abs() > limit).sum()) for v in leaves(value))
    assert out.meta["clipped_fraction"] == pytest.approx(changed / sum(v.numel() for v in leaves(value)))


def test_clip_by_value_counts_only_the_entries_beyond_the_limit():
    out = apply1(P.clip_by_value(0.5), record(torch.tensor([0.5, -0.5, 0.75, -2.0, 0.0])))
    assert torch.equal(out.value, torch.tensor([0.5, -0.5, 0.5, -0.5, 0.0]))
    assert float(out.meta["clipped_fraction"]) == pytest.approx(2 / 5)


@pytest.mark.parametrize("make", [P.topk, P.randk])
def test_a_sparsifier_keeps_at_least_one_entry_and_a_zero_costate_sends_all_its_energy(make):
    """k = ceil(ratio n) is at least one entry of a non-empty tensor, however small the ratio; topk's
    energy ratio of an all-zero costate is 1 (nothing was lost)."""
    value = torch.tensor([0.1, -3.0, 0.2, 0.4])
    out = apply1(make(1e-12), record(value))
    assert int((out.value != 0).sum()) == 1
    if make is P.topk:
        assert out.value[1].item() == -3.0
        assert float(apply1(make(0.5), record(torch.zeros(4))).meta["topk_energy"]) == 1.0


class HostReads(TorchDispatchMode):
    """Records, by name, every read of a number off the device while it is entered.

    ``aten::_local_scalar_dense`` is what ``.item()``, ``float(t)``, ``int(t)`` and ``bool(t)``
    dispatch to (a stalled stream on a GPU). Some reads never reach the dispatcher on the CPU,
    where every tensor already lies on the host: ``.tolist()``, ``.numpy()``, ``.cpu()`` and
    ``.to("cpu")``. So while entered (with ``methods=True``), those methods of ``torch.Tensor``, and
    ``item``, ``__bool__``, ``__float__``, ``__int__`` and ``__index__`` (what a Python ``if``, ``int(t)``
    or an index on a tensor calls), are wrapped to record the call and delegate. A wrapper bound
    while the mode was entered and called after it (``Lazy.of(t)`` keeps ``t.item``) records
    nothing: reading a lazy value later is the point."""

    METHODS = ("tolist", "numpy", "item", "cpu", "to", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, methods: bool = True):
        super().__init__()
        self.reads: list[str] = []
        self.methods = methods
        self._saved: dict = {}
        self._depth = 0

    def __enter__(self):
        if self.methods and self._depth == 0:
            self._saved = {name: torch.Tensor.__dict__.get(name) for name in self.METHODS}
            for name in self.METHODS:
                setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._depth -= 1
            if self.methods and self._depth == 0:
                for name, original in self._saved.items():
                    if original is None:
                        delattr(torch.Tensor, name)
                    else:
                        setattr(torch.Tensor, name, original)

    def _wrap(self, name, original):
        reads = self

        def wrapper(t, *args, **kwargs):
            if reads._depth and (name != "to" or _to_cpu(args, kwargs)):
                reads.reads.append(f"Tensor.{name}")
            return original(t, *args, **kwargs)

        return wrapper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append("aten::_local_scalar_dense")
        return func(*args, **(kwargs or {}))


_TENSOR_METHODS = {name: torch.Tensor.__dict__.get(name) for name in HostReads.METHODS}


def _to_cpu(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names the CPU as the target device."""
    return any(
        isinstance(d, (str, torch.device)) and torch.device(d).type == "cpu" for d in (*args, kwargs.get("device"))
    )


def watched(p, reads: HostReads) -> P.Pass:
    """``p`` with ``reads`` entered around each of its updates, and only there (neither the
    sweep's own work nor reading the lazy measurements afterwards is watched)."""
    p = P.lift(p)

    def update(adj, state, ctx):
        with reads:
            return p.update(adj, state, ctx)

    return P.Pass(p.init, update, f"watched({p.name})")


def _sweep_problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    chain, params = ef.from_module(model, loss=nn.functional.mse_loss)
    return chain, params, torch.randn(6, 8), torch.randn(6, 4)


def _reads_of(p):
    """The host reads inside ``p``'s updates over one sweep (after a warm-up sweep), and its result."""
    chain, params, x, y = _sweep_problem()
    ef.sweep(chain, params, x, y, passes=p)  # warm-up: lazy initialisations
    reads = HostReads()
    res = ef.sweep(chain, params, x, y, passes=watched(p, reads))
    assert {name: torch.Tensor.__dict__.get(name) for name in HostReads.METHODS} == _TENSOR_METHODS  # restored
    return reads.reads, res


def _reading(name, read):
    """A pass that reads its costate's norm off the device with ``read``: what the detector must catch."""

    def update(adj, state, ctx):
        read(torch.linalg.vector_norm(adj.value))
        return adj.applied(name, adj.value), state

    return P.Pass(lambda: None, update, name)


def _if_tensor(t):
    if t:  # a Python if on a tensor
        return True
    return False


READS = {
    "tolist": (lambda t: t.tolist(), "Tensor.tolist"),
    "item": (lambda t: t.item(), "Tensor.item"),
    "cpu": (lambda t: t.cpu(), "Tensor.cpu"),
    "to_cpu": (lambda t: t.to("cpu"), "Tensor.to"),
    "to_cpu_device": (lambda t: t.to(device=torch.device("cpu"), dtype=torch.float64), "Tensor.to"),
    "numpy": (lambda t: t.detach().numpy(), "Tensor.numpy"),
    "bool": (lambda t: bool(t > 0), "Tensor.__bool__"),
    "if": (lambda t: _if_tensor(t > 0), "Tensor.__bool__"),
    "float": (lambda t: float(t), "Tensor.__float__"),
    "int": (lambda t: int(t), "Tensor.__int__"),
    "index": (lambda t: operator.index(t.long()), "Tensor.__index__"),
}


@pytest.mark.parametrize("kind", list(READS))
def test_the_host_read_detector_fires_on_each_kind_of_read(kind):
    """So that the no-host-read tests below cannot pass vacuously: a pass that reads its costate
    with ``kind`` is caught at every boundary (and nothing else is), through the same harness."""
    read, expected = READS[kind]
    reads, res = _reads_of(_reading(kind, read))
    assert reads.count(expected) == len(res.adjoints) > 0, reads
    assert set(reads) <= {expected, "aten::_local_scalar_dense"}, reads


def test_the_host_read_detector_passes_casts_and_lazy_values_read_afterwards():
    """A cast that names no device is no read, and a lazy value read after the update is not counted."""

    def update(adj, state, ctx):
        value = adj.value.to(torch.float64).to(adj.value.dtype)
        return adj.applied("lazy", value, lazy_norm=Lazy.of(torch.linalg.vector_norm(value))), state

    reads, res = _reads_of(P.Pass(lambda: None, update, "lazy"))
    for adj in res.adjoints:
        assert float(res.stats["boundaries"][adj.index]["lazy_norm"]) == pytest.approx(
            torch.linalg.vector_norm(adj.value).item()
        )
    assert reads == []


def built_in_passes():
    """Every built-in pass, in each of its modes, as a factory (``check_finite("raise")`` apart)."""
    return {
        **{name: lambda name=name: all_passes()[name] for name in all_passes()},
        "identity": P.identity,
        "check_finite_skip": lambda: P.check_finite("skip"),
        "synthetic_learning": lambda: P.synthetic(warmup=1, replace=True),
        "synthetic_observing": lambda: P.synthetic(replace=False),
        "error_feedback_int8": lambda: P.error_feedback(P.int8()),
        "log_enabled": lambda: P.log(_collecting_logger()),
        "randk_tiny": lambda: P.randk(1e-3),
        "topk_all": lambda: P.topk(1.0),
        "compose": lambda: ef.compose(P.int8(), P.clip_by_global_norm(1e-3), P.stats()),
    }


class _Collect(logging.Handler):
    """Keeps the records unformatted (a handler that formats one reads its lazy numbers, as it should)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _collecting_logger():
    logger = logging.getLogger("test_passes.host_reads")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.handlers[:] = [_Collect()]
    return logger


@pytest.mark.parametrize("name", list(built_in_passes()))
def test_no_built_in_pass_reads_the_device_inside_the_sweep(name):
    """Every built-in pass (``check_finite("raise")`` apart) measures on the device and records
    plain or lazy numbers: no host read inside its updates, and the numbers read fine afterwards."""
    reads, res = _reads_of(built_in_passes()[name]())
    assert reads == []
    for adj in res.adjoints:
        for key, value in adj.meta.items():
            assert isinstance(value.value if isinstance(value, Lazy) else value, (bool, int, float, str)), (key, value)
    if name == "log_enabled":  # one record per boundary, over the warm-up sweep and the watched one
        (handler,) = logging.getLogger("test_passes.host_reads").handlers
        assert len(handler.records) == 2 * len(res.adjoints)
        assert all("eae costate at boundary" in r.getMessage() for r in handler.records)


def test_check_finite_raise_reads_its_count_once_per_boundary_and_nothing_else():
    """The one built-in pass that must read (raising needs the count), seen by the detector."""
    reads, res = _reads_of(P.check_finite("raise"))
    assert reads.count("Tensor.item") == len(res.adjoints)
    assert set(reads) == {"Tensor.item", "aten::_local_scalar_dense"}


@pytest.mark.parametrize(
    "passes",
    [
        lambda: ef.compose(P.int8(), P.clip_by_global_norm(1e-3), P.stats()),
        lambda: ef.compose(
            P.error_feedback(P.topk(0.3)),
            P.fp8(),
            P.cast(torch.bfloat16),
            P.clip_by_value(1e-3),
            P.check_finite("zero"),
            P.synthetic(warmup=0),
        ),
    ],
    ids=["int8+clip+stats", "the other measuring passes"],
)
def test_no_host_sync_inside_the_sweep_meta_is_read_when_used(passes):
    """The passes record their measurements lazily: a sweep (the engine's work and the passes')
    dispatches no scalar read, the passes' updates read nothing at all, and the recorded values
    are right once read (clip: the norm before, the scale, whether it clipped)."""
    chain, params, x, y = _sweep_problem()
    ef.sweep(chain, params, x, y, passes=passes())  # warm-up: lazy initialisations
    in_sweep, in_passes = HostReads(methods=False), HostReads()
    with in_sweep:
        res = ef.sweep(chain, params, x, y, passes=watched(passes(), in_passes))
    assert in_sweep.reads == [] and in_passes.reads == []
    meta = res.stats["boundaries"]
    if "clip_norm" in meta[1]:
        for adj in res.adjoints:
            m = meta[adj.index]
            assert m["clipped"] == (m["clip_norm"] > 1e-3) and 0 < m["clip_scale"] <= 1
            assert f"{m['norm']:.3e}" == f"{torch.linalg.vector_norm(adj.value.float()).item():.3e}"


# ----------------------------------------------------------------------------- passes as values

positive = st.floats(1e-3, 1e3)
ratio = st.floats(1e-3, 1.0)
VALUED = {  # each built-in factory, the strategy of its positional arguments
    "scale": (P.scale, st.tuples(st.floats(-10, 10))),
    "clip_by_global_norm": (P.clip_by_global_norm, st.tuples(positive)),
    "clip_by_value": (P.clip_by_value, st.tuples(positive)),
    "gaussian_noise": (P.gaussian_noise, st.tuples(st.floats(0, 1))),
    "topk": (P.topk, st.tuples(ratio)),
    "randk": (P.randk, st.tuples(ratio)),
    "int8": (P.int8, st.tuples(st.sampled_from(["tensor", "channel"]), st.booleans())),
    "cast": (P.cast, st.tuples(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))),
    "fp8": (P.fp8, st.tuples(st.sampled_from(FP8))),
    "check_finite": (P.check_finite, st.tuples(st.sampled_from(["raise", "zero", "skip"]))),
    "synthetic": (
        P.synthetic,
        st.tuples(st.floats(1e-3, 1), st.floats(0, 0.99), st.integers(0, 3), st.booleans()),
    ),
    "log": (P.log, st.tuples(st.sampled_from(["a", "b"]), st.sampled_from([logging.INFO, logging.DEBUG]))),
}


@st.composite
def recipes(draw, depth=2):
    """How to build a built-in pass: ``(kind, arguments)``, combinators nested up to ``depth``."""
    kind = draw(st.sampled_from(list(VALUED) + (["compose", "only", "error_feedback"] if depth else [])))
    if kind == "compose":
        return kind, tuple(draw(st.lists(recipes(depth - 1), max_size=3)))
    if kind == "error_feedback":
        return kind, draw(recipes(depth - 1))
    if kind == "only":
        return kind, draw(recipes(depth - 1)), tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=2)))
    return kind, draw(VALUED[kind][1])


def built(recipe) -> P.Pass:
    """A fresh pass from its recipe (new closures every time)."""
    kind = recipe[0]
    if kind == "compose":
        return ef.compose(*map(built, recipe[1]))
    if kind == "error_feedback":
        return P.error_feedback(built(recipe[1]))
    if kind == "only":
        return P.only(built(recipe[1]), indices=recipe[2])
    return VALUED[kind][0](*recipe[1])


def _flat(recipe):
    """A compose recipe as its flattened members (what ``compose`` keeps), ``identity()`` dropped."""
    if recipe[0] != "compose":
        return (recipe,)
    return tuple(m for part in recipe[1] for m in _flat(part))


@given(a=recipes(), b=recipes())
def test_a_built_in_pass_equals_one_built_alike_and_hashes_alike(a, b):
    """As a frozen dataclass of its arguments: a pass built twice from one recipe is equal to itself
    with one hash and one description; passes of other recipes (a compose's flattened members, in
    order) are other passes."""
    p, again, q = built(a), built(a), built(b)
    assert p == again and hash(p) == hash(again) and p.describe() == again.describe()
    same = _flat(a) == _flat(b)
    assert (p == q) is same
    if not same:  # what ranks compare: another value is another text
        assert p.describe() != q.describe()


@given(parts=st.lists(recipes(depth=1), min_size=3, max_size=3))
def test_compose_is_associative_with_identity_as_its_neutral_element_as_values(parts):
    a, b, c = map(built, parts)
    assert ef.compose(a, ef.compose(b, c)) == ef.compose(ef.compose(a, b), c) == ef.compose(a, b, c)
    assert ef.compose(P.identity(), a) == a == ef.compose(a, P.identity())
    assert len({ef.compose(a, b), ef.compose(a, b)}) == 1


def test_a_pass_of_the_callers_own_functions_is_equal_only_to_itself_and_said_by_qualified_name():
    def double(adj):
        return adj.replace(value=2 * adj.value)

    assert P.stateless(double) == P.stateless(double) and P.stateless(double) != P.stateless(lambda adj: adj)
    assert P.tap(print) == P.tap(print) and P.when(bool, P.scale(2.0)) == P.when(bool, P.scale(2.0))
    own = P.Pass(lambda: None, lambda adj, s, ctx: (adj, s), "own")
    assert own == own and own != P.Pass(lambda: None, own.update, "own") and own.describe() == "own"
    assert P.stateless(double).describe() == f"stateless(<{__name__}.{double.__qualname__}>, 'double')"
    assert P.scale(1.0 + 1e-9).name == P.scale(1.0).name and P.scale(1.0 + 1e-9) != P.scale(1.0)
    assert P.scale(1.0 + 1e-9).describe() == "scale(1.000000001)"
