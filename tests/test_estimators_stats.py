"""Statistical properties of the estimators against the theory of docs/estimators.md.

Every batch position (sample) has its own probes, so one sweep on a batch of B samples gives
B independent estimates; K keys give K·B. Bounds are many standard errors wide: a correct
estimator fails them with negligible probability (seeds are fixed anyway), a biased one or a
wrong variance (off by a factor, a missing ±1 in d±1) cannot pass.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import eae_func as ef
from eae_func import estimators as E

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
    pytest.mark.usefixtures("one_thread"),
]

F64 = torch.float64


def setup(width: int = 4, batch: int = 128, depth: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]).to(F64)
    chain, params = ef.from_module(model, loss=F.mse_loss)
    x, y = torch.randn(batch, width, dtype=F64), 2 * torch.randn(batch, width, dtype=F64)
    exact = ef.sweep(chain, params, x, y)
    return chain, params, x, y, {i: exact.adjoints[len(chain) - i].value for i in range(len(chain))}


def estimates(chain, params, x, y, estimator, physical, keys: int, stage: int) -> torch.Tensor:
    """``(keys, B, d)``: the estimated input costate of ``stage`` for keys 0..keys-1."""
    return torch.stack(
        [
            ef.sweep(chain, params, x, y, estimator=estimator, physical=physical, key=k)
            .adjoints[len(chain) - stage]
            .value
            for k in range(keys)
        ]
    )


def projection_variance(kind: str, g: torch.Tensor, n: int, others: torch.Tensor | None = None) -> torch.Tensor:
    """Per-coordinate variance of ĝ = (1/n) Σ u_i D_i with D_i = <u_i, g> + <v_i, h> (v independent of u,
    ``others`` = |h|^2 per sample, zero for a plain projection), exact directional derivatives."""
    d = g.shape[-1]
    sq = (g * g).sum(-1, keepdim=True)
    rest = 0 if others is None else others.unsqueeze(-1)
    if kind == "gaussian":  # E u_j^2 (u.g)^2 = |g|^2 + 2 g_j^2
        second = sq + 2 * g * g
    elif kind == "rademacher":  # u_j^2 = 1
        second = sq
    elif kind == "sphere":  # E u_j^2 u_k^2 = d/(d+2) (j != k), E u_j^4 = 3d/(d+2)
        second = d / (d + 2) * (sq + 2 * g * g)
    else:
        raise ValueError(kind)
    return (second + rest - g * g) / n


def assert_unbiased(samples: torch.Tensor, g: torch.Tensor, variance: torch.Tensor) -> None:
    """The mean of K estimates is within the standard error the theory predicts of g."""
    z = (samples.mean(0) - g) / (variance / samples.shape[0]).sqrt()
    assert z.abs().max() < 6, f"max |z| = {z.abs().max():.2f}"
    assert (z * z).mean() < 1.5, f"mean z^2 = {(z * z).mean():.2f} over {z.numel()} coordinates (expected ≈ 1)"


def relative_error(samples: torch.Tensor, g: torch.Tensor) -> float:
    """Measured E|ĝ − g|^2 / |g|^2, pooled over keys and samples."""
    return ((samples - g) ** 2).sum().item() / (samples.shape[0] * (g * g).sum().item())


KEYS = 100
MAKE = {
    "zbp-jvp": lambda p: E.zbp(p, method="jvp"),
    "zbp-fd": lambda p: E.zbp(p, method="fd", eps=1e-5),
    "direct-oracle": lambda p: E.direct(p, form="oracle"),
    "direct-jvp": lambda p: E.direct(p, form="jvp"),
    "direct-fd": lambda p: E.direct(p, form="fd", eps=1e-5),
}
SINGLE = [(name, kind) for name in ("zbp-jvp", "direct-oracle") for kind in ("gaussian", "rademacher", "sphere")]
SINGLE += [("zbp-fd", "rademacher"), ("direct-jvp", "sphere"), ("direct-fd", "gaussian")]


@pytest.mark.parametrize("name,kind", SINGLE)
def test_single_projection_is_unbiased_with_the_predicted_variance(name, kind):
    make = MAKE[name]
    chain, params, x, y, g = setup()
    n = 6
    samples = estimates(chain, params, x, y, make(E.Probes(n, kind)), [2], KEYS, stage=2)
    assert_unbiased(samples, g[2], projection_variance(kind, g[2], n))
    d = g[2].shape[-1]
    table = (d + 1) / n if kind == "gaussian" else (d - 1) / n
    assert 0.9 < relative_error(samples, g[2]) / table < 1.1


@pytest.mark.parametrize("form", ["oracle", "jvp", "fd"])
def test_node_perturbation_is_unbiased_with_cross_stage_variance(form):
    chain, params, x, y, g = setup()
    n, physical = 6, [1, 3]
    est = E.node_perturbation(E.Probes(n), form=form, eps=1e-5)
    runs = [ef.sweep(chain, params, x, y, estimator=est, physical=physical, key=k) for k in range(KEYS)]
    norms = {i: (g[i] ** 2).sum(-1) for i in physical}
    for i, other in ((1, 3), (3, 1)):
        samples = torch.stack([r.adjoints[len(chain) - i].value for r in runs])
        assert_unbiased(samples, g[i], projection_variance("gaussian", g[i], n, others=norms[other]))
        d = g[i].shape[-1]  # docs/estimators.md (gaussian np): [(d+1)|g_l|^2 + d Σ_{l'≠l} |g_l'|^2] / n per sample
        theory = ((d + 1) * norms[i] + d * norms[other]).sum().item() / n
        measured = ((samples - g[i]) ** 2).sum().item() / KEYS
        assert 0.9 < measured / theory < 1.1


def test_chained_zbp_is_unbiased_across_two_physical_stages():
    """The upstream estimate uses the downstream one; probes are independent, so the mean still is g."""
    chain, params, x, y, g = setup()
    samples = estimates(chain, params, x, y, E.zbp(E.Probes(4)), [1, 2], 4 * KEYS, stage=1)
    variance = samples.var(0)  # the compounded variance has no closed form here: use the measured one
    z = (samples.mean(0) - g[1]) / (variance / samples.shape[0]).sqrt()
    assert z.abs().max() < 6 and (z * z).mean() < 1.5


def test_probe_kinds_rank_by_variance_as_the_table_says():
    chain, params, x, y, g = setup(width=8, batch=64)
    n, d = 2, 8  # orthogonal: d/n - 1 = 3 (at n = d/2 its error would be exactly |g|^2, not random)
    errors = {}
    for kind in ("gaussian", "rademacher", "sphere", "orthogonal"):
        samples = estimates(chain, params, x, y, E.direct(E.Probes(n, kind)), [2], KEYS, stage=2)
        errors[kind] = relative_error(samples, g[2])
    assert_unbiased(samples, g[2], samples.var(0))  # orthogonal: no closed form per coordinate here
    table = {"gaussian": (d + 1) / n, "rademacher": (d - 1) / n, "sphere": (d - 1) / n, "orthogonal": d / n - 1}
    for kind, error in errors.items():
        assert 0.9 < error / table[kind] < 1.1, (kind, error, table[kind])
    assert errors["orthogonal"] < errors["rademacher"] < errors["gaussian"]
    full = estimates(chain, params, x, y, E.direct(E.Probes(d, "orthogonal")), [2], 2, stage=2)
    torch.testing.assert_close(full, g[2].expand_as(full), rtol=1e-10, atol=1e-14)  # n = d: exact


def test_antithetic_pairs_repeat_each_term_with_exact_derivatives():
    """(−u)(−u)ᵀg = u uᵀg: n antithetic probes are n/2 independent ones, the variance of n/2."""
    chain, params, x, y, g = setup()
    n, d = 8, 4
    samples = estimates(chain, params, x, y, E.direct(E.Probes(n, antithetic=True)), [2], KEYS, stage=2)
    assert_unbiased(samples, g[2], projection_variance("gaussian", g[2], n // 2))
    assert 0.9 < relative_error(samples, g[2]) / ((d + 1) / (n // 2)) < 1.1


def test_cosine_approaches_one_as_n_grows():
    chain, params, x, y, g = setup(width=8, batch=32)
    d, cosines = 8, {}
    for n in (4, 64, 1024):
        est = ef.sweep(chain, params, x, y, estimator=E.direct(E.Probes(n)), physical=[2], key=1)
        cosines[n] = F.cosine_similarity(est.adjoints[len(chain) - 2].value, g[2], dim=-1).mean().item()
        assert abs(cosines[n] - math.sqrt(n / (d + n))) < 0.1  # the table's E cos, per sample
    assert cosines[4] < cosines[64] < cosines[1024]
    assert cosines[1024] > 0.99
