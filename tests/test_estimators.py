"""Estimators (docs/estimators.md): probes, exactness of the forms against each other, the black-box
contract, transformer blocks, cost counters and errors. Statistics: test_estimators_stats.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import eae_func as ef
from eae_func import estimators as E

from helpers import transformer

# torch's forward-AD decompositions script themselves on first use (a torch-internal deprecation)
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
    pytest.mark.usefixtures("one_thread"),
]

D, BATCH = 4, 5
F64 = torch.float64


def mlp_problem(depth: int = 4, width: int = D, batch: int = BATCH, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]).to(F64)
    x, y = torch.randn(batch, width, dtype=F64), torch.randn(batch, width, dtype=F64)
    return model, x, y


def costates(res, chain, stages) -> dict:
    """The input costate of each stage in ``stages`` (boundary i is the input of stage i)."""
    return {i: res.adjoints[len(chain) - i].value for i in stages}


def assert_trees_close(a, b, **tol):
    for x, y in zip(ef.tree_leaves(a), ef.tree_leaves(b), strict=True):
        torch.testing.assert_close(x, y, **tol)


ALL_ESTIMATORS = [
    ("zbp-jvp", lambda p: E.zbp(p, method="jvp")),
    ("zbp-fd", lambda p: E.zbp(p, method="fd", eps=1e-4)),
    *[(f"np-{f}", lambda p, f=f: E.node_perturbation(p, form=f, eps=1e-4)) for f in ("oracle", "jvp", "fd")],
    *[(f"direct-{f}", lambda p, f=f: E.direct(p, form=f, eps=1e-4)) for f in ("oracle", "jvp", "fd")],
]


# ---- probes ----


@pytest.mark.parametrize("kind", ["gaussian", "rademacher", "sphere", "orthogonal"])
@pytest.mark.parametrize("antithetic", [False, True])
def test_probe_draws_do_not_depend_on_the_chunk_size(kind, antithetic):
    def draw(chunk):
        probes = E.Probes(37, kind, chunk=chunk, batch_dims=2, antithetic=antithetic)
        return torch.cat(list(probes.chunks(seed=11, batch_shape=(2, 3), d=6, dtype=F64, device="cpu")))

    full = draw(None)
    assert full.shape == (37, 2, 3, 6)
    for chunk in (1, 5, 16, 17):
        torch.testing.assert_close(draw(chunk), full, rtol=0, atol=1e-12)


def test_probe_kinds_have_their_geometry():
    d, batch = 6, (3,)

    def draw(kind, n=14, antithetic=False, seed=1):
        return next(E.Probes(n, kind, antithetic=antithetic).chunks(seed, batch, d, F64, "cpu"))

    assert set(draw("rademacher").unique().tolist()) == {-1.0, 1.0}
    torch.testing.assert_close(draw("sphere").norm(dim=-1), torch.full((14, 3), d**0.5, dtype=F64))
    u = draw("orthogonal")  # blocks of d directions per batch position, the last block partial
    for block in (u[:d], u[d : 2 * d], u[2 * d :]):
        gram = torch.einsum("ibk,jbk->bij", block, block)
        torch.testing.assert_close(gram, d * torch.eye(len(block), dtype=F64).expand_as(gram))
    assert not torch.allclose(u[:d], u[d : 2 * d])  # independent blocks
    assert not torch.allclose(u[:, 0], u[:, 1])  # independent per batch position
    pairs = draw("gaussian", antithetic=True)
    torch.testing.assert_close(pairs[1::2], -pairs[0::2])
    assert not torch.allclose(draw("gaussian", seed=1), draw("gaussian", seed=2))


@pytest.mark.parametrize("name,make", ALL_ESTIMATORS)
def test_estimate_does_not_depend_on_the_chunk_size(name, make):
    model, x, y = mlp_problem()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    runs = [
        ef.sweep(chain, params, x, y, estimator=make(E.Probes(12, "sphere", chunk=c)), physical=[1, 3], key=5)
        for c in (None, 1, 5)
    ]
    for res in runs[1:]:
        assert_trees_close(costates(res, chain, [0, 1, 3]), costates(runs[0], chain, [0, 1, 3]), rtol=1e-9, atol=1e-12)
        assert_trees_close(res.grads, runs[0].grads, rtol=1e-9, atol=1e-12)


# ---- exactness of the forms ----


def test_exact_estimator_equals_no_estimator():
    model, x, y = mlp_problem()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    ref = ef.sweep(chain, params, x, y)
    res = ef.sweep(chain, params, x, y, estimator=E.exact(), physical=[0, 2, 3])
    assert_trees_close(res.grads, ref.grads, rtol=0, atol=0)
    assert_trees_close([a.value for a in res.adjoints], [a.value for a in ref.adjoints], rtol=0, atol=0)


@pytest.mark.parametrize("estimator", [E.node_perturbation, E.direct])
@pytest.mark.parametrize("physical", [[1, 3], [0, 2], [3]])
def test_jvp_form_equals_oracle_and_fd_converges_like_eps_squared(estimator, physical):
    model, x, y = mlp_problem()
    chain, params = ef.from_module(model, loss=F.mse_loss)

    def run(form, eps=1e-3):
        res = ef.sweep(
            chain, params, x, y, estimator=estimator(E.Probes(8), form=form, eps=eps), physical=physical, key=7
        )
        return torch.cat([c.flatten() for c in costates(res, chain, physical).values()]), res.grads

    oracle, oracle_grads = run("oracle")
    jvp, jvp_grads = run("jvp")
    torch.testing.assert_close(jvp, oracle, rtol=1e-10, atol=1e-13)
    assert_trees_close(jvp_grads, oracle_grads, rtol=1e-10, atol=1e-13)
    errors = [(run("fd", eps)[0] - oracle).norm() for eps in (2e-2, 1e-2, 5e-3)]
    assert errors[0] / errors[1] == pytest.approx(4, rel=0.15)
    assert errors[1] / errors[2] == pytest.approx(4, rel=0.15)


def test_zbp_fd_approaches_jvp_until_rounding_dominates():
    model, x, y = mlp_problem()
    chain, params = ef.from_module(model, loss=F.mse_loss)

    def estimate(method, eps=1e-3):
        res = ef.sweep(chain, params, x, y, estimator=E.zbp(E.Probes(8), method=method, eps=eps), physical=[2], key=3)
        return res.adjoints[len(chain) - 2].value

    jvp = estimate("jvp")
    errors = {eps: (estimate("fd", eps) - jvp).norm().item() for eps in (1e-1, 1e-2, 1e-3, 1e-4, 1e-13)}
    assert errors[1e-1] / errors[1e-2] == pytest.approx(100, rel=0.2)  # truncation O(eps^2)
    assert errors[1e-2] / errors[1e-3] == pytest.approx(100, rel=0.2)
    assert errors[1e-4] < 1e-8 * jvp.norm()
    assert errors[1e-13] > 10 * errors[1e-4]  # rounding error ~ machine eps / eps takes over


def test_oracle_and_jvp_give_physical_parameters_their_exact_local_vjp():
    """With the last stage physical its output costate is exact, so its parameter gradients are too."""
    model, x, y = mlp_problem()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    ref = ef.sweep(chain, params, x, y)
    for est in (E.zbp(E.Probes(4)), E.node_perturbation(E.Probes(4), form="jvp"), E.direct(E.Probes(4))):
        res = ef.sweep(chain, params, x, y, estimator=est, physical=[3])
        assert_trees_close(res.grads[3], ref.grads[3], rtol=1e-12, atol=1e-14)


def test_fd_probes_physical_parameters_without_differentiating():
    model, x, y = mlp_problem()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    ref = ef.sweep(chain, params, x, y)
    res = ef.sweep(chain, params, x, y, estimator=E.zbp(E.Probes(6000, "sphere"), method="fd"), physical=[3])
    exact = torch.cat([g.flatten() for g in ref.grads[3].values()])
    probed = torch.cat([g.flatten() for g in res.grads[3].values()])
    # sphere probes in d = 20 parameter directions: E|ĝ-g|^2 = (d-1)/n |g|^2, so cos ≈ 1 - 0.0016
    assert F.cosine_similarity(probed, exact, dim=0) > 0.99


def test_fd_probes_a_scalar_parameter_of_a_physical_stage():
    """A 0-dim parameter (a gain) is one probe direction: with d = 1, every probe gives the exact
    projection, so the estimate equals the central difference."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, D, generator=g, dtype=F64), torch.randn(5, D, generator=g, dtype=F64)
    chain = ef.Chain(
        [
            ef.stage(lambda p, h: torch.tanh(p["gain"] * h), name="gain", physical=True),
            ef.stage(lambda p, h: h @ p["w"], name="out"),
        ],
        loss=F.mse_loss,
    )
    params = ({"gain": torch.tensor(0.7, dtype=F64)}, {"w": torch.randn(D, D, generator=g, dtype=F64)})
    exact = ef.sweep(chain, params, x, y, estimator=E.exact()).grads[0]["gain"]
    probed = ef.sweep(chain, params, x, y, estimator=E.zbp(E.Probes(3, "rademacher"), method="fd")).grads[0]["gain"]
    assert probed.shape == () and torch.allclose(probed, exact, rtol=1e-6)


