"""Correctness rules: dropout replay, buffers updated once, integer inputs, tied weights, nothing mutated."""

import copy

import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import eae_func as ef
from eae_func.adjoint import NAMESPACE
from eae_func.models import Block, lm_loss, transformer_lm

from helpers import assert_grads_match, autograd_grads


def snapshot(tree):
    return optree.tree_map(lambda t: t.clone(), tree, namespace=NAMESPACE)


def assert_unchanged(before, after):
    for a, b in zip(optree.tree_leaves(before, namespace=NAMESPACE), optree.tree_leaves(after, namespace=NAMESPACE)):
        assert torch.equal(a, b)


@given(seed=st.integers(0, 2**16), p=st.floats(0.1, 0.7))
def test_dropout_gives_autograds_gradients_under_the_same_seed(seed, p):
    torch.manual_seed(0)
    model = (
        nn.Sequential(
            nn.Linear(6, 12), nn.Dropout(p), nn.Sequential(nn.Linear(12, 12), nn.Dropout(p)), nn.Linear(12, 3)
        )
        .double()
        .train()
    )
    x, y = torch.randn(9, 6, dtype=torch.float64), torch.randint(0, 3, (9,))
    chain, params = ef.from_module(model, loss=F.cross_entropy)
    torch.manual_seed(seed)
    res = ef.sweep(chain, params, x, y)
    after_eae = torch.rand(1)
    torch.manual_seed(seed)
    loss, reference = autograd_grads(model, F.cross_entropy, x, y)
    after_autograd = torch.rand(1)
    torch.testing.assert_close(res.loss, loss)
    assert_grads_match(chain, res.grads, reference, rtol=1e-10, atol=1e-12)
    assert torch.equal(after_eae, after_autograd), "the sweep must advance the global RNG like one forward"


