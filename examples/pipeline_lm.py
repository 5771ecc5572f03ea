"""Train the reference transformer LM split across processes: pipeline parallel, optionally
times data parallel, with the costates compressed where they cross a rank boundary.

    torchrun --nproc-per-node 2 examples/pipeline_lm.py                    # 2-stage pipeline
    torchrun --nproc-per-node 4 examples/pipeline_lm.py --codec int8       # 4 stages, int8 costates
    torchrun --nproc-per-node 4 examples/pipeline_lm.py --pp 2 --grad-codec int8   # 2 x 2 mesh

gloo on CPU, NCCL when every process has a GPU (chosen by eae_func.distributed.init).

Every rank builds the whole model from the same seed and trains only its own stage range
(balanced by parameter count). The head is tied to the token embedding, which sit on the
first and the last rank: both keep a copy of the tensor, the pipeline sums the two ranks'
gradient contributions (exactly as ``ef.sweep`` sums tied uses), both optimizers take the
same step, and the copies stay equal; the script checks that at the end. Step 0 is checked
against a single-process ``ef.sweep`` of the whole chain on every rank (--check).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import eae_func as ef
import eae_func.distributed as D
from eae_func import passes as P
from eae_func.models import lm_loss, transformer_lm

from text_data import batches, split_tokens, stdlib_docstrings

CODECS = {
    "none": lambda: None,
    "int8": D.codecs.int8,
    "fp8": D.codecs.fp8,
    "bf16": lambda: D.codecs.cast(torch.bfloat16),
    "topk": lambda: D.codecs.topk(0.1),
}


def single_process_error(chain, params, x, y, pipe, res, args) -> float:
    """Largest |grad difference| of this rank's stages against ef.sweep of the whole chain."""
    codec = CODECS[args.codec]()
    passes = P.clip_by_global_norm(1.0)
    if codec is not None:
        passes = ef.compose(passes, P.only(codec.as_pass(), indices=[lo for lo, _ in pipe.ranges[1:]]))
    ref = ef.sweep(chain, params, x, y, passes=passes, microbatches=args.microbatches, key=0)
    return max(
        (res.grads[pipe.stages.index(i)][n] - ref.grads[i][n]).abs().max().item()
        for i in pipe.stages
        for n in ref.grads[i]
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=None, help="pipeline ranks (default: all; the rest is data parallel)")
    parser.add_argument("--codec", default="none", choices=sorted(CODECS), help="costate codec on the wire")
    parser.add_argument("--grad-codec", default="none", choices=sorted(CODECS), help="data-parallel gradient codec")
    parser.add_argument("--schedule", default="1f1b", choices=tuple(D.SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--corpus-bytes", type=int, default=1_000_000)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--no-check", dest="check", action="store_false")
    args = parser.parse_args(argv)

    device = D.init(timeout=args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = D.mesh(pp=args.pp or world)
    torch.manual_seed(0)
    model = transformer_lm(256, args.width, args.depth, n_heads=4, n_kv_heads=2).to(device)
    chain, params = ef.from_module(model, loss=lm_loss)
    pipe = D.Pipeline(
        chain,
        params=params,
        ranks=mesh.pipeline_ranks,
        schedule=args.schedule,
        costate_codec=CODECS[args.codec](),
        timeout=args.timeout,
    )
    mine = [list(model)[i] for i in pipe.stages]
    opt = torch.optim.AdamW([p for m in mine for p in m.parameters()], lr=args.lr, weight_decay=0.1)
    if rank == 0:
        print(
            f"{world} processes on {dist.get_backend()}: pipeline of {mesh.pp} x {mesh.dp} replicas, "
            f"stage ranges {pipe.ranges}, schedule {args.schedule}, {args.microbatches} microbatches, "
            f"costates {args.codec}, gradients {args.grad_codec}"
        )

    train_data, _ = split_tokens(stdlib_docstrings(args.corpus_bytes))
    stream = batches(train_data, args.batch * mesh.dp, args.seq, seed=0)
    rows = slice(mesh.replica * args.batch, (mesh.replica + 1) * args.batch)
    last = pipe.position == len(pipe.ranks) - 1
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = (t[rows].to(device) for t in next(stream))
        res = pipe.sweep(params, x, y, passes=P.clip_by_global_norm(1.0), microbatches=args.microbatches, key=step)
        grads, dp_stats = res.grads, {"bytes_sent": 0}
        if mesh.dp > 1:
            grads, dp_stats = D.average_gradients(
                grads, mesh.data_group, codec=CODECS[args.grad_codec](), timeout=args.timeout
            )
        if step == 0 and args.check and mesh.dp == 1:
            err = torch.tensor(single_process_error(chain, params, x, y, pipe, res, args))
            dist.all_reduce(err, op=dist.ReduceOp.MAX)
            if rank == 0:
                print(f"step 0: largest |grad - single-process ef.sweep grad| over all ranks = {err.item():.2e}")
        ef.write_grads(mine, grads)
        opt.step()
        if last and mesh.replica == 0 and (step % 5 == 0 or step == args.steps - 1):
            wire, sched = res.stats["wire"], res.stats["schedule"]
            print(
                f"step {step:3d}  loss {res.loss.item():.4f}  bytes sent: costates "
                f"{wire['costate_bytes_sent']:,}, data parallel {dp_stats['bytes_sent']:,}; activations received "
                f"{wire['activation_bytes_received']:,}  "
                f"bubble {sched['bubble']:.2f} "
                f"(ideal {sched['ideal_bubble']:.2f})  {time.perf_counter() - start:.1f} s",
                flush=True,
            )
    check_tied_copies(pipe, mine, chain)
    dist.barrier()  # neither rank tears gloo down while another still runs
    dist.destroy_process_group()


def check_tied_copies(pipe, mine, chain) -> None:
    """The embedding (first rank) and the head (last rank) hold copies of one tensor: they
    must still be equal after training. The two ranks swap their copies and compare."""
    first, last = pipe.ranks[0], pipe.ranks[-1]
    if first == last or dist.get_rank() not in (first, last):
        return
    (i, name), *_ = [(i, n) for group in chain.ties for i, n in group if i in pipe.stages]
    weight = dict(mine[pipe.stages.index(i)].named_parameters())[name].detach()
    other = torch.empty_like(weight)
    peer = last if dist.get_rank() == first else first
    ops = [dist.P2POp(dist.isend, weight.contiguous(), peer), dist.P2POp(dist.irecv, other, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if dist.get_rank() == first:
        print(
            f"tied embedding / head copies differ by at most {(weight - other).abs().max().item():.2e} after training"
        )


if __name__ == "__main__":
    main()
