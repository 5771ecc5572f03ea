"""Quickstart: train a small transformer LM with EAE and a costate pass pipeline.

1. Checks that EAE's gradients (no passes) equal plain autograd's.
2. Trains for a few dozen AdamW steps with int8-quantised, norm-clipped costates.
3. Prints the costate norm at every block boundary.

    python examples/quickstart.py
"""

import time

import torch

import eae_func as ef
from eae_func import passes as P
from eae_func.models import lm_loss, transformer_lm

from text_data import batches, split_tokens, stdlib_docstrings


def main(steps: int = 40, depth: int = 4, dim: int = 64):
    torch.manual_seed(0)
    model = transformer_lm(vocab=256, dim=dim, depth=depth, n_heads=4, n_kv_heads=2, ffn_hidden=4 * dim)
    chain, params = ef.from_module(model, loss=lm_loss)
    train_tokens, _ = split_tokens(stdlib_docstrings(max_bytes=200_000))
    stream = batches(train_tokens, batch=8, seq=64, seed=0)

    # 1. Gradients equal plain autograd's.
    x, y = next(stream)
    grads = ef.grad(chain, params, x, y)
    lm_loss(model(x), y).backward()
    ef_grads = {
        id(p): g
        for stage, gs in zip(chain.stages, grads)
        for name, g in gs.items()
        for p in [dict(stage.module.named_parameters())[name]]
    }
    diff = max((ef_grads[id(p)] - p.grad).abs().max().item() for p in model.parameters())
    print(f"max |EAE grad - autograd grad| = {diff:.2e}")

    # 2. Train with int8 + clip on every costate.
    passes = ef.compose(P.int8(), P.clip_by_global_norm(1.0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = next(stream)
        res = ef.sweep(chain, params, x, y, passes=passes, key=step)
        ef.write_back(model, res)
        opt.step()
        if step % 10 == 0 or step == 1:
            print(f"step {step:3d}  loss {res.loss.item():.4f}")
    print(f"{steps} steps in {time.perf_counter() - start:.1f} s")

    # 3. The exposed costates, boundary L (loss side) down to 0 (token ids: no costate).
    for adj in res.adjoints:
        norm = sum(t.norm() ** 2 for t in ef.tree_leaves(adj.value)) ** 0.5
        norm = f"{float(norm):.3e}" if adj.value is not None else "none (integer input)"
        print(f"boundary {adj.index} ({adj.stage:>12}): |p| = {norm}  passes {adj.history}")


if __name__ == "__main__":
    main()
