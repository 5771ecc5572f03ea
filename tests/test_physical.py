"""Physical stages as a simulator or instrument is wired in: the black-box adapter, honest row
accounting against a budget, clear errors before anything is simulated, the twin and frozen
estimators, and choosing eps from measured noise."""

import math
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import eae_func as ef
from eae_func import estimators as E

F64 = torch.float64
D, B = 6, 5


class Simulator:
    """``tanh(x M) * gain`` in numpy, one sample (a ``(D,)`` vector) or a batch per call, counting
    the rows it is run on and the largest call."""

    def __init__(self, seed: int = 0, noise: float = 0.0):
        self.m = np.random.default_rng(seed).standard_normal((D, D)) / D**0.5
        self.noise, self.rows, self.calls, self.largest = noise, 0, 0, 0
        self.lock = threading.Lock()

    def __call__(self, params, x):
        assert isinstance(x, np.ndarray) and x.dtype == np.float64
        rows = 1 if x.ndim == 1 else len(x)
        with self.lock:
            self.rows, self.calls, self.largest = self.rows + rows, self.calls + 1, max(self.largest, rows)
        out = np.tanh(x @ self.m) * params["gain"]
        return out + self.noise * np.random.standard_normal(out.shape) if self.noise else out

    def torch(self, params, h):
        """The same function in torch: differentiable, batched."""
        return torch.tanh(h @ torch.from_numpy(self.m).to(h.dtype)) * params["gain"]


def network(box_stage, dtype=F64):
    g = torch.Generator().manual_seed(1)
    chain = ef.Chain(
        [
            ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name="in"),
            box_stage,
            ef.stage(lambda p, h: h @ p["w"], name="out"),
        ],
        loss=F.mse_loss,
    )
    params = (
        {"w": torch.randn(D, D, generator=g, dtype=dtype)},
        {"gain": torch.tensor(1.3, dtype=dtype)},
        {"w": torch.randn(D, D, generator=g, dtype=dtype)},
    )
    x, y = torch.randn(B, D, generator=g, dtype=dtype), torch.randn(B, D, generator=g, dtype=dtype)
    return chain, params, x, y


FD_ESTIMATORS = {
    "zbp": lambda n: E.zbp(E.Probes(n, "rademacher", chunk=3), method="fd", eps=1e-4),
    "np": lambda n: E.node_perturbation(E.Probes(n, chunk=3), form="fd", eps=1e-4),
    "direct": lambda n: E.direct(E.Probes(n, "orthogonal"), form="fd", eps=1e-4),
}


@pytest.mark.parametrize("name", sorted(FD_ESTIMATORS))
@settings(max_examples=6, deadline=None)
@given(
    per_sample=st.booleans(),
    max_rows=st.sampled_from([None, 1, 4, 7]),
    workers=st.sampled_from([None, 3]),
    n=st.integers(1, 5),
    key=st.integers(0, 1000),
)
def test_black_box_equals_the_same_function_in_torch_and_counts_every_row(name, per_sample, max_rows, workers, n, key):
    """A numpy simulator behind ``ef.black_box`` (per sample or in capped calls, on threads) gives the
    estimates of the same function written in torch as a plain physical stage (same key); no call
    exceeds the cap; ``stats`` rows and calls are the rows and calls the simulator ran."""
    sim = Simulator()
    box = ef.black_box(
        sim, name="box", numpy=True, per_sample=per_sample, max_rows=None if per_sample else max_rows, workers=workers
    )
    chain, params, x, y = network(box)
    twin_chain, _, _, _ = network(ef.stage(sim.torch, name="box", physical=True))
    res = ef.sweep(chain, params, x, y, estimator=FD_ESTIMATORS[name](n), key=key)
    ref = ef.sweep(twin_chain, params, x, y, estimator=FD_ESTIMATORS[name](n), key=key)
    for a, b in zip(res.adjoints, ref.adjoints):
        torch.testing.assert_close(a.value, b.value, rtol=1e-9, atol=1e-12)
    for g, h in zip(res.grads, ref.grads):
        for k in g:
            torch.testing.assert_close(g[k], h[k], rtol=1e-9, atol=1e-12)
    cap = 1 if per_sample else (max_rows or 10**9)
    assert sim.largest <= cap
    assert res.stats["box"]["rows"] == ref.stats["box"]["rows"] == sim.rows
    assert res.stats["box"]["calls"] == sim.calls


