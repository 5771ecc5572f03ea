"""Data parallel on 2 CPU processes (gloo): DDP, DDP with a checkpoint per block, eae_func's
sweep followed by ``D.average_gradients``, and eae_func on the DDP model (``data_parallel=``:
each stage's gradients all-reduced as the fold makes them, overlapped with the next stages).

Per method, on every rank: the step (loss and averaged gradients, no optimizer), interleaved
over the rounds, the slowest rank's median and its ratio to DDP; the peak resident set above
the set before the step (``VmHWM`` after resetting it through ``/proc/self/clear_refs``); the
bytes each rank sends per step. The gradients of every method are checked against DDP's.

    python examples/bench_data_parallel.py --blocks 8 --width 256 --seq 256 --batch 4 --rounds 7
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import eae_func as ef
import eae_func.distributed as D
from eae_func.models import Block

METHODS = ("ddp", "ddp + checkpoint", "eae + average_gradients", "eae data_parallel=")


class Checkpointed(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, h):
        return checkpoint(self.block, h, use_reentrant=False)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(match.group(1)) if match else 0


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(args) -> dict:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    blocks = [Block(args.width, 8, 4, 4 * args.width) for _ in range(args.blocks)]
    model = nn.Sequential(*blocks)
    ddp = DDP(model)
    checkpointed = DDP(nn.Sequential(*[Checkpointed(b) for b in blocks]))  # the same weights
    params = dict(ddp.named_parameters())
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.seq, args.width, generator=g), torch.randn(args.batch, args.seq, args.width)
    stats = {}

    def autograd(net):
        net.zero_grad(set_to_none=True)
        F.mse_loss(net(x), y).backward()
        return {n: p.grad for n, p in ddp.named_parameters()}

    def sweep_then_average():
        grads = ef.grad(model, dict(model.named_parameters()), x, y, loss=F.mse_loss, data_parallel=False)
        grads, stats["average"] = D.average_gradients(grads)
        return {"module." + n: g for n, g in grads.items()}

    def data_parallel():
        res = ef.sweep(ddp, params, x, y, loss=F.mse_loss, keep_costates=False, timers=False)
        stats["reducer"] = res.stats["data_parallel"]
        return res.grads

    runs = dict(
        zip(METHODS, (lambda: autograd(ddp), lambda: autograd(checkpointed), sweep_then_average, data_parallel))
    )
    if args.peak_of is not None:  # a fresh pair of processes per method: the allocator has kept nothing yet
        before = _status_kb("VmRSS")
        reset_peak()
        runs[args.peak_of]()
        return {"peak_mb": (_status_kb("VmHWM") - before) / 1024}
    reference = {n: g.clone() for n, g in runs["ddp"]().items()}
    errors = {}
    for name, run in runs.items():
        grads = run()
        errors[name] = max((grads[n] - reference[n]).abs().max().item() for n in reference)
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            dist.barrier()
            start = time.perf_counter()
            run()
            dist.barrier()  # the slowest rank's step
            times[name].append(time.perf_counter() - start)
    return {
        "time": {n: statistics.median(t) for n, t in times.items()},
        "error": errors,
        "bytes": {
            "ddp": stats["average"]["bytes_sent"],
            "eae data_parallel=": stats["reducer"]["bytes_sent"],
            "buckets": stats["reducer"]["buckets"],
        },
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a smoke run: a tiny model, 1 round")
    parser.add_argument("--peak-of", choices=METHODS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.width, args.seq, args.batch, args.rounds = 2, 32, 16, 2, 1
    print(f"2 ranks (gloo), {args.blocks} blocks width {args.width}, seq {args.seq}, batch {args.batch}")
    results = D.run(worker, 2, args, timeout=1800, pg_timeout=600)
    for name in METHODS:
        peaks = D.run(worker, 2, argparse.Namespace(**{**vars(args), "peak_of": name}), timeout=600, pg_timeout=300)
        for r, p in zip(results, peaks):
            r.setdefault("peak_mb", {})[name] = p["peak_mb"]
    base = results[0]["time"]["ddp"]
    print(f"{'method':<26} {'step / ddp':>10} {'peak MB r0':>10} {'peak MB r1':>10} {'max |g - ddp|':>13}")
    for name in METHODS:
        ratio = results[0]["time"][name] / base
        peaks = [r["peak_mb"][name] for r in results]
        print(f"{name:<26} {ratio:>9.2f}x {peaks[0]:>10.1f} {peaks[1]:>10.1f} {results[0]['error'][name]:>13.1e}")
    b = results[0]["bytes"]
    print(
        f"bytes sent per rank per step: average_gradients {b['ddp']}, data_parallel= {b['eae data_parallel=']} "
        f"in {b['buckets']} buckets (one per stage and dtype)"
    )


if __name__ == "__main__":
    main()
