"""Single-process properties of eae_func.distributed: wire codecs, the zero-bubble split, balancing."""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import eae_func as ef
from eae_func import passes as P
from eae_func.adjoint import AdjointState
from eae_func.core import fold as Fold
from eae_func.core import microbatch as M
from eae_func.core.options import make
from eae_func.core.runner import Range
from eae_func.distributed import balance
from eae_func.distributed import codecs as K
from eae_func.distributed.plan import ideal_bubble

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
    assert enc.arg == codec.arg_for(tuple(t.shape))  # known to a receiver from the shape alone
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
    with pytest.raises(TypeError, match="wire codecs take tensor costates, boundary 1 has a int"):
        K.int8().as_pass().apply(AdjointState((torch.ones(2), 3), 1, "s"))


def test_a_pytree_costate_crosses_the_wire_leaf_by_leaf():
    """Each tensor leaf is coded (bytes and ratio of all of them); a leaf without a costate stays ``None``."""
    adj, _ = K.int8().as_pass().apply(AdjointState((torch.ones(2), None, {"h": -torch.ones(3)}), 1, "s"))
    assert torch.equal(adj.value[0], torch.ones(2)) and adj.value[1] is None
    assert torch.equal(adj.value[2]["h"], -torch.ones(3))
    assert adj.meta["wire_bytes"] == 2 + 4 + 3 + 4 and adj.history == ("wire:int8",)


@given(
    widths=st.lists(st.integers(1, 6), min_size=2, max_size=5),
    seed=st.integers(0, 2**16),
    passes=st.booleans(),
    rows=st.integers(1, 4),
)
def test_the_zero_bubble_split_gives_the_full_backward_bit_for_bit(widths, seed, passes, rows):
    """The I half (costates, passes) now and the W half (weights) later, each rebuilt from the
    boundary under the replayed RNG, give exactly the full reverse step's gradients, trace and
    pass state, dropout included: what lets pipelining's zero-bubble schedule run our stages."""
    g = torch.Generator().manual_seed(seed)
    stages = [
        ef.stage(lambda p, h: torch.nn.functional.dropout(torch.tanh(h @ p["w"] + p["b"]), 0.3), name=f"s{i}")
        for i in range(len(widths) - 1)
    ]
    params = tuple(
        {"w": torch.randn(a, b, generator=g), "b": torch.randn(b, generator=g)} for a, b in zip(widths, widths[1:])
    )
    chain = ef.Chain(stages, loss=lambda out, y: (out - y).square().mean())
    x, y = torch.randn(rows, widths[0], generator=g), torch.randn(rows, widths[-1], generator=g)
    opts = make("test", {"key": seed, "passes": P.clip_by_global_norm(0.1) if passes else None}).bind(chain)
    runner = Range(chain, 0, len(chain), params, opts, torch.device("cpu"))
    mb = M.split(x, (y,), 1, "mean", seed)[0]
    buffers = chain.check_buffers(None)
    pieces = []
    for defer in (False, True):
        torch.manual_seed(seed)
        piece = runner.backward(runner.forward(buffers, mb), mb, None, defer_weights=defer)
        grads = tuple(g.compute() if isinstance(g, Fold.Deferred) else g for g in piece.grads)
        pieces.append((piece, grads))
    (full, full_grads), (split, split_grads) = pieces
    assert all(isinstance(g, Fold.Deferred) for g in split.grads)
    for a, b in zip(full_grads, split_grads):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(full.loss, split.loss) and torch.equal(full.costate, split.costate)
    assert [r.history for r in full.trace] == [r.history for r in split.trace]
    assert all(torch.equal(a.value, b.value) for a, b in zip(full.trace, split.trace))


def test_ideal_bubbles():
    """(p-1)/(v m + p-1) for gpipe, 1f1b and interleaved 1f1b."""
    assert ideal_bubble("1f1b", 4, 4) == pytest.approx(3 / 7)
    assert ideal_bubble("gpipe", 2, 3) == pytest.approx(1 / 4)
    assert ideal_bubble("interleaved_1f1b", 4, 4, 2) == pytest.approx(3 / 11)


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