def test_rows_follow_the_query_formulas_and_repeats_cost_rows():
    """zbp (fd) on a physical stage with one parameter: the forward (B rows), 2n·B rows probing its
    input and 2·B per parameter probe; ``repeats=r`` runs every row r times and says so."""
    n, r = 4, 3
    for repeats in (1, r):
        sim = Simulator()
        chain, params, x, y = network(ef.black_box(sim, name="box", numpy=True, repeats=repeats))
        res = ef.sweep(chain, params, x, y, estimator=E.zbp(E.Probes(n), method="fd"))
        assert res.stats["box"]["queries"] == 2 * n and res.stats["box"]["param_queries"] == 2 * n
        assert res.stats["box"]["rows"] == sim.rows == repeats * (B + 2 * n * B + 2 * n * B)


@pytest.mark.parametrize("max_rows, repeats", [(2, 1), (2, 3), (None, 2), (1, 1)])
def test_calls_count_every_call_the_black_box_ran(max_rows, repeats):
    """``max_rows`` below the batch splits every run of the stage into ⌈rows / max_rows⌉ calls of
    ``fn``, each made ``repeats`` times: ``stats`` counts those calls, as it counts their rows."""
    sim = Simulator()
    chain, params, x, y = network(ef.black_box(sim, name="box", numpy=True, max_rows=max_rows, repeats=repeats))
    res = ef.sweep(chain, params, x, y, estimator=E.frozen())  # the forward alone: one run on B rows
    assert res.stats["box"]["forward_calls"] == 1
    assert res.stats["box"]["calls"] == sim.calls == repeats * math.ceil(B / (max_rows or B))
    assert res.stats["box"]["rows"] == sim.rows == repeats * B
    sim = Simulator()
    chain, params, x, y = network(ef.black_box(sim, name="box", numpy=True, max_rows=max_rows, repeats=repeats))
    res = ef.sweep(chain, params, x, y, estimator=E.zbp(E.Probes(3, chunk=2), method="fd"))
    assert res.stats["box"]["calls"] == sim.calls and res.stats["box"]["rows"] == sim.rows


@pytest.mark.parametrize("method", ["zbp", "np", "direct"])
def test_a_black_box_that_fails_only_on_the_probes_is_named(method):
    """A black box finite on the forward's rows but NaN on the probes' (shifted, folded) calls would
    give a finite loss and NaN gradients: the sweep raises, naming the stage and the probe call."""
    sim = Simulator()

    def box(params, x):
        out = sim(params, x)
        return out if len(x) == B else out * np.nan

    chain, params, x, y = network(ef.black_box(box, name="box", numpy=True))
    assert np.isfinite(ef.sweep(chain, params, x, y, estimator=E.frozen()).loss.item())
    with pytest.raises(
        FloatingPointError, match=r"estimator: stage 1 \('box'\) returned \d+ non-finite .* over \d+ probe calls"
    ):
        ef.sweep(chain, params, x, y, estimator=FD_ESTIMATORS[method](2))


def test_a_budget_raises_before_the_call_that_would_exceed_it():
    n = 4
    needed = B + 2 * n * B + 2 * n * B
    for budget, ok in ((needed, True), (needed - 1, False), (B, False)):
        sim = Simulator()
        chain, params, x, y = network(ef.black_box(sim, name="box", numpy=True))
        estimator = E.zbp(E.Probes(n), method="fd")
        if ok:
            assert ef.sweep(chain, params, x, y, estimator=estimator, budget=budget).stats["box"]["rows"] == needed
        else:
            with pytest.raises(RuntimeError, match=rf"stage 1 \('box'\) would run \d+ more rows.*budget of {budget}"):
                ef.sweep(chain, params, x, y, estimator=estimator, budget=budget)
        assert sim.rows <= budget


