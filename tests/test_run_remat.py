"""``recompute=`` on a model cut at run time: each cut call is rebuilt, keeps its graph from the
forward, or keeps some ops' outputs for its rebuild, as the remat policy says of it as stage
``index - 1`` of a chain of the cut calls; every policy gives the same gradients bit for bit
(dropout replayed or its graph kept), the kept graphs cost their bytes, and nothing is captured."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import eae_func as ef
from eae_func import remat as R

from live_bytes import LiveBytes

F64 = torch.float64


class Net(nn.Module):
    """MLP blocks with dropout on a residual stream (one block called twice), and a head."""

    def __init__(self, width=16, depth=4, p=0.1):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(p), nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 3)
        self.to(F64)

    def forward(self, x):
        for block in [*self.blocks, self.blocks[0]]:
            x = x + block(x)
        return self.head(x)


def data(width=16, rows=32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, generator=g, dtype=F64), torch.randint(0, 3, (rows,), generator=g)


def no_export(monkeypatch):
    def exported(*args, **kwargs):
        raise AssertionError("torch.export called")

    monkeypatch.setattr(torch.export, "export", exported)


def run(model, x, y, **options):
    torch.manual_seed(7)  # the dropout masks: one draw per forward, replayed by every rebuild
    return ef.sweep(
        model, dict(model.named_parameters()), x, y, loss=F.cross_entropy, split_at=["blocks.*"], capture="run",
        **options,
    )  # fmt: skip


POLICIES = st.one_of(
    st.booleans(),
    st.sets(st.integers(0, 4)).map(lambda rebuilt: lambda i, name: i in rebuilt),
    st.integers(0, 200_000),
    st.just(R.save()),
    st.integers(0, 4).map(lambda i: R.save(keep=lambda j, name: j == i)),
)


@given(policy=POLICIES)
@settings(max_examples=12, deadline=None)
def test_every_policy_gives_the_same_gradients_bitwise(policy):
    model, (x, y) = Net(), data()
    want = run(model, x, y)
    got = run(model, x, y, recompute=policy)
    assert torch.equal(got.loss, want.loss)
    for n, g in want.grads.items():
        assert torch.equal(got.grads[n], g), n


def test_the_rebuilt_and_kept_calls_are_the_ones_the_policy_names_and_cost_their_graphs(monkeypatch):
    """Kept graphs skip the rebuild (no ``recompute_s``) and hold their bytes: the peak grows with
    the graphs kept, all of them costing about what autograd's tape costs; a byte budget of two
    graphs keeps the last two calls', and a second forward, which knows the graphs' sizes, builds
    only those: its peak is the rebuild's plus the budget at most."""
    no_export(monkeypatch)
    model, (x, y) = Net(width=32, depth=4, p=0.0), data(width=32, rows=256)
    peaks, rebuilt = {}, {}
    for label, policy in {
        "all": True,
        "none": False,
        "even": lambda i, name: i % 2 == 0,
        "two": None,
    }.items():
        if label == "two":  # the bytes of two graphs of a block: read off the peaks
            policy = int((peaks["none"] - peaks["all"]) / 4 * 2.2)
        with LiveBytes() as live:
            res = run(model, x, y, recompute=policy, timers=True)
        peaks[label] = live.peak
        rebuilt[label] = {n for n, s in res.stats.items() if n.startswith("blocks") and "recompute_s" in s}
    assert rebuilt["all"] == {"blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.0#2"}
    assert rebuilt["none"] == set()
    assert rebuilt["even"] == {"blocks.0", "blocks.2", "blocks.0#2"}  # calls 1, 3, 5: stages 0, 2, 4
    assert rebuilt["two"] == {"blocks.0", "blocks.1", "blocks.2"}  # the last two calls' graphs kept
    assert peaks["all"] < peaks["even"] < peaks["none"]
    assert peaks["two"] < peaks["none"]
    with LiveBytes() as live:  # again: the sizes measured, only the graphs kept are built
        res = run(model, x, y, recompute=policy, timers=True)
    assert {n for n, s in res.stats.items() if n.startswith("blocks") and "recompute_s" in s} == rebuilt["two"]
    assert live.peak < peaks["two"] and live.peak <= peaks["all"] + policy, (live.peak, peaks, policy)


def test_an_enabled_model_keeps_the_graphs_recompute_names():
    model, (x, y) = Net(), data()
    want = run(model, x, y).grads
    with ef.enable(model, split_at=["blocks.*"], recompute=False):
        torch.manual_seed(7)
        F.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n]), n


def test_a_kept_graph_of_a_module_writing_into_its_input_says_to_rebuild_it():
    class Writes(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4, dtype=F64)

        def forward(self, h):
            return self.linear(h.mul_(2))

    model = nn.Sequential(nn.Linear(4, 4, dtype=F64), Writes())
    x, y = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    params = dict(model.named_parameters())
    with pytest.raises(RuntimeError, match="leaf") as info:
        ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["1"], recompute=False)
    assert any("rebuild this cut instead" in n for n in info.value.__notes__)
    ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["1"])  # rebuilt: as eager PyTorch runs it


class WritesItsProduct(nn.Module):
    """Attention whose context, ``torch.matmul``'s ``_unsafe_view`` of a ``bmm`` output, is written in
    place (``ctx += ...``, as Nystromformer does) and then read by a nonlinearity that saves it."""

    def __init__(self, width=8):
        super().__init__()
        self.q, self.k, self.v, self.mix = (nn.Linear(width, width, dtype=F64) for _ in range(4))

    def forward(self, h):
        b, t, w = h.shape
        q, k, v = (f(h).view(b, t, 2, w // 2).transpose(1, 2) for f in (self.q, self.k, self.v))
        ctx = torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)), -1), v)
        ctx += self.mix(h).view(b, t, 2, w // 2).transpose(1, 2)
        return h + torch.tanh(ctx.transpose(1, 2).reshape(b, t, w))


def test_remat_save_is_exact_where_the_forward_writes_into_a_kept_product():
    """torch's selective checkpointing hands the rebuild the kept ``bmm`` output as the forward's write
    left it (its version counter does not see a write through ``_unsafe_view``): 0.53 off here. The
    forward watches the kept outputs' storage and rebuilds such a stage in full: exact, at run time
    and on a chain."""
    torch.manual_seed(0)
    model = nn.Sequential(WritesItsProduct(), WritesItsProduct(), WritesItsProduct())
    x, y = torch.randn(2, 5, 8, dtype=F64), torch.randn(2, 5, 8, dtype=F64)
    params = dict(model.named_parameters())
    want = ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["*"])
    got = ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["*"], recompute=R.save())
    assert all(torch.equal(got[n], want[n]) for n in want)
    chain, per_stage = ef.from_module(model, loss=F.mse_loss)
    want, got = ef.grad(chain, per_stage, x, y), ef.grad(chain, per_stage, x, y, recompute=R.save())
    assert all(torch.equal(g[n], w[n]) for g, w in zip(got, want) for n in w)