def test_attention_and_residual_dropout_of_a_block_are_replayed():
    """``Block(dropout=p)`` drops attention weights too; the recompute draws the same masks."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(16, n_heads=4, n_kv_heads=2, ffn_hidden=24, dropout=0.3) for _ in range(3)])
    model = model.double().train()
    assert all(b.attn.dropout == 0.3 for b in model)
    x, y = torch.randn(2, 7, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    chain, params = ef.from_module(model, loss=F.mse_loss)
    torch.manual_seed(5)
    res = ef.sweep(chain, params, x, y)
    torch.manual_seed(5)
    loss, reference = autograd_grads(model, F.mse_loss, x, y)
    torch.testing.assert_close(res.loss, loss)
    assert_grads_match(chain, res.grads, reference, rtol=1e-10, atol=1e-12)
    model.eval()
    with torch.no_grad():  # attention dropout is on in train mode: the attention path differs from eval
        block = model[0]
        h = block.attn_norm(x)
        torch.manual_seed(5)
        assert not torch.allclose(block.train().attn(h), block.eval().attn(h))


def test_batchnorm_stats_updated_once_returned_and_inputs_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8))
    reference = copy.deepcopy(model)
    x, target = torch.randn(16, 5), torch.randn(16, 8)
    chain, params = ef.from_module(model, loss=F.mse_loss)
    buffers_before = snapshot(chain.buffers())
    res = ef.sweep(chain, params, x, target)
    assert_unchanged(buffers_before, chain.buffers())  # the module's running stats are not touched
    loss, grads = autograd_grads(reference, F.mse_loss, x, target)
    for i in (1, 4):
        for name, b in reference[i].named_buffers():
            torch.testing.assert_close(res.buffers[i][name], b)
    assert int(res.buffers[1]["num_batches_tracked"]) == 1
    # a second step threads the returned buffers
    res2 = ef.sweep(chain, params, x, target, buffers=res.buffers)
    reference(x)
    torch.testing.assert_close(res2.buffers[4]["running_var"], reference[4].running_var)


def test_eval_mode_uses_running_stats_and_matches_autograd():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double()
    model(torch.randn(32, 5, dtype=torch.float64))  # give the running stats values
    model.eval()
    x, target = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    chain, params = ef.from_module(model, loss=F.mse_loss)
    res = ef.sweep(chain, params, x, target)
    _, reference = autograd_grads(model, F.mse_loss, x, target)
    assert_grads_match(chain, res.grads, reference, rtol=1e-10, atol=1e-12)


@given(seed=st.integers(0, 2**16), depth=st.integers(1, 3))
def test_token_inputs_and_tied_embedding_head(seed, depth):
    torch.manual_seed(seed)
    model = transformer_lm(vocab=23, dim=16, depth=depth, n_heads=4, n_kv_heads=2, ffn_hidden=24).double()
    tokens = torch.randint(0, 23, (2, 9))
    x, y = tokens[:, :-1], tokens[:, 1:]
    chain, params = ef.from_module(model, loss=lm_loss)
    assert chain.ties == (((0, "weight"), (depth + 1, "weight")),)
    res = ef.sweep(chain, params, x, y)
    assert res.adjoints[-1].value is None  # integer input: no costate
    _, reference = autograd_grads(model, lm_loss, x, y)
    tied = model[0].weight
    assert_grads_match(chain, res.grads, reference, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(res.grads[0]["weight"], reference[tied])  # the sum of both uses
    # write_grads puts autograd's .grad on the module
    clone = copy.deepcopy(model)
    ef.write_grads(clone, res.grads)
    for p, q in zip(model.parameters(), clone.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-11)


def test_ties_survive_a_pure_update():
    torch.manual_seed(0)
    model = transformer_lm(vocab=11, dim=8, depth=1, n_heads=2).double()
    tokens = torch.randint(0, 11, (2, 6))
    chain, params = ef.from_module(model, loss=lm_loss)
    grads = ef.grad(chain, params, tokens[:, :-1], tokens[:, 1:])
    params = optree.tree_map(lambda p, g: p - 0.1 * g, params, grads, namespace=NAMESPACE)
    assert params[0]["weight"] is not params[-1]["weight"]
    torch.testing.assert_close(params[0]["weight"], params[-1]["weight"])
    grads = ef.grad(chain, params, tokens[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(grads[0]["weight"], grads[-1]["weight"])


def test_nothing_the_caller_passed_is_modified():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.2), nn.Linear(6, 3)).train()
    chain, params = ef.from_module(model, loss=F.cross_entropy)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    buffers = chain.buffers()
    before = snapshot((params, x, y, buffers))
    res = ef.sweep(chain, params, x, y, buffers=buffers, passes=lambda a: a.replace(value=a.value * 2))
    assert_unchanged(before, (params, x, y, buffers))
    assert res.adjoints[0].value.abs().sum() > 0


def test_params_share_storage_with_the_module_so_optimizers_are_seen():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    chain, params = ef.from_module(model, loss=lambda o: o.sum())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(4, 3)
    ef.write_grads(model, ef.grad(chain, params, x))
    opt.step()
    assert torch.equal(params[0]["weight"], model[0].weight.detach())


def test_the_recompute_runs_in_the_modes_the_forward_saw():
    """Another thread switching the model to eval mode mid-sweep (here: a pass at the loss boundary,
    between the forward and the reverse steps, and a stage's forward switching an earlier stage): the
    recompute still runs BatchNorm in train mode, as the forward did, and the switch stands after."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double().train()
    x, target = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    loss, reference = autograd_grads(copy.deepcopy(model), F.mse_loss, x, target)
    reference = dict(zip([n for n, _ in model.named_parameters()], reference.values()))

    def switch(adj):
        model.eval()
        return adj

    chain, params = ef.from_module(model, loss=F.mse_loss)
    res = ef.sweep(chain, params, x, target, passes=switch)
    assert not model.training and not model[1].training
    torch.testing.assert_close(res.loss, loss)
    for k, stage in enumerate(res.grads):
        for name, g in stage.items():
            torch.testing.assert_close(g, reference[f"{k}.{name}"], rtol=1e-10, atol=1e-12)
    model.train()
    head = ef.stage(lambda p, h: switch(h) @ p["w"] + p["b"], name="head")  # switches BatchNorm_1 as it runs
    switching = ef.Chain([*chain.stages[:3], head], loss=F.mse_loss)
    res = ef.sweep(switching, (*params[:3], {"w": params[3]["weight"].T, "b": params[3]["bias"]}), x, target)
    assert not model[1].training
    torch.testing.assert_close(res.grads[1]["weight"], reference["1.weight"], rtol=1e-10, atol=1e-12)


def test_parameter_hooks_act_as_under_autograd():
    """``p.register_hook(fn)`` on a module's parameter (the usual way to mask or prune a gradient):
    the sweep hands ``fn`` the parameter's whole gradient once, as autograd does before accumulating
    it into ``.grad``: a tied parameter's sum over its uses, every microbatch's, before a fused update."""
    torch.manual_seed(0)
    model = transformer_lm(vocab=11, dim=8, depth=2, n_heads=2).double()
    tokens = torch.randint(0, 11, (4, 6))
    x, y = tokens[:, :-1], tokens[:, 1:]
    mask = (torch.rand(32, 8) > 0.5).double()
    seen = []
    model[1].ffn.w1.weight.register_hook(lambda g: g * mask)
    model[0].weight.register_hook(lambda g: g * g.norm())  # the tied weight, not linear: once, on the sum
    model[2].attn_norm.weight.register_hook(lambda g: seen.append(g.clone()))  # returns None: observes
    _, reference = autograd_grads(model, lm_loss, x, y)
    assert len(seen) == 1
    chain, params = ef.from_module(model, loss=lm_loss)
    for options in ({}, {"microbatches": 2}):
        seen.clear()
        assert_grads_match(chain, ef.grad(chain, params, x, y, **options), reference, rtol=1e-10, atol=1e-12)
        assert len(seen) == 1
    flat = ef.grad(model, dict(model.named_parameters()), x, y, loss=lm_loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(flat[name], reference[p], rtol=1e-10, atol=1e-12)
    before = {p: p.detach().clone() for p in model.parameters()}
    model.zero_grad(set_to_none=True)
    seen.clear()
    ef.sweep(chain, params, x, y, update=torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(seen) == 1
    for p, old in before.items():
        torch.testing.assert_close(p.detach(), old - 0.1 * reference[p], rtol=1e-10, atol=1e-12)


class HostNoise(nn.Module):
    """A linear layer whose noise comes from Python's ``random`` and/or numpy's global generator."""

    def __init__(self, source, width=6):
        super().__init__()
        self.source, self.linear = source, nn.Linear(width, width)

    def forward(self, h):
        import random

        import numpy as np

        out = self.linear(h)
        if "python" in self.source:
            out = out * random.uniform(0.5, 2.0)
        if "numpy" in self.source:
            out = out * torch.from_numpy(np.random.rand(h.shape[-1]) > 0.5).to(h.dtype)
        return out


@pytest.mark.parametrize("source", ["python", "numpy", "python+numpy"])
def test_python_and_numpy_draws_inside_a_stage_are_replayed(source):
    """A stage drawing from Python's or numpy's generator sees the same numbers in its rebuild; a
    stage of the same class before it that draws nothing does not hide it."""
    import random

    import numpy as np

    torch.manual_seed(0)
    quiet = lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh())  # noqa: E731
    noise = type(f"HostNoise_{source}", (HostNoise,), {})  # a class per case: each kind watched afresh
    model = nn.Sequential(quiet(), nn.Sequential(nn.Tanh(), noise(source)), quiet(), noise(source)).double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    chain, params = ef.from_module(model, loss=F.mse_loss)
    for _ in range(2):  # the first call of a stage is watched, later ones saved and replayed
        random.seed(3), np.random.seed(3)
        res = ef.sweep(chain, params, x, y)
        after_eae = random.random(), np.random.rand()
        random.seed(3), np.random.seed(3)
        loss, reference = autograd_grads(model, F.mse_loss, x, y)
        assert (random.random(), np.random.rand()) == after_eae, "the sweep must draw as one forward does"
        torch.testing.assert_close(res.loss, loss)
        assert_grads_match(chain, res.grads, reference, rtol=1e-10, atol=1e-12)
