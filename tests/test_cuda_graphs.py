"""``cuda_graphs=True`` (``eae_func.drivers.cut_graphs``) on the CPU: refused there, on a chain and with
``compile=``, nothing written; its capture plan (which calls share a graph, which run eagerly); and,
with a stand-in capture that replays by running the captured step again on the graph's static
tensors (what a CUDA graph's replay reads and writes), gradients bit for bit the eager sweep's over
steps whose inputs, dropout masks, modes and dropout ``p`` change (with passes, stored boundaries,
microbatches, autocast, a fused update, ``ef.enable``), and no host reads in a replay; a replay
that differs from its eager step, and a backward that writes a ``.grad`` itself, stay eager with a
warning. The CUDA capture itself runs only on a GPU: ``examples/gpu_check.py`` (l)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import eae_func as ef
from eae_func import tree as T
from eae_func.drivers import cut_graphs as CG

from helpers import mse


def replaying(step, device):
    """A capture whose replay runs ``step`` again and writes its results into the outputs it returned."""
    outs = step()

    def replay():
        for out, new in zip(outs, step()):
            if out is not None:
                out.copy_(new)

    return replay, outs


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setitem(CG.CAPTURE, "cpu", replaying)
    ef.clear_caches()
    yield
    ef.clear_caches()


class Block(nn.Module):
    def __init__(self, width: int, p: float):
        super().__init__()
        self.lin, self.drop = nn.Linear(width, width), nn.Dropout(p)
        self.register_buffer("count", torch.zeros((), dtype=torch.double))

    def forward(self, h, mask=None, gain: float = 1.0):
        if self.training:
            self.count += 1  # a buffer the forward writes: the rebuild reads it as it was before the call
        h = self.drop(torch.tanh(self.lin(h))) * (1.0 + 0.1 * self.count) * gain
        return h if mask is None else h * mask


class Model(nn.Module):
    def __init__(self, depth: int, width: int, p: float):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, p) for _ in range(depth))
        self.seen: list = []  # the costates at the blocks' boundaries, as a hook sees and keeps them

    def forward(self, x, mask):
        for k, b in enumerate(self.blocks):
            x = b(x, mask, gain=1.0 + k)
            if x.requires_grad:
                x.register_hook(self.seen.append)
        return x


def model(depth=3, width=5, p=0.0, seed=0):
    torch.manual_seed(seed)
    return Model(depth, width, p).double()


def step(net, x, target, seed, **options):
    torch.manual_seed(seed)
    return ef.sweep(
        net, dict(net.named_parameters()), (x, torch.ones_like(x)), target, loss=mse, split_at=["blocks.*"],
        **options,
    )  # fmt: skip


def counts(res, key):
    return sum(s.get(key, 0) for n, s in res.stats.items() if n != "boundaries")


def test_refused_on_the_cpu_nothing_written():
    net = model()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    x = torch.randn(4, 5, dtype=torch.double)
    with pytest.raises(ValueError, match=r"cuda_graphs=True captures CUDA kernels, and the model runs on cpu"):
        step(net, x, x, 0, cuda_graphs=True)
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in net.named_parameters())


def test_refused_on_a_chain_and_with_compile(on_cpu):
    net = model()
    chain, params = ef.from_module(nn.Sequential(*net.blocks), loss=mse)
    x = torch.randn(4, 5, dtype=torch.double)
    with pytest.raises(ValueError, match="cuda_graphs=True captures the reverse steps of a model cut at run time"):
        ef.grad(chain, params, x, x, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs=True and compile= both"):
        step(net, x, x, 0, cuda_graphs=True, compile=True)
    with pytest.raises(TypeError, match="cuda_graphs must be True or False"):
        step(net, x, x, 0, cuda_graphs=1)


@settings(max_examples=12, deadline=None)
@given(
    depth=st.integers(1, 3),
    p=st.sampled_from([0.0, 0.4]),
    steps=st.lists(st.sampled_from([(2, True), (2, False), (3, True)]), min_size=7, max_size=7),
    passes=st.booleans(),
    stored=st.sampled_from([{}, {"boundary_dtype": torch.float32}, {"offload": True}, {"microbatches": 2}]),
)
def test_replays_equal_the_eager_sweep(depth, p, steps, passes, stored):
    """Step after step (the batch size, the inputs, the masks and the train/eval mode change), with
    passes or not, the boundaries kept as computed, in float32 or on the host, in two microbatches
    (their keys their own: a batch of 3 splits into 2 and 1), the graphs' gradients,
    loss and costates are the eager sweep's bit for bit; a key seen twice before replays (its first
    replay is checked beside the eager step)."""
    CG.CAPTURE["cpu"] = replaying
    try:
        ef.clear_caches()
        net = model(depth, p=p)
        options = {"passes": ef.passes.clip_by_global_norm(0.5)} if passes else {}
        options.update(stored)
        seen, results, buffers, replays = [], [], None, 0
        for k, (b, train) in enumerate(steps):  # 7 steps of 3 kinds: one kind replays
            net.train(train)
            x, target = torch.randn(b, 5, dtype=torch.double), torch.randn(b, 5, dtype=torch.double)
            graphed = step(net, x, target, k, cuda_graphs=True, buffers=buffers, **options)
            graphed_seen, net.seen = net.seen, []
            eager = step(net, x, target, k, buffers=buffers, **options)
            results.append((graphed, eager, graphed_seen, net.seen))
            net.seen = []
            assert all(torch.equal(graphed.buffers[n], eager.buffers[n]) for n in eager.buffers)
            buffers = graphed.buffers  # the counts go on: each capture's static buffers are stale
            assert torch.equal(graphed.loss, eager.loss)
            assert all(torch.equal(graphed.grads[n], eager.grads[n]) for n in eager.grads)
            assert all(torch.equal(a.value, e.value) for a, e in zip(graphed.adjoints, eager.adjoints, strict=True))
            if "microbatches" not in stored:
                assert counts(graphed, "graph_replays") == (depth if seen.count((b, train)) >= 2 else 0)
            seen.append((b, train))
            replays += counts(graphed, "graph_replays")
        assert replays > 0  # with microbatches too: 14 pieces of 3 kinds (rows, mode)
        for graphed, eager, graphed_seen, eager_seen in results:  # a later replay wrote into none of them
            assert all(torch.equal(graphed.grads[n], eager.grads[n]) for n in eager.grads)
            assert all(torch.equal(a, b) for a, b in zip(graphed_seen, eager_seen, strict=True))
    finally:
        del CG.CAPTURE["cpu"]
        ef.clear_caches()


def test_enabled_model(on_cpu):
    """``ef.enable(..., cuda_graphs=True)``: loss.backward() replays too, with the eager gradients."""
    net, ref = model(p=0.3), model(p=0.3)
    ef.enable(net, split_at=["blocks.*"], cuda_graphs=True)
    ef.enable(ref, split_at=["blocks.*"])
    for k in range(4):
        x = torch.randn(3, 5, dtype=torch.double)
        for m in (net, ref):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(k)
            mse(m(x, torch.ones_like(x)), x).backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(net.parameters(), ref.parameters()))
    assert len(CG.GRAPHS) == 3


def plan_of(net, *calls):
    """The graph keys (or why-eager reasons) of the first block's calls on ``calls`` (args, kwargs)."""
    from eae_func.drivers.cut_call import Call, walk

    out = []
    for args, kwargs in calls:
        leaves, spec = T.flatten_call(args, kwargs)
        params, buffers, modes = walk(net.blocks[0])
        call = Call(1, "b", net.blocks[0], net.blocks[0].forward, leaves, spec, [0], params, buffers, None, (), modes)
        call.trained = list(params.values())
        why = CG.why_eager(call, leaves, torch.device("cpu"))
        costates = [torch.zeros(args[0].shape, dtype=args[0].dtype)]
        out.append(why or CG.key_of(call, leaves, costates))
    return out


