"""What the rebuild's early stop saves: one gradient step with it, without it, and per-block checkpoint.

A stack of ``models.Block(width, 8 heads, 4 kv heads, FFN 4 * width)``, input and target
``randn(batch, seq, width)``, loss ``mean((out - target)^2)``, fp32; one step is forward +
parameter gradients:

    eae_func               ef.value_and_grad(blocks, params, x, y, loss=loss)
    eae_func, full rebuild the same with early_stop=False: every rebuild runs its block to the end
    checkpoint             torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False) per
                           block, loss.backward() (its recompute stops at the last saved tensor)

The methods alternate step by step (interleaved) after a warm-up step each (the first rebuild
of each block learns its tail); the table gives median seconds and the ratio to checkpoint.

    python examples/bench_early_stop.py             # 12 blocks of width 256, batch 8, seq 256, 9 rounds
    python examples/bench_early_stop.py --quick     # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

import eae_func as ef
from eae_func.models import Block


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 blocks of width 64, 2 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.depth, args.width, args.batch, args.seq, args.rounds = 2, 64, 2, 32, 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[Block(args.width, 8, 4, 4 * args.width) for _ in range(args.depth)])
    params = [dict(b.named_parameters()) for b in blocks]
    x, y = torch.randn(2, args.batch, args.seq, args.width).unbind()

    def loss(h, target):
        return (h - target).pow(2).mean()

    def checkpointed():
        h = x
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=False)
        loss(h, y).backward()
        blocks.zero_grad(set_to_none=True)

    methods = {
        "eae_func": lambda: ef.value_and_grad(blocks, params, x, y, loss=loss),
        "eae_func, full rebuild": lambda: ef.value_and_grad(blocks, params, x, y, loss=loss, early_stop=False),
        "checkpoint": checkpointed,
    }
    for step in methods.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, step in methods.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    print(
        f"{args.depth} blocks of width {args.width}, batch {args.batch}, seq {args.seq}, "
        f"{args.threads} threads, median of {args.rounds} interleaved rounds\n"
    )
    print("| method | step s | vs checkpoint |\n|---|---|---|")
    for name, t in medians.items():
        print(f"| {name} | {t:.3f} | {t / medians['checkpoint']:.3f}x |")
    return medians


if __name__ == "__main__":
    main()
