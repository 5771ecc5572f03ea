"""torch.compile and the sweep, side by side: eager autograd, eager checkpoint per block,
``torch.compile`` + autograd, ``torch.compile`` + checkpoint per block, eae_func eager and eae_func
``compile=True`` on a chain (each stage's forward, and its recompute + local vjp as one graph) and
on run-time cuts (``split_at``: each cut call's forward compiled, its rebuild the same graph with
grad and autograd's compiled backward); and, the
structural baseline of per-stage graphs, "regional compile + checkpoint": each checkpointed block
compiled by ``torch.compile`` on its own (PyTorch's regional compilation), so no kernel fuses across blocks.

Model: ``--depth`` ``models.Block(256, 8, 4, 1024)`` or (``--model llama``) transformers'
``LlamaDecoderLayer`` of the same width, heads and MLP, seq 128, batch 4, fp32, the loss and every
parameter gradient. ``--model llama-captured`` takes the whole ``LlamaModel`` (on ``inputs_embeds``)
instead: checkpoint is Hugging Face's own ``gradient_checkpointing_enable()``, and eae_func cuts the
model (``split_at=["layers.*"]``) by graph capture (the "eae_func" rows) or at run time, its layers
sharing their compiled graphs.

Per method: the one-time compile seconds (the first step's time minus a steady step's), the step
time interleaved over ``--rounds`` rounds (A B C ... A B C ...), its median as a ratio to eager
autograd, its median minor page faults (``ru_minflt``: memory glibc gave back and the step touched
again; ``--keep-heap`` times with glibc keeping what it frees, for every method alike), and the peak
resident set of a steady step above the set before it, in a fresh process per method (one warm-up
step first, glibc mapping every tensor above 64 KiB on its own so RSS follows live memory). The
gradients are checked against eager autograd's.

    python examples/bench_compile.py --depth 6 --rounds 11
    python examples/bench_compile.py --model llama --depth 12 --rounds 11
    python examples/bench_compile.py --model llama --depth 6 --rounds 11 --keep-heap
    python examples/bench_compile.py --model llama-captured --depth 12 --rounds 11
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from extras import extra
from peak_rss import keep_heap, step_peak_mb

METHODS = (
    "autograd",
    "checkpoint",
    "compile + autograd",
    "compile + checkpoint",
    "regional compile + checkpoint",
    "eae_func",
    "eae_func compile=",
    "eae_func compile= run-time",
)


def build(args):
    import torch

    from eae_func.models import Block

    torch.manual_seed(0)
    if args.model == "llama-captured":
        blocks = [llama_model(args.depth, checkpointed) for checkpointed in (False, True, True)]
    elif args.model == "llama":
        blocks = llama_layers(args.depth)
    else:
        blocks = [Block(256, 8, 4, 1024) for _ in range(args.depth)]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, args.seq, 256, generator=g), torch.randn(args.batch, args.seq, 256, generator=g)
    return blocks, x, y


def llama_config(depth: int):
    with extra("hf"):
        from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=depth,
        attn_implementation="sdpa",
    )


def llama_model(depth: int, checkpointed: bool):
    """transformers' ``LlamaModel`` of ``depth`` layers (seed 0), with Hugging Face's gradient
    checkpointing (non-reentrant) or without."""
    import torch

    with extra("hf"):
        from transformers import LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(llama_config(depth)).train()
    if checkpointed:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def llama_layers(depth: int) -> list:
    """transformers' ``LlamaDecoderLayer`` (width 256, 8 heads, 4 KV heads, MLP 1024, causal SDPA),
    each with its rotary tables, as ``h -> h'`` modules."""
    import torch
    from torch import nn

    with extra("hf"):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = llama_config(depth)

    class Layer(nn.Module):
        def __init__(self, i: int):
            super().__init__()
            self.layer, self.rotary = LlamaDecoderLayer(config, i), LlamaRotaryEmbedding(config)

        def forward(self, h):
            position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            out = self.layer(h, position_embeddings=self.rotary(h, position_ids), position_ids=position_ids)
            return out[0] if isinstance(out, tuple) else out

    return [Layer(i) for i in range(depth)]