def test_the_plan():
    """One graph per module and call layout: the same shapes and plain values share one; another batch
    size, dtype, plain value, module mode, plain attribute of a module or kernel setting of torch is
    another; an object argument runs eagerly."""
    net = model()
    h, m = torch.randn(4, 5, dtype=torch.double), torch.ones(4, 5, dtype=torch.double)
    a, b, c, d = plan_of(net, ((h, m), {}), ((h + 1, m * 2), {}), ((h[:2], m[:2]), {}), ((h, m), {"gain": 2.0}))
    assert a == b and len({a, c, d}) == 3
    net.eval()
    (e,) = plan_of(net, ((h, m), {}))
    assert e != a
    (f,) = plan_of(net, ((h.float(), m.float()), {}))
    assert f != a
    (g,) = plan_of(net, ((h, m), {"gain": [1.0]}))  # a list is a pytree: its float is a plain leaf
    assert g != a and not isinstance(g, str)
    net.train()
    net.blocks[0].drop.p = 0.5  # a plain attribute of one of its modules
    (k,) = plan_of(net, ((h, m), {}))
    assert k != a
    net.blocks[0].drop.p = 0.0
    assert plan_of(net, ((h, m), {})) == [a]
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # a setting that picks other kernels
    try:
        assert plan_of(net, ((h, m), {})) != [a]
    finally:
        torch.set_float32_matmul_precision(precision)
    (why,) = plan_of(net, ((h, m), {"gain": object()}))
    assert why == "it is passed an argument of type object, which a graph would fix at its capture"