# ---- the black box contract ----


def numpy_stage(params, h):
    """A physical stage that leaves torch: tanh(h W + b) computed by numpy."""
    out = np.tanh(h.numpy() @ params["w"].numpy() + params["b"].numpy())
    return torch.from_numpy(out)


def torch_twin(params, h):
    return torch.tanh(h @ params["w"] + params["b"])


def test_fd_forms_work_on_a_stage_computed_by_numpy():
    model, x, y = mlp_problem(depth=2)
    torch.manual_seed(1)
    black_box = {"w": torch.randn(D, D, dtype=F64) / 2, "b": torch.randn(D, dtype=F64) / 2}
    digital = [
        ef.stage(lambda p, h, m=m: torch.func.functional_call(m, p, (h,)), name=f"mlp{k}") for k, m in enumerate(model)
    ]
    params = (dict(model[0].named_parameters()), black_box, dict(model[1].named_parameters()))
    params = tuple({k: v.detach() for k, v in p.items()} for p in params)
    for fd, reference in [
        (E.zbp(E.Probes(16), method="fd", eps=1e-4), E.zbp(E.Probes(16), method="jvp")),
        (E.node_perturbation(E.Probes(16), form="fd", eps=1e-4), E.node_perturbation(E.Probes(16), form="oracle")),
        (E.direct(E.Probes(16), form="fd", eps=1e-4), E.direct(E.Probes(16), form="oracle")),
    ]:
        box = ef.Chain([digital[0], ef.stage(numpy_stage, name="box", physical=True), digital[1]], loss=F.mse_loss)
        twin = ef.Chain([digital[0], ef.stage(torch_twin, name="box"), digital[1]], loss=F.mse_loss)
        res = ef.sweep(box, params, x, y, estimator=fd, key=2)  # physical read from the stage
        ref = ef.sweep(twin, params, x, y, estimator=reference, physical=["box"], key=2)
        torch.testing.assert_close(res.adjoints[-1].value, ref.adjoints[-1].value, rtol=1e-5, atol=1e-9)
        assert res.stats["box"]["forward_calls"] > 0 and res.stats["box"]["param_queries"] == 32
    with pytest.raises(RuntimeError):  # forward-mode AD cannot enter numpy: why the fd forms exist
        ef.sweep(box, params, x, y, estimator=E.zbp(E.Probes(4), method="jvp"))


