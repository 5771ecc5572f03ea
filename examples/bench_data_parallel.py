"""Data parallel on 2 CPU processes (gloo). Replicated: DDP, DDP with a checkpoint per block,
eae_func's sweep followed by ``D.average_gradients``, and eae_func on the DDP model
(``data_parallel=``: each stage's gradients all-reduced as the fold makes them, overlapped with
the next stages). Sharded: FSDP2 (``fully_shard`` per block and on the root), FSDP2 with a
checkpoint per block, and eae_func on the FSDP2 model (each block's forward, recompute and
backward through FSDP; on an accelerator the next block's all-gather prefetched).

Per method, on every rank: the step (loss and averaged gradients, no optimizer), interleaved
over the rounds, the slowest rank's median and its ratio to DDP; the peak resident set of a
step above the set before it (``VmHWM`` after resetting it through ``/proc/self/clear_refs``),
in fresh processes per method, for the first step (with what it leaves allocated for the next
ones: DDP's buckets, FSDP's buffers) and for the second (without that), no gradients kept from a
step before, glibc's ``M_MMAP_THRESHOLD`` at 64 KiB so that it maps every tensor above that on
its own and unmaps it when freed (RSS follows live memory); the
bytes each replicated rank sends per step. The gradients of every method are checked against
DDP's (the sharded ones: this rank's shard of them). ``--where`` prints, for the sharded
methods, the live tensor bytes of a step after the first at their peak, by the operator and
shape that made them (``bench_memory.LiveBytes``; FSDP's unsharded parameters, which it frees and
refills in place, are not seen).

    python examples/bench_data_parallel.py --blocks 8 --width 256 --seq 256 --batch 4 --rounds 7
    python examples/bench_data_parallel.py --where      # where the FSDP rows' peaks go
    python examples/bench_data_parallel.py --user-step --rounds 3   # FSDP2 with AdamW: the user's step
"""

from __future__ import annotations

import argparse
import copy
import ctypes
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

from peak_rss import map_tensors_apart, step_peak_mb

METHODS = (
    "ddp",
    "ddp + checkpoint",
    "eae + average_gradients",
    "eae data_parallel=",
    "fsdp2",
    "fsdp2 + checkpoint",
    "eae on fsdp2",
)


class Checkpointed(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, h):
        return checkpoint(self.block, h, use_reentrant=False)


def sharded(blocks: list, wrap=lambda b: b) -> nn.Sequential:
    """``fully_shard`` on each (copied, wrapped) block, then on the root, over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(*[fully_shard(wrap(copy.deepcopy(b)), mesh=mesh) for b in blocks])
    return fully_shard(model, mesh=mesh)


USER_STEPS = (
    "fsdp2 + checkpoint, opt.step()",
    "eae on fsdp2, write_back, opt.step()",
    "eae on fsdp2, update=opt",
)


def user_steps(args, blocks: list, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The step a user takes, with AdamW (its state made in two warm-up steps), on a fresh FSDP2 model
    per method: each step's peak of live tensor bytes and of the resident set above the set before it,
    medians of ``--rounds`` steps. The sweeps keep no costates (``keep_costates=False``, what
    ``ef.grad`` runs with): a kept costate per stage is as large as a boundary."""
    from bench_memory import LiveBytes

    out = {}
    for name in USER_STEPS:
        net = sharded(blocks, Checkpointed if "checkpoint" in name else lambda b: b)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        params = dict(net.named_parameters())

        def step(net=net, opt=opt, params=params, name=name):
            if "checkpoint" in name:
                F.mse_loss(net(x), y).backward()
            elif "update" in name:
                ef.sweep(net, params, x, y, loss=F.mse_loss, update=opt, keep_costates=False)
                return
            else:
                ef.write_back(net, ef.sweep(net, params, x, y, loss=F.mse_loss, keep_costates=False))
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(2):
            step()
        live, rss = [], []
        for _ in range(args.rounds):
            with LiveBytes() as counter:
                step()
            live.append(counter.peak / 2**20)
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            rss.append(step_peak_mb(step))
        out[name] = (statistics.median(live), statistics.median(rss))
    return out


