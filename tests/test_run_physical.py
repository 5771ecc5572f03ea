"""Physical modules on a model cut at run time (``physical=["name"]``, ``estimator=``): each call's
reverse step comes from the estimator, bit for bit what the same estimator gives on a chain of the
same modules (the k-th cut call probes as the chain's stage k - 1), rows counted against ``budget=``,
under ``ef.enable`` too, and nothing is captured."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import eae_func as ef
from eae_func import estimators as E

F64 = torch.float64


def no_export(monkeypatch):
    def exported(*args, **kwargs):
        raise AssertionError("torch.export called")

    monkeypatch.setattr(torch.export, "export", exported)


def blocks(depth=3, width=6, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]).to(F64)


def batch(width=6, rows=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g, dtype=F64), torch.randn(rows, width, generator=g, dtype=F64)


def twin(params, h):  # the block's own function with its weights 10% off: a twin that is wrong
    return torch.tanh(h @ (1.1 * params["0.weight"]).T + params["0.bias"])


ESTIMATORS = {
    "zbp-jvp": lambda: E.zbp(E.Probes(8)),
    "zbp-fd": lambda: E.zbp(E.Probes(6, "rademacher"), method="fd"),
    "exact": E.exact,
    "frozen": E.frozen,
    "twin": lambda: E.twin(twin),
    "control-variate": lambda: E.control_variate(E.zbp(E.Probes(8)), twin),
    "guided": lambda: E.guided(E.zbp(E.Probes(8)), twin),
}


@pytest.mark.parametrize("name", ESTIMATORS)
@given(depth=st.integers(2, 4), seed=st.integers(0, 2**16), key=st.integers(0, 2**16), data=st.data())
@settings(max_examples=4, deadline=None)
def test_a_physical_cut_is_the_estimator_on_a_chain_of_the_cut_modules(name, depth, seed, key, data):
    """For any depth, weights and key, and any physical block: the run-time sweep's gradients and
    records equal (bitwise, f64) the chain's, the estimator's costs too, and the forward ran once."""
    physical = data.draw(st.integers(0, depth - 1))
    model, (x, y) = blocks(depth, seed=seed), batch(seed=seed + 1)
    chain, params = ef.from_module(model, loss=F.mse_loss)
    want = ef.sweep(chain, params, x, y, physical=[physical], estimator=ESTIMATORS[name](), key=key)
    cuts = [str(i) for i in range(depth)]
    got = ef.sweep(
        model, dict(model.named_parameters()), x, y, loss=F.mse_loss, split_at=cuts,
        physical=[str(physical)], estimator=ESTIMATORS[name](), key=key,
    )  # fmt: skip
    for i in range(depth):
        for n, g in want.grads[i].items():
            h = got.grads[f"{i}.{n}"]
            assert (g is None and h is None) or torch.equal(g, h), (i, n)
    assert torch.equal(got.loss, want.loss)
    costs = {k: v for k, v in want.stats[chain.names[physical]].items() if not k.endswith(("_s", "_bytes"))}
    assert {k: got.stats[str(physical)][k] for k in costs} == costs


def test_guided_history_threads_the_same_estimates_at_run_time_as_on_a_chain():
    """``E.guided(..., history=2)`` under fd, threaded by ``observe`` over 3 steps: a physical cut's
    parameter estimates, and every gradient, are the chain's bit for bit at each step (the guides
    are the estimates the same stats hold)."""
    model, (x, y) = blocks(3), batch()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    on_chain = on_cuts = E.guided(E.zbp(E.Probes(6), method="fd"), twin, history=2)
    for key in range(3):
        want = ef.sweep(chain, params, x, y, physical=[1], estimator=on_chain, key=key)
        got = ef.sweep(
            model, dict(model.named_parameters()), x, y, loss=F.mse_loss, split_at=["0", "1", "2"],
            physical=["1"], estimator=on_cuts, key=key,
        )  # fmt: skip
        assert torch.equal(got.stats["1"]["param_estimate"], want.stats[chain.names[1]]["param_estimate"])
        for i in range(3):
            for n, g in want.grads[i].items():
                assert torch.equal(g, got.grads[f"{i}.{n}"]), (key, i, n)
        on_chain, on_cuts = on_chain.observe(want), on_cuts.observe(got)
    assert len(on_cuts.past["1"]) == 2


class Net(nn.Module):
    """A stem, blocks on a residual stream, a head: the glue runs around the cuts."""

    def __init__(self, width=6, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, 2)
        self.to(F64)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def net_sweep(model, x, y, **options):
    return ef.sweep(model, dict(model.named_parameters()), x, y, loss=F.cross_entropy, split_at=["blocks.*"], **options)


def test_exact_at_a_physical_cut_is_autograd_and_zbp_is_unbiased_around_it(monkeypatch):
    """Inside glue: ``E.exact()`` at the physical block gives autograd's gradients (1e-12), and zbp's
    mean over 400 keys is within 4 standard errors of them, entry by entry (a biased one is not:
    zbp scaled by 1.5 fails the same test)."""
    no_export(monkeypatch)
    model, (x, _) = Net(), batch(rows=6)
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    reference = net_sweep(model, x, y).grads
    exact = net_sweep(model, x, y, physical=["blocks.1"], estimator=E.exact()).grads
    for n, g in reference.items():
        torch.testing.assert_close(exact[n], g, rtol=1e-12, atol=1e-14)
    runs = [
        net_sweep(model, x, y, physical=["blocks.1"], estimator=E.zbp(E.Probes(4)), key=k).grads for k in range(400)
    ]
    for n in ("stem.weight", "blocks.0.0.weight"):  # upstream of the physical block: estimated
        samples = torch.stack([r[n] for r in runs])
        mean, se = samples.mean(0), samples.std(0) / len(runs) ** 0.5 + 1e-12
        assert ((mean - reference[n]).abs() <= 4 * se + 1e-12).float().mean() >= 0.99, n
        assert ((1.5 * mean - reference[n]).abs() > 4 * se).any(), n  # the bound can tell a bias
    for n in ("blocks.2.0.weight", "head.weight"):  # downstream: exact
        torch.testing.assert_close(runs[0][n], reference[n], rtol=1e-12, atol=1e-14)


class Counted(nn.Module):
    """A block that counts the calls of its forward (the estimator's probe calls among them)."""

    def __init__(self, width=6):
        super().__init__()
        self.linear, self.calls = nn.Linear(width, width, dtype=F64), 0

    def forward(self, h):
        self.calls += 1
        return torch.tanh(self.linear(h))


def test_the_budget_counts_every_row_and_refuses_before_the_call_that_would_pass_it():
    torch.manual_seed(0)
    model, (x, y) = nn.Sequential(Counted(), Counted(), Counted()), batch()
    options = dict(loss=F.mse_loss, split_at=["0", "1", "2"], physical=["1"], estimator=E.zbp(E.Probes(4), method="fd"))
    params = dict(model.named_parameters())
    needed = ef.sweep(model, params, x, y, **options).stats["1"]["rows"]
    assert needed == 5 + 2 * 4 * 5 + 2 * 4 * 5  # the forward, two calls per input probe, two per parameter probe
    assert ef.sweep(model, params, x, y, budget=needed, **options).stats["1"]["rows"] == needed
    assert ef.sweep(model, params, x, y, microbatches=2, **options).stats["1"]["rows"] == needed  # summed
    # the forward, the input probes (one call: 8 shifted copies of 5 rows), 8 parameter probe calls
    for budget, ran in ((needed, 1 + 1 + 8), (needed - 1, 1 + 1 + 7), (5, 1), (4, 0)):
        model[1].calls = 0
        if budget == needed:
            ef.sweep(model, params, x, y, budget=budget, **options)
        else:
            with pytest.raises(RuntimeError, match="over the budget"):
                ef.sweep(model, params, x, y, budget=budget, **options)
        assert model[1].calls == ran, budget


def test_an_enabled_model_runs_the_estimator_in_its_backward():
    """``ef.enable(..., physical=, estimator=)``: ``loss.backward()`` puts in ``.grad`` what the sweep
    gives with the same key."""
    model, (x, _) = Net(), batch(rows=6)
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    est = E.zbp(E.Probes(4))
    want = net_sweep(model, x, y, physical=["blocks.1"], estimator=est, key=7).grads
    with ef.enable(model, split_at=["blocks.*"], physical=["blocks.1"], estimator=est, key=7):
        F.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n]), n


