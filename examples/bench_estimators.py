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

    python examples/bench_estimators.py            # full table
    python examples/bench_estimators.py --quick    # small models, n in {8, 32}, speed-ups at n = 16
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small models, n in {8, 32}, speed-ups at n = 16 once")
    parser.add_argument("--eps", type=float, default=1e-3, help="finite-difference step (float32)")
    parser.add_argument("--chunk", type=int, default=128, help="probes per chunk (memory bound)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (small problems: 1)")
    add_out(parser)
    args = parser.parse_args()
    plt = pyplot()  # a missing matplotlib says so before anything runs
    torch.set_num_threads(args.threads)
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
