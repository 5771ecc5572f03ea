"""Pass overhead: time in the pass pipeline as a fraction of an EAE step.

A stack of pre-norm transformer blocks (eae_func.models.Block), loss = mean(x_L^2), one
``ef.sweep`` per step with and without ``compose(P.int8(), P.clip_by_global_norm(1.0))``. For each step
with passes, the fraction is the passes' seconds (``res.stats[stage]["pass_s"]`` summed over
the stages and the loss) over the step's wall-clock time; the steps alternate between the
two configurations so drift hits both alike. Prints a markdown table of medians.

    python examples/bench_passes.py                      # 12 blocks, dim 256, seq 256, batch 8
    python examples/bench_passes.py --depth 4 --dim 128 --seq 64 --batch 4 --steps 3   # quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import eae_func as ef
from eae_func import passes as P
from eae_func.models import Block


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=12, help="number of blocks (stages)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024, help="SwiGLU hidden size")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 small blocks, 2 steps")
    args = parser.parse_args()
    if args.quick:
        args.depth, args.dim, args.ffn, args.seq, args.batch, args.steps = 2, 64, 128, 32, 2, 2
    return args


def mean_square(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def timed_step(chain, params, x, passes) -> tuple[float, float]:
    """(wall-clock seconds of one sweep, seconds spent in its passes)."""
    start = time.perf_counter()
    res = ef.sweep(chain, params, x, passes=passes)
    wall = time.perf_counter() - start
    pass_s = sum(entry["pass_s"] for name, entry in res.stats.items() if name != "boundaries")
    return wall, pass_s


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.dim, args.heads, args.kv_heads, args.ffn) for _ in range(args.depth)])
    chain, params = ef.from_module(model, loss=mean_square)
    x = torch.randn(args.batch, args.seq, args.dim)
    configs = {"none": None, "int8 + clip(1.0)": ef.compose(P.int8(), P.clip_by_global_norm(1.0))}

    walls = {name: [] for name in configs}
    fractions = []
    for step in range(args.steps + 1):
        for name, passes in configs.items():
            wall, pass_s = timed_step(chain, params, x, passes)
            if step == 0:
                continue  # warm-up
            walls[name].append(wall)
            if passes is not None:
                fractions.append(pass_s / wall)

    base, with_passes = statistics.median(walls["none"]), statistics.median(walls["int8 + clip(1.0)"])
    print(
        f"{args.depth} blocks, dim {args.dim}, heads {args.heads}/{args.kv_heads}, ffn {args.ffn}, "
        f"seq {args.seq}, batch {args.batch}, fp32, {torch.get_num_threads()} threads, "
        f"median of {args.steps} steps\n"
    )
    print("| passes | step (s) | pass time (ms) | pass fraction of step | step / step without passes |")
    print("|---|---|---|---|---|")
    print(f"| none | {base:.3f} | 0 | 0 | 1.000 |")
    pass_ms = statistics.median(f * w for f, w in zip(fractions, walls["int8 + clip(1.0)"])) * 1e3
    print(
        f"| int8 + clip(1.0) | {with_passes:.3f} | {pass_ms:.1f} | "
        f"{100 * statistics.median(fractions):.2f}% | {with_passes / base:.3f} |"
    )


if __name__ == "__main__":
    main()