def test_what_a_physical_cut_cannot_do_at_run_time_is_refused_by_name():
    model, (x, y) = blocks(), batch()
    params = dict(model.named_parameters())
    run = dict(loss=F.mse_loss, split_at=["0", "1", "2"], capture="run")
    with pytest.raises(ValueError, match=r"'sim' is not a cut module"):
        ef.sweep(model, params, x, y, physical=["sim"], estimator=E.exact(), **run)
    with pytest.raises(ValueError, match=r"no estimator"):
        ef.sweep(model, params, x, y, physical=["1"], **run)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for capture in ("run", None):  # left to choose, an option is never a reason to capture
        run["capture"] = capture
        with pytest.raises(ValueError, match=r"scope 'model'.*capture='graph'"):
            ef.sweep(model, params, x, y, physical=["1"], estimator=E.node_perturbation(E.Probes(4)), **run)
        with pytest.raises(ValueError, match=r"budget= with update=.*capture='graph'"):
            ef.sweep(model, params, x, y, physical=["1"], estimator=E.exact(), budget=100, update=opt, **run)


def test_a_physical_cut_writing_into_its_input_is_refused_naming_it():
    class Doubles(nn.Module):
        def forward(self, h):
            return h.mul_(2)

    model = nn.Sequential(nn.Linear(6, 6), Doubles(), nn.Linear(6, 6)).to(F64)
    x, y = batch()
    with pytest.raises(ValueError, match=r"physical cut '1' writes into its input args\[0\]"):
        ef.sweep(
            model, dict(model.named_parameters()), x, y, loss=F.mse_loss, split_at=["1"],
            physical=["1"], estimator=E.zbp(E.Probes(2)),
        )  # fmt: skip


