"""torch's private parts behind ``eae_func.compat``: each still there and still computing what its
public counterpart computes, so a torch that changes one fails here, by name, not silently."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd.graph import get_gradient_edge

from eae_func import compat


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**16))
def test_pull_back_unchecked_is_torch_autograd_grad(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(cols, cols, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64, requires_grad=True)
    unused = torch.randn(3, dtype=torch.float64, requires_grad=True)
    outs = [torch.tanh(x @ w), (x * 2).sum(0)]
    cots = [torch.randn_like(o) for o in outs]
    want = torch.autograd.grad(outs, [w, x, unused], cots, allow_unused=True, retain_graph=True)
    got = compat.pull_back_unchecked([get_gradient_edge(o) for o in outs], cots, [w, x, unused])
    assert got[2] is None and want[2] is None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
