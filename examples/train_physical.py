"""Classify scikit-learn's handwritten digits through a physical black box, with each estimator.

The network is digital -> physical -> physical -> digital: the middle stages are a fixed
random nonlinear medium ``tanh(h M) + noise`` (measurement noise of std ``--noise``) that
can only be run forward. The digital layers around them are trained with AdamW from the
costates each estimator gives the physical stages; exact backprop through a noiseless-
gradient copy of the medium is the reference. Prints test accuracy, queries per sample and
wall time per estimator, and plots accuracy against queries. Methods that differentiate
(exact backprop, zbp with jvp) train on a noiseless simulation of the medium, as one
would with a device model; the finite-difference methods query the noisy medium itself.
Every model is tested on the noisy medium (``ef.apply``: the trained chain run forward). Needs the
``examples`` extra (scikit-learn, matplotlib); the plot goes to ``--out`` (default ``./eae_out``).

    python examples/train_physical.py
    python examples/train_physical.py --epochs 10 --probes 64 --noise 0.01
    python examples/train_physical.py --quick      # a smoke run: 200 samples, 1 epoch, 4 probes
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import eae_func as ef
from eae_func import estimators as E

from extras import add_out, extra, pyplot, save

with extra("examples"):
    from sklearn.datasets import load_digits


def medium(width: int, noise: float, seed: int):
    """A black box: ``tanh(h M) + noise``, M fixed and random; only ever run forward."""
    m = torch.randn(width, width, generator=torch.Generator().manual_seed(seed)) * (1.5 / width**0.5)

    def physical(params, h):
        out = torch.tanh(h @ m)
        return out + noise * torch.randn(out.shape) if noise else out

    return physical


def linear(params, h):
    return h @ params["w"] + params["b"]


def network(width: int, noise: float):
    stages = [
        ef.stage(lambda p, h: torch.relu(linear(p, h)), name="encoder"),
        ef.stage(medium(width, noise, 1), name="medium1", physical=True),
        ef.stage(medium(width, noise, 2), name="medium2", physical=True),
        ef.stage(linear, name="readout"),
    ]
    return ef.Chain(stages, loss=F.cross_entropy)


def init_params(width: int):
    g = torch.Generator().manual_seed(0)
    layer = lambda i, o: {"w": torch.randn(i, o, generator=g) / i**0.5, "b": torch.zeros(o)}  # noqa: E731
    return (layer(64, width), {}, {}, layer(width, 10))


def accuracy(chain, params, x, y) -> float:
    with torch.no_grad():
        return (ef.apply(chain, params, x).argmax(-1) == y).float().mean().item()


def train(chain, x, y, estimator, args):
    params = init_params(args.width)
    trainable = [t for p in params for t in p.values()]
    opt = torch.optim.AdamW(trainable, lr=args.lr)
    queries, start = 0, time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for step, idx in enumerate(order.split(args.batch)):
            res = ef.sweep(chain, params, x[idx], y[idx], estimator=estimator, key=epoch * 10_000 + step)
            for t, g in zip(trainable, (g for p in res.grads for g in p.values())):
                t.grad = g
            opt.step()
            queries += sum(res.stats[n].get("queries", 0) for n in ("medium1", "medium2")) * len(idx)
    return params, queries / (args.epochs * len(x)), time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--probes", type=int, default=32)
    parser.add_argument("--noise", type=float, default=1e-3)
    parser.add_argument("--eps", type=float, default=3e-2, help="finite-difference step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 200 samples, 1 epoch, 4 probes")
    add_out(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.probes = 1, 4
    plt = None if args.no_plot else pyplot()  # a missing matplotlib says so before anything trains

    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train_idx, test_idx = (perm[:150], perm[150:200]) if args.quick else (perm[:1400], perm[1400:])
    hardware, simulation = network(args.width, args.noise), network(args.width, 0.0)
    probes = E.Probes(args.probes, "rademacher")
    estimators = {  # name: (estimator, needs a differentiable simulation of the medium)
        "exact backprop": (E.exact(), True),
        "zbp (jvp)": (E.zbp(probes, method="jvp"), True),
        "zbp (fd)": (E.zbp(probes, method="fd", eps=args.eps), False),
        "np (fd)": (E.node_perturbation(probes, form="fd", eps=args.eps), False),
        "direct (fd)": (E.direct(probes, form="fd", eps=args.eps), False),
    }
    rows = []
    print(
        f"digits: {len(train_idx)} train / {len(test_idx)} test, medium width {args.width}, noise {args.noise}, "
        f"{args.probes} probes, {args.epochs} epochs\n"
    )
    print("| estimator | test accuracy | queries / sample / epoch | wall s |")
    print("|---|---|---|---|")
    for name, (est, simulated) in estimators.items():
        params, queries, wall = train(simulation if simulated else hardware, x[train_idx], y[train_idx], est, args)
        acc = accuracy(hardware, params, x[test_idx], y[test_idx])
        rows.append((name, acc, queries))
        print(f"| {name} | {acc:.3f} | {queries:.0f} | {wall:.1f} |", flush=True)
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for name, acc, q in rows:
            ax.scatter(max(q, 1), acc, label=name)
        ax.set(
            xscale="log",
            xlabel="black-box queries per sample per epoch (exact: 1)",
            ylabel="test accuracy",
            title="Digits through a physical medium",
        )
        ax.legend(fontsize=7)
        fig.tight_layout()
        save(fig, args.out, "train_physical.png", dpi=80)


if __name__ == "__main__":
    main()