class Writes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, h):
        out = torch.tanh(self.lin(h.clone()))
        h.mul_(1.0)  # a write into its input (which nothing saved)
        return out


class Draws(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, h):
        return torch.tanh(self.lin(h)) * random.random()


@pytest.mark.parametrize("cls", [Writes, Draws])
def test_calls_that_cannot_replay_run_eagerly(on_cpu, cls):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 5), cls(), cls()).double()
    for k in range(2):
        x = torch.randn(3, 5, dtype=torch.double)
        random.seed(k)
        graphed = ef.sweep(net, dict(net.named_parameters()), x, x, loss=mse, split_at=["1", "2"], cuda_graphs=True)
        random.seed(k)
        eager = ef.sweep(net, dict(net.named_parameters()), x, x, loss=mse, split_at=["1", "2"])
        assert all(torch.equal(graphed.grads[n], eager.grads[n]) for n in eager.grads)
        assert counts(graphed, "graph_eager") == 2 and counts(graphed, "graph_replays") == 0
    assert not CG.GRAPHS  # nothing captured


def test_a_replay_that_differs_stays_eager(monkeypatch):
    """A capture that bakes in its first values (as a graph bakes what its module read on the host) is
    caught at its first replay, on the next call's values: a warning, and the key's steps stay
    eager, with the eager gradients."""

    def baked(step, device):
        return (lambda: None), step()  # the replay writes nothing: the capture's values stay

    monkeypatch.setitem(CG.CAPTURE, "cpu", baked)
    ef.clear_caches()
    net = model()
    for k in range(4):
        x = torch.randn(3, 5, dtype=torch.double)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graphed = step(net, x, x * 2, k, cuda_graphs=True)
        eager = step(net, x, x * 2, k)
        assert all(torch.equal(graphed.grads[n], eager.grads[n]) for n in eager.grads)
        assert counts(graphed, "graph_replays") == 0
        said = [str(w.message) for w in caught if "cuda_graphs" in str(w.message)]
        assert len(said) == (3 if k == 1 else 0)
        assert all("its replay differs from its eager step" in m for m in said)
    assert len(CG.GRAPHS) == 3 and all(g.replay is None and not g.leaves and not g.outs for g in CG.GRAPHS.values())
    ef.clear_caches()


class Accumulates(torch.autograd.Function):
    """A backward that runs autograd on the parameter itself, as Reformer's reversible layers do."""

    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w)
        return h @ w

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        with torch.enable_grad():
            torch.autograd.backward(h.detach() @ w, g)
        return g @ w.T, None


class SelfAccumulating(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 5))

    def forward(self, h):
        return Accumulates.apply(h, self.w)


def test_a_backward_that_writes_grad_stays_eager(on_cpu):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 5), SelfAccumulating()).double()
    for k in range(2):
        x = torch.randn(3, 5, dtype=torch.double)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graphed = ef.sweep(net, dict(net.named_parameters()), x, x, loss=mse, split_at=["1"], cuda_graphs=True)
        eager = ef.sweep(net, dict(net.named_parameters()), x, x, loss=mse, split_at=["1"])
        assert all(torch.equal(graphed.grads[n], eager.grads[n]) for n in eager.grads)
        assert counts(graphed, "graph_replays") == 0
        if k == 0:
            assert any("writes a parameter's .grad itself" in str(w.message) for w in caught)


def baking(net):
    """A capture whose replay runs the step with every module of ``net`` holding the plain attributes
    it had at the capture, as a CUDA graph's kernels keep what the Python decided then."""

    def capture(step, device):
        frozen = {m: {k: v for k, v in vars(m).items() if isinstance(v, CG.PLAIN)} for m in net.modules()}
        outs = step()

        def replay():
            now = {m: {k: vars(m)[k] for k in d} for m, d in frozen.items()}
            for m, d in frozen.items():
                vars(m).update(d)
            try:
                new = step()
            finally:
                for m, d in now.items():
                    vars(m).update(d)
            for out, n in zip(outs, new):
                if out is not None:
                    out.copy_(n)

        return replay, outs

    return capture


