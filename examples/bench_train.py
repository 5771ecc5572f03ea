"""Peak memory and time of a full training step (forward + gradients + AdamW update), side by side.

Workload: a stack of blocks of width 256 (8 heads / 4 kv heads, FFN 1024), input and target
``randn(batch 8, seq 256, 256)``, loss ``mean((out - target)^2)``, fp32, in two implementations:

    block   eae_func.models.Block (ours)
    llama   transformers' LlamaDecoderLayer from a tiny LlamaConfig (nobody here wrote it; its
            rotary embedding computed in a two-line wrapper)

Methods (AdamW lr 1e-3 for every one; a warm-up step first, so the optimizer state exists):

    autograd           loss.backward(), optimizer.step()
    checkpoint         torch.utils.checkpoint per block, then step()
    checkpoint+hooks   the same, the update fused into backward: one AdamW per parameter stepped
                       by register_post_accumulate_grad_hook (PyTorch's optimizer-in-backward recipe)
    eae-runtime        eae_runtime 0.1.1 compute_gradients, grads written to .grad, step()
    eae_func           ef.value_and_grad, ef.write_grads, step()
    eae_func fused     ef.sweep(..., update=optimizer): each stage stepped in the fold

Memory: every (method, depth, block) runs in its own process with MALLOC_MMAP_THRESHOLD_=65536;
every method ends its step with no gradients left (``zero_grad(set_to_none=True)``); after the
warm-up step the process notes its resident set (parameters, optimizer state, input) and
resets the kernel's high-water mark to it; "peak MB" is the high-water mark over the timed
steps above that: the step's own memory above the parameters and optimizer state. "live MB" is
the peak of tensor bytes created in one more step and alive at once (a TorchDispatchMode, no
allocator in the way). Floors: B is the measured live peak of one block's local backward
(recompute + ``torch.autograd.grad`` of its params and input: its saved tensors T, the
backward's own temporaries, its gradients G and its input costate); while stage i is reversed
the sweep needs at least the boundaries x_1..x_{i-1}, the costate p_i and B, and, unfused, the
gradients of stages i+1..L: fused floor max_i i A + B, floor max_i (L-i) G + i A + B (A one
boundary's bytes). Time: the median of interleaved steps (every method's
step in turn, in one more process), so load from other tenants hits every method alike.
``--keep-heap`` times with glibc keeping freed memory mapped (``peak_rss.keep_heap``), for every
method alike: no step then faults in pages that glibc gave back to the kernel after the last one,
a cost that depends on the order of frees rather than on the method's work.

``--curve`` adds the remat curve (block, one depth): step time against live peak of
``ef.value_and_grad(..., recompute=budget)`` over byte budgets from 0 (recompute every stage) to
all graphs kept (the last ones that fit), and the last graph kept with ``remat.save`` (matmul
outputs kept) on the 0..L-1 blocks before it, beside
``torch.utils.checkpoint.checkpoint_sequential`` with 1..L segments (``--no-early-stop``: each
segment's recompute run to its end, as eae_func's rebuild runs a block, where by default it stops
at the segment's last saved tensor and skips the matrix product after it); it
plots it into ``--out`` (default ``./eae_out``; matplotlib, from the ``examples`` extra). The
llama block needs the ``hf`` extra, eae-runtime the ``bench`` extra.

    python examples/bench_train.py --depths 12               # both blocks, depth 12
    python examples/bench_train.py --depths 6 12 24 --curve  # the tables and plot of docs/benchmarks.md
    python examples/bench_train.py --quick                   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_memory import LiveBytes, peak_rss, reset_peak_rss, usable_cores  # noqa: E402
from extras import add_out, extra, pyplot, save  # noqa: E402
from peak_rss import keep_heap  # noqa: E402

METHODS = ("autograd", "checkpoint", "checkpoint+hooks", "eae-runtime", "eae_func", "eae_func fused")
BLOCKS = ("block", "llama")
DIM, HEADS, KV_HEADS, FFN = 256, 8, 4, 1024
MB = 2**20
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def make_blocks(kind: str, depth: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "block":
        from eae_func.models import Block

        return [Block(DIM, HEADS, KV_HEADS, FFN) for _ in range(depth)]
    with extra("hf"):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=FFN,
        vocab_size=256,
        max_position_embeddings=4096,
    )
    config._attn_implementation = "sdpa"

    class Llama(nn.Module):
        """LlamaDecoderLayer on ``h``, with the rotary embedding of positions 0..seq-1."""

        def __init__(self, index: int):
            super().__init__()
            self.layer, self.rotary = LlamaDecoderLayer(config, index), LlamaRotaryEmbedding(config)

        def forward(self, h):
            position = torch.arange(h.shape[1], device=h.device)[None]
            return self.layer(h, position_embeddings=self.rotary(h, position), attention_mask=None)

    return [Llama(i) for i in range(depth)]


def loss_fn(out, target):
    return (out - target).square().mean()


def make_step(method: str, blocks: list, x, target):
    """One training step of ``method`` (AdamW), returning the loss."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    params = [p for b in blocks for p in b.parameters()]
    if method in ("autograd", "checkpoint"):
        opt = torch.optim.AdamW(params, lr=1e-3)

        def step():
            h = x
            for b in blocks:
                h = checkpoint(b, h, use_reentrant=False) if method == "checkpoint" else b(h)
            loss = loss_fn(h, target)
            del h
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)  # every method ends its step with no gradients left
            return loss.detach()

        return step
    if method == "checkpoint+hooks":
        per_param = {p: torch.optim.AdamW([p], lr=1e-3) for p in params}

        def hook(p):
            per_param[p].step()
            per_param[p].zero_grad(set_to_none=True)

        for p in params:
            p.register_post_accumulate_grad_hook(hook)

        def step():
            h = x
            for b in blocks:
                h = checkpoint(b, h, use_reentrant=False)
            loss = loss_fn(h, target)
            del h
            loss.backward()
            return loss.detach()

        return step
    if method == "eae-runtime":
        with extra("bench"):
            from eae_runtime import EAERuntime, RuntimeConfig

        rt, opt = EAERuntime(nn.ModuleList(blocks), None, RuntimeConfig()), torch.optim.AdamW(params, lr=1e-3)

        def step():
            loss, grads = rt.compute_gradients(x, lambda out: loss_fn(out, target))
            for p in params:
                p.grad = grads[p]
            del grads
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return step
    import eae_func as ef

    model = nn.ModuleList(blocks)
    chain, stage_params = ef.from_module(model, loss=loss_fn)
    opt = torch.optim.AdamW(params, lr=1e-3)
    if method == "eae_func":

        def step():
            loss, grads = ef.value_and_grad(chain, stage_params, x, target)
            ef.write_grads(model, grads)
            del grads
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return step
    if method == "eae_func fused":

        def step():
            return ef.sweep(chain, stage_params, x, target, update=opt, keep_costates=False).loss

        return step
    raise ValueError(f"unknown method {method!r}")


