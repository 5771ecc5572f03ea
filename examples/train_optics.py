"""Train a digits classifier through a Fourier-optics simulator from PyPI, used as a black box.

    digital encoder (64 -> 64 phases) -> optics (black box) -> digital readout (64 -> 10)

The optics is LightPipes (``pip install LightPipes``, numpy, one complex field per sample): the
64 phases (8x8, each on 2x2 pixels of a 16x16 grid) modulate a plane wave, which propagates a
distance z (Fresnel, LightPipes' ``Forvard``); a camera reads the intensity, pooled to 8x8, with
detector noise of std ``--noise``. It is wrapped with ``ef.black_box(..., numpy=True,
per_sample=True)`` and run on a process pool. The twin is the same spectral propagator written
in torch (differentiable, batched) at the nominal distance; the hardware sits at
``(1 + --mismatch) z``, as a real bench never matches its model.

Methods, each trained with AdamW for ``--epochs`` and tested on the (noisy) hardware:

    exact through twin   in silico: forward and reverse through the twin only
    twin (PAT)           forward on the hardware, reverse through the twin's vjp (E.twin)
    zbp / np / direct    forward-only estimates from the hardware (fd, n probes, eps from E.suggest_eps)
    control variate      zbp's probes with the twin as a control variate (E.control_variate, β "ema",
                         the twin's own central differences): zbp's rows, unbiased
    shrinkage cv         the same, shrunk toward the twin: βs + λ(ĝ − βs), λ* = h / (h + v) for an
                         averaging horizon h (``--cv-horizon``, default 1: one step's MSE): a little
                         bias for much less variance (E.control_variate(..., shrink="auto"))
    frozen               readout only: no costate passes the optics (E.frozen)

Prints the table (test accuracy, rows simulated per step, wall time) and plots the cosine of
each estimator's costate at the optics' input to the exact one (the twin at the true distance,
noiseless) against n, beside the mismatched twin's, into ``--out`` (default ``./eae_out``). Needs
the ``examples`` extra (LightPipes, scikit-learn, matplotlib).

``--repeats K`` trains each method K times, repeat k with torch seed ``--seed`` + k (the
initialization, the batch order and the probe keys; the detector noise stays fresh from the OS),
and prints each method's test accuracy as mean ± standard error over the K runs, each run's, and
every method's paired difference (same seeds) to PAT and to zbp; ``--methods`` picks some of
exact, pat, zbp, np, direct, cv, shrink, frozen, and oracle (not run by default: PAT with the twin at the
bench's true distance: the exact costate at the bench's states, which the unbiased estimators
approach as n grows, and which no real bench offers). The control variate's training stats (the twin's error r,
the residual ρ, β, pooled over the steps) follow the table.

    python examples/train_optics.py
    python examples/train_optics.py --epochs 2 --probes 8 --workers 2
    python examples/train_optics.py --methods pat,zbp,cv --repeats 4 --mismatch 0.3 --no-cosines
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import eae_func as ef
from eae_func import estimators as E

from extras import add_out, extra, pyplot, save

with extra("examples"):
    from LightPipes import Begin, Forvard, Intensity, SubPhase, cm, mm, nm
    from sklearn.datasets import load_digits

GRID, SIZE, WAVELENGTH, DISTANCE = 16, 2 * mm, 633 * nm, 50 * cm


class Bench:
    """The hardware: one sample's 64 phases -> 64 pooled intensities, by LightPipes, plus detector
    noise (fresh from the OS entropy in every call, on whichever process runs it)."""

    def __init__(self, distance: float, noise: float):
        self.distance, self.noise = distance, noise

    def __call__(self, params: dict, phases: np.ndarray) -> np.ndarray:
        field = SubPhase(Begin(SIZE, WAVELENGTH, GRID), np.kron(phases.reshape(8, 8), np.ones((2, 2))))
        image = Intensity(Forvard(field, self.distance)).reshape(8, 2, 8, 2).sum((1, 3)).ravel() / 4
        return image + self.noise * np.random.default_rng().standard_normal(image.shape) if self.noise else image


def twin(distance: float):
    """The bench in torch: the same spectral Fresnel propagator, batched and differentiable."""
    k = torch.arange(-GRID // 2, GRID - GRID // 2, dtype=torch.float64) / SIZE
    chirp = -2 * math.pi * (distance * WAVELENGTH / 2) * (k[:, None] ** 2 + k[None, :] ** 2)
    sign = torch.ones(GRID, dtype=torch.float64)
    sign[1::2] = -1
    checker = sign[:, None] * sign[None, :]  # the fftshift of LightPipes' Forvard

    def optics(params, h):
        phase = h.reshape(-1, 8, 8).repeat_interleave(2, 1).repeat_interleave(2, 2)
        field = torch.polar(torch.ones_like(phase), phase) * checker.to(h.dtype)
        out = torch.fft.ifft2(torch.fft.fft2(field) * torch.polar(torch.ones_like(chirp), chirp).to(field.dtype))
        return (out.abs() ** 2).reshape(-1, 8, 2, 8, 2).sum((2, 4)).reshape(-1, 64) / 4

    return optics


def network(optics_stage):
    return ef.Chain(
        [
            ef.stage(lambda p, h: h @ p["w"] + p["b"], name="encoder"),
            optics_stage,
            ef.stage(lambda p, h: (h - 1) @ p["w"] + p["b"], name="readout"),
        ],
        loss=F.cross_entropy,
    )


def init_params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        {"w": torch.randn(64, 64, generator=g) * 0.3, "b": torch.zeros(64)},
        {},
        {"w": torch.randn(64, 10, generator=g) / 8, "b": torch.zeros(10)},
    )


def train(chain, estimator, x, y, args, seed: int = 0):
    """AdamW for ``args.epochs``; ``seed`` sets the initialization, the batch order and the probe
    keys (seed 0: those of a single run). Returns the parameters, the rows per step, the wall time
    and the control variate's stats pooled over the steps (empty for other estimators)."""
    params = init_params(seed)
    leaves = [t for p in params for t in p.values()]
    opt = torch.optim.AdamW(leaves, lr=args.lr, weight_decay=0.0)
    rows, steps, pooled, start = 0, 0, {}, time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for step, idx in enumerate(order.split(args.batch)):
            key = seed * 1_000_000 + epoch * 10_000 + step
            res = ef.sweep(chain, params, x[idx], y[idx], estimator=estimator, key=key)
            if hasattr(estimator, "observe"):  # the control variate's running β, threaded as a value
                estimator = estimator.observe(res)
            for t, g in zip(leaves, (g for p in res.grads for g in p.values())):
                t.grad = g
            opt.step()
            stats = res.stats["optics"]
            rows += stats.get("rows", 0)
            for name in ("twin_error", "cv_residual", "beta"):  # ratios: a sum pools them
                if name in stats:
                    pooled[name] = pooled[name] + stats[name] if name in pooled else stats[name]
            steps += 1
    return params, rows / steps, time.perf_counter() - start, {name: float(v) for name, v in pooled.items()}