def test_errors_come_before_anything_is_simulated():
    """No estimator, or one that would differentiate a black box: a clear error, naming the stage,
    and the simulator never ran."""
    sim = Simulator()
    chain, params, x, y = network(ef.black_box(sim, name="box", numpy=True))
    with pytest.raises(ValueError, match=r"stage 1 \('box'\) is physical .* no estimator"):
        ef.sweep(chain, params, x, y)
    for estimator in (
        E.exact(),
        E.zbp(E.Probes(2), method="jvp"),
        E.node_perturbation(E.Probes(2)),
        E.direct(E.Probes(2), form="jvp"),
    ):
        with pytest.raises(ValueError, match=r"differentiates the physical stages, but stage 1 \('box'\) cannot"):
            ef.sweep(chain, params, x, y, estimator=estimator)
    with pytest.raises(ValueError, match=r"stage 1 \('box'\) cannot be differentiated .* not among physical=\[\]"):
        ef.sweep(chain, params, x, y, estimator=E.frozen(), physical=[])
    assert sim.rows == 0
    with pytest.raises(RuntimeError, match="called under a torch.func transform"):
        torch.func.jvp(lambda h: chain.stages[1].fn(params[1], h), (x,), (x,))


def test_the_black_box_output_comes_back_in_the_boundary_dtype_and_a_raw_stage_is_named():
    """A float64 simulator in a float32 network: the adapter converts; a hand-written physical stage
    returning float64 makes the next stage fail, and the error names the stage that produced it."""
    sim = Simulator()
    chain, params, x, y = network(ef.black_box(sim, name="box", numpy=True, dtype=np.float64), dtype=torch.float32)
    res = ef.sweep(chain, params, x, y, estimator=E.zbp(E.Probes(3), method="fd", eps=1e-2))
    assert res.adjoints[-1].value.dtype == torch.float32 and res.grads[0]["w"].dtype == torch.float32

    def raw(params, h):
        return torch.from_numpy(sim({"gain": params["gain"].item()}, h.numpy().astype(np.float64)))

    chain, params, x, y = network(ef.stage(raw, name="box", physical=True), dtype=torch.float32)
    with pytest.raises(RuntimeError) as info:
        ef.sweep(chain, params, x, y, estimator=E.zbp(E.Probes(3), method="fd"))
    notes = " ".join(info.value.__notes__)
    assert "the output of stage 1 ('box') must be torch.float32" in notes


def test_twin_equal_to_the_black_box_gives_exact_backprop():
    """Physics-aware training with a twin equal to the simulator: the exact gradients, while the
    black box only runs forward (its rows are the forward's)."""
    sim = Simulator()
    chain, params, x, y = network(ef.black_box(sim, name="box", numpy=True))
    exact_chain, _, _, _ = network(ef.stage(sim.torch, name="box"))
    res = ef.sweep(chain, params, x, y, estimator=E.twin(sim.torch))
    ref = ef.sweep(exact_chain, params, x, y)
    for g, h in zip(res.grads, ref.grads):
        for k in g:
            torch.testing.assert_close(g[k], h[k], rtol=1e-12, atol=1e-14)
    assert res.stats["box"]["rows"] == sim.rows == B and res.stats["box"]["twin_calls"] == 1
    with pytest.raises(ValueError, match=r"twin of stage 1 \('box'\): its output has shapes \[\(5, 3\)\]"):
        ef.sweep(chain, params, x, y, estimator=E.twin(lambda p, h: h[:, :3]))


