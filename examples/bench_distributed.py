"""Benchmark (not a test): a pipeline-parallel training step of the reference transformer LM on
2 or 4 CPU processes (gloo), every schedule of ``torch.distributed.pipelining``, side by side:

    pipelining               pipelining's own stages (each rank's modules, autograd)
    pipelining + checkpoint  the same with a checkpoint per block
    eae_func                 ``D.Pipeline``: each rank's range an EAE stage on the same schedule
    eae_func int8            the same with int8 costates on the wire

Per method and schedule: the step (loss and this rank's gradients, no optimizer; the slowest
rank's median over the steps, methods interleaved), its ratio to pipelining + checkpoint, the
peak resident set of a step above the set before it on each rank (``VmHWM`` after resetting it,
glibc's ``M_MMAP_THRESHOLD`` at 64 KiB so RSS follows live memory), and for eae_func the bubble
(1 - busy / step, averaged over ranks) against its ideal and the costate bytes all ranks send.

    python examples/bench_distributed.py --ranks 2 --schedules 1f1b,zero_bubble
    python examples/bench_distributed.py --ranks 4 --blocks 8 --width 256 --seq 256 --batch 16

Absolute CPU times say little here (processes share 2 cores, gloo over loopback): read the
ratios, the memory and the bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.utils.checkpoint import checkpoint

import eae_func as ef
import eae_func.distributed as D
from eae_func.models import Block, lm_loss, transformer_lm

from peak_rss import map_tensors_apart, step_peak_mb

METHODS = ("pipelining", "pipelining + checkpoint", "eae_func", "eae_func int8")


class Checkpointed(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, h):
        return checkpoint(self.module, h, use_reentrant=False) if isinstance(self.module, Block) else self.module(h)


def worker(schedule: str, args) -> dict:
    map_tensors_apart()
    torch.manual_seed(0)
    model = transformer_lm(256, args.width, args.blocks, n_heads=4, n_kv_heads=2)
    chain, params = ef.from_module(model, loss=lm_loss)
    per_rank = 2 if schedule == "interleaved_1f1b" else 1
    pipes = {
        "eae_func": D.Pipeline(chain, params=params, schedule=schedule, timeout=300),
        "eae_func int8": D.Pipeline(
            chain, params=params, schedule=schedule, costate_codec=D.codecs.int8(), timeout=300
        ),
    }
    pipe = pipes["eae_func"]
    p, m = len(pipe.ranks), args.microbatches
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (args.batch, args.seq), generator=g) for _ in range(2))

    def theirs(wrap):
        """Pipelining's own stages over the same ranges, on the same schedule."""
        stages = [
            pipelining.PipelineStage(nn.Sequential(*(wrap(c) for c in list(model)[lo:hi])), r, p * per_rank, "cpu")
            for r in pipe.owned
            for lo, hi in [pipe.ranges[r]]
        ]
        cls = D.SCHEDULES[schedule]
        sched = cls(stages[0] if schedule in ("gpipe", "1f1b") else stages, m, loss_fn=lm_loss)
        first, last = pipe.position == 0, pipe.position == p - 1

        def step():
            sched.step(*((x,) if first else ()), target=y if last else None, return_outputs=False)
            for s in stages:
                s.submod.zero_grad(set_to_none=True)

        return step

    stats: dict = {name: [] for name in pipes}

    def ours(name):
        def step():
            stats[name].append(pipes[name].sweep(params, x, y, microbatches=m, key=0).stats)

        return step

    runs = {
        "pipelining": theirs(lambda c: c),
        "pipelining + checkpoint": theirs(Checkpointed),
        "eae_func": ours("eae_func"),
        "eae_func int8": ours("eae_func int8"),
    }
    times: dict = {name: [] for name in METHODS}
    peaks: dict = {}
    for round_ in range(args.warmup + args.steps):
        for name in METHODS:
            dist.barrier()
            if round_ == args.warmup - 1 or (args.warmup == 0 and round_ == 0):
                peaks[name] = step_peak_mb(runs[name])
                continue
            start = time.perf_counter()
            runs[name]()
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - start)
    timed = {name: s[-args.steps :] for name, s in stats.items()}
    return {
        "step_s": {name: statistics.median(t) for name, t in times.items()},
        "peak_mb": peaks,
        "bubble": {name: statistics.mean(s["schedule"]["bubble"] for s in timed[name]) for name in pipes},
        "ideal": timed["eae_func"][0]["schedule"]["ideal_bubble"],
        "costate_bytes": {name: timed[name][-1]["wire"].get("costate_bytes_sent", 0) for name in pipes},
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2")
    parser.add_argument("--schedules", default=",".join(D.SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 ranks, a tiny model, 1 step")
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.blocks, args.width, args.batch, args.seq, args.steps, args.warmup = "2", 2, 32, 4, 16, 1, 1
        args.schedules = "1f1b,zero_bubble"

    print(
        f"transformer_lm(vocab 256, width {args.width}, {args.blocks} blocks), batch {args.batch} x {args.seq} "
        f"tokens, {args.microbatches} microbatches, gloo, one CPU thread per process\n"
    )
    print(
        "| ranks | schedule | method | step (ms) | / pipelining + checkpoint | peak MB per rank "
        "| bubble (ideal) | costate bytes / step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for p in (int(r) for r in args.ranks.split(",")):
        for schedule in args.schedules.split(","):
            ranks = D.run(worker, p, schedule, args, timeout=900, pg_timeout=600)
            base = max(r["step_s"]["pipelining + checkpoint"] for r in ranks)
            for name in METHODS:
                step = max(r["step_s"][name] for r in ranks)
                peak = " / ".join(f"{r['peak_mb'][name]:.1f}" for r in ranks)
                bubble = bytes_ = "-"
                if name.startswith("eae_func"):
                    bubble = f"{statistics.mean(r['bubble'][name] for r in ranks):.2f} ({ranks[0]['ideal']:.2f})"
                    bytes_ = f"{sum(r['costate_bytes'][name] for r in ranks):,}"
                print(
                    f"| {p} | {schedule} | {name} | {1000 * step:.0f} | {step / base:.2f} | {peak} | {bubble} "
                    f"| {bytes_} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