def steps(blocks, x, y, captured: bool = False) -> dict:
    """One function per method running a step and returning its gradients (in the blocks' order)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    import eae_func as ef

    if captured:
        return captured_steps(*blocks, x, y)
    model = nn.Sequential(*blocks)
    params = list(model.parameters())

    class Checkpointed(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, h):
            return checkpoint(self.block, h, use_reentrant=False)

    checkpointed = nn.Sequential(*[Checkpointed(b) for b in blocks])  # the same weights
    compiled, compiled_checkpointed = torch.compile(model), torch.compile(checkpointed)
    regional = nn.Sequential(*[torch.compile(Checkpointed(b)) for b in blocks])

    def autograd(net):
        def step():
            for p in params:
                p.grad = None
            F.mse_loss(net(x), y).backward()
            return [p.grad for p in params]

        return step

    flat = dict(model.named_parameters())

    def sweep(**options):
        def step():
            grads = ef.grad(model, flat, x, y, loss=F.mse_loss, **options)
            return list(grads.values())

        return step

    cuts = [str(i) for i in range(len(blocks))]

    return dict(
        zip(
            METHODS,
            (
                autograd(model),
                autograd(checkpointed),
                autograd(compiled),
                autograd(compiled_checkpointed),
                autograd(regional),
                sweep(),
                sweep(compile=True),
                sweep(compile=True, split_at=cuts),
            ),
        )
    )


def captured_steps(model, checkpointed, regional, x, y) -> dict:
    """The methods on a whole Hugging Face model: ``checkpointed`` and ``regional`` are copies with
    its own gradient checkpointing on, ``regional``'s layers compiled one by one; eae_func cuts
    ``model`` per layer by graph capture, and with ``compile=`` at run time too."""
    import torch
    import torch.nn.functional as F

    import eae_func as ef

    def loss(out, target):
        return F.mse_loss(out.last_hidden_state, target)

    def autograd(net, params):
        def step():
            for p in params:
                p.grad = None
            loss(net(inputs_embeds=x), y).backward()
            return [p.grad for p in params]

        return step

    flat = dict(model.named_parameters())

    def sweep(**options):
        def step():
            grads = ef.grad(model, flat, {"inputs_embeds": x}, y, loss=loss, split_at=["layers.*"], **options)
            return [grads[n] for n in flat]

        return step

    plain, ckpt = list(model.parameters()), list(checkpointed.parameters())
    for layer in regional.layers:
        layer.compile()
    return dict(
        zip(
            METHODS,
            (
                autograd(model, plain),
                autograd(checkpointed, ckpt),
                autograd(torch.compile(model), plain),
                autograd(torch.compile(checkpointed), ckpt),
                autograd(regional, list(regional.parameters())),
                sweep(capture="graph"),
                sweep(compile=True, capture="graph"),
                sweep(compile=True, capture="run"),
            ),
        )
    )


def peak_worker(args) -> None:
    """One method's steady-step peak RSS above the set before it, printed as JSON (glibc's heap as the
    environment sets it: every tensor mapped on its own, whatever ``--keep-heap`` says)."""
    import torch

    torch.set_num_threads(args.threads)
    blocks, x, y = build(args)
    step = steps(blocks, x, y, args.model == "llama-captured")[args.peak_of]
    step()  # the warm-up (and the compile)
    for p in (p for b in blocks for p in b.parameters()):
        p.grad = None  # no gradients kept from the warm-up: every method's step holds its own
    print(json.dumps({"peak_mb": step_peak_mb(step)}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("block", "llama", "llama-captured"), default="block")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-heap", action="store_true", help="time with glibc keeping freed memory mapped")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 blocks, seq 16, 1 round, no peaks")
    parser.add_argument("--peak-of", choices=METHODS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.depth, args.seq, args.batch, args.rounds = 2, 16, 2, 1
    if args.peak_of is not None:
        return peak_worker(args)

    if args.keep_heap:
        keep_heap()
    import torch

    torch.set_num_threads(args.threads)
    blocks, x, y = build(args)
    runs = steps(blocks, x, y, args.model == "llama-captured")
    first, reference, errors = {}, None, {}
    for name, step in runs.items():
        start = time.perf_counter()
        grads = step()
        first[name] = time.perf_counter() - start
        reference = reference or [None if g is None else g.clone() for g in grads]  # None: a weight not used
        errors[name] = max(
            (g - r).abs().max().item() if g is not None and r is not None else 0.0 if g is r else float("inf")
            for g, r in zip(grads, reference)
        )
    times, faults = {name: [] for name in runs}, {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, step in runs.items():
            before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    median = {n: statistics.median(t) for n, t in times.items()}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    peaks: dict = {}  # --quick: not measured, printed as "-"
    for name in () if args.quick else METHODS:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            *(argv if argv is not None else sys.argv[1:]),
            "--peak-of",
            name,
        ]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        peaks[name] = json.loads(out.strip().splitlines()[-1])["peak_mb"]
    kind = {
        "llama": "LlamaDecoderLayer(256, 8 heads, 4 KV, MLP 1024)",
        "llama-captured": "layers of LlamaModel(256, 8 heads, 4 KV, MLP 1024)",
        "block": "models.Block(256, 8, 4, 1024)",
    }[args.model]
    heap = ", glibc keeping freed memory mapped" if args.keep_heap else ""
    print(f"{args.depth} x {kind}, seq {args.seq}, batch {args.batch}, {args.threads} threads{heap}")
    print(
        f"{'method':<30} {'step / autograd':>15} {'faults / step':>13} {'compile s':>10} {'peak MB':>8} "
        f"{'max |g - autograd|':>19}"
    )
    for name in METHODS:
        compile_s = max(first[name] - median[name], 0.0) if "compile" in name else 0.0
        print(
            f"{name:<30} {median[name] / median['autograd']:>14.2f}x {statistics.median(faults[name]):>13.0f} "
            f"{compile_s:>10.1f} {f'{peaks[name]:.1f}' if name in peaks else '-':>8} {errors[name]:>19.1e}"
        )


if __name__ == "__main__":
    main()