# ---- transformer blocks, mixed chains, microbatches ----


def test_transformer_blocks_take_forward_mode_through_attention():
    """Forward AD through the fused SDPA CPU kernel is not implemented; the estimators select the math backend."""
    torch.manual_seed(0)
    model = transformer(3).to(F64)
    x, y = torch.randn(2, 7, 16, dtype=F64), torch.randn(2, 7, 16, dtype=F64)
    chain, params = ef.from_module(model, loss=F.mse_loss, physical=[1])
    oracle = ef.sweep(chain, params, x, y, estimator=E.node_perturbation(E.Probes(4), form="oracle"), key=1)
    for est in (E.node_perturbation(E.Probes(4), form="jvp"), E.direct(E.Probes(4), form="jvp")):
        res = ef.sweep(chain, params, x, y, estimator=est, key=1)
        torch.testing.assert_close(res.adjoints[2].value, oracle.adjoints[2].value, rtol=1e-9, atol=1e-12)
    exact = ef.sweep(chain, params, x, y, physical=[]).adjoints[2].value  # physical=[]: every stage digital
    res = ef.sweep(chain, params, x, y, estimator=E.zbp(E.Probes(800, chunk=400)), key=1)
    # d = 112: E cos ≈ sqrt(n / (n + d)) = 0.94
    assert F.cosine_similarity(res.adjoints[2].value.flatten(), exact.flatten(), dim=0) > 0.88