def cosines(hardware, exact_chain, mismatched, params, x, y, ns, eps) -> dict:
    """Cosine of each method's costate at the optics' input (boundary 1) to the exact one."""
    exact = ef.sweep(exact_chain, params, x, y).adjoints[-2].value
    cos = lambda v: F.cosine_similarity(v.flatten(), exact.flatten(), dim=0).item()  # noqa: E731
    out = {
        "twin (PAT)": [cos(ef.sweep(hardware, params, x, y, estimator=E.twin(mismatched)).adjoints[-2].value)] * len(ns)
    }
    for name, make in fd_estimators(eps).items():
        out[name] = [cos(ef.sweep(hardware, params, x, y, estimator=make(n), key=1).adjoints[-2].value) for n in ns]
    return out


def fd_estimators(eps: float) -> dict:
    return {
        "zbp": lambda n: E.zbp(E.Probes(n, "rademacher"), method="fd", eps=eps),
        "np": lambda n: E.node_perturbation(E.Probes(n, "rademacher"), form="fd", eps=eps),
        "direct": lambda n: E.direct(E.Probes(n, "rademacher"), form="fd", eps=eps),
    }


NAMES = {
    "exact": "exact through twin",
    "pat": "twin (PAT)",
    "zbp": "zbp",
    "np": "np",
    "direct": "direct",
    "cv": "control variate",
    "shrink": "shrinkage cv",
    "frozen": "frozen (readout only)",
}
EXTRA = {"oracle": "twin at the true distance (oracle)"}  # by --methods only: a real bench has no such twin


