"""Parity with eae-runtime 0.1.1, the object-oriented peer: the same passes give the same numbers.

Both runtimes run the pipeline on the output costate p_L and on every block's input
costate p_{L-1}..p_0 (eae-runtime's scheduler runs it after each block's reconstruction,
p_0 included), and stage l's parameter gradients come from the processed p_l.

Counterparts: ClipPass(m) = clip(m); FP16Pass = cast(float16); Int8QuantizationPass = int8()
(per tensor, deterministic); FP8Pass = int8() too (in 0.1.1 it is an alias of the int8 fake
quantisation, not a float8 format); RegularizationPass(s) = scale(1 - s); LoggingPass's
statistics = stats(). GaussianNoisePass draws from the global RNG, so only its
distribution is compared. SyntheticGradientPass (an MLP trained with torch.optim on a
different target) has no exact counterpart.
"""

import math

import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import eae_func as ef
from eae_func import passes as P
from eae_func.adjoint import AdjointState

from helpers import assert_grads_match, build

pytest.importorskip(
    "eae_runtime",
    reason="eae-runtime 0.1.1, the peer package these tests compare with, "
    "is not installed (pip install eae-runtime==0.1.1)",
)
from eae_runtime import EAERuntime, RuntimeConfig  # noqa: E402
from eae_runtime import passes as R  # noqa: E402
from eae_runtime.adjoint import AdjointState as RuntimeAdjoint  # noqa: E402

COUNTERPARTS = {
    "clip": (lambda: R.ClipPass(max_norm=0.05), lambda: P.clip_by_global_norm(0.05)),
    "fp16": (R.FP16Pass, lambda: P.cast(torch.float16)),
    "int8": (R.Int8QuantizationPass, P.int8),
    "fp8_alias": (R.FP8Pass, P.int8),
    "regularization": (lambda: R.RegularizationPass(strength=0.3), lambda: P.scale(0.7)),
    "int8+clip": (
        lambda: [R.Int8QuantizationPass(), R.ClipPass(max_norm=1.0)],
        lambda: ef.compose(P.int8(), P.clip_by_global_norm(1.0)),
    ),
}


def _runtime_grads(model, x, target, runtime_passes):
    passes = runtime_passes if isinstance(runtime_passes, list) else [runtime_passes]
    runtime = EAERuntime(model, None, RuntimeConfig(passes=passes, log_level=None))
    return runtime.compute_gradients(x, lambda out: F.mse_loss(out, target))


@pytest.mark.parametrize("name", sorted(COUNTERPARTS))
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_parameter_gradients_match_eae_runtime(name, kind):
    runtime_pass, our_pass = COUNTERPARTS[name]
    model, x, target = build(kind, 3, torch.float32, seed=7)
    x, target = x * 30, target * 100  # large costates, so clipping is active
    loss_ref, reference = _runtime_grads(model, x, target, runtime_pass())
    chain, params = ef.from_module(model, loss=F.mse_loss)
    res = ef.sweep(chain, params, x, target, passes=our_pass())
    torch.testing.assert_close(res.loss, loss_ref, rtol=0, atol=0)
    # vjp and autograd.grad may reassociate sums (transformer: ~1e-7 relative); the MLP is bitwise equal
    assert_grads_match(chain, res.grads, reference, rtol=1e-5, atol=1e-6)
    plain = ef.sweep(chain, params, x, target).grads
    assert any(
        not torch.allclose(a, b, rtol=1e-4, atol=1e-5)
        for a, b in zip(optree.tree_leaves(plain), optree.tree_leaves(res.grads))
    ), "the pass had no effect"


costates = st.tuples(st.integers(1, 6), st.integers(1, 9), st.floats(1e-4, 1e4), st.integers(0, 2**31 - 1))


def _tensor(shape_a, shape_b, magnitude, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape_a, shape_b, generator=g) * magnitude


@given(costate=costates, name=st.sampled_from(["clip", "fp16", "int8", "fp8_alias", "regularization"]))
def test_single_costate_bitwise_equal(costate, name):
    """On one costate the counterparts agree bit for bit (and int8 records the same scale)."""
    t = _tensor(*costate)
    runtime_pass, our_pass = COUNTERPARTS[name]
    theirs = runtime_pass()(RuntimeAdjoint(tensor=t, layer_id=2))
    ours = our_pass().apply(AdjointState(t, 2, "block"))[0]
    assert torch.equal(ours.value, theirs.tensor)
    if "quantization_scale" in theirs.metadata:
        assert ours.meta["int8_scale"] == theirs.metadata["quantization_scale"]


@given(costate=costates)
def test_stats_match_logging_pass_statistics(costate):
    t = _tensor(*costate)
    theirs = RuntimeAdjoint(tensor=t, layer_id=1).statistics()
    ours = P.stats().apply(AdjointState(t, 1, "block"))[0].meta
    assert set(theirs) <= set(ours)
    for k, v in theirs.items():
        assert ours[k] == pytest.approx(v, rel=1e-5, abs=1e-6 * costate[2]), k


def test_gaussian_noise_has_the_distribution_of_gaussian_noise_pass():
    """Noise of std 0.5 on a zero costate of n entries: both means within 6 standard errors
    of 0 (se = std / sqrt(n)), both sample stds within 6 se of 0.5 (se ~ std / sqrt(2n))."""
    n, std = 200_000, 0.5
    zero = torch.zeros(n)
    theirs = R.GaussianNoisePass(std=std, generator=torch.Generator().manual_seed(1))(
        RuntimeAdjoint(tensor=zero, layer_id=1)
    ).tensor
    ours = P.gaussian_noise(std).apply(AdjointState(zero, 1, "block", key=1))[0].value
    for noise in (theirs, ours):
        assert abs(noise.mean().item()) < 6 * std / math.sqrt(n)
        assert abs(noise.std().item() - std) < 6 * std / math.sqrt(2 * n)
