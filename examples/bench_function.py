"""A transformer written as a pure function over a params dict: what its capture costs once, and
what a step costs against the same function under plain autograd and the same blocks as a
hand-made ``ef.Chain``.

    torch.func      torch.func.grad of the function (a full autograd tape)
    eae chain       ef.grad of an ef.Chain with one ef.stage per block (the pieces cut by hand)
    eae function    ef.grad(model_fn, params, ...): the function captured by torch.export once,
                    cut at its ef.cut marks

Capture seconds are the median of fresh captures (a new function object each); step times are
interleaved over the rounds, medians and ratios to torch.func.

    python examples/bench_function.py --depths 4 12 --rounds 9
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import eae_func as ef

HEADS = 4


def block(p, h):
    """A pre-norm transformer block (causal attention and a GELU MLP) as a pure function."""
    B, T, D = h.shape
    q, k, v = (F.layer_norm(h, (D,)) @ p["qkv"]).view(B, T, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
    h = h + a @ p["proj"]
    return h + F.gelu(F.layer_norm(h, (D,)) @ p["up"]) @ p["down"]


def make_model_fn():
    def model_fn(p, ids):
        h = p["embed"][ids]
        for i, layer in enumerate(p["layers"]):
            h = ef.cut(block(layer, h), f"block{i}")
        return F.layer_norm(h, (h.shape[-1],)) @ p["head"]

    return model_fn


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def init(depth, width, vocab):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    def layer():
        return {
            "qkv": r(width, 3 * width),
            "proj": r(width, width),
            "up": r(width, 4 * width),
            "down": r(4 * width, width),
        }

    return {"embed": r(vocab, width), "layers": [layer() for _ in range(depth)], "head": r(width, vocab)}


def as_chain(params):
    """The same network cut by hand: embedding, one stage per block, the head; params per stage."""
    stages = [ef.stage(lambda p, ids: p["embed"][ids], name="embed")]
    stages += [ef.stage(block, name=f"block{i}") for i in range(len(params["layers"]))]
    stages += [ef.stage(lambda p, h: F.layer_norm(h, (h.shape[-1],)) @ p["head"], name="head")]
    per_stage = ({"embed": params["embed"]}, *params["layers"], {"head": params["head"]})
    return ef.Chain(stages, loss=lm_loss), per_stage


def measure(depth, args):
    """``(capture seconds, torch.func seconds per step, step-time ratios to torch.func)`` at ``depth``."""
    params = init(depth, args.width, args.vocab)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    capture = []
    for _ in range(args.captures):
        fresh = make_model_fn()
        start = time.perf_counter()
        ef.grad(fresh, params, x, y, loss=lm_loss)
        first = time.perf_counter() - start
        start = time.perf_counter()
        ef.grad(fresh, params, x, y, loss=lm_loss)
        capture.append(first - (time.perf_counter() - start))  # the first call less a step
    model_fn = make_model_fn()
    chain, per_stage = as_chain(params)
    runs = {
        "torch.func": lambda: torch.func.grad(lambda p: lm_loss(model_fn(p, x), y))(params),
        "eae chain": lambda: ef.grad(chain, per_stage, x, y),
        "eae function": lambda: ef.grad(model_fn, params, x, y, loss=lm_loss),
    }
    for run in runs.values():
        run()  # warm: the capture, the allocator
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["torch.func"])
    return statistics.median(capture), base, {name: statistics.median(t) / base for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 12])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--captures", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny run that checks the script works")
    args = parser.parse_args()
    if args.quick:
        args.depths, args.width, args.seq, args.batch, args.rounds, args.captures = [2], 32, 16, 2, 2, 1
    torch.set_num_threads(2)
    print(f"width {args.width}, seq {args.seq}, batch {args.batch}, vocab {args.vocab}, {args.rounds} rounds")
    print(f"{'depth':>5}  {'capture s':>9}  {'torch.func':>10}  {'eae chain':>9}  {'eae function':>12}")
    for depth in args.depths:
        capture, base, ratios = measure(depth, args)
        print(
            f"{depth:>5}  {capture:>9.2f}  {base * 1e3:>8.1f}ms  {ratios['eae chain']:>8.2f}x"
            f"  {ratios['eae function']:>11.2f}x"
        )


if __name__ == "__main__":
    main()