def test_physical_and_digital_stages_in_any_order_with_function_stages():
    torch.manual_seed(0)
    ws = [torch.randn(D, D, dtype=F64) / 2 for _ in range(4)]
    fns = [lambda p, h: torch.tanh(h @ p["w"]) for _ in ws]
    chain = ef.Chain([ef.stage(f, physical=k in (0, 2)) for k, f in enumerate(fns)], loss=F.mse_loss)
    params = tuple({"w": w} for w in ws)
    x, y = torch.randn(BATCH, D, dtype=F64), torch.randn(BATCH, D, dtype=F64)
    ref = ef.sweep(chain, params, x, y, physical=[])  # every stage digital
    res = ef.sweep(chain, params, x, y, estimator=E.exact())
    assert_trees_close(res.grads, ref.grads, rtol=0, atol=0)
    oracle = ef.sweep(chain, params, x, y, estimator=E.node_perturbation(E.Probes(6)), key=4)
    jvp = ef.sweep(chain, params, x, y, estimator=E.node_perturbation(E.Probes(6), form="jvp"), key=4)
    assert_trees_close([a.value for a in jvp.adjoints], [a.value for a in oracle.adjoints], rtol=1e-10, atol=1e-13)
    assert_trees_close(jvp.grads[3], ref.grads[3], rtol=0, atol=0)  # downstream of every physical stage: exact


def test_microbatches_scale_the_model_level_scalars():
    model, x, y = mlp_problem(batch=6)
    chain, params = ef.from_module(model, loss=F.mse_loss)
    for form in ("jvp", "fd"):
        whole = ef.sweep(
            chain,
            params,
            x,
            y,
            estimator=E.node_perturbation(E.Probes(5), form="oracle"),
            physical=[1],
            microbatches=2,
            key=9,
        )
        res = ef.sweep(
            chain,
            params,
            x,
            y,
            estimator=E.node_perturbation(E.Probes(5), form=form, eps=1e-5),
            physical=[1],
            microbatches=2,
            key=9,
        )
        torch.testing.assert_close(res.adjoints[-1].value, whole.adjoints[-1].value, rtol=1e-6, atol=1e-10)


@pytest.mark.parametrize("form", ["jvp", "fd"])
def test_with_two_batch_dims_jvp_and_fd_take_their_scalar_per_sample(form):
    """np's D is per sample for every form; direct's oracle projects per position, jvp/fd per sample."""
    model, _, _ = mlp_problem()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    x, y = torch.randn(3, 2, D, dtype=F64), torch.randn(3, 2, D, dtype=F64)
    probes = E.Probes(6, batch_dims=2)
    oracle = ef.sweep(chain, params, x, y, estimator=E.node_perturbation(probes), physical=[1, 2], key=1)
    res = ef.sweep(
        chain, params, x, y, estimator=E.node_perturbation(probes, form=form, eps=1e-5), physical=[1, 2], key=1
    )
    torch.testing.assert_close(res.adjoints[-1].value, oracle.adjoints[-1].value, rtol=1e-6, atol=1e-10)
    # direct's per-sample scalar is the np scalar of a single stage
    single = ef.sweep(chain, params, x, y, estimator=E.node_perturbation(probes), physical=[2], key=1)
    res = ef.sweep(chain, params, x, y, estimator=E.direct(probes, form=form, eps=1e-5), physical=[2], key=1)
    torch.testing.assert_close(
        res.adjoints[len(chain) - 2].value, single.adjoints[len(chain) - 2].value, rtol=1e-6, atol=1e-10
    )