transformers = pytest.importorskip("transformers")


def test_a_physical_block_of_gpt2(monkeypatch):
    """A GPT-2 block as the physical module (its inputs: the hidden states and the mask, its output a
    tuple): ``E.exact()`` there is autograd (f64, 1e-10), zbp gives finite gradients and nothing is
    captured."""
    no_export(monkeypatch)
    config = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(F64)
    ids = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(0))

    def loss(out, labels):
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    params = dict(model.named_parameters())
    cut = dict(loss=loss, split_at=["transformer.h.*"])
    reference = ef.grad(model, params, ids, ids, **cut)
    exact = ef.grad(model, params, ids, ids, physical=["transformer.h.1"], estimator=E.exact(), **cut)
    for n, g in reference.items():
        torch.testing.assert_close(exact[n], g, rtol=1e-10, atol=1e-12)
    probed = ef.grad(model, params, ids, ids, physical=["transformer.h.1"], estimator=E.zbp(E.Probes(4)), **cut)
    assert all(torch.isfinite(g).all() for g in probed.values() if g is not None)
    assert not torch.equal(probed["transformer.h.0.mlp.c_fc.weight"], reference["transformer.h.0.mlp.c_fc.weight"])


class ModeScaled(nn.Module):
    """Twice its layer's output in train mode, once in eval mode."""

    def __init__(self, width=6):
        super().__init__()
        self.linear = nn.Linear(width, width, dtype=F64)

    def forward(self, h):
        return torch.tanh(self.linear(h)) * (2.0 if self.training else 1.0)


def test_a_physical_cut_is_estimated_in_the_modes_its_forward_ran_in():
    """``ef.enable``, the model switched to eval between the forward and the backward: ``E.exact()`` at
    the physical cut differentiates it in the train mode its forward ran in, so ``.grad`` is autograd's
    of the model in train mode (the mode at the backward would halve the gradients through it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6, dtype=F64), ModeScaled(), nn.Linear(6, 2, dtype=F64)).train()
    x, y = batch()
    y = y[:, :2]
    F.mse_loss(model(x), y).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with ef.enable(model, split_at=["1"], physical=["1"], estimator=E.exact()):
        loss = F.mse_loss(model(x), y)
        model.eval()
        loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[n], rtol=1e-12, atol=1e-14)
