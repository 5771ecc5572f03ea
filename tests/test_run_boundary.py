"""``boundary_dtype=`` and ``offload=`` on a model cut at run time: each cut call's inputs that require
grad are kept in that dtype / on the host and the call runs on the kept value, so the gradients are
exactly autograd's through a model that rounds its cut inputs (straight through), the stored inputs
live in that dtype, and nothing is captured."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import eae_func as ef

from live_bytes import LiveBytes

F64 = torch.float64


class Residual(nn.Module):
    """Blocks on a residual stream, one of them called twice, and a head as glue; the stream is written
    in place once before each later call (its version is not 0)."""

    def __init__(self, width=6, depth=3, classes=3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for block in [*self.blocks, self.blocks[0]]:
            x = x + block(x)
            x.mul_(1.0)
        return self.head(x)


def rounding(dtype):
    """A forward pre-hook that rounds a block's input to ``dtype`` and passes its gradient straight through,
    where it requires grad (the data itself, like masks and rotary tables, is used as given)."""

    def hook(module, args):
        (x,) = args
        return (x + (x.to(dtype).to(x.dtype) - x).detach(),) if x.requires_grad else args

    return hook


def no_export(monkeypatch):
    def exported(*args, **kwargs):
        raise AssertionError("torch.export called")

    monkeypatch.setattr(torch.export, "export", exported)


@settings(max_examples=20, deadline=None)
@given(
    depth=st.integers(1, 4),
    width=st.integers(2, 8),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    offload=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_stored_inputs_give_autograds_gradients_through_the_rounded_model(depth, width, dtype, offload, seed):
    torch.manual_seed(seed)
    model = Residual(width, depth).to(F64)
    x, y = torch.randn(5, width, dtype=F64), torch.randint(0, 3, (5,))
    res = ef.sweep(
        model, dict(model.named_parameters()), x, y, loss=F.cross_entropy, split_at=["blocks.*"],
        boundary_dtype=dtype, offload=offload, capture="run",
    )  # fmt: skip
    handles = [b.register_forward_pre_hook(rounding(dtype)) for b in model.blocks]
    F.cross_entropy(model(x), y).backward()
    for h in handles:
        h.remove()
    for n, p in model.named_parameters():
        torch.testing.assert_close(res.grads[n], p.grad, rtol=1e-12, atol=1e-12, msg=n)
    torch.testing.assert_close(res.loss, F.cross_entropy(model(x), y), rtol=0, atol=1e-2)  # rounded vs not
    # each call's stored input: one (5, width) tensor in the dtype; the first call's is the data
    assert res.stats["blocks.0"]["boundary_bytes"] == 0
    assert res.stats["blocks.0#2"]["boundary_bytes"] == 5 * width * dtype.itemsize


def test_bfloat16_inputs_halve_what_the_sweep_keeps(monkeypatch):
    """On a deep, narrow model whose boundaries dominate, storing the cut inputs in bfloat16 takes the
    peak down by half of the float32 boundaries; nothing is captured."""
    no_export(monkeypatch)
    torch.manual_seed(0)
    rows, width, depth = 2048, 8, 16
    model = Residual(width, depth)
    x, y = torch.randn(rows, width), torch.randint(0, 3, (rows,))
    params = dict(model.named_parameters())
    boundaries = (depth + 1) * rows * width * 4  # one float32 input per call (blocks.0 twice)
    peaks, grads = {}, {}
    for dtype in (None, torch.bfloat16):
        with LiveBytes() as live:
            grads[dtype] = ef.grad(
                model, params, x, y, loss=F.cross_entropy, split_at=["blocks.*"], boundary_dtype=dtype
            )
        peaks[dtype] = live.peak
    assert peaks[None] > boundaries  # every float32 input kept
    assert peaks[torch.bfloat16] < peaks[None] - 0.4 * boundaries  # kept in half the bytes
    for n in params:
        torch.testing.assert_close(
            grads[torch.bfloat16][n], grads[None][n], rtol=0.05, atol=0.05 * grads[None][n].abs().max()
        )


class Writes(nn.Module):
    def forward(self, x):
        return x.mul_(2).tanh()


def test_a_cut_writing_into_its_stored_input_is_refused_naming_it():
    model = nn.Sequential(nn.Linear(4, 4), Writes(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"cut '1' writes into its input args\[0\] in place, and boundary_dtype"):
        ef.grad(
            model,
            dict(model.named_parameters()),
            x,
            loss=lambda o: o.sum(),
            split_at=["1"],
            boundary_dtype=torch.bfloat16,
        )


def test_an_enabled_model_stores_its_cut_inputs_too():
    torch.manual_seed(0)
    model = Residual(6, 3).to(F64)
    x, y = torch.randn(5, 6, dtype=F64), torch.randint(0, 3, (5,))
    ref = ef.grad(
        model,
        dict(model.named_parameters()),
        x,
        y,
        loss=F.cross_entropy,
        split_at=["blocks.*"],
        boundary_dtype=torch.float16,
    )
    with ef.enable(model, split_at=["blocks.*"], boundary_dtype=torch.float16):
        F.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=0, atol=0, msg=n)
