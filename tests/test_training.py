"""Paper-style check: training with EAE follows plain autograd step for step."""

import copy

import optree
import torch

import eae_func as ef
from eae_func.adjoint import NAMESPACE
from eae_func.models import lm_loss, transformer_lm

from helpers import build, mse


def train_losses(model, data, mode: str, steps: int = 25):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    chain, params = ef.from_module(model, loss=lm_loss)
    losses = []
    for step in range(steps):
        x, y = data[step % len(data)]
        if mode == "autograd":
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model(x), y)
            loss.backward()
        else:
            loss, grads = ef.value_and_grad(chain, params, x, y, recompute=(mode == "eae"), key=step)
            ef.write_grads(model, grads)
        opt.step()
        losses.append(loss.item())
    return losses


def test_eae_training_tracks_autograd_and_recompute_changes_nothing():
    torch.manual_seed(0)
    model = transformer_lm(vocab=32, dim=32, depth=3, n_heads=4, n_kv_heads=2, ffn_hidden=48, dropout=0.1)
    g = torch.Generator().manual_seed(1)
    data = [(t[:, :-1], t[:, 1:]) for t in torch.randint(0, 32, (4, 4, 17), generator=g)]
    runs = {}
    for mode in ("autograd", "eae", "eae-keep-graph"):
        torch.manual_seed(123)  # dropout masks: the same global stream for every run
        runs[mode] = train_losses(copy.deepcopy(model), data, mode)
    ref, eae, kept = runs["autograd"], runs["eae"], runs["eae-keep-graph"]
    assert ref[-1] < 0.8 * ref[0], "the model should learn"
    for a, b in zip(eae, ref):
        assert abs(a - b) <= 1e-4 * abs(b)
    assert eae == kept  # bit-identical with and without the memory-saving reverse sweep


def test_keeping_the_forward_graph_gives_identical_gradients():
    model, x, target = build("transformer", 4, torch.float32, 5)
    chain, params = ef.from_module(model, loss=mse)
    a = ef.sweep(chain, params, x, target)
    b = ef.sweep(chain, params, x, target, recompute=False)
    assert all(
        torch.equal(u, v)
        for u, v in zip(
            optree.tree_leaves(a.grads, namespace=NAMESPACE), optree.tree_leaves(b.grads, namespace=NAMESPACE)
        )
    )
    assert b.stats[chain.names[0]]["recompute_s"] == 0
