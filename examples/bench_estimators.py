"""Forward-only estimators for physical stages: accuracy, queries and time (a benchmark, not a test).

Two chains with black-box stages:
  * mlp:         8 stages Linear(w, w) + tanh, stages 2 and 5 replaced by a fixed physical
                 medium tanh(h M) (M a random buffer, no trainable parameters);
  * transformer: 4 pre-norm blocks (eae_func.models.Block), blocks 1 and 2 physical (their
                 parameters are trained through the estimator: exact local vjp for jvp/oracle,
                 probed parameter directions for fd).
For every estimator and n in {8, 32, 128, 512}: the cosine similarity of every physical
stage's estimated input costate to the exact one (flattened over the batch), of all the
parameter gradients (concatenated) to the exact ones, the queries per sample (summed over
the physical stages, res.stats: input probing + parameter probing) and the wall time of
one ``ef.sweep``. Then the speed-up of the batched estimators (all probes in one vmapped /
folded call) over the same estimator run one probe at a time (chunk=1: a Python loop over
probes) at n = 64. Plots cosine vs n per estimator into ``--out`` (default ``./eae_out``;
matplotlib, from the ``examples`` extra).

With --control-variate, only the twin as a control variate (docs/estimators.md): one physical
stage tanh(h W), d 64, n 8, twins at r ≈ 0.075 and 1.2; MSE relative to zbp's over --keys keys
beside the formula, bias in standard errors, the fd truncation rows, and MSE against r in
``--out``/control_variate_mse.png; then np and direct with and without twins 5% off on a token
model with two physical stages (--keys / 5 keys).

    python examples/bench_estimators.py                      # full table
    python examples/bench_estimators.py --quick              # small models, n in {8, 32}
    python examples/bench_estimators.py --control-variate    # the control-variate table and plot
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time

import torch
import torch.nn.functional as F
from torch import nn

import eae_func as ef
from eae_func import estimators as E
from eae_func.models import Block

from extras import add_out, pyplot, save

ESTIMATORS = {
    "zbp-jvp": lambda p, eps: E.zbp(p, method="jvp"),
    "zbp-fd": lambda p, eps: E.zbp(p, method="fd", eps=eps),
    "np-oracle": lambda p, eps: E.node_perturbation(p, form="oracle"),
    "np-jvp": lambda p, eps: E.node_perturbation(p, form="jvp"),
    "np-fd": lambda p, eps: E.node_perturbation(p, form="fd", eps=eps),
    "direct-oracle": lambda p, eps: E.direct(p, form="oracle"),
    "direct-jvp": lambda p, eps: E.direct(p, form="jvp"),
    "direct-fd": lambda p, eps: E.direct(p, form="fd", eps=eps),
}


class Medium(nn.Module):
    """A fixed physical transform ``tanh(h M)``: a black box with no trainable parameters."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("mixing", torch.randn(width, width) / math.sqrt(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.mixing)


def mlp_problem(width: int, batch: int):
    torch.manual_seed(0)
    layers = [Medium(width) if i in (2, 5) else nn.Sequential(nn.Linear(width, width), nn.Tanh()) for i in range(8)]
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    return nn.Sequential(*layers), x, y, [2, 5]


def transformer_problem(dim: int, seq: int, batch: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(dim, n_heads=4, n_kv_heads=2, ffn_hidden=2 * dim) for _ in range(4)])
    x, y = torch.randn(batch, seq, dim), torch.randn(batch, seq, dim)
    return model, x, y, [1, 2]


def flat_grads(grads) -> torch.Tensor:
    return torch.cat([g.flatten() for g in ef.tree_leaves(grads)])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def measure(chain, params, x, y, physical, estimator) -> dict:
    start = time.perf_counter()
    res = ef.sweep(chain, params, x, y, estimator=estimator, physical=physical, key=0)
    wall = time.perf_counter() - start
    names = [chain.names[i] for i in physical]
    return {
        "res": res,
        "wall": wall,
        "queries": sum(res.stats[k].get("queries", 0) + res.stats[k].get("param_queries", 0) for k in names),
    }