# ---- cost ----


def test_queries_follow_the_design_formulas():
    model, x, y = mlp_problem()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    n, physical = 8, [0, 1, 3]
    names = [chain.names[i] for i in physical]

    def stats(est):
        return ef.sweep(chain, params, x, y, estimator=est, physical=physical).stats

    B = len(x)
    s = stats(E.node_perturbation(E.Probes(n), form="fd"))
    assert [s[k]["queries"] for k in names] == [2 * n] * 3  # 2n network forwards, shared by every stage
    # the sweep's forward, prepare's forward, one folded call of 2n copies, 2n calls probing params
    assert all(s[k]["forward_calls"] == s[k]["calls"] == 3 + 2 * n for k in names)
    assert all(s[k]["rows"] == (2 + 2 * n + 2 * n) * B for k in names)
    s = stats(E.direct(E.Probes(n), form="jvp"))
    assert [s[k]["queries"] for k in names] == [2 * n * 3, 2 * n * 2, 2 * n * 1]  # sum: 2n·Σk
    assert [s[k]["jvp_calls"] for k in names] == [1, 2, 3]  # each suffix runs through the later stages
    # forwards: the sweep's, prepare's, the parameter vjp's; each jvp call runs n probe copies
    assert [s[k]["rows"] for k in names] == [(3 + c * n) * B for c in (1, 2, 3)]
    s = stats(E.zbp(E.Probes(n, chunk=3), method="fd"))
    assert all(s[k]["queries"] == 2 * n and s[k]["forward_calls"] == 1 + 3 + 2 * n for k in names)
    assert all(s[k]["rows"] == (1 + 2 * n + 2 * n) * B for k in names)
    s = stats(E.direct(E.Probes(n), form="oracle"))
    assert all(s[k]["backward_calls"] == 2 for k in names)  # the oracle's sweep, the replay's parameter vjp


# ---- errors ----


def test_bad_arguments_say_what_was_expected():
    with pytest.raises(ValueError, match="unknown kind 'normal'"):
        E.Probes(4, "normal")
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        E.Probes(0)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        E.zbp(E.Probes(4), method="fd", eps=0)
    with pytest.raises(ValueError, match="unknown method"):
        E.zbp(E.Probes(4), method="backprop")
    with pytest.raises(ValueError, match="unknown form"):
        E.direct(E.Probes(4), form="exact")
    with pytest.raises(ValueError, match="needs Probes\\(batch_dims >= 1\\)"):
        E.node_perturbation(E.Probes(4, batch_dims=0), form="fd")
    with pytest.raises(TypeError, match="expected a Probes"):
        E.zbp(4)


def test_errors_name_the_stage():
    model, x, y = mlp_problem()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    with pytest.raises(ValueError, match=r"input of stage 2 \('Sequential_2'\): batch_dims=3 exceeds the rank"):
        ef.sweep(chain, params, x, y, estimator=E.zbp(E.Probes(4, batch_dims=3), method="fd"), physical=[2])
    summed = ef.Chain(chain.stages, loss=lambda out, t: F.mse_loss(out, t, reduction="sum"))
    with pytest.raises(ValueError, match="not a per-sample mean"):
        ef.sweep(summed, params, x, y, estimator=E.direct(E.Probes(4), form="jvp"), physical=[2])
    ok = ef.sweep(summed, params, x, y, estimator=E.direct(E.Probes(4), form="jvp", reduction="sum"), physical=[2])
    assert torch.isfinite(ok.adjoints[-1].value).all()


