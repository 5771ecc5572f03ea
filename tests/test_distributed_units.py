"""Single-process properties of eae_func.distributed: wire codecs, pipeline schedules, balancing."""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from eae_func import passes as P
from eae_func.adjoint import AdjointState
from eae_func.distributed import balance
from eae_func.distributed import codecs as K
from eae_func.distributed import schedule as S

CODECS_AND_PASSES = [
    (K.int8(), P.int8()),
    (K.fp8(), P.fp8()),
    (K.fp8(torch.float8_e5m2), P.fp8(torch.float8_e5m2)),
    (K.cast(torch.float16), P.cast(torch.float16)),
    (K.cast(torch.bfloat16), P.cast(torch.bfloat16)),
    (K.topk(0.2), P.topk(0.2)),
]


def _randn(shape, magnitude, seed, zero):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * magnitude
    return torch.zeros(shape) if zero else t


tensors = st.builds(
    _randn,
    st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple),
    st.floats(-3, 3).map(lambda e: 10.0**e),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)


@pytest.mark.parametrize("codec, pass_", CODECS_AND_PASSES, ids=lambda c: getattr(c, "name", ""))
@given(t=tensors)
def test_codec_round_trip_is_the_matching_pass(codec, pass_, t):
    """decode(encode(p)) is bit-for-bit what the pass of eae_func.passes computes."""
    adj = AdjointState(t, 2, "s")
    sent = codec.as_pass().apply(adj)[0]
    assert torch.equal(sent.value, pass_.apply(adj)[0].value)
    assert sent.history == (f"wire:{codec.name}",)
    assert sent.meta["wire_bytes"] == codec.encode(t).nbytes


@pytest.mark.parametrize("codec", [K.raw()] + [c for c, _ in CODECS_AND_PASSES], ids=lambda c: c.name)
@given(t=tensors)
def test_codec_layout_is_what_the_receiver_allocates(codec, t):
    """The payload's shapes and dtypes follow from (shape, dtype, arg) alone, and its size is
    n entries of the stated width (+ a float32 scale; top-k: k int32 indices and k values)."""
    enc = codec.encode(t)
    assert [(tuple(p.shape), p.dtype) for p in enc.payload] == [
        (tuple(s), d) for s, d in codec.layout(enc.shape, enc.dtype, enc.arg)
    ]
    n = t.numel()
    expected = {
        "raw": 4 * n,
        "int8": n + 4,
        "cast(float16)": 2 * n,
        "cast(bfloat16)": 2 * n,
        "fp8(float8_e4m3fn)": n + 4,
        "fp8(float8_e5m2)": n + 4,
        "topk(0.2)": 8 * math.ceil(0.2 * n - 1e-9),
    }
    assert enc.nbytes == expected[codec.name]


def test_codec_rejects_bad_arguments():
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        K.cast(torch.float32)
    with pytest.raises(ValueError, match="float8"):
        K.fp8(torch.int8)
    for ratio in (0.0, 1.5, True):  # a bool is not a ratio
        with pytest.raises(ValueError, match=r"topk: ratio must be a finite number and > 0 and <= 1"):
            K.topk(ratio)
    with pytest.raises(TypeError, match="tensor costate"):
        K.int8().as_pass().apply(AdjointState((torch.ones(2), None), 1, "s"))


SIZES = [(p, m) for p in range(1, 6) for m in range(1, 9)]


@pytest.mark.parametrize("name", S.NAMES)
def test_schedules_run_every_microbatch_once_forward_before_backward(name):
    for p, m in SIZES:
        for ops in S.schedule(name, p, m):
            f = [o.microbatch for o in ops if o.kind == "forward"]
            b = [o.microbatch for o in ops if o.kind == "backward"]
            assert sorted(f) == sorted(b) == list(range(m))
            assert all(ops.index(S.Op("forward", j)) < ops.index(S.Op("backward", j)) for j in range(m))


@pytest.mark.parametrize("name", S.NAMES)
def test_neighbours_see_the_same_sequence_of_transfers(name):
    """Between ranks r and r+1 both sides post the same transfers in the same order, so even
    blocking (rendezvous) point-to-point cannot deadlock, and the simulated bubble is the
    ideal (p-1)/(m+p-1)."""
    mirror = {"send_activation": "recv_activation", "recv_costate": "send_costate"}
    for p, m in SIZES:
        ops = S.schedule(name, p, m)
        for r in range(p - 1):
            mine = [(mirror[o.kind], o.microbatch) for o in ops[r] if o.kind in mirror]
            theirs = [(o.kind, o.microbatch) for o in ops[r + 1] if o.kind in mirror.values()]
            assert mine == theirs
        for rendezvous in (False, True):
            sim = S.simulate(ops, rendezvous=rendezvous)
            assert sim["bubble"] == pytest.approx(S.ideal_bubble(p, m))


def test_1f1b_bounds_the_microbatches_in_flight():
    """At any time rank r of 1F1B holds at most p - r microbatches (forward done, backward not);
    GPipe holds all m."""
    for p, m in SIZES:
        for name, bound in (("1f1b", lambda r, p=p, m=m: min(p - r, m)), ("gpipe", lambda r, m=m: m)):
            for r, ops in enumerate(S.schedule(name, p, m)):
                live = peak = 0
                for o in ops:
                    live += {"forward": 1, "backward": -1}.get(o.kind, 0)
                    peak = max(peak, live)
                assert peak == bound(r)


def test_simulate_detects_a_deadlock():
    bad = (
        (S.Op("recv_costate", 0), S.Op("forward", 0), S.Op("send_activation", 0), S.Op("backward", 0)),
        (S.Op("recv_activation", 0), S.Op("forward", 0), S.Op("backward", 0), S.Op("send_costate", 0)),
    )
    with pytest.raises(RuntimeError, match="deadlocks"):
        S.simulate(bad)


def test_unknown_schedule_is_an_error():
    with pytest.raises(ValueError, match="gpipe"):
        S.schedule("zero-bubble", 2, 2)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=7), st.integers(1, 7))
def test_balance_is_optimal_and_contiguous(sizes, parts):
    """The largest range's parameter count is the smallest over all contiguous splits."""
    if parts > len(sizes):
        with pytest.raises(ValueError, match="non-empty"):
            balance([{"w": torch.zeros(s)} for s in sizes], parts)
        return
    ranges = balance([{"w": torch.zeros(s)} for s in sizes], parts)
    assert [lo for lo, _ in ranges] == [0] + [hi for _, hi in ranges[:-1]] and ranges[-1][1] == len(sizes)
    assert all(hi > lo for lo, hi in ranges)
    load = max(sum(sizes[lo:hi]) for lo, hi in ranges)
    best = min(
        max(sum(sizes[a:b]) for a, b in zip((0,) + cuts, cuts + (len(sizes),)))
        for cuts in itertools.combinations(range(1, len(sizes)), parts - 1)
    )
    assert load == best
