"""Train the reference decoder-only transformer on the standard library's docstrings with EAE.

Byte-level LM (embedding, pre-norm blocks, tied head), AdamW with warm-up and a
cosine schedule, gradient accumulation by microbatches, a pass pipeline on
every costate. The same model is trained a second time with plain autograd
from the same seed and batches; the script reports the largest loss gap
between the two runs and plots both curves and the costate norm at every
boundary over training, into ``--out`` (default ``./eae_out``). Needs the ``examples`` extra (tqdm,
matplotlib).

    python examples/train_lm.py                       # a few minutes on 2 CPU cores
    python examples/train_lm.py --passes int8,clip --steps 300 --depth 6 --width 192
    python examples/train_lm.py --quick               # a smoke run: a tiny model, 4 steps
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch

import eae_func as ef
from eae_func import passes as P
from eae_func.models import lm_loss, transformer_lm

from extras import add_out, extra, pyplot, save
from text_data import batches, split_tokens, stdlib_docstrings

with extra("examples"):
    from tqdm import tqdm

PASSES = {
    "stats": P.stats,
    "int8": P.int8,
    "clip": lambda: P.clip_by_global_norm(1.0),
    "fp16": lambda: P.cast(torch.float16),
    "bf16": lambda: P.cast(torch.bfloat16),
    "fp8": P.fp8,
    "topk": lambda: P.topk(0.25),
}


def cosine_schedule(warmup: int, total: int):
    return lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))


def evaluate(model: torch.nn.Module, data: torch.Tensor, args) -> float:
    model.eval()
    with torch.no_grad():
        losses = [
            lm_loss(model(x.to(args.device)), y.to(args.device)).item()
            for _, (x, y) in zip(range(args.eval_batches), batches(data, args.batch, args.seq, seed=1))
        ]
    model.train()
    return sum(losses) / len(losses)


def train(model: torch.nn.Module, data: torch.Tensor, args, use_eae: bool):
    """Train ``model`` in place; returns per-step losses and, with EAE, per-boundary costate norms."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_schedule(args.steps // 10 + 1, args.steps))
    chain, params = ef.from_module(model, loss=lm_loss)
    pipeline = ef.compose(*[PASSES[name]() for name in args.passes.split(",") if name and name != "none"])
    pass_state = None  # the sweep starts the passes from the boundaries it sees
    losses, norms = [], []
    stream = batches(data, args.batch, args.seq, seed=0)
    bar = tqdm(range(args.steps), desc="EAE" if use_eae else "autograd", dynamic_ncols=True)
    start = time.perf_counter()
    for step in bar:
        x, y = (t.to(args.device) for t in next(stream))
        if use_eae:
            res = ef.sweep(
                chain, params, x, y, passes=pipeline, pass_state=pass_state, key=step, microbatches=args.accumulate
            )
            pass_state, loss = res.pass_state, res.loss
            ef.write_back(model, res)
            norms.append([a.value.norm().item() for a in res.adjoints if a.value is not None])
        else:
            opt.zero_grad(set_to_none=True)
            loss = 0.0
            for xm, ym in zip(x.tensor_split(args.accumulate), y.tensor_split(args.accumulate)):
                part = lm_loss(model(xm), ym) * (len(xm) / len(x))
                part.backward()
                loss += part.detach()
        opt.step()
        sched.step()
        losses.append(float(loss))
        tokens = (step + 1) * x.numel()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
    return losses, norms


def plot(plt, eae_losses, ref_losses, norms, names, out):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(ref_losses, label="plain autograd", lw=3, alpha=0.4)
    ax.plot(eae_losses, label="EAE (eae_func)", lw=1)
    ax.set(xlabel="step", ylabel="training loss", title="Same seed, same batches")
    ax.legend()
    fig.tight_layout()
    save(fig, out, "train_lm_loss.png", dpi=80)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    series = torch.tensor(norms).T
    for name, s in zip(names, series):
        ax.semilogy(s, label=name, lw=1)
    ax.set(xlabel="step", ylabel="|p_l|", title="Costate norm at every boundary")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    save(fig, out, "train_lm_costates.png", dpi=80)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", default="stats", help=f"comma list of {sorted(PASSES)} or 'none'")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--accumulate", type=int, default=2, help="microbatches per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 block of width 32, 4 steps")
    add_out(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.depth, args.width, args.steps, args.batch, args.seq = 1, 32, 4, 4, 32
        args.eval_batches, args.corpus_bytes = 1, 100_000
    plt = None if args.no_plots else pyplot()  # a missing matplotlib says so before anything trains

    train_data, valid_data = split_tokens(stdlib_docstrings(args.corpus_bytes))
    print(f"corpus: {len(train_data):,} training bytes, {len(valid_data):,} held-out bytes")
    torch.manual_seed(0)
    model = transformer_lm(256, args.width, args.depth, n_heads=4, n_kv_heads=2).to(args.device)
    reference = copy.deepcopy(model)

    eae_losses, norms = train(model, train_data, args, use_eae=True)
    ref_losses, _ = train(reference, train_data, args, use_eae=False)
    gap = max(abs(a - b) for a, b in zip(eae_losses, ref_losses))
    rel = max(abs(a - b) / abs(b) for a, b in zip(eae_losses, ref_losses))
    print(f"EAE      train {eae_losses[-1]:.4f}  valid {evaluate(model, valid_data, args):.4f}")
    print(f"autograd train {ref_losses[-1]:.4f}  valid {evaluate(reference, valid_data, args):.4f}")
    print(
        f"max |loss_EAE - loss_autograd| over {args.steps} steps: {gap:.2e} (relative {rel:.2e}), passes: {args.passes}"
    )
    if plt is not None:
        names = [f"p{i}" for i in range(len(norms[0]), 0, -1)]
        plot(plt, eae_losses, ref_losses, norms, names, args.out)
    return gap, rel


if __name__ == "__main__":
    main()
