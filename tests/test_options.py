"""Sweep options: boundary precision/offload, autocast, microbatches, keys, stats and profiler ranges."""

import pathlib

import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import eae_func as ef
from eae_func import passes as P
from eae_func.adjoint import NAMESPACE

from helpers import assert_grads_match, autograd_grads, build, mse


class Rounded(nn.Module):
    """``module`` followed by the boundary round trip the sweep applies: the network EAE differentiates."""

    def __init__(self, module, dtype):
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, h):
        out = self.module(h)
        return out + (out.to(self.dtype).to(out.dtype) - out).detach()  # rounded value, exact costate


@given(
    kind=st.sampled_from(["mlp", "transformer"]),
    depth=st.integers(2, 6),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_low_precision_boundaries_differentiate_the_rounded_network(kind, depth, seed, dtype):
    """Documented bound: with ``boundary_dtype`` the gradients are exactly those of the network whose
    boundaries x_1..x_{L-1} are rounded to that dtype (autograd of it, float tolerance)."""
    model, x, target = build(kind, depth, torch.float32, seed)
    chain, params = ef.from_module(model, loss=mse)
    res = ef.sweep(chain, params, x, target, boundary_dtype=dtype)
    rounded = nn.Sequential(*[Rounded(m, dtype) for m in model[:-1]], model[-1])
    loss, reference = autograd_grads(rounded, mse, x, target)
    torch.testing.assert_close(res.loss, loss)
    assert_grads_match(chain, res.grads, reference, rtol=1e-4, atol=1e-6)
    assert res.stats[chain.names[1]]["boundary_bytes"] == x.numel() * 2


def test_offload_on_cpu_gives_the_same_gradients():
    model, x, target = build("mlp", 4, torch.float64, 0)
    chain, params = ef.from_module(model, loss=mse)
    plain = ef.sweep(chain, params, x, target)
    offloaded = ef.sweep(chain, params, x, target, offload=True, boundary_dtype=torch.float32)
    for a, b in zip(
        optree.tree_leaves(plain.grads, namespace=NAMESPACE), optree.tree_leaves(offloaded.grads, namespace=NAMESPACE)
    ):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_autocast_matches_autograd_under_the_same_autocast():
    model, x, target = build("transformer", 3, torch.float32, 1)
    chain, params = ef.from_module(model, loss=lambda out, t: mse(out.float(), t))
    res = ef.sweep(chain, params, x, target, autocast=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, reference = autograd_grads(model, lambda out, t: mse(out.float(), t), x, target)
    assert all(g.dtype == torch.float32 for g in optree.tree_leaves(res.grads, namespace=NAMESPACE))
    assert_grads_match(chain, res.grads, reference, rtol=2e-2, atol=1e-3)


def test_the_loss_runs_under_the_same_autocast_as_an_amp_step():
    """With autocast, the loss sees what an AMP step's loss sees (cross-entropy autocasts to float32
    from bf16 logits): the same loss, bit for bit, and gradients within bf16 rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 10))
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    chain, params = ef.from_module(model, loss=F.cross_entropy)
    res = ef.sweep(chain, params, x, y, autocast=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    assert loss.dtype == torch.float32 and torch.equal(res.loss, loss.detach())
    reference = torch.autograd.grad(loss, list(model.parameters()))
    for g, r in zip([g for stage in res.grads for g in stage.values()], reference):
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-3)


@given(k=st.integers(2, 5), reduction=st.sampled_from(["mean", "sum"]), seed=st.integers(0, 2**16))
def test_microbatches_equal_the_full_batch(k, reduction, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(11, 4, dtype=torch.float64), torch.randint(0, 3, (11,))
    loss_fn = lambda out, t: F.cross_entropy(out, t, reduction=reduction)  # noqa: E731
    chain, params = ef.from_module(model, loss=loss_fn)
    full = ef.sweep(chain, params, x, y)
    split = ef.sweep(chain, params, x, y, microbatches=k, reduction=reduction)
    torch.testing.assert_close(split.loss, full.loss)
    for a, b in zip(
        optree.tree_leaves(split.grads, namespace=NAMESPACE), optree.tree_leaves(full.grads, namespace=NAMESPACE)
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for a, b in zip(split.adjoints, full.adjoints):  # costates are the full batch's, concatenated
        torch.testing.assert_close(a.value, b.value, rtol=1e-10, atol=1e-12)
    assert len(split.stats["boundaries"][0]["microbatches"]) == k


def noise(adj):
    g = adj.generator()
    return adj.applied("noise", adj.value + torch.randn(adj.value.shape, generator=g, dtype=adj.value.dtype))


@given(key=st.integers(0, 2**62))
def test_same_key_bit_identical_other_key_different(key):
    model, x, target = build("mlp", 3, torch.float32, 0)
    chain, params = ef.from_module(model, loss=mse)
    a = ef.sweep(chain, params, x, target, passes=noise, key=key)
    b = ef.sweep(chain, params, x, target, passes=noise, key=key)
    c = ef.sweep(chain, params, x, target, passes=noise, key=key + 1)
    leaves = lambda r: optree.tree_leaves((r.grads, [adj.value for adj in r.adjoints]), namespace=NAMESPACE)  # noqa
    assert all(torch.equal(u, v) for u, v in zip(leaves(a), leaves(b)))
    assert not all(torch.equal(u, v) for u, v in zip(leaves(a), leaves(c)))
    assert [adj.key for adj in a.adjoints] == [ef.fold_in(key, i) for i in range(3, -1, -1)]
    assert all(adj.history == ("noise",) for adj in a.adjoints)


def test_each_microbatch_draws_with_its_own_key_and_keeps_its_own_records():
    """microbatches=2 on a batch of two equal halves: each piece draws its own noise (piece j's key is
    fold_in(key, -1 - j)), each boundary's record keeps every piece's measurements, and a stage's
    boundary bytes are one piece's (what is held at once), not the pieces' sum."""
    model, x, target = build("mlp", 3, torch.float64, 0)
    chain, params = ef.from_module(model, loss=mse)
    both = ef.sweep(chain, params, torch.cat([x, x]), torch.cat([target, target]), passes=noise, microbatches=2, key=5)
    alone = [ef.sweep(chain, params, x, target, passes=noise, key=ef.fold_in(5, -1 - j)) for j in range(2)]
    clean = ef.sweep(chain, params, x, target)
    n = len(x)
    for adj, plain, *pieces in zip(both.adjoints, clean.adjoints, *(r.adjoints for r in alone)):
        halves = (adj.value[:n], adj.value[n:])
        for half, piece in zip(halves, pieces):  # half the loss (a mean over twice the rows), the same noise
            torch.testing.assert_close(half, piece.value - plain.value / 2, rtol=1e-10, atol=1e-12)
        assert not torch.equal(*halves)
        assert adj.meta["microbatches"] == (dict(pieces[0].meta), dict(pieces[1].meta))
    for name in chain.names:
        assert both.stats[name]["boundary_bytes"] == alone[0].stats[name]["boundary_bytes"] > 0


def test_stats_and_profiler_ranges_name_every_stage():
    model, x, target = build("mlp", 3, torch.float32, 0)
    chain, params = ef.from_module(model, loss=mse)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        res = ef.sweep(chain, params, x, target, passes=P.stats())
    names = {e.name for e in prof.events()}
    for stage in chain.names:
        for part in ("forward", "recompute", "vjp", "passes"):
            assert f"eae/{stage}/{part}" in names
        entry = res.stats[stage]
        assert entry["forward_s"] > 0 and entry["recompute_s"] > 0 and entry["vjp_s"] > 0
        assert entry["boundary_bytes"] == x.numel() * 4
    assert res.stats["loss"]["forward_s"] > 0


def test_value_and_grad_and_grad_agree_with_sweep():
    model, x, target = build("mlp", 2, torch.float64, 3)
    chain, params = ef.from_module(model, loss=mse)
    res = ef.sweep(chain, params, x, target)
    loss, grads = ef.value_and_grad(chain, params, x, target)
    assert torch.equal(loss, res.loss)
    for a, b, c in zip(
        optree.tree_leaves(grads, namespace=NAMESPACE),
        optree.tree_leaves(res.grads, namespace=NAMESPACE),
        optree.tree_leaves(ef.grad(chain, params, x, target), namespace=NAMESPACE),
    ):
        assert torch.equal(a, b) and torch.equal(b, c)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for offload with prefetch")
def test_cuda_offload_prefetch_matches():
    model, x, target = build("transformer", 4, torch.float32, 0)
    model, x, target = model.cuda(), x.cuda(), target.cuda()
    chain, params = ef.from_module(model, loss=mse)
    plain = ef.sweep(chain, params, x, target)
    offloaded = ef.sweep(chain, params, x, target, offload=True)
    for a, b in zip(
        optree.tree_leaves(plain.grads, namespace=NAMESPACE), optree.tree_leaves(offloaded.grads, namespace=NAMESPACE)
    ):
        torch.testing.assert_close(a, b)


def test_dropping_costates_keeps_grads_history_and_meta():
    model, x, target = build("mlp", 3, torch.float64, 2)
    chain, params = ef.from_module(model, loss=mse)
    tag = lambda adj: adj.applied("tag", adj.value, norm=float(adj.value.norm()))  # noqa: E731
    kept = ef.sweep(chain, params, x, target, passes=tag)
    dropped = ef.sweep(chain, params, x, target, passes=tag, keep_costates=False, microbatches=2)
    assert all(a.value is None for a in dropped.adjoints)
    assert [a.history for a in dropped.adjoints] == [a.history for a in kept.adjoints]
    for a, b in zip(
        optree.tree_leaves(kept.grads, namespace=NAMESPACE), optree.tree_leaves(dropped.grads, namespace=NAMESPACE)
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@given(seed=st.integers(0, 2**16), budget_blocks=st.integers(0, 4))
def test_every_remat_policy_gives_the_same_gradients(seed, budget_blocks):
    """recompute=True / False / a predicate / a byte budget: bit-identical gradients; a kept stage is
    not recomputed, and a budget keeps the last graphs whose saved tensors fit."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8)) for _ in range(4)])
    x, target = torch.randn(16, 8), torch.randn(16, 8)
    chain, params = ef.from_module(model, loss=mse)
    reference = ef.sweep(chain, params, x, target)
    one_block = 16 * 32 * 4  # a block's graph saves tanh's (16, 32) output (which Linear 2 saves too); its input
    # and weights are the stage's own and not counted
    policies = [
        (True, set()),
        (False, {0, 1, 2, 3}),
        (lambda i, name: i % 2 == 1, {0, 2}),
        (budget_blocks * one_block, set(range(4 - budget_blocks, 4))),
    ]  # a list: 0 == False as a dict key
    for policy, kept in policies:
        res = ef.sweep(chain, params, x, target, recompute=policy)
        assert {i for i, s in enumerate(chain.stages) if res.stats[s.name]["recompute_s"] == 0} == kept, policy
        for got, want in zip(
            optree.tree_leaves(res.grads, namespace=NAMESPACE), optree.tree_leaves(reference.grads, namespace=NAMESPACE)
        ):
            assert torch.equal(got, want), policy
    with pytest.raises(TypeError, match="recompute must be True, False, a predicate"):
        ef.sweep(chain, params, x, target, recompute=-1)


class FakeEvent:
    """A stand-in for ``torch.cuda.Event``: ``elapsed_time`` in ms, counting the waits."""

    waits = 0

    def __init__(self, ms: float):
        self.ms = ms

    def synchronize(self):
        FakeEvent.waits += 1

    def elapsed_time(self, end) -> float:
        return end.ms - self.ms


def test_gpu_seconds_add_lazily_and_are_read_when_used_as_numbers():
    """GPU timers: sums of event pairs stay lazy through the stats' counters (no wait for the GPU
    inside the sweep) and become seconds when read."""
    from eae_func.core.microbatch import merge_counters
    from eae_func.lazy import event_seconds

    FakeEvent.waits = 0
    a, b = event_seconds(FakeEvent(0), FakeEvent(250)), event_seconds(FakeEvent(10), FakeEvent(760))
    total = merge_counters({"vjp_s": a}, {"vjp_s": b}, {"vjp_s": 0})["vjp_s"]
    assert FakeEvent.waits == 0
    assert float(total) == 1.0 and f"{total:.2f}" == "1.00" and total > 0.5 and total + 1.0 == 2.0
    assert FakeEvent.waits == 2


def test_the_compute_device_comes_from_the_params_not_the_input():
    """``x`` may live on the CPU while the stages compute elsewhere (a first stage moves it): the
    device whose RNG state is saved, whose autocast runs and where offload prefetches is the params'."""
    from eae_func.core.boundary import device_of

    elsewhere = ({"w": torch.empty(2, device="meta")}, {})
    assert device_of(elsewhere, torch.randn(2)) == torch.device("meta")
    assert device_of(({}, {}), torch.randn(2)) == torch.device("cpu")  # no params: the input's


def test_stored_boundaries_keep_their_memory_format():
    """A channels_last boundary stored in bf16 stays channels_last, so the recompute runs the same kernels."""
    from eae_func.core.options import Options
    from eae_func.core.runner import Range
    from eae_func.core.tape import forward

    chain = ef.Chain(
        [ef.stage(lambda p, h: torch.tanh(h) * 2, name="a"), ef.stage(lambda p, h: h * h, name="b")],
        loss=lambda out: out.float().square().mean(),
    )
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    opts = Options(boundary_dtype=torch.bfloat16).bind(chain)
    tape = forward(Range(chain, 0, 2, ({}, {}), opts, torch.device("cpu")), ({}, {}), x, opts)
    stored = tape.entries[1].boundary
    assert stored.dtype == torch.bfloat16 and stored.is_contiguous(memory_format=torch.channels_last)
    assert not stored.is_contiguous()


class _Matmuls(TorchDispatchMode):
    """Counts the matrix products dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in ef.remat.MATMULS
        return func(*args, **(kwargs or {}))


@given(seed=st.integers(0, 2**16), saving=st.sets(st.integers(0, 3)), keep_last=st.booleans())
def test_saving_ops_outputs_gives_the_same_gradients_and_skips_their_recompute(seed, saving, keep_last):
    """remat.save(MATMULS, where, keep): the stages ``where`` names keep their matrix products'
    outputs from the forward and their rebuild reuses them (two products fewer per such block), a
    stage ``keep`` names keeps its graph (no rebuild), dropout replayed, the gradients bit-identical
    to rebuilding everything."""
    torch.manual_seed(seed)
    block = lambda: nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.Tanh(), nn.Linear(32, 8))  # noqa: E731
    chain, params = ef.from_module(nn.Sequential(*[block() for _ in range(4)]).train(), loss=mse)
    x, target = torch.randn(16, 8), torch.randn(16, 8)
    runs = []
    keep = (lambda i, name: i == 3) if keep_last else None
    for policy in (True, ef.remat.save(where=lambda i, name: i in saving, keep=keep)):
        torch.manual_seed(seed)
        with _Matmuls() as counted:
            res = ef.sweep(chain, params, x, target, recompute=policy, key=seed)
        runs.append((res, counted.count))
    (full, full_count), (saved, saved_count) = runs
    assert full_count - saved_count == 2 * len(saving | ({3} if keep_last else set()))
    assert (saved.stats[chain.stages[3].name]["recompute_s"] == 0) == keep_last
    for got, want in zip(
        optree.tree_leaves(saved.grads, namespace=NAMESPACE), optree.tree_leaves(full.grads, namespace=NAMESPACE)
    ):
        assert torch.equal(got, want)


def test_remat_save_names_what_it_takes():
    with pytest.raises(TypeError, match="remat.save: expected a sequence of torch.ops.aten overloads"):
        ef.remat.save(["mm"])
    with pytest.raises(TypeError, match="remat.save: where must be a predicate"):
        ef.remat.save(where=3)
    with pytest.raises(TypeError, match="remat.save: keep must be a predicate"):
        ef.remat.save(keep="last")


@given(
    name=st.sampled_from(["offload", "keep_costates", "timers", "early_stop"]),
    value=st.one_of(st.sampled_from(["False", "no", "True", "", None]), st.integers(0, 1), st.floats(0, 1)),
)
def test_a_boolean_option_takes_only_true_or_false(name, value):
    """``keep_costates="False"`` was read as True; any non-bool is refused, naming the option."""
    with pytest.raises(TypeError, match=f"sweep: {name} must be True or False"):
        ef.Options(**{name: value})


def test_the_options_are_declared_once():
    """``SweepOptions`` (what a caller may pass) names exactly ``Options``' fields, each of which
    has its doc where it is declared."""
    import dataclasses

    from eae_func.core.options import SweepOptions

    fields = [f.name for f in dataclasses.fields(ef.Options)]
    assert list(SweepOptions.__annotations__) == fields
    griffe = pytest.importorskip("griffe")  # reads the attribute docstrings as the API reference does
    root = pathlib.Path(__file__).resolve().parents[1]
    options = griffe.load("eae_func.core.options", search_paths=[str(root)])["Options"]
    assert all(options.members[name].docstring for name in fields)