def accuracy_table(label, model, x, y, physical, ns, chunk, eps) -> dict:
    chain, params = ef.from_module(model, loss=F.mse_loss)
    exact = ef.sweep(chain, params, x, y)
    L = len(chain)
    print(f"\n### {label}: physical stages {physical}, input {tuple(x.shape)}\n")
    print("| estimator | n | cos p_in per physical stage | cos grads | queries / sample | time (ms) |")
    print("|---|---:|---|---:|---:|---:|")
    curves = {}
    for make in ESTIMATORS.values():  # warm-up: forward-AD decompositions load on first use
        measure(chain, params, x, y, physical, make(E.Probes(2), eps))
    for name, make in ESTIMATORS.items():
        for n in ns:
            m = measure(chain, params, x, y, physical, make(E.Probes(n, chunk=min(chunk, n)), eps))
            cos_p = [cosine(m["res"].adjoints[L - i].value, exact.adjoints[L - i].value) for i in physical]
            cos_g = cosine(flat_grads(m["res"].grads), flat_grads(exact.grads))
            curves.setdefault(name, []).append(sum(cos_p) / len(cos_p))
            print(
                f"| {name} | {n} | {' / '.join(f'{c:.3f}' for c in cos_p)} | {cos_g:.3f} | "
                f"{m['queries']} | {1e3 * m['wall']:.1f} |"
            )
    return curves


def speedup_table(label, model, x, y, physical, n, eps, repeats) -> None:
    """Batched (one chunk of n probes) vs one probe at a time (chunk=1), best of ``repeats``: whole
    sweeps, and the estimator alone (sweep minus the plain exact sweep)."""
    chain, params = ef.from_module(model, loss=F.mse_loss)

    def best(estimator) -> float:
        ef.sweep(chain, params, x, y, estimator=estimator, physical=physical)  # warm-up
        return min(measure(chain, params, x, y, physical, estimator)["wall"] for _ in range(repeats))

    plain = best(E.exact())  # the exact sweep: every physical stage differentiated
    print(
        f"\n### {label}: batched probes vs a Python loop over probes (chunk=1), n = {n}; "
        f"plain sweep {1e3 * plain:.1f} ms\n"
    )
    print("| estimator | batched sweep (ms) | loop sweep (ms) | speed-up, sweep | speed-up, estimator alone |")
    print("|---|---:|---:|---:|---:|")
    for name, make in ESTIMATORS.items():
        batched, loop = (best(make(E.Probes(n, chunk=chunk), eps)) for chunk in (n, 1))
        alone = (loop - plain) / max(batched - plain, 1e-6)
        print(f"| {name} | {1e3 * batched:.1f} | {1e3 * loop:.1f} | {loop / batched:.1f}x | {alone:.1f}x |")


def plot(plt, curves: dict, ns: list, out: pathlib.Path) -> None:
    colors = {"zbp": "tab:blue", "np": "tab:orange", "direct": "tab:green"}
    styles = {"jvp": ("-", "o"), "fd": (":", "^"), "oracle": ("--", "s")}  # forms coincide for the same probes
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.2), squeeze=False)
    for ax, (label, by_estimator) in zip(axes[0], curves.items()):
        for name, values in by_estimator.items():
            family, form = name.split("-")
            linestyle, marker = styles[form]
            ax.plot(ns, values, color=colors[family], linestyle=linestyle, marker=marker, label=name, alpha=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("probes n")
        ax.set_ylabel("cos(estimated p_in, exact), mean over physical stages")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    save(fig, out, "estimators_cosine.png", dpi=120)


def one_stage(d: int, batch: int):
    """One physical stage ``tanh(h W)`` (d inputs and outputs, no parameters) under an MSE loss, and
    ``twin(c)``: the stage with ``W + c Δ`` (Δ fixed), a twin whose error grows with c."""
    g = torch.Generator().manual_seed(0)
    w, delta = (torch.randn(d, d, generator=g) / math.sqrt(d) for _ in range(2))
    x, y = torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)
    chain = ef.Chain([ef.stage(lambda p, h: torch.tanh(h @ w), name="medium", physical=True)], loss=F.mse_loss)
    return chain, ({},), x, y, lambda c: lambda p, h: torch.tanh(h @ (w + c * delta))


def twin_at(chain, params, x, y, g, make_twin, r: float):
    """The twin of ``make_twin`` whose costate error ‖s − g‖ / ‖g‖ is r (bisection on c), its s and r."""

    def error(c):
        s = ef.sweep(chain, params, x, y, estimator=E.twin(make_twin(c))).adjoints[-1].value
        return ((s - g).norm() / g.norm()).item(), s

    lo, hi = 0.0, 1.0
    while error(hi)[0] < r:
        hi *= 2
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if error(mid)[0] < r else (lo, mid)
    return make_twin(hi), *error(hi)[::-1]


