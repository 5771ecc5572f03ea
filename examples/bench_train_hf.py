"""A training step with AdamW on a Hugging Face causal LM, side by side: memory and time.

Workload: ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` built from a config (random weights, no download),
seed 0, fp32 (``--dtype bfloat16``: bf16 weights and AdamW state), train mode, random token ids (batch x seq); the next-token loss
``cross_entropy(logits[:, :-1], ids[:, 1:])``; one step is forward, backward and ``AdamW.step()``:

    autograd               loss.backward(); opt.step()
    hf-checkpoint          model.gradient_checkpointing_enable() (non-reentrant), then the same
    hf-checkpoint + in-bw  the same, each parameter stepped by its own AdamW from a post-accumulate-grad
                           hook (PyTorch's optimizer-in-backward recipe): no full set of gradients
    eae_func               ef.sweep(model, params, ids, ids, loss=..., split_at=[layers]); write_back; opt.step()
    eae_func update=       the same with update=opt: each layer stepped in its own backward node
    + chunked head         update=opt on the LM's last hidden state (its body, ``model.model`` /
                           ``model.transformer``) with loss=ef.chunked_loss(model.lm_head, chunks=8):
                           the logits never exist whole; the head is glue the optimizer steps
    + bf16 boundaries      the same with boundary_dtype=torch.bfloat16 (cut inputs kept in bf16)
    ef.enable              ef.enable(model, split_at=[layers]) once, then autograd's loop as written
    ef.enable update= + chunks   ef.enable(model, split_at=[layers], update=opt) and the loop calls the body,
                           ef.chunked_loss(model.lm_head, chunks=8)(h[:, :-1], ids[:, 1:]).backward(),
                           opt.step() (which finds nothing left to step)

Every method trains its own copy of the same weights. Two warm-up steps make AdamW's state, so the
memory column is the peak of tensor bytes created during one more step and alive at once, which is
the step's peak above the weights and the optimizer state: on the CPU counted exactly by a
``TorchDispatchMode`` (``bench_memory.LiveBytes``), on CUDA ``max_memory_allocated`` minus what was
allocated before the step. Times are medians over ``--rounds`` rounds in which the methods alternate
step by step (each step after ``torch.manual_seed(round)``, so dropout draws alike). Ratios are to
``hf-checkpoint``. The "loss" column is each method's loss at its last step and "max |dw|" the
largest difference of its weights from autograd's after the same steps (float32 rounding); "1st step"
the first (warm-up) step's time over the median (what a first call costs: no capture at run time).

``--budget-mb B`` adds, per method, the longest sequence (a multiple of 64) whose step peak fits in
B MB above the weights and optimizer state, found by doubling then bisection on live bytes.

    python examples/bench_train_hf.py                       # Llama 8 x 256, vocab 8192, 4 x 512
    python examples/bench_train_hf.py --family gpt2
    python examples/bench_train_hf.py --layers 4 --hidden 512 --vocab 512 --batch 2 --seq 64
    python examples/bench_train_hf.py --budget-mb 200
    python examples/bench_train_hf.py --seqs 128 256 512 1024 --methods autograd hf-checkpoint \
        "ef.enable update= + chunks" --rounds 2            # memory and time against the sequence length
    python examples/bench_train_hf.py --quick               # a smoke run
    python examples/bench_train_hf.py --shape tinyllama --dtype bfloat16 --device cuda --batch 4 --seq 2048
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import eae_func as ef

from bench_memory import LiveBytes
from extras import add_out, extra, pyplot, save

MB = 2**20
METHODS = (
    "autograd",
    "hf-checkpoint",
    "hf-checkpoint + in-bw",
    "eae_func",
    "eae_func update=",
    "+ chunked head",
    "+ bf16 boundaries",
    "ef.enable",
    "ef.enable update= + chunks",
)


TINYLLAMA = dict(layers=22, hidden=2048, intermediate=5632, heads=32, kv_heads=4, vocab=32000)  # its 1.1B shape


def build(
    family: str, layers: int, hidden: int, vocab: int, seq: int, intermediate: int | None = None,
    heads: int | None = None, kv_heads: int | None = None,
) -> tuple[nn.Module, str, str]:  # fmt: skip
    """``(model, body attribute, layer pattern within the body)``: a random causal LM from a config (a
    Llama's MLP 4 x hidden, a head per 64 and a key/value head per 128 wide, unless given)."""
    with extra("hf"):
        import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), vocab_size=vocab, n_positions=seq,
            use_cache=False,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config).train(), "transformer", "h.*"
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate or 4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads or max(1, hidden // 64), num_key_value_heads=kv_heads or max(1, hidden // 128),
        vocab_size=vocab, max_position_embeddings=seq, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train(), "model", "layers.*"


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*", category=FutureWarning)
warnings.filterwarnings("ignore", message=r".*finds no gradient.*")  # ef.enable(update=): said once per model


def loop(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], torch.Tensor]:
    """The plain training step: forward, ``loss.backward()``, ``opt.step()``, ``zero_grad``."""

    def step(ids):
        loss = lm_loss(model(ids).logits, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


class LastHidden(nn.Module):
    """A causal LM's last hidden state (its body's output, before the head): the program swept with the
    head and loss in chunks. The LM is a submodule, so its head (tied to the embedding in GPT-2) is
    among the swept parameters, and the optimizer steps it as glue."""

    def __init__(self, lm: nn.Module, body: str):
        super().__init__()
        self.lm, self.body = lm, body

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return getattr(self.lm, self.body)(ids).last_hidden_state


def make_step(method: str, model: nn.Module, body: str, layers: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """One training step of ``method`` on ``model`` (its own optimizer inside), as ``step(ids) -> loss``."""
    split_at = [f"{body}.{layers}"]
    if method in ("autograd", "hf-checkpoint"):
        if method == "hf-checkpoint":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return loop(model, adamw(model.parameters()))
    if method == "hf-checkpoint + in-bw":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        each = {p: adamw([p]) for p in model.parameters()}

        def stepped(p):
            each[p].step()
            each[p].zero_grad(set_to_none=True)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(stepped)

        def in_backward(ids):
            loss = lm_loss(model(ids).logits, ids)
            loss.backward()
            return loss.detach()

        return in_backward
    opt = adamw(model.parameters())
    if method == "ef.enable":
        ef.enable(model, split_at=split_at)
        return loop(model, opt)
    if method == "ef.enable update= + chunks":
        ef.enable(model, split_at=split_at, update=opt)
        chunked = ef.chunked_loss(model.get_output_embeddings(), chunks=8)

        def switched(ids):
            loss = chunked(getattr(model, body)(ids).last_hidden_state[:, :-1], ids[:, 1:])
            loss.backward()
            opt.step()
            return loss.detach()

        return switched
    if method == "eae_func":

        def unfused(ids):
            res = ef.sweep(model, dict(model.named_parameters()), ids, ids, split_at=split_at,
                           loss=lambda out, y: lm_loss(out.logits, y))  # fmt: skip
            ef.write_back(model, res)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return res.loss

        return unfused
    if method == "eae_func update=":

        def fused(ids):
            return ef.sweep(model, dict(model.named_parameters()), ids, ids, split_at=split_at, update=opt,
                            loss=lambda out, y: lm_loss(out.logits, y)).loss  # fmt: skip

        return fused
    hidden = LastHidden(model, body)
    chunked = ef.chunked_loss(model.get_output_embeddings(), chunks=8)
    options = {"boundary_dtype": torch.bfloat16} if method == "+ bf16 boundaries" else {}

    def fused_chunked(ids):
        return ef.sweep(
            hidden, dict(hidden.named_parameters()), ids, ids, split_at=[f"lm.{body}.{layers}"], update=opt,
            loss=lambda h, y: chunked(h[:, :-1], y[:, 1:]), **options,
        ).loss  # fmt: skip

    return fused_chunked


def step_peak(step: Callable, ids: torch.Tensor) -> int:
    """Bytes created by one step and alive at once (the weights and optimizer state exist before it)."""
    if ids.is_cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(ids)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with LiveBytes() as live:
        step(ids)
    return live.peak


def setup(args: argparse.Namespace, seq: int, methods: tuple) -> tuple[dict, dict, torch.Tensor, dict]:
    """Each method's model (the same weights) and step, warmed up twice, the ids, and each method's
    first step's seconds."""
    shape = TINYLLAMA if getattr(args, "shape", None) == "tinyllama" else {}
    model, body, layers = build(
        args.family, args.layers, args.hidden, args.vocab, seq,
        **{k: shape[k] for k in ("intermediate", "heads", "kv_heads") if k in shape},
    )  # fmt: skip
    model.to(args.device, getattr(torch, getattr(args, "dtype", "float32")))
    models = {m: copy.deepcopy(model) for m in methods}
    steps = {m: make_step(m, models[m], body, layers) for m in methods}
    ids = torch.randint(args.vocab, (args.batch, seq), generator=torch.Generator().manual_seed(0)).to(args.device)
    first = {}
    for k in range(2):
        for m in methods:
            torch.manual_seed(k)
            start = time.perf_counter()
            steps[m](ids)
            if ids.is_cuda:
                torch.cuda.synchronize()
            first.setdefault(m, time.perf_counter() - start)
    return models, steps, ids, first


def longest(args: argparse.Namespace, method: str) -> int:
    """The longest multiple of 64 tokens whose step peak of ``method`` fits ``--budget-mb``."""

    def fits(seq: int) -> bool:
        _, steps, ids, _ = setup(args, seq, (method,))
        return step_peak(steps[method], ids) <= args.budget_mb * MB

    lo, hi = 0, 64
    while fits(hi) and hi < args.max_seq:
        lo, hi = hi, min(2 * hi, args.max_seq)
    if lo == hi:
        return lo
    while hi - lo > 64:
        mid = (lo + hi) // 128 * 64
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def measure(args: argparse.Namespace, seq: int, methods: tuple) -> tuple[dict, dict, dict, dict, dict]:
    """Per method at ``seq`` tokens: the median step seconds, the step's peak bytes, the last loss,
    the largest weight difference from the first method's after the same steps, and the first step's
    seconds."""
    models, steps, ids, first = setup(args, seq, methods)
    times: dict[str, list] = {m: [] for m in methods}
    losses = {}
    for r in range(args.rounds):
        for m in methods:
            torch.manual_seed(2 + r)
            if ids.is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            losses[m] = float(steps[m](ids))
            if ids.is_cuda:
                torch.cuda.synchronize()
            times[m].append(time.perf_counter() - start)
    peaks = {}
    for m in methods:
        torch.manual_seed(2 + args.rounds)
        peaks[m] = step_peak(steps[m], ids)
    reference = dict(models[methods[0]].named_parameters())
    drift = {m: max((p - reference[n]).abs().max().item() for n, p in models[m].named_parameters()) for m in methods}
    return {m: statistics.median(t) for m, t in times.items()}, peaks, losses, drift, first


def plot(args: argparse.Namespace, methods: tuple) -> None:
    """Peak memory and step time against the sequence length (``--seqs``), one line per method."""
    plt = pyplot()
    rows = {seq: measure(args, seq, methods) for seq in args.seqs}
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for m in methods:
        left.plot(args.seqs, [rows[s][1][m] / MB for s in args.seqs], marker="o", label=m)
        right.plot(args.seqs, [rows[s][0][m] for s in args.seqs], marker="o", label=m)
    left.set(xlabel="sequence length", ylabel="step peak above weights + AdamW state (MB)", xscale="log")
    right.set(xlabel="sequence length", ylabel="step time (s)", xscale="log")
    for ax in (left, right):
        ax.set_xticks(args.seqs, [str(s) for s in args.seqs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(
        f"{args.family}, {args.layers} layers x {args.hidden}, vocab {args.vocab}, batch {args.batch}, {args.dtype}, "
        f"{args.device}, AdamW",
        fontsize=9,
    )
    fig.tight_layout()
    save(fig, args.out, "bench_train_hf.png", dpi=110)
    for seq in args.seqs:
        t, p, *_ = rows[seq]
        print(f"seq {seq}: " + ", ".join(f"{m} {p[m] / MB:.1f} MB {t[m]:.3f} s" for m in methods))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=["llama", "gpt2"], default="llama")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--shape", choices=["tinyllama"], help="TinyLlama's 1.1B shape (sets layers, hidden, vocab)")
    parser.add_argument("--budget-mb", type=float, default=None, help="also find the longest sequence in this budget")
    parser.add_argument("--max-seq", type=int, default=8192)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, metavar="METHOD")
    parser.add_argument("--seqs", type=int, nargs="+", help="plot memory and time against these sequence lengths")
    add_out(parser)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 layers, width 64, vocab 512, 2 x 64")
    args = parser.parse_args(argv)
    if args.shape == "tinyllama":
        args.family, args.layers, args.hidden, args.vocab = (
            "llama",
            *(TINYLLAMA[k] for k in ("layers", "hidden", "vocab")),
        )
    if args.quick:
        args.layers, args.hidden, args.vocab, args.batch, args.seq, args.rounds = 2, 64, 512, 2, 64, 1
        args.max_seq = min(args.max_seq, 256)
    torch.set_num_threads(args.threads)
    methods = tuple(args.methods)
    if args.seqs:
        plot(args, methods)
        return
    times, peaks, losses, drift, first = measure(args, args.seq, methods)
    base = "hf-checkpoint" if "hf-checkpoint" in methods else methods[0]
    t0, p0 = times[base], peaks[base]
    print(
        f"{args.family}: {args.layers} layers x {args.hidden}, vocab {args.vocab}, batch {args.batch} x "
        f"{args.seq}, {args.dtype}, {args.device}, AdamW; medians of {args.rounds} interleaved rounds; ratios to {base}"
    )
    print(
        f"{'method':28} {'step s':>8} {'ratio':>7} {'peak MB':>9} {'ratio':>7} {'loss':>9} {'max |dw|':>9} "
        f"{'1st step':>9}"
    )
    for m in methods:
        print(
            f"{m:28} {times[m]:8.3f} {times[m] / t0:6.2f}x {peaks[m] / MB:9.1f} {peaks[m] / p0:6.2f}x "
            f"{losses[m]:9.5f} {drift[m]:9.2e} {first[m] / times[m]:8.2f}x"
        )
    if args.budget_mb is not None:
        print(f"longest sequence (multiple of 64, at most {args.max_seq}) whose step fits {args.budget_mb:g} MB:")
        found = {m: longest(args, m) for m in methods}
        for m in methods:
            print(f"{m:28} {found[m]:6d} {found[m] / max(found[base], 1):6.2f}x")


if __name__ == "__main__":
    main()