def build(kind: str, depth: int, batch: int, seq: int):
    import torch

    blocks = make_blocks(kind, depth)
    g = torch.Generator().manual_seed(1)
    return blocks, torch.randn(batch, seq, DIM, generator=g), torch.randn(batch, seq, DIM, generator=g)


def worker(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    if spec.get("keep_heap"):
        keep_heap()
    for method in METHODS:  # load every method's code on a tiny model first (one-time imports are not a step)
        make_step(method, *build(spec["kind"], 1, 1, 8))()
    blocks, x, target = build(spec["kind"], spec["depth"], spec["batch"], spec["seq"])
    if spec["method"] == "interleaved":
        # each method trains its own copy of the model (a method's update must not move another's weights)
        steps = {m: make_step(m, make_blocks(spec["kind"], spec["depth"]), x, target) for m in METHODS}
        times = {m: [] for m in steps}
        for k in range(spec["warmup"] + spec["steps"]):
            for m, step in steps.items():
                start = time.perf_counter()
                step()
                if k >= spec["warmup"]:
                    times[m].append(time.perf_counter() - start)
        return {"times": times}
    step = make_step(spec["method"], blocks, x, target)
    for _ in range(spec["warmup"]):
        step()  # the optimizer state now exists
    setup, was_reset = reset_peak_rss()
    losses = [float(step()) for _ in range(spec["steps"])]
    result = {"peak": peak_rss() - setup, "reset": was_reset, "loss": losses[0]}
    with LiveBytes() as live:
        step()
    result["live"] = live.peak
    return result


def floor(kind: str, depth: int, batch: int, seq: int) -> dict:
    """One block's gradient bytes G, boundary bytes A, saved-tensor bytes T, and the peak live bytes
    B of its local backward (recompute + ``torch.autograd.grad`` of params and input, as autograd
    runs it, given its input and output costate); the floors of a training step (see the module doc)."""
    import torch

    blocks, x, _ = build(kind, 1, batch, seq)
    G = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    A = x.numel() * x.element_size()
    own = {p.untyped_storage().data_ptr() for p in blocks[0].parameters()}
    h = x.clone().requires_grad_(True)
    own.add(h.untyped_storage().data_ptr())
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        blocks[0](h)
    T = sum(saved.values())
    costate = torch.randn_like(x)
    with LiveBytes() as live:
        torch.autograd.grad(blocks[0](h), [h, *blocks[0].parameters()], costate)
    B = live.peak
    # while stage i (1-based) is reversed: the boundaries x_1..x_{i-1}, the costate p_i, the local
    # backward; unfused also the gradients of stages i+1..L
    fused = max((i - 1) * A + A + B for i in range(1, depth + 1))
    unfused = max((depth - i) * G + (i - 1) * A + A + B for i in range(1, depth + 1))
    return {"G": G, "A": A, "T": T, "B": B, "fused_floor": fused, "floor": unfused}


def run(spec: dict, env: dict | None = None) -> dict:
    environ = {**os.environ, **(env or {})}
    done = subprocess.run(
        [sys.executable, __file__, "--_worker", json.dumps(spec)], capture_output=True, text=True, env=environ
    )
    if done.returncode:
        raise RuntimeError(f"{spec}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def curve(
    depth: int, batch: int, seq: int, threads: int, steps: int, heap_kept: bool, early_stop: bool, plt, folder
) -> None:
    """Step time against live peak: eae_func's remat budgets beside checkpoint_sequential's segments."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint_sequential, set_checkpoint_early_stop

    import eae_func as ef

    torch.set_num_threads(threads)
    if heap_kept:
        keep_heap()
    blocks, x, target = build("block", depth, batch, seq)
    model = nn.Sequential(*blocks)
    chain, params = ef.from_module(model, loss=loss_fn)
    G = floor("block", depth, batch, seq)
    per_block = G["T"] + G["A"]
    runs = {}
    for kept in range(depth + 1):  # a budget that keeps the first `kept` blocks' graphs
        budget = kept * per_block + per_block // 2 if kept else 0
        runs[("eae_func", kept)] = lambda b=budget: ef.value_and_grad(chain, params, x, target, recompute=b)
    for saving in range(
        depth
    ):  # the last block's graph kept, the `saving` blocks before it keep their matmuls' outputs
        policy = ef.remat.save(where=lambda i, name, k=saving: i >= depth - 1 - k, keep=lambda i, name: i == depth - 1)
        runs[("eae_func save", saving)] = lambda p=policy: ef.value_and_grad(chain, params, x, target, recompute=p)
    for segments in range(1, depth + 1):

        def ckpt(s=segments):
            model.zero_grad(set_to_none=True)
            with set_checkpoint_early_stop(early_stop):
                loss_fn(checkpoint_sequential(model, s, x, use_reentrant=False), target).backward()

        runs[("checkpoint_sequential", segments)] = ckpt
    peaks, times = {}, {k: [] for k in runs}
    for key, fn in runs.items():
        fn()
        with LiveBytes() as live:
            out = fn()
        del out
        peaks[key] = live.peak / MB
    for _ in range(steps):
        for key, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    print(
        f"\n### Remat curve: block, depth {depth} (gradient step, live MB, median of {steps} interleaved"
        f"{'; checkpoint without early stop' if not early_stop else ''})\n"
    )
    print("| method | setting | live MB | step s |")
    print("|---|---|---|---|")
    for (method, setting), peak in peaks.items():
        label = {
            "eae_func": f"{setting} graphs kept",
            "eae_func save": f"last graph kept, {setting} blocks keep their matmul outputs",
            "checkpoint_sequential": f"{setting} segments",
        }[method]
        print(f"| {method} | {label} | {peak:.1f} | {statistics.median(times[method, setting]):.3f} |")
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    labels = {
        "eae_func": "eae_func (recompute= byte budget)",
        "eae_func save": "eae_func (last graph + remat.save on 0..L-1 blocks)",
        "checkpoint_sequential": "checkpoint_sequential (1..L segments)",
    }
    for method, marker in (("eae_func", "o"), ("eae_func save", "^"), ("checkpoint_sequential", "s")):
        keys = sorted((k for k in peaks if k[0] == method), key=peaks.get)
        ax.plot(
            [peaks[k] for k in keys], [statistics.median(times[k]) for k in keys], marker=marker, label=labels[method]
        )
    ax.set(
        xlabel="live peak MB (gradient step)",
        ylabel="step s (median)",
        title=f"remat: time against memory, {depth} blocks",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, folder, "bench_train_curve.png", dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[12])
    parser.add_argument(
        "--blocks",
        nargs="*",
        default=list(BLOCKS),
        choices=BLOCKS,
        help="block kinds for the tables (none: only --curve)",
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=usable_cores())
    parser.add_argument("--curve", action="store_true", help="also the remat curve and its plot")
    parser.add_argument("--keep-heap", action="store_true", help="time with glibc keeping freed memory mapped")
    parser.add_argument("--no-early-stop", action="store_true", help="--curve: checkpoint recomputes to the end")
    parser.add_argument("--quick", action="store_true", help="smoke run: depth 2, batch 2, seq 32, 1 step")
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    add_out(parser)
    args = parser.parse_args(argv)
    if args._worker:
        print(json.dumps(worker(json.loads(args._worker))))
        return
    plt = pyplot() if args.curve else None  # a missing matplotlib says so before anything runs
    if args.quick:
        args.depths, args.batch, args.seq, args.steps = [2], 2, 32, 1
    print(
        f"# Training step: forward + gradients + AdamW, batch {args.batch}, seq {args.seq}, width {DIM}, "
        f"{args.threads} threads, {args.steps} timed steps after {args.warmup} warm-up"
        f"{', glibc keeping freed memory mapped' if args.keep_heap else ''}\n"
    )
    for kind in args.blocks:
        for depth in args.depths:
            spec = dict(
                kind=kind,
                depth=depth,
                batch=args.batch,
                seq=args.seq,
                threads=args.threads,
                steps=args.steps,
                warmup=args.warmup,
                keep_heap=args.keep_heap,
            )
            res = {m: run({**spec, "method": m}, MMAP_ENV) for m in METHODS}
            times = run({**spec, "method": "interleaved"})["times"]
            fl = floor(kind, depth, args.batch, args.seq)
            step = {m: statistics.median(times[m]) for m in METHODS}
            print(
                f"### {kind}, depth {depth}: floor {fl['floor'] / MB:.1f} MB, fused floor "
                f"{fl['fused_floor'] / MB:.1f} MB (G {fl['G'] / MB:.1f}, A {fl['A'] / MB:.1f}, T {fl['T'] / MB:.1f}, "
                f"local backward B {fl['B'] / MB:.1f} MB)\n"
            )
            print(
                "| method | peak MB above params + optimizer state | live MB | step s | peak / eae-runtime | "
                "step / checkpoint | loss |"
            )
            print("|---|---|---|---|---|---|---|")
            for m in METHODS:
                r = res[m]
                print(
                    f"| {m} | {r['peak'] / MB:.1f} | {r['live'] / MB:.1f} | {step[m]:.3f} | "
                    f"{r['peak'] / res['eae-runtime']['peak']:.2f}x | {step[m] / step['checkpoint']:.2f}x | "
                    f"{r['loss']:.6f} |"
                )
            fused, hooks = res["eae_func fused"], res["checkpoint+hooks"]
            print(
                f"\nunfused: live {res['eae_func']['live'] / fl['floor']:.2f}x its floor, peak "
                f"{res['eae_func']['peak'] / res['checkpoint']['peak']:.2f}x checkpoint's; step "
                f"{step['eae_func'] / step['checkpoint']:.2f}x checkpoint's"
            )
            print(
                f"fused: live {fused['live'] / fl['fused_floor']:.2f}x its floor; peak "
                f"{fused['peak'] / res['eae-runtime']['peak']:.2f}x eae-runtime+AdamW's, "
                f"{fused['peak'] / hooks['peak']:.2f}x checkpoint+hooks'; step "
                f"{step['eae_func fused'] / step['checkpoint']:.2f}x checkpoint+AdamW's\n",
                flush=True,
            )
    if args.curve:
        curve(
            args.depths[0],
            args.batch,
            args.seq,
            args.threads,
            max(args.steps, 2),
            args.keep_heap,
            not args.no_early_stop,
            plt,
            args.out,
        )


if __name__ == "__main__":
    main()
