"""Train the reference transformer LM sharded with FSDP2, its reverse sweep run by eae_func
block by block on FSDP's own all-gather, backward and reduce-scatter.

    torchrun --nproc-per-node 2 examples/train_fsdp.py
    torchrun --nproc-per-node 2 examples/train_fsdp.py --fused      # AdamW fused into the fold

gloo on CPU, NCCL when every process has a GPU (chosen by eae_func.distributed.init). Each
child of the ``nn.Sequential`` (embedding, blocks, head) gets its own ``fully_shard``, then the
root; the head is untied from the embedding (FSDP2 keeps a tied weight in one group). The sweep
returns this step's gradients as DTensors sharded like the parameters; ``ef.write_grads``,
``clip_grad_norm_`` and ``AdamW`` take them as FSDP2 training would. Step 0 is checked against
FSDP2's own ``loss.backward()`` on a second copy of the model (--check).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import eae_func as ef
import eae_func.distributed as D
from eae_func import passes as P
from eae_func.models import TiedHead, lm_loss, transformer_lm

from text_data import batches, split_tokens, stdlib_docstrings


def sharded_lm(args, device: torch.device) -> nn.Sequential:
    """The LM from seed 0, its head untied, every child and the root ``fully_shard``ed."""
    torch.manual_seed(0)
    model = transformer_lm(256, args.width, args.depth, n_heads=4, n_kv_heads=2)
    untied = nn.Embedding(256, args.width)
    untied.weight = nn.Parameter(model[0].weight.detach().clone())
    model[-1] = TiedHead(untied)  # a head with a weight of its own
    model = model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for child in model:
        fully_shard(child, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def check_step(model: nn.Sequential, x, y, args, device) -> float:
    """Largest |difference| over all ranks of eae_func's gradient shards (no passes) against FSDP2's
    own ``loss.backward()`` on a copy of the model."""
    grads = ef.grad(model, dict(model.named_parameters()), x, y, loss=lm_loss)
    reference = sharded_lm(args, device)
    reference.load_state_dict(model.state_dict())
    lm_loss(reference(x), y).backward()
    err = torch.tensor(
        max((grads[n].to_local() - p.grad.to_local()).abs().max().item() for n, p in reference.named_parameters())
    )
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return err.item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--fused", action="store_true", help="fuse AdamW into the fold (update=)")
    parser.add_argument("--corpus-bytes", type=int, default=1_000_000)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--no-check", dest="check", action="store_false")
    args = parser.parse_args(argv)

    device = D.init(timeout=args.timeout)
    train(args, device)
    # FSDP's modules sit in reference cycles that hold the process group: free them now, while both
    # ranks are here, not in the interpreter's teardown after the group is gone
    gc.collect()
    dist.barrier()  # neither rank tears gloo down while another still runs
    dist.destroy_process_group()


def train(args, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = sharded_lm(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    if rank == 0:
        print(
            f"{world} processes on {dist.get_backend()}: FSDP2 over {world} ranks, {len(model)} stages "
            f"(each its own fully_shard), {args.microbatches} microbatches, {'fused' if args.fused else 'unfused'} AdamW"
        )
    train_data, _ = split_tokens(stdlib_docstrings(args.corpus_bytes))
    stream = batches(train_data, args.batch * world, args.seq, seed=0)
    rows = slice(rank * args.batch, (rank + 1) * args.batch)
    passes = P.clip_by_global_norm(1.0)  # each costate clipped to norm 1 as the fold goes
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = (t[rows].to(device) for t in next(stream))
        if step == 0 and args.check:
            err = check_step(model, x, y, args, device)
            if rank == 0:
                print(f"step 0: largest |grad - FSDP2 backward's grad| over all ranks = {err:.2e}")
        params = dict(model.named_parameters())
        if args.fused:
            res = ef.sweep(model, params, x, y, loss=lm_loss, passes=passes, microbatches=args.microbatches, update=opt)
            loss = res.loss
        else:
            loss, grads = ef.value_and_grad(
                model, params, x, y, loss=lm_loss, passes=passes, microbatches=args.microbatches
            )
            ef.write_grads(model, grads)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}  {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