def draws(chain, params, x, y, estimator, keys: int) -> tuple[torch.Tensor, float]:
    """``(keys, B, d)`` estimates for keys 0..keys-1 (an ``observe``-ing estimator threaded), and the
    mean β the stats report (nan without one)."""
    out, betas = [], []
    for k in range(keys):
        res = ef.sweep(chain, params, x, y, estimator=estimator, key=k)
        out.append(res.adjoints[-1].value)
        betas.append(float(res.stats["medium"].get("beta", math.nan)))
        if hasattr(estimator, "observe"):
            estimator = estimator.observe(res)
    return torch.stack(out).double(), sum(betas) / len(betas)


def bias_in_se(samples: torch.Tensor, g: torch.Tensor) -> tuple[float, float]:
    """The mean error along g in standard errors (measured over the keys), and the rms over
    coordinates of the per-coordinate z (≈ 1 when unbiased)."""
    along = ((samples - g) * g).flatten(1).sum(1) / g.norm()
    z_g = along.mean() / (along.std() / math.sqrt(len(along)))
    z = (samples.mean(0) - g) / (samples.var(0) / len(samples)).sqrt()
    return z_g.item(), z.pow(2).mean().sqrt().item()


def control_variate_table(keys: int, d: int = 64, n: int = 8, batch: int = 8, plot=None) -> None:
    """The twin as a control variate on one physical stage (d 64, n 8 rademacher probes, exact
    directional derivatives): MSE over ``keys`` keys relative to zbp's, beside the formula
    (d−1)/n·‖g − βs‖² (relative: ‖g − βs‖² / ‖g‖²), and the bias in standard errors; then zbp fd
    at ε = 0.3, where exact <u, s> exposes the central differences' truncation and the twin's own
    central differences cancel it. With ``plot`` (pyplot, folder): MSE against the twin's error."""
    chain, params, x, y, make_twin = one_stage(d, batch)
    g = ef.sweep(chain, params, x, y, estimator=E.exact()).adjoints[-1].value.double()
    probes = E.Probes(n, "rademacher")
    zbp = E.zbp(probes)
    base = ((draws(chain, params, x, y, zbp, keys)[0] - g) ** 2).sum().item() / keys
    theory = (d - 1) / n
    print(
        f"\n### The twin as a control variate: one stage tanh(h W), d = {d}, batch {batch}, n = {n} rademacher, {keys} keys\n"
    )
    print(f"zbp: MSE / ‖g‖² = {base / (g * g).sum().item():.3f} (formula (d−1)/n = {theory:.3f})\n")
    print("| twin r | estimator | mean β | MSE / zbp's | formula | bias along g (SE) | rms z over coords |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in (0.075, 1.2):
        twin, s, r = twin_at(chain, params, x, y, g, make_twin, r)
        s = s.double()
        pat = ((s - g) ** 2).sum().item()
        print(
            f"| {r:.3f} | PAT (E.twin) | | {pat / base:.4f} | {pat / (theory * (g * g).sum().item()):.4f} | (bias s − g) | |"
        )
        for beta in (1.0, "ema", "xfit"):
            samples, mean_beta = draws(chain, params, x, y, E.control_variate(zbp, twin, beta), keys)
            mse = ((samples - g) ** 2).sum().item() / keys
            formula = ((g - s) ** 2).sum().item() / (g * g).sum().item() if beta == 1.0 else ""
            z_g, z_rms = bias_in_se(samples, g)
            formula = f"{formula:.4f}" if formula != "" else ""
            print(
                f"| {r:.3f} | control variate β={beta} | {mean_beta:.3f} | {mse / base:.4f} | {formula} | {z_g:+.2f} | {z_rms:.2f} |"
            )
    twin, s, r = twin_at(chain, params, x, y, g, make_twin, 0.075)
    fd = E.zbp(probes, method="fd", eps=0.3)
    print(f"\nzbp fd at ε = 0.3, twin r = {r:.3f}, β = 1: the bias in SE\n")
    print("| estimator | MSE / zbp's (jvp) | bias along g (SE) | rms z over coords |")
    print("|---|---:|---:|---:|")
    for name, estimator in (
        ("zbp fd", fd),
        ("control variate, exact <u, s>", E.control_variate(fd, twin)),
        ("control variate, twin's central differences", E.control_variate(fd, twin, twin_directional="fd")),
    ):
        samples = draws(chain, params, x, y, estimator, keys)[0]
        z_g, z_rms = bias_in_se(samples, g)
        print(f"| {name} | {((samples - g) ** 2).sum().item() / keys / base:.4f} | {z_g:+.1f} | {z_rms:.2f} |")
    if plot is not None:
        plot_control_variate(chain, params, x, y, g, make_twin, zbp, base, theory, max(keys // 5, 20), *plot)


def shrinkage_table(keys: int, d: int = 64, n: int = 8, batch: int = 8, horizon: int = 10) -> None:
    """The shrinkage control variate s + λ(ĝ_cv − s) beside zbp, PAT and the control variate on one
    stage (d 64, n 8 gaussian probes, exact directional derivatives), twin errors 0.075 / 0.44 / 1.2:
    one step's MSE and the MSE of the mean of ``horizon`` estimates at fixed parameters, over ``keys``
    keys, relative to ‖g‖²; λ = "auto" for one step (λ* = n/(n + d + 1)) and for ``horizon`` steps; and
    twin-guided probes (``E.guided``: one probe along the twin's costate, the rest orthogonal to it)."""
    chain, params, x, y, make_twin = one_stage(d, batch)
    g = ef.sweep(chain, params, x, y, estimator=E.exact()).adjoints[-1].value.double()
    g2 = (g * g).sum().item()
    zbp = E.zbp(E.Probes(n, "gaussian"))
    zbp_samples = draws(chain, params, x, y, zbp, keys)[0]

    def mse(samples: torch.Tensor, average: int) -> float:
        means = samples[: len(samples) // average * average]
        means = means.reshape(-1, average, *samples.shape[1:]).mean(1)
        return ((means - g) ** 2).sum().item() / len(means) / g2

    print(
        f"\n### Shrinkage: one stage tanh(h W), d = {d}, batch {batch}, n = {n} gaussian, {keys} keys; "
        f"MSE / ‖g‖², one step and the mean of {horizon} (h = {horizon})\n"
    )
    print(
        f"| twin r | zbp | PAT | control variate | shrink auto (h = 1) | shrink auto (h = {horizon}) | "
        f"λ (h = 1 / {horizon}) | guided probes (vs zbp) | guided + shrink auto (h = 1) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in (0.075, 0.44, 1.2):
        twin, s, r = twin_at(chain, params, x, y, g, make_twin, r)
        pat = ((s.double() - g) ** 2).sum().item() / g2
        cv = draws(chain, params, x, y, E.control_variate(zbp, twin), keys)[0]
        one = E.control_variate(zbp, twin, shrink="auto")
        many = E.control_variate(zbp, twin, shrink="auto", horizon=horizon)
        lam = [float(ef.sweep(chain, params, x, y, estimator=e).stats["medium"]["shrink"]) for e in (one, many)]
        one_s, many_s = draws(chain, params, x, y, one, keys)[0], draws(chain, params, x, y, many, keys)[0]
        guided = mse(draws(chain, params, x, y, E.guided(zbp, twin), keys)[0], 1)
        shrunk = E.control_variate(E.guided(zbp, twin), twin, shrink="auto")
        guided_shrunk = mse(draws(chain, params, x, y, shrunk, keys)[0], 1)
        cells = [
            f"{mse(zbp_samples, 1):.3f} / {mse(zbp_samples, horizon):.3f}",
            f"{pat:.4f}",
            f"{mse(cv, 1):.4f} / {mse(cv, horizon):.4f}",
            f"{mse(one_s, 1):.4f} ({mse(one_s, 1) / min(pat, mse(cv, 1), mse(zbp_samples, 1)):.2f}x the best)",
            f"{mse(many_s, horizon):.4f} ({mse(many_s, horizon) / min(pat, mse(cv, horizon), mse(zbp_samples, horizon)):.2f}x)",
            f"{lam[0]:.3f} / {lam[1]:.3f}",
            f"{guided:.4f} ({guided / mse(zbp_samples, 1):.3f}x)",
            f"{guided_shrunk:.4f} ({guided_shrunk / min(pat, mse(cv, 1), mse(zbp_samples, 1)):.2f}x the best)",
        ]
        print(f"| {r:.3f} | " + " | ".join(cells) + " |")
    print("\n(zbp and the control variate: one step / the mean of h; PAT's bias does not average.)")


def history_table(steps: int, widths=(3, 8), n: int = 8, batch: int = 8, lr: float = 0.05) -> None:
    """Guided fd parameter directions (``E.guided(..., history=k)``): a physical stage linear in its
    width² parameters (``h W``, central differences exact) between two digital ones, and a twin
    ((h A) W, A off by noise) whose parameter gradient is off by r; the parameter estimate's MSE /
    ‖g_W‖² over ``steps`` steps (the first 10 dropped), at fixed parameters and while SGD at ``lr``
    moves them (g_W exact at each step): history 0 (the twin's direction only), the span of the last
    1, 2 or 4 estimates, and the mean of the last 4 or 16."""
    print(
        f"\n### Guided parameter directions with history: h W (d = width² parameters), batch {batch}, "
        f"n = {n} gaussian fd, {steps} steps; parameter MSE / ‖g_W‖²\n"
    )
    guides = ((0, "span"), (1, "span"), (2, "span"), (4, "span"), (4, "mean"), (16, "mean"))
    print(
        "| d | twin r | parameters | fd (unguided) | "
        + " | ".join(f"{c} of {k}" if k else "twin only" for k, c in guides)
        + " |"
    )
    print("|---:|---:|---|---:|" + "---:|" * len(guides))
    for width, off in ((w, off) for w in widths for off in (0.3, 1.5)):
        g = torch.Generator().manual_seed(5)
        mix = torch.eye(width) + off * torch.randn(width, width, generator=g) / math.sqrt(width)
        chain = ef.Chain(
            [
                ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name="digital0"),
                ef.stage(lambda p, h: h @ p["w"], name="box", physical=True),
                ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name="digital1"),
            ],
            loss=F.mse_loss,
        )
        start = tuple({"w": torch.randn(width, width, generator=g) / math.sqrt(width)} for _ in range(3))
        x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)

        def twin(p, h, mix=mix):
            return (h @ mix) @ p["w"]

        def exact(params, chain=chain, x=x, y=y):
            return ef.sweep(chain, params, x, y, estimator=E.exact()).grads[1]["w"].flatten()

        s = ef.sweep(chain, start, x, y, estimator=E.twin(twin)).grads[1]["w"].flatten()
        r = ((s - exact(start)).norm() / exact(start).norm()).item()
        fd = E.zbp(E.Probes(n), method="fd", eps=1e-2)
        for training in (False, True):
            cells = []
            for estimator in (fd, *(E.guided(fd, twin, history=k, combine=c) for k, c in guides)):
                params, errors = start, []
                for step in range(steps):
                    res = ef.sweep(chain, params, x, y, estimator=estimator, key=step)
                    want = exact(params)
                    errors.append(((res.grads[1]["w"].flatten() - want) ** 2).sum().item() / (want @ want).item())
                    if hasattr(estimator, "observe"):
                        estimator = estimator.observe(res)
                    if training:
                        params = tuple({"w": p["w"] - lr * gr["w"]} for p, gr in zip(params, res.grads))
                cells.append(f"{sum(errors[10:]) / len(errors[10:]):.4f}")
            where = f"SGD lr {lr:g}" if training else "fixed"
            print(f"| {width * width} | {r:.2f} | {where} | " + " | ".join(cells) + " |")


def token_model(batch: int = 4, tokens: int = 6, width: int = 8, vocab: int = 16, off: float = 0.05):
    """embedding, digital, physical, digital, physical, linear head + cross-entropy; the physical
    stages ``tanh(h M_k)`` per token, and their twins with ``M_k`` off by ``off`` (relative, random)."""
    g = torch.Generator().manual_seed(1)
    mixing = [torch.randn(width, width, generator=g) / math.sqrt(width) for _ in range(2)]
    twins = [m + off * m.std() * torch.randn(width, width, generator=g) for m in mixing]

    def medium(m):
        return lambda p, h: torch.tanh(h @ m)

    chain = ef.Chain(
        [
            ef.stage(lambda p, ids: p["table"][ids], name="embedding"),
            ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name="digital1"),
            ef.stage(medium(mixing[0]), name="physical1", physical=True),
            ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name="digital2"),
            ef.stage(medium(mixing[1]), name="physical2", physical=True),
            ef.stage(lambda p, h: h @ p["w"], name="head"),
        ],
        loss=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
    )
    params = (
        {"table": torch.randn(vocab, width, generator=g)},
        {"w": torch.randn(width, width, generator=g) / math.sqrt(width)},
        {},
        {"w": torch.randn(width, width, generator=g) / math.sqrt(width)},
        {},
        {"w": torch.randn(width, vocab, generator=g) / math.sqrt(width)},
    )
    ids = torch.randint(0, vocab, (batch, tokens), generator=g)
    y = torch.randint(0, vocab, (batch, tokens), generator=g)
    return chain, params, ids, y, {"physical1": medium(twins[0]), "physical2": medium(twins[1])}