def test_a_noisy_black_box_sees_fresh_noise_in_every_query_and_the_seed_reproduces_the_run():
    """The sweep replays the RNG for digital recomputes (dropout) only: a physical stage's noise
    drawn from torch's global RNG is independent between the forward and the estimator's queries."""
    draws = []

    def noisy(params, h):
        noise = torch.randn(h.shape, dtype=h.dtype)
        draws.append(noise[:2].clone())  # the first two rows of each call
        return torch.tanh(h) + 1e-3 * noise

    chain = ef.Chain(
        [ef.stage(lambda p, h: h @ p["w"], name="in"), ef.stage(noisy, name="box", physical=True)],
        loss=lambda out: out.square().mean(),
    )
    params = ({"w": torch.randn(8, 8, dtype=F64)}, {})
    x = torch.randn(16, 8, dtype=F64)  # 128 entries: torch draws them in the same order as a bigger call's first ones
    estimator = E.zbp(E.Probes(4, "rademacher"), method="fd", eps=1e-2)
    torch.manual_seed(0)
    first = ef.sweep(chain, params, x, estimator=estimator, key=1)
    forward, query = draws[0], draws[1]
    assert not torch.equal(forward, query)  # the first rows of the folded query are not the forward's noise
    draws.clear()
    torch.manual_seed(0)
    again = ef.sweep(chain, params, x, estimator=estimator, key=1)
    assert torch.equal(first.grads[0]["w"], again.grads[0]["w"]) and torch.equal(draws[0], forward)


def test_problem_states_are_the_forward_measured_inputs_until_the_fold_hands_them_out():
    """``problem.state(i)``: stage i's input from the tape, every stage in ``prepare``; once the
    reverse fold has handed stage i's entry out, reading it says so. A probe stream is named."""
    model, x, y = mlp_problem()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    seen = {}

    class Reader:
        scope = "stage"

        def prepare(self, problem):
            with pytest.raises(ValueError, match=r"Problem.probe_seed: stream must be one of \('input', 'params'\)"):
                problem.probe_seed(1, "weights")
            return [problem.state(i) for i in range(len(chain))]

        def stage_vjp(self, problem, prepared, i, h_in, costate):
            seen[i] = torch.equal(prepared[i], h_in)
            with pytest.raises(ValueError, match=rf"Problem.state\({i}\): stage {i} .* read states in prepare"):
                problem.state(i)
            return E.exact().stage_vjp(problem, None, i, h_in, costate)

    res = ef.sweep(chain, params, x, y, estimator=Reader(), physical=[1, 3])
    assert seen == {1: True, 3: True}
    for a, b in zip(ef.tree_leaves(res.grads), ef.tree_leaves(ef.sweep(chain, params, x, y).grads), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_a_frozen_parameter_of_a_physical_stage_gets_no_gradient():
    """The estimators' parameter vectors are dense: the fold drops what they estimate for a frozen
    parameter of a physical stage, as autograd gives it none."""
    model, x, y = mlp_problem()
    model[1][0].weight.requires_grad_(False)
    chain, params = ef.from_module(model, loss=F.mse_loss)
    ref = ef.sweep(chain, params, x, y)
    res = ef.sweep(chain, params, x, y, estimator=E.exact(), physical=[1])
    assert ref.grads[1]["0.weight"] is None and res.grads[1]["0.weight"] is None
    assert_trees_close(res.grads, ref.grads, rtol=0, atol=0)


class WrongShape:
    """An estimator whose input costate has one row too many."""

    def prepare(self, problem):
        return None

    def stage_vjp(self, problem, prepared, i, h_in, costate):
        grads, g_in = E.exact().stage_vjp(problem, prepared, i, h_in, costate)[:2]
        return grads, torch.cat([g_in, g_in[:1]]), {}


def test_an_estimators_costate_of_another_shape_is_refused_naming_the_stage():
    model, x, y = mlp_problem()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    with pytest.raises(
        ValueError,
        match=r"costate entering stage 1 .* at boundary 2: costate shape \(6, 4\) differs from the stage output shape \(5, 4\)",
    ):
        ef.sweep(chain, params, x, y, estimator=WrongShape(), physical=[2])