def test_a_changed_dropout_p_is_another_graph(monkeypatch):
    """A dropout's p changed between steps: the graphs captured at the old p are not replayed for
    the new one (a graph would keep the old p), and the gradients stay the eager sweep's."""
    net = model(2, p=0.2)
    monkeypatch.setitem(CG.CAPTURE, "cpu", baking(net))
    ef.clear_caches()
    for k, p in enumerate([0.2, 0.2, 0.2, 0.5, 0.5, 0.5, 0.2]):
        for b in net.blocks:
            b.drop.p = p
        x = torch.randn(3, 5, dtype=torch.double)
        graphed = step(net, x, x, k, cuda_graphs=True)
        eager = step(net, x, x, k)
        assert all(torch.equal(graphed.grads[n], eager.grads[n]) for n in eager.grads)
        assert counts(graphed, "graph_replays") == (2 if k in (2, 5, 6) else 0)
    ef.clear_caches()


def test_under_autocast(on_cpu):
    """``autocast=``: the graphs' step runs under the call's autocast (without its cache of cast
    weights) and gives the eager sweep's gradients bit for bit."""
    net = model(2, p=0.3).float()
    for k in range(4):
        x = torch.randn(3, 5)
        graphed = step(net, x, x, k, cuda_graphs=True, autocast=torch.bfloat16)
        eager = step(net, x, x, k, autocast=torch.bfloat16)
        assert all(torch.equal(graphed.grads[n], eager.grads[n]) for n in eager.grads)
        assert counts(graphed, "graph_replays") == (2 if k >= 2 else 0)
    assert graphed.grads["blocks.0.lin.weight"].dtype == torch.float32


def test_replays_read_nothing_on_the_host(on_cpu):
    """Once its keys are checked, a sweep's replays (copies in, replay, clones out) read no tensor
    value on the host: no ``.item()``, ``bool()``, ``torch.equal`` or ``nonzero`` (``test_host_waits``' spy)."""
    from test_host_waits import spying

    net = model(3, p=0.2)
    x = torch.randn(4, 5, dtype=torch.double)
    for k in range(2):  # the capture, then the checked first replay (one torch.equal per gradient)
        step(net, x, x, k, cuda_graphs=True)
    with spying() as reads:
        for k in range(2):
            res = step(net, x, x, k, cuda_graphs=True)
    assert counts(res, "graph_replays") == 3
    assert not reads, dict(reads)


def test_same_gradient():
    """A replay's gradient is its eager step's when bit for bit equal, or within 8 epsilons of its
    dtype in norm (atomics' last bits); not when off by more, of another dtype or shape, or NaN
    where the other is not."""
    torch.manual_seed(0)
    b = torch.randn(64, 32)
    eps = torch.finfo(b.dtype).eps
    assert CG.same(b, b.clone()) and CG.same(None, None) and not CG.same(b, None)
    assert CG.same(b.clone().fill_(float("nan")), b.clone().fill_(float("nan")))  # the same bytes
    assert CG.same(b * (1 + eps), b)
    assert not CG.same(b * (1 + 16 * eps), b)
    assert not CG.same(b.double(), b) and not CG.same(b[:2], b)
    nan = b.clone()
    nan[0, 0] = float("nan")
    assert not CG.same(nan, b) and not CG.same(b, nan)
    assert not CG.same(torch.zeros(3), torch.ones(3))


def test_a_fused_update_steps_from_the_replayed_gradients(on_cpu):
    """``update=`` a torch.optim optimizer stepped in the backward: over five steps the parameters
    follow the eager sweep's bit for bit (each module stepped once its replayed gradients exist)."""
    graphed_net, eager_net = model(3, p=0.2), model(3, p=0.2)
    graphed_opt = torch.optim.SGD(graphed_net.parameters(), lr=0.1, momentum=0.9)
    eager_opt = torch.optim.SGD(eager_net.parameters(), lr=0.1, momentum=0.9)
    for k in range(5):
        x = torch.randn(4, 5, dtype=torch.double)
        res = step(graphed_net, x, x, k, cuda_graphs=True, update=graphed_opt)
        step(eager_net, x, x, k, update=eager_opt)
        assert all(torch.equal(a, b) for a, b in zip(graphed_net.parameters(), eager_net.parameters()))
    assert counts(res, "graph_replays") == 3