def token_table(keys: int, n: int = 8, off: float = 0.05) -> None:
    """np and direct (jvp form, n rademacher probes per sample, tokens × features in one probe) with
    and without the twins as a control variate (β = 1, and shrunk: λ "auto"), and with probes guided by
    the twins (alone and shrunk) on ``token_model``: MSE over ``keys`` keys of
    both physical stages' input costates and of the upstream parameter gradients (embedding and
    digital1), relative to the wrapped estimator's, at the same rows of the black boxes."""
    chain, params, ids, y, twins = token_model(off=off)
    exact = ef.sweep(chain, params, ids, y, estimator=E.exact())
    pat = ef.sweep(chain, params, ids, y, estimator=E.twin(twins))
    L = len(chain)
    rs = [
        (pat.adjoints[L - i].value - exact.adjoints[L - i].value).norm() / exact.adjoints[L - i].value.norm()
        for i in (2, 4)
    ]

    def errors(estimator, keys: int = keys) -> tuple[list, int]:
        total, rows = [0.0] * 4, 0
        for k in range(keys):
            res = ef.sweep(chain, params, ids, y, estimator=estimator, key=k)
            got = [res.adjoints[L - i].value for i in (2, 4)] + [res.grads[0]["table"], res.grads[1]["w"]]
            want = [exact.adjoints[L - i].value for i in (2, 4)] + [exact.grads[0]["table"], exact.grads[1]["w"]]
            total = [t + ((a - b) ** 2).sum().item() / keys for t, a, b in zip(total, got, want)]
            rows = res.stats["physical1"]["rows"] + res.stats["physical2"]["rows"]
        return total, rows

    print(
        f"\n### Control variate at the model level: token model (batch 4, 6 tokens, width 8, two physical "
        f"stages), twins {off:.0%} off (costate error r = {rs[0]:.3f} / {rs[1]:.3f}), n = {n}, {keys} keys\n"
    )
    print("| estimator | rows / step | MSE ratio: p_in physical1 | p_in physical2 | grad embedding | grad digital1 |")
    print("|---|---:|---:|---:|---:|---:|")
    twin_errors, twin_rows = errors(E.twin(twins), 1)  # deterministic: its bias alone
    for name, make in (("np", E.node_perturbation), ("direct", E.direct)):
        wrapped = make(E.Probes(n, "rademacher"), form="jvp")
        base, rows = errors(wrapped)
        print(f"| {name} | {rows} | 1 | 1 | 1 | 1 |")
        print(f"| PAT (E.twin) | {twin_rows} | " + " | ".join(f"{m / b:.4f}" for m, b in zip(twin_errors, base)) + " |")
        variants = {
            "control variate": E.control_variate(wrapped, twins),
            'shrinkage cv (λ "auto")': E.control_variate(wrapped, twins, shrink="auto"),
            "guided probes": E.guided(wrapped, twins),
            'guided probes + shrinkage cv (λ "auto")': E.control_variate(
                E.guided(wrapped, twins), twins, shrink="auto"
            ),
        }
        for label, estimator in variants.items():
            mine, cv_rows = errors(estimator)
            print(f"| {name} + {label} | {cv_rows} | " + " | ".join(f"{m / b:.4f}" for m, b in zip(mine, base)) + " |")


