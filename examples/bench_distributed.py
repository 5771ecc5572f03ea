"""Benchmark (not a test): a pipeline of 2 and 4 CPU processes (gloo) training step of the
reference transformer LM, float32 vs int8 costates on the wire.

Per configuration: the step time (slowest rank, median over steps), the bytes all ranks
send per step (costates alone, and everything: activations, costates, headers, loss and
tied gradient), and the pipeline bubble: measured (1 - busy / step time, averaged over
ranks), simulated on the schedule with each rank's measured forward / backward times
(what stage imbalance alone costs), and the ideal (p-1)/(m+p-1).

    python examples/bench_distributed.py                   # ~1 min on 2 cores
    python examples/bench_distributed.py --ranks 2 --schedules gpipe,1f1b --microbatches 8

Absolute CPU times say little here (4 processes share 2 cores, gloo over loopback);
the byte ratios say a lot: int8 costates cost 1/4 of float32's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import eae_func as ef
import eae_func.distributed as D
from eae_func.models import lm_loss, transformer_lm

CODECS = {"float32": lambda: None, "int8": D.codecs.int8}


def worker(codec: str, schedule: str, args) -> dict:
    torch.manual_seed(0)
    chain, params = ef.from_module(transformer_lm(256, args.width, args.depth, n_heads=4, n_kv_heads=2), loss=lm_loss)
    pipe = D.Pipeline(chain, params=params, schedule=schedule, costate_codec=CODECS[codec](), timeout=120)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (args.batch, args.seq), generator=g) for _ in range(2))
    steps = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        res = pipe.sweep(params, x, y, microbatches=args.microbatches, key=step)
        if step >= args.warmup:
            steps.append((time.perf_counter() - start, res.stats))
    stats = [s for _, s in steps]
    stage_names = [chain.stages[i].name for i in pipe.stages]
    per_mb = args.microbatches * len(stats)
    forward = sum(s[n]["forward_s"] for s in stats for n in stage_names) / per_mb
    backward = sum(s[n]["recompute_s"] + s[n]["vjp_s"] + s[n]["pass_s"] for s in stats for n in stage_names)
    backward += sum(s["loss"]["forward_s"] + s["loss"]["pass_s"] for s in stats if "loss" in s)
    return {
        "step_s": statistics.median(t for t, _ in steps),
        "bubble": statistics.mean(s["schedule"]["bubble"] for s in stats),
        "ideal": stats[0]["schedule"]["ideal_bubble"],
        "costate_bytes": stats[-1]["wire"]["costate_bytes_sent"],
        "bytes": stats[-1]["wire"]["bytes_sent"],
        "forward_s": forward,
        "backward_s": backward / per_mb,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--schedules", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 ranks, a tiny model, 1 step")
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.depth, args.width, args.batch, args.seq, args.steps, args.warmup = "2", 2, 32, 4, 16, 1, 0

    print(
        f"transformer_lm(vocab 256, width {args.width}, depth {args.depth}), batch {args.batch} x {args.seq} "
        f"tokens, {args.microbatches} microbatches, gloo, one CPU thread per process\n"
    )
    print(
        "| ranks | schedule | costates | step (ms) | costate bytes / step | all bytes / step "
        "| costate bytes vs float32 | bubble measured | bubble simulated | bubble ideal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in (int(r) for r in args.ranks.split(",")):
        for schedule in args.schedules.split(","):
            base = None
            for codec in CODECS:
                ranks = D.run(worker, p, codec, schedule, args, timeout=600)
                ops = D.schedule.schedule(schedule, p, args.microbatches)
                sim = D.schedule.simulate(ops, [r["forward_s"] for r in ranks], [r["backward_s"] for r in ranks])
                costate = sum(r["costate_bytes"] for r in ranks)
                base = costate if base is None else base
                print(
                    f"| {p} | {schedule} | {codec} | {1000 * max(r['step_s'] for r in ranks):.0f} "
                    f"| {costate:,} | {sum(r['bytes'] for r in ranks):,} | {costate / base:.3f} "
                    f"| {statistics.mean(r['bubble'] for r in ranks):.2f} | {sim['bubble']:.2f} "
                    f"| {ranks[0]['ideal']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
