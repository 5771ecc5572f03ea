"""``ef.apply`` runs a chain forward: the module's own output, the stages run by hand, and the loss the
sweep differentiates; it writes no buffer, differentiates as the sweep does, and names a failing stage."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import eae_func as ef


def test_apply_is_the_modules_forward_and_writes_no_buffer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 3))
    chain, params = ef.from_module(model, loss=F.cross_entropy)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    running = model[1].running_mean.clone()
    torch.manual_seed(1)
    out = ef.apply(chain, params, x)  # train mode: batch statistics, dropout
    assert torch.equal(model[1].running_mean, running)  # the module's statistics are not written
    torch.manual_seed(1)
    assert torch.equal(out, model(x))
    model.eval()
    with torch.no_grad():
        out = ef.apply(chain, params, x)
        assert torch.equal(out, model(x))
    res = ef.sweep(chain, params, x, y)
    assert torch.equal(chain.loss(out, y), res.loss)


def test_apply_runs_the_stages_in_order_and_differentiates_as_the_sweep():
    torch.manual_seed(0)
    stages = [ef.stage(lambda p, h: torch.tanh(h @ p["w"] + p["b"]), name=f"layer{i}") for i in range(3)]
    chain = ef.Chain(stages, loss=F.mse_loss)
    params = tuple({"w": torch.randn(4, 4) / 2, "b": torch.randn(4)} for _ in range(3))
    x, y = torch.randn(5, 4), torch.randn(5, 4)
    h = x
    for p in params:
        h = torch.tanh(h @ p["w"] + p["b"])
    assert torch.equal(ef.apply(chain, params, x), h)
    exact = torch.func.grad(lambda p: chain.loss(ef.apply(chain, p, x), y))(params)
    for got, want in zip(ef.tree_leaves(ef.grad(chain, params, x, y)), ef.tree_leaves(exact)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_apply_names_the_stage_and_refuses_what_is_not_a_chain():
    def broken(p, h):
        raise RuntimeError("the simulator is off")

    chain = ef.Chain([ef.stage(lambda p, h: h, name="in"), ef.stage(broken, name="sim")], loss=F.mse_loss)
    with pytest.raises(RuntimeError, match="simulator") as info:
        ef.apply(chain, ({}, {}), torch.zeros(2, 3))
    assert "in stage 1 ('sim')" in "".join(info.value.__notes__)
    with pytest.raises(ValueError, match="one entry per stage"):
        ef.apply(chain, ({},), torch.zeros(2, 3))
    with pytest.raises(TypeError, match="apply: expected a Chain"):
        ef.apply(nn.Linear(3, 3), {}, torch.zeros(2, 3))
