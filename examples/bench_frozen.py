"""What not differentiating frozen weights saves: a LoRA fine-tune of a small GPT-2.

Every attention projection ``c_attn`` of a GPT-2 (random weights from a config) gets a rank-4
adapter ``h A B``; the base model is frozen (``requires_grad_(False)``), the adapters train.
Three ways to get the adapters' gradients, interleaved over the rounds, medians and ratios:

    autograd        loss.backward() on the model
    eae frozen      ef.grad(model, params, ..., split_at=["transformer.h.*"]): frozen weights are not
                    differentiated (their gradient is None)
    eae all         the same sweep on a copy of the model with every weight trainable (what 0.2 did
                    with frozen weights: every weight's gradient computed, then ignored)

    python examples/bench_frozen.py --layers 6 --width 128 --rounds 9
"""

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

import eae_func as ef

from extras import extra

with extra("hf"):
    import transformers


class LoRA(torch.nn.Module):
    """``base(h) + (h A) B``: a frozen base layer with a trainable low-rank adapter."""

    def __init__(self, base, rank):
        super().__init__()
        self.base = base
        n_in, n_out = base.weight.shape  # GPT-2's Conv1D stores (in, out)
        self.a = torch.nn.Parameter(torch.randn(n_in, rank) / n_in**0.5)
        self.b = torch.nn.Parameter(torch.zeros(rank, n_out))

    def forward(self, h):
        return self.base(h) + (h @ self.a) @ self.b


def next_token_loss(out, ids):
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=512, n_positions=args.seq
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    model.requires_grad_(False)
    for block in model.transformer.h:
        block.attn.c_attn = LoRA(block.attn.c_attn, args.rank)
    ids = torch.randint(0, 512, (args.batch, args.seq))
    params = dict(model.named_parameters())
    adapters = [n for n, p in params.items() if p.requires_grad]
    everything = copy.deepcopy(model).requires_grad_(True)
    every_param = dict(everything.named_parameters())

    def autograd():
        model.zero_grad(set_to_none=True)
        next_token_loss(model(ids), ids).backward()

    def eae_frozen():
        ef.grad(model, params, ids, ids, loss=next_token_loss, split_at=["transformer.h.*"])

    def eae_all():
        ef.grad(everything, every_param, ids, ids, loss=next_token_loss, split_at=["transformer.h.*"])

    methods = {"autograd": autograd, "eae frozen": eae_frozen, "eae all": eae_all}
    for fn in methods.values():  # warm-up (and the capture, once per mode and layout)
        fn()
    times = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print(
        f"GPT-2 {args.layers} layers, width {args.width}, seq {args.seq}, batch {args.batch}, rank-{args.rank} "
        f"adapters: {len(adapters)} trainable tensors of {len(params)}; {torch.get_num_threads()} threads, "
        f"medians of {args.rounds} interleaved rounds"
    )
    base = statistics.median(times["autograd"])
    for name, t in times.items():
        print(f"  {name:<12} {statistics.median(t) * 1e3:8.1f} ms   {statistics.median(t) / base:5.2f}x autograd")
    saved = 1 - statistics.median(times["eae frozen"]) / statistics.median(times["eae all"])
    print(f"  not differentiating the frozen weights saves {saved:.0%} of the sweep's time")


if __name__ == "__main__":
    main()