def mean_se(values) -> tuple[float, float]:
    """The mean and its standard error (0 for one value)."""
    v = np.asarray(values, dtype=float)
    return v.mean(), (v.std(ddof=1) / math.sqrt(len(v)) if len(v) > 1 else 0.0)


def beta_arg(text: str):
    return text if text in ("ema", "xfit") else float(text)


def methods_arg(text: str) -> list:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in NAMES and k not in EXTRA]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(f"{unknown or text!r}: choose from {','.join([*NAMES, *EXTRA])}")
    return keys


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--probes", type=int, default=8)
    parser.add_argument("--noise", type=float, default=1e-2, help="detector noise std (intensities average 1)")
    parser.add_argument("--mismatch", type=float, default=0.05, help="relative error of the twin's distance")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--workers", type=int, default=2, help="processes running the simulator")
    parser.add_argument("--train", type=int, default=1400, help="training samples (the rest of 1797 test)")
    parser.add_argument(
        "--methods", type=methods_arg, default=list(NAMES), help=f"some of {','.join([*NAMES, *EXTRA])}"
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each method, torch seeds seed..seed+K-1")
    parser.add_argument("--seed", type=int, default=0, help="the first run's torch seed")
    parser.add_argument("--cv-beta", type=beta_arg, default="ema", help="control variate's beta: ema, xfit, a number")
    parser.add_argument(
        "--cv-directional", choices=("fd", "exact"), default="fd", help="control variate's twin_directional"
    )
    parser.add_argument(
        "--cv-horizon", type=float, default=1.0, help="shrinkage cv's averaging horizon h (1: one step's MSE)"
    )
    parser.add_argument("--no-cosines", action="store_true", help="skip the cosine-against-n curves and plot")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny data, one epoch, no plot")
    add_out(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.train, args.probes, args.batch = 1, 64, 2, 32
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    plt = None if args.quick or args.no_cosines else pyplot()  # a missing matplotlib says so before anything trains

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train_idx, test_idx = perm[: args.train], perm[args.train :]
    if args.quick:
        test_idx = test_idx[:64]

    with concurrent.futures.ProcessPoolExecutor(args.workers) as pool:
        bench = Bench(DISTANCE * (1 + args.mismatch), args.noise)
        hardware = network(ef.black_box(bench, name="optics", numpy=True, per_sample=True, workers=pool))
        nominal = twin(DISTANCE)
        in_silico = network(ef.stage(nominal, name="optics"))
        exact_copy = network(ef.stage(twin(DISTANCE * (1 + args.mismatch)), name="optics"))

        params = init_params()
        h = x[train_idx[:64]] @ params[0]["w"] + params[0]["b"]  # the optics' input
        noise = E.suggest_eps(hardware.stages[1], {}, h, repeats=8)
        print(
            f"digits: {len(train_idx)} train / {len(test_idx)} test; optics {GRID}x{GRID}, twin distance off by "
            f"{args.mismatch:.0%}; measured detector noise {noise.noise:.2g} (set {args.noise:g}), gain "
            f"{noise.gain:.2g}: eps = {noise.eps:.2g}; {args.probes} probes, {args.epochs} epochs, "
            f"{args.workers} simulator processes\n"
        )
        cv = E.control_variate(fd_estimators(noise.eps)["zbp"](args.probes), nominal, args.cv_beta, args.cv_directional)
        shrunk = E.control_variate(
            fd_estimators(noise.eps)["zbp"](args.probes), nominal, args.cv_beta, args.cv_directional,
            shrink="auto", horizon=args.cv_horizon,
        )  # fmt: skip
        methods = {
            "exact through twin": (in_silico, None),
            "twin (PAT)": (hardware, E.twin(nominal)),
            **{name: (hardware, make(args.probes)) for name, make in fd_estimators(noise.eps).items()},
            "control variate": (hardware, cv),
            "shrinkage cv": (hardware, shrunk),
            "frozen (readout only)": (hardware, E.frozen()),
            EXTRA["oracle"]: (hardware, E.twin(twin(DISTANCE * (1 + args.mismatch)))),
        }
        names = {**NAMES, **EXTRA}
        methods = {names[k]: methods[names[k]] for k in args.methods}
        seeds = range(args.seed, args.seed + args.repeats)
        if args.repeats == 1:
            print("| method | test accuracy | rows simulated / step | wall s |")
            print("|---|---|---|---|")
        else:
            print(
                f"| method | test accuracy, mean ± SE of {args.repeats} | runs (seeds {seeds[0]}..{seeds[-1]}) "
                "| rows simulated / step | wall s (mean) |"
            )
            print("|---|---|---|---|---|")
        accuracy, cv_stats = {}, []
        for name, (chain, estimator) in methods.items():
            accs, walls = [], []
            for seed in seeds:
                trained, rows, wall, stats = train(chain, estimator, x[train_idx], y[train_idx], args, seed)
                with torch.no_grad():
                    logits = ef.apply(hardware, trained, x[test_idx])
                accs.append((logits.argmax(-1) == y[test_idx]).float().mean().item())
                walls.append(wall)
                if name == "control variate":
                    cv_stats.append(stats)
                if args.repeats > 1:
                    print(f"  # {name}, seed {seed}: {accs[-1]:.3f} ({wall:.1f} s)", file=sys.stderr, flush=True)
            accuracy[name] = accs
            if args.repeats == 1:
                print(f"| {name} | {accs[0]:.3f} | {rows:.0f} | {wall:.1f} |", flush=True)
            else:
                mean, se = mean_se(accs)
                runs = " ".join(f"{a:.3f}" for a in accs)
                print(f"| {name} | {mean:.4f} ± {se:.4f} | {runs} | {rows:.0f} | {np.mean(walls):.1f} |", flush=True)
        if args.repeats > 1:
            refs = [ref for ref in ("twin (PAT)", "zbp") if ref in accuracy]
            for k, ref in enumerate(refs):
                others = [name for name in accuracy if name not in refs[: k + 1]]
                if others:
                    text = "; ".join(
                        "{} {:+.4f} ± {:.4f}".format(name, *mean_se(np.subtract(accuracy[name], accuracy[ref])))
                        for name in others
                    )
                    print(f"\npaired difference to {ref} (same seeds), mean ± SE: {text}")
        if cv_stats:
            r, rho, beta = (np.mean([s[k] for s in cv_stats]) for k in ("twin_error", "cv_residual", "beta"))
            d = 64
            print(
                f"\ncontrol variate (β {args.cv_beta}, twin_directional {args.cv_directional}), pooled over the "
                f"training steps: twin error r {r:.3f}, residual ρ {rho:.3f}, mean β {beta:.3f}; per step its "
                f"error is (d-1)/n·ρ² = {(d - 1) / args.probes * rho**2:.3f} ‖g‖² against PAT's r² = {r**2:.3f} ‖g‖² "
                f"(zbp's: {(d - 1) / args.probes:.2f} ‖g‖²); equal at n = {(d - 1) * rho**2 / r**2:.0f} probes"
            )

        if args.no_cosines:
            return
        ns = (2, 8) if args.quick else (8, 32, 128)
        curves = cosines(
            hardware, exact_copy, nominal, init_params(), x[train_idx[:64]], y[train_idx[:64]], ns, noise.eps
        )
    print(
        "\ncosine of the costate at the optics' input to the exact one, by n:",
        {k: [round(c, 2) for c in v] for k, v in curves.items()},
    )
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for name, values in curves.items():
            ax.plot(ns, values, marker="o", label=name, linestyle="--" if name.startswith("twin") else "-")
        ax.plot(ns, [(n / (n + 64)) ** 0.5 for n in ns], color="gray", linestyle=":", label="theory √(n/(n+d)), d=64")
        ax.set(
            xscale="log",
            xlabel="probes n",
            ylabel="cosine to the exact costate",
            title="costate at the optics' input (one physical stage:\nzbp, np and direct coincide)",
        )
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        save(fig, args.out, "train_optics_cosine.png", dpi=120)


if __name__ == "__main__":
    main()