def test_twin_differs_from_exact_where_the_hardware_differs_from_the_twin():
    """A mismatched twin (gain off by 10%): PAT keeps the measured forward, so the costate reaching the
    box is the hardware's; only the box's own Jacobian is the twin's."""
    sim = Simulator()
    chain, params, x, y = network(ef.black_box(sim, name="box", numpy=True))
    exact_chain, _, _, _ = network(ef.stage(sim.torch, name="box"))
    wrong = lambda p, h: sim.torch({"gain": p["gain"] * 1.1}, h)  # noqa: E731
    res = ef.sweep(chain, params, x, y, estimator=E.twin(wrong))
    ref = ef.sweep(exact_chain, params, x, y)
    torch.testing.assert_close(res.grads[2]["w"], ref.grads[2]["w"], rtol=1e-12, atol=1e-14)  # downstream: exact
    torch.testing.assert_close(res.grads[0]["w"], ref.grads[0]["w"] * 1.1, rtol=1e-12, atol=1e-14)


def test_frozen_passes_no_costate_upstream():
    sim = Simulator()
    chain, params, x, y = network(ef.black_box(sim, name="box", numpy=True))
    exact_chain, _, _, _ = network(ef.stage(sim.torch, name="box"))
    res = ef.sweep(chain, params, x, y, estimator=E.frozen())
    ref = ef.sweep(exact_chain, params, x, y)
    assert all(a.value is None for a in res.adjoints if a.index <= 1)  # no costate flows upstream
    assert res.grads[0]["w"] is None and res.grads[1]["gain"] is None  # no gradient: an optimizer leaves them
    torch.testing.assert_close(res.grads[2]["w"], ref.grads[2]["w"], rtol=1e-12, atol=1e-14)
    assert res.stats["box"]["rows"] == sim.rows == B


def test_with_one_physical_stage_the_three_estimators_coincide():
    """One physical stage, the same probe stream: zbp's <J u, p_out> is <u, J^T p_out>, np's and
    direct's scalar too, so the three jvp forms give the same estimate."""
    sim = Simulator()
    chain, params, x, y = network(ef.stage(sim.torch, name="box", physical=True))
    probes = E.Probes(7, "rademacher")
    estimates = [
        ef.sweep(chain, params, x, y, estimator=est, key=3).adjoints[-2].value
        for est in (E.zbp(probes), E.node_perturbation(probes, form="jvp"), E.direct(probes, form="jvp"))
    ]
    for other in estimates[1:]:
        torch.testing.assert_close(other, estimates[0], rtol=1e-10, atol=1e-12)


def test_suggest_eps_measures_the_noise_and_keeps_fd_close_to_the_exact_directional_derivatives():
    """Noise std 1e-3: the measured σ is within 15% of it, and zbp (fd) at the suggested eps stays at
    cosine >= 0.99 to zbp (jvp) on the noiseless simulator with the same 8 probes; at eps = σ it does not."""
    sigma = 1e-3
    noisy = Simulator(noise=sigma)
    chain, params, x, y = network(ef.black_box(noisy, name="box", numpy=True))
    clean_chain, _, _, _ = network(ef.stage(Simulator().torch, name="box", physical=True))
    h = torch.tanh(x @ params[0]["w"])  # the box's input
    np.random.seed(0)
    est = E.suggest_eps(chain.stages[1], params[1], h, repeats=16)
    assert abs(est.noise - sigma) < 0.15 * sigma and est.gain > 0
    assert est.eps == pytest.approx(10 * est.noise / est.gain)
    probes = E.Probes(8, "rademacher")
    jvp = ef.sweep(clean_chain, params, x, y, estimator=E.zbp(probes), key=5).adjoints[-2].value

    def cosine(eps):
        fd = ef.sweep(chain, params, x, y, estimator=E.zbp(probes, method="fd", eps=eps), key=5).adjoints[-2].value
        return F.cosine_similarity(fd.flatten(), jvp.flatten(), dim=0).item()

    assert cosine(est.eps) >= 0.99  # measured 0.997-0.998 over noise draws
    assert cosine(sigma) < 0.9  # measured 0.69-0.80
