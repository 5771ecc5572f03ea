"""A step makes no host wait a GPU would stall on: no ``.item()``, ``.tolist()``, ``float()``,
``int()`` or ``bool()`` of a tensor inside the fold, the built-in passes (but ``check_finite("raise")``,
which must read its count to raise) or a fused update, over microbatches and several steps."""

import collections

import pytest
import torch
from torch import nn

import eae_func as ef
from eae_func import passes as P

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


@pytest.fixture
def reads(monkeypatch):
    """Counts of the reads of a tensor's value on the host, by method."""
    counts: collections.Counter = collections.Counter()
    for name in READS:
        real = getattr(torch.Tensor, name)

        def spy(self, *args, _name=name, _real=real, **kwargs):
            counts[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return counts


def every_pass():
    return ef.compose(
        P.clip_by_global_norm(1.0),
        P.clip_by_value(0.5),
        P.scale(0.9),
        P.gaussian_noise(1e-3),
        P.error_feedback(P.int8()),
        P.topk(0.5),
        P.randk(0.5),
        P.cast(torch.bfloat16),
        P.fp8(),
        P.int8(),
        P.stats(),
        P.check_finite("zero"),
        P.synthetic(warmup=1),
        P.only(P.scale(2.0), indices=[1]),
        P.when(lambda adj: True, P.scale(1.0)),
    )


@pytest.mark.parametrize("update", ["none", "torch.optim", "pure"])
def test_a_sweep_reads_no_tensor_value_on_the_host(reads, update):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.1), nn.Linear(16, 4))
    chain, params = ef.from_module(model, loss=lambda out, y: (out - y).square().mean())
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    state, fused_state = None, [{} for _ in params]
    for _ in range(3):
        if update == "torch.optim":
            options = {"update": torch.optim.SGD(model.parameters(), lr=0.1)}
        elif update == "pure":
            options = {"update": ef.fused(lambda p, g, s: ({n: t - 0.1 * g[n] for n, t in p.items()}, s), fused_state)}
        else:
            options = {}
        res = ef.sweep(chain, params, x, y, passes=every_pass(), pass_state=state, microbatches=2, **options)
        state = res.pass_state
        if update == "pure":
            params, fused_state = res.params, res.update_state
    assert not reads, dict(reads)