def plot_control_variate(chain, params, x, y, g, make_twin, zbp, base, theory, keys, plt, out) -> None:
    """MSE / zbp's against the twin's error r for PAT, the control variate (β 1 and "ema"), the
    shrinkage control variate (λ "auto", one step) and twin-guided probes, measured over ``keys``
    keys, beside the formulas r² / ((d−1)/n) (PAT), r² (β = 1) and ‖g − β*s‖² / ‖g‖² (the best β,
    which "ema" estimates), into ``out/control_variate_mse.png``."""
    rs = [0.05, 0.1, 0.2, 0.4, 0.7, 1.0, 1.4, 2.0]
    estimators = {
        "control variate β=1.0": lambda twin: E.control_variate(zbp, twin),
        "control variate β=ema": lambda twin: E.control_variate(zbp, twin, "ema"),
        "shrinkage cv (λ auto)": lambda twin: E.control_variate(zbp, twin, shrink="auto"),
        "guided probes": lambda twin: E.guided(zbp, twin),
    }
    measured: dict = {"PAT": [], **{name: [] for name in estimators}}
    actual, best = [], []
    for target in rs:
        twin, s, r = twin_at(chain, params, x, y, g, make_twin, target)
        actual.append(r)
        s = s.double()
        best.append(((g - (g * s).sum() / (s * s).sum() * s) ** 2).sum().item() / (g * g).sum().item())
        measured["PAT"].append(((s.double() - g) ** 2).sum().item() / base)
        for name, make in estimators.items():
            samples = draws(chain, params, x, y, make(twin), keys)[0]
            measured[name].append(((samples - g) ** 2).sum().item() / keys / base)
    fig, ax = plt.subplots(figsize=(6, 4.4))
    colors = {
        "PAT": "tab:red",
        "control variate β=1.0": "tab:blue",
        "control variate β=ema": "tab:green",
        "shrinkage cv (λ auto)": "tab:purple",
        "guided probes": "tab:orange",
    }
    for name, values in measured.items():
        ax.plot(actual, values, marker="o", linestyle="none", color=colors[name], label=f"{name} (measured)")
    grid = torch.linspace(min(actual), max(actual), 100)
    ax.plot(grid, grid**2 / theory, color="tab:red", alpha=0.6, label="PAT: r² / ((d−1)/n)")
    ax.plot(grid, grid**2, color="tab:blue", alpha=0.6, label="β = 1: r²")
    ax.plot(actual, best, color="tab:green", alpha=0.6, label="β* = <g,s>/‖s‖²: ‖g − β*s‖² / ‖g‖²")
    ax.axhline(1.0, color="gray", linestyle=":", label="zbp")
    ax.set(xscale="log", yscale="log", xlabel="twin error r = ‖s − g‖ / ‖g‖", ylabel="MSE / zbp's MSE")
    ax.set_title(f"one stage, d = {g.shape[-1]}, n = {zbp.probes.n}: MSE against the twin's error")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, out, "control_variate_mse.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small models, n in {8, 32}, speed-ups at n = 16 once")
    parser.add_argument("--eps", type=float, default=1e-3, help="finite-difference step (float32)")
    parser.add_argument("--chunk", type=int, default=128, help="probes per chunk (memory bound)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (small problems: 1)")
    add_out(parser)
    parser.add_argument("--control-variate", action="store_true", help="only the control-variate table (and plot)")
    parser.add_argument("--keys", type=int, default=1000, help="keys of the control-variate table")
    args = parser.parse_args()
    plt = pyplot()  # a missing matplotlib says so before anything runs
    torch.set_num_threads(args.threads)
    if args.control_variate:
        control_variate_table(50 if args.quick else args.keys, plot=None if args.quick else (plt, args.out))
        shrinkage_table(50 if args.quick else args.keys)
        token_table(20 if args.quick else args.keys // 5)
        history_table(20 if args.quick else args.keys // 5)
        return
    ns = [8, 32] if args.quick else [8, 32, 128, 512]
    width, batch = (16, 8) if args.quick else (64, 32)
    dim, seq, tbatch = (16, 8, 2) if args.quick else (32, 16, 4)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), float32, eps = {args.eps:g}")

    problems = {"deep MLP": mlp_problem(width, batch), "transformer": transformer_problem(dim, seq, tbatch)}
    curves = {label: accuracy_table(label, *p, ns, args.chunk, args.eps) for label, p in problems.items()}
    for label, p in problems.items():
        speedup_table(label, *p, n=16 if args.quick else 64, eps=args.eps, repeats=1 if args.quick else 3)
    plot(plt, curves, ns, args.out)


if __name__ == "__main__":
    main()