def worker(args) -> dict:
    torch.set_num_threads(1)
    if args.peak_of is not None or args.user_step:
        map_tensors_apart()
    rank = dist.get_rank()
    torch.manual_seed(0)
    blocks = [Block(args.width, 8, 4, 4 * args.width) for _ in range(args.blocks)]
    fsdp, fsdp_checkpointed = sharded(blocks), sharded(blocks, Checkpointed)
    fsdp_params = dict(fsdp.named_parameters())
    model = nn.Sequential(*blocks)
    ddp = DDP(model)
    checkpointed = DDP(nn.Sequential(*[Checkpointed(b) for b in blocks]))  # the same weights
    params = dict(ddp.named_parameters())
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.seq, args.width, generator=g), torch.randn(args.batch, args.seq, args.width)
    stats = {}
    if args.user_step:
        return {"user": user_steps(args, blocks, x, y)}

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

    def fsdp_autograd(net):
        net.zero_grad(set_to_none=True)
        F.mse_loss(net(x), y).backward()
        return {"module." + n.replace(".block.", "."): p.grad.full_tensor() for n, p in net.named_parameters()}

    def eae_on_fsdp():
        grads = ef.grad(fsdp, fsdp_params, x, y, loss=F.mse_loss)
        return {"module." + n: g.full_tensor() for n, g in grads.items()}

    runs = dict(
        zip(
            METHODS,
            (
                lambda: autograd(ddp),
                lambda: autograd(checkpointed),
                sweep_then_average,
                data_parallel,
                lambda: fsdp_autograd(fsdp),
                lambda: fsdp_autograd(fsdp_checkpointed),
                eae_on_fsdp,
            ),
        )
    )
    if args.where:
        from bench_memory import LiveBytes

        where = {}
        for name in ("fsdp2 + checkpoint", "eae on fsdp2"):
            runs[name]()
            fsdp_checkpointed.zero_grad(set_to_none=True)
            with LiveBytes(breakdown=True) as live:
                runs[name]()
            where[name] = (live.peak, live.at_peak.most_common(args.where))
        return {"where": where}
    if args.peak_of is not None:  # a fresh pair of processes per method: its first step, then a second one
        peaks = []
        for _ in range(2):
            for net in (ddp, checkpointed, fsdp, fsdp_checkpointed):  # no gradients kept from a step before
                net.zero_grad(set_to_none=True)
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            peaks.append(step_peak_mb(runs[args.peak_of]))
        return {"peak_mb": peaks}
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
    parser.add_argument("--where", type=int, nargs="?", const=8, default=0, help="the FSDP peaks' largest parts")
    parser.add_argument("--user-step", action="store_true", help="FSDP2 with AdamW: the step a user takes")
    parser.add_argument("--peak-of", choices=METHODS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.width, args.seq, args.batch, args.rounds = 2, 32, 16, 2, 1
    print(f"2 ranks (gloo), {args.blocks} blocks width {args.width}, seq {args.seq}, batch {args.batch}")
    if args.user_step:
        results = D.run(worker, 2, args, timeout=1800, pg_timeout=600)
        base = [r["user"][USER_STEPS[0]] for r in results]
        print(f"{'method (AdamW)':<38} {'live MB r0 / r1':>16} {'ratio':>6} {'RSS MB r0 / r1':>16} {'ratio':>6}")
        for name in USER_STEPS:
            (l0, s0), (l1, s1) = (r["user"][name] for r in results)
            ratio = max(l0 / base[0][0], l1 / base[1][0]), max(s0 / base[0][1], s1 / base[1][1])
            print(
                f"{name:<38} {f'{l0:.1f} / {l1:.1f}':>16} {ratio[0]:5.2f}x {f'{s0:.1f} / {s1:.1f}':>16} {ratio[1]:5.2f}x"
            )
        return
    if args.where:
        for name, (peak, parts) in D.run(worker, 2, args, timeout=600)[0]["where"].items():
            print(f"{name}: live peak {peak / 2**20:.1f} MB (rank 0), of which")
            for what, nbytes in parts:
                print(f"  {nbytes / 2**20:8.2f} MB  {what}")
        return
    results = D.run(worker, 2, args, timeout=1800, pg_timeout=600)
    for name in METHODS:
        peaks = D.run(worker, 2, argparse.Namespace(**{**vars(args), "peak_of": name}), timeout=600, pg_timeout=300)
        for r, p in zip(results, peaks):
            r.setdefault("peak_mb", {})[name] = p["peak_mb"]
    base = results[0]["time"]["ddp"]
    print(
        f"{'method':<26} {'step / ddp':>10} {'1st step MB r0 / r1':>20} {'2nd step MB r0 / r1':>20} {'max |g - ddp|':>13}"
    )
    for name in METHODS:
        ratio = results[0]["time"][name] / base
        (a0, b0), (a1, b1) = (r["peak_mb"][name] for r in results)
        first, second = f"{a0:.1f} / {a1:.1f}", f"{b0:.1f} / {b1:.1f}"
        print(f"{name:<26} {ratio:>9.2f}x {first:>20} {second:>20} {results[0]['error'][name]:>13.1e}")
    b = results[0]["bytes"]
    print(
        f"bytes sent per rank per step: average_gradients {b['ddp']}, data_parallel= {b['eae data_parallel=']} "
        f"in {b['buckets']} buckets (one per stage and dtype)"
    )


if __name__ == "__main__":
    main()
