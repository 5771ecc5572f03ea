"""``data_parallel=`` and DDP models (2 gloo ranks on 127.0.0.1): each stage's gradients are
averaged over the replicas as the fold makes them, bitwise DDP's average; fused updates step
on the average; the DDP model trains on normally afterwards; a multi-process sweep without
``data_parallel=`` is warned that its gradients are local."""

import contextlib
import re
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import eae_func as ef
import eae_func.distributed as D

F64 = torch.float64


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4)
    )
    model[4].weight = model[2].weight  # tied: one parameter in two stages
    return model.double()


def _batch(rank, n=6):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(n, 8, generator=g, dtype=F64), torch.randn(n, 4, generator=g, dtype=F64)


def _max_error(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[n] - want[n]).abs().max().item() for n in want)


def _equivalence():
    rank = dist.get_rank()
    x, y = _batch(rank)
    reference = DDP(_model())
    F.mse_loss(reference(x), y).backward()
    want = {n: p.grad.clone() for n, p in reference.named_parameters()}

    ddp = DDP(_model())
    out = {}
    grads = ef.grad(ddp, dict(ddp.named_parameters()), x, y, loss=F.mse_loss)
    out["ddp"] = _max_error(grads, want)
    plain = _model()
    local = {n[len("module.") :]: g for n, g in want.items()}
    grads = ef.grad(plain, dict(plain.named_parameters()), x, y, loss=F.mse_loss, data_parallel=dist.group.WORLD)
    out["data_parallel"] = _max_error(grads, local)
    grads = ef.grad(plain, dict(plain.named_parameters()), x, y, loss=F.mse_loss, data_parallel=False)
    out["local"] = _max_error(grads, local)  # this rank's own gradients: not the average
    grads = ef.grad(ddp, dict(ddp.named_parameters()), x, y, loss=F.mse_loss, microbatches=2)
    out["microbatches"] = _max_error(grads, want)
    res = ef.sweep(ddp, dict(ddp.named_parameters()), x, y, loss=F.mse_loss)
    out["bytes"] = res.stats["data_parallel"]["bytes_sent"]

    ef.write_grads(ddp, res.grads)  # then a plain optimizer step, and DDP trains on
    torch.optim.SGD(ddp.parameters(), lr=0.1).step()
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference_opt.step()
    out["stepped"] = _max_error(dict(ddp.named_parameters()), dict(reference.named_parameters()))
    for model in (ddp, reference):
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
    out["ddp_after"] = _max_error(
        {n: p.grad for n, p in ddp.named_parameters()}, {n: p.grad for n, p in reference.named_parameters()}
    )

    fused = DDP(_model())
    opt = torch.optim.AdamW(fused.parameters(), lr=0.01)
    ef.sweep(fused, dict(fused.named_parameters()), x, y, loss=F.mse_loss, update=opt)
    unfused = DDP(_model())
    opt2 = torch.optim.AdamW(unfused.parameters(), lr=0.01)
    ef.write_grads(unfused, ef.grad(unfused, dict(unfused.named_parameters()), x, y, loss=F.mse_loss))
    opt2.step()
    out["fused"] = _max_error(dict(fused.named_parameters()), dict(unfused.named_parameters()))
    replicas = [torch.empty(0)] * 2
    dist.all_gather_object(replicas, [p.detach() for p in fused.parameters()])
    out["replicas_agree"] = all(torch.equal(a, b) for a, b in zip(*replicas))
    cut = _model()  # the same fused step at run time: each cut's group averaged, then stepped, in its backward
    opt3 = torch.optim.AdamW(cut.parameters(), lr=0.01)
    with _no_export():
        res = ef.sweep(
            cut,
            dict(cut.named_parameters()),
            x,
            y,
            loss=F.mse_loss,
            update=opt3,
            split_at=["0", "2", "4"],
            data_parallel=dist.group.WORLD,
        )
    stepped = {n[len("module.") :]: p for n, p in unfused.named_parameters()}
    out["fused run-time"] = _max_error(dict(cut.named_parameters()), stepped)
    out["fused run-time bytes"] = res.stats["data_parallel"]["bytes_sent"]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ef.grad(plain, dict(plain.named_parameters()), x, y, loss=F.mse_loss)
        ef.grad(plain, dict(plain.named_parameters()), x, y, loss=F.mse_loss, data_parallel=False)
        ef.grad(plain, dict(plain.named_parameters()), x, y, loss=F.mse_loss, split_at=["0", "2"])  # run-time cuts
        ef.grad(plain, dict(plain.named_parameters()), x, y, loss=F.mse_loss, split_at=["0", "2"], data_parallel=False)
    out["warnings"] = [(str(w.message), w.filename) for w in caught]
    return out


@contextlib.contextmanager
def _no_export():
    """torch.export refused: what runs inside is cut at run time, never captured."""

    def refused(*args, **kwargs):
        raise AssertionError("torch.export was called")

    export, torch.export.export = torch.export.export, refused
    try:
        yield
    finally:
        torch.export.export = export


def test_data_parallel_is_bitwise_ddp_and_a_ddp_model_trains_on():
    for out in D.run(_equivalence, 2, timeout=240, pg_timeout=120):
        assert out["ddp"] == 0.0 and out["data_parallel"] == 0.0 and out["local"] > 1e-3
        assert out["microbatches"] < 1e-12
        assert out["stepped"] == 0.0 and out["ddp_after"] == 0.0
        assert out["fused"] < 1e-12 and out["replicas_agree"]
        assert out["fused run-time"] < 1e-12
        n_params = sum(p.numel() for p in _model().parameters())
        flags = len(list(_model().parameters()))  # one int32 flag per parameter: used on this rank or not
        assert out["bytes"] == n_params * 8 + flags * 4  # 2 (R-1)/R of every float64 gradient, once
        assert out["fused run-time bytes"] == out["bytes"]  # the same gradients, sent once, group by group
        # the chain path and run-time cuts warn once each, at the caller's line (not inside torch)
        assert len(out["warnings"]) == 2, out["warnings"]
        for message, filename in out["warnings"]:
            assert "gradients are this rank's batch alone" in message and filename == __file__, (message, filename)


def test_data_parallel_takes_a_group_or_a_1d_mesh():
    with pytest.raises(TypeError, match="data_parallel= takes a torch.distributed process group or a 1-D DeviceMesh"):
        ef.Options(data_parallel="world")
    model = _model()
    x, y = _batch(0)
    grads = ef.grad(model, dict(model.named_parameters()), x, y, loss=F.mse_loss, data_parallel=False)
    assert all(g is not None for g in grads.values())


def _replicas_differ(case, split_at=None):
    """One data_parallel= step where rank 1's replica is not rank 0's (a chain, or cut at run time
    at ``split_at``): every rank's outcome."""
    rank = dist.get_rank()
    model = _model()
    if rank == 1 and case == "extra layer":
        model.append(nn.Linear(4, 4).double())
    if rank == 1 and case == "frozen layer":
        model[0].requires_grad_(False)
    x, y = _batch(rank)
    try:
        ef.grad(
            model, dict(model.named_parameters()), x, y, loss=F.mse_loss, data_parallel=dist.group.WORLD,
            split_at=split_at,
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "returned gradients"


@pytest.mark.parametrize(
    "case, named",
    [
        ("extra layer", r"stage 6 \('Linear_6'\) 'weight' \(shape \(4, 4\), torch.float64, trained\) only on rank 1"),
        (
            "frozen layer",
            r"stage 0 \('Linear_0'\) 'weight': trained on rank 0, frozen \(requires_grad=False\) on rank 1",
        ),
    ],
)
def test_replicas_that_differ_make_every_rank_raise_naming_the_difference(case, named):
    for out in D.run(_replicas_differ, 2, case, timeout=120, pg_timeout=30):
        assert out.startswith("PeerError: sweep: data_parallel= replicas differ"), out
        assert re.search(named, out), out
        assert "give every replica the same model" in out


def test_replicas_cut_at_run_time_that_differ_in_what_trains_raise_naming_it():
    """At run-time cuts the replicas agree on the model's parameters by name, trained or frozen."""
    for out in D.run(_replicas_differ, 2, "frozen layer", ["*"], timeout=120, pg_timeout=30):
        assert out.startswith("PeerError: sweep: data_parallel= replicas differ"), out
        assert re.search(r"'0.weight': trained on rank 0, frozen \(requires_grad=False\) on rank 1", out), out


def _a_replica_its_forward_fails_on(capture):
    """Rank 1's first layer is wider, so its forward (and a capture of it) fails on its own model."""
    model = _model()
    if dist.get_rank() == 1:
        model[0] = nn.Linear(8, 20).double()
    x, y = _batch(dist.get_rank())
    try:
        ef.grad(
            model,
            dict(model.named_parameters()),
            x,
            y,
            loss=F.mse_loss,
            split_at=["0", "2"],
            capture=capture,
            data_parallel=dist.group.WORLD,
        )
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "returned gradients"


@pytest.mark.parametrize("capture", ["run", "graph"])
def test_a_replica_whose_model_differs_is_named_on_every_rank_before_its_forward_or_capture(capture):
    for out in D.run(_a_replica_its_forward_fails_on, 2, capture, timeout=120, pg_timeout=30):
        assert out.startswith("PeerError: sweep: data_parallel= replicas differ"), out
        assert re.search(r"'0.weight': shape \(16, 8\), torch.float64 on rank 0, shape \(20, 8\)", out), out


def _agreement_collectives():
    """The all_gathers of the replica check over steps (one 32-byte digest each), also when every replica
    freezes a layer (a new layout); the frozen layer then gets no gradient."""
    gather, calls = dist.all_gather, []

    def counting(*args, **kwargs):
        calls.append(1)
        return gather(*args, **kwargs)

    dist.all_gather = counting
    model = _model()
    x, y = _batch(dist.get_rank())
    counts = []
    for step in range(4):
        if step == 2:
            model[0].requires_grad_(False)
        grads = ef.grad(model, dict(model.named_parameters()), x, y, loss=F.mse_loss, data_parallel=dist.group.WORLD)
        counts.append(len(calls))
    return counts, grads["0.weight"] is None


def test_the_replicas_agreement_costs_one_small_collective_per_step():
    for counts, frozen_none in D.run(_agreement_collectives, 2, timeout=120, pg_timeout=30):
        assert counts == [1, 2, 3, 4] and frozen_none


def _one_replica_changes():
    """Two steps; before the second, rank 1 alone freezes a layer."""
    model = _model()
    x, y = _batch(dist.get_rank())
    try:
        for step in range(2):
            if step == 1 and dist.get_rank() == 1:
                model[0].requires_grad_(False)
            ef.grad(model, dict(model.named_parameters()), x, y, loss=F.mse_loss, data_parallel=dist.group.WORLD)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "returned gradients"


def test_a_replica_that_changes_after_the_first_step_makes_every_rank_raise():
    for out in D.run(_one_replica_changes, 2, timeout=120, pg_timeout=30):
        assert out.startswith("PeerError: sweep: data_parallel= replicas differ"), out
        assert "rank 1" in out and "frozen" in out, out


class Routed(nn.Module):
    """A branch (MoE routing): a batch whose sum is positive takes expert ``a``, any other ``b``; ``c``
    is never taken. ``unequal``: ``b`` is wider than ``a``, so the ranks' used parameters differ in size."""

    def __init__(self, unequal):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8)) if unequal else nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, h):
        return self.a(h) if h.sum() > 0 else self.b(h)


def _routed(unequal):
    torch.manual_seed(0)
    return nn.Sequential(Routed(unequal), nn.Tanh(), nn.Linear(8, 4)).double()


def _routed_grads(unequal):
    """Rank 0's batch takes expert a, rank 1's expert b: DDP(find_unused_parameters=True)'s averaged
    gradients, and ``data_parallel=``'s on the chain path, at run-time cuts, and of the DDP model itself."""
    rank = dist.get_rank()
    x, y = _batch(rank)
    x = x + (3.0 if rank == 0 else -3.0)
    reference = DDP(_routed(unequal), find_unused_parameters=True)
    F.mse_loss(reference(x), y).backward()
    want = {n[len("module.") :]: p.grad for n, p in reference.named_parameters()}
    out: dict = {"want": want}
    model = _routed(unequal)
    params = dict(model.named_parameters())
    world = dist.group.WORLD
    runs = {
        "chain": lambda: ef.grad(model, params, x, y, loss=F.mse_loss, data_parallel=world),
        "run-time cuts": lambda: ef.grad(
            model, params, x, y, loss=F.mse_loss, split_at=["0.a", "0.b", "0.c", "2"], data_parallel=world
        ),
        "ddp run-time cuts": lambda: ef.grad(
            ddp, dict(ddp.module.named_parameters()), x, y, loss=F.mse_loss, split_at=["0.a", "0.b", "2"]
        ),
    }
    ddp = DDP(_routed(unequal), find_unused_parameters=True)
    for name, fn in runs.items():
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[name] = f"{type(e).__name__}: {e}"
    fused = _routed(unequal)  # a fused SGD step on the average: the weights of DDP's step
    ef.sweep(fused, dict(fused.named_parameters()), x, y, loss=F.mse_loss, update=_sgd(fused), data_parallel=world)
    cut = _routed(unequal)  # at run time: the ranks complete different experts' groups, in other orders
    with _no_export():
        ef.sweep(
            cut,
            dict(cut.named_parameters()),
            x,
            y,
            loss=F.mse_loss,
            update=_sgd(cut),
            data_parallel=world,
            split_at=["0.a", "0.b", "0.c", "2"],
        )
    _sgd(reference).step()
    stepped = {n[len("module.") :]: p for n, p in reference.named_parameters()}
    for name, model in (("fused", fused), ("fused run-time", cut)):
        out[name] = max((p - stepped[n]).abs().max().item() for n, p in model.named_parameters())
    return out


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("unequal", [False, True], ids=["equal experts", "unequal experts"])
def test_replicas_that_use_different_parameters_average_as_ddp_does(unequal):
    for out in D.run(_routed_grads, 2, unequal, timeout=120, pg_timeout=20):
        want = out.pop("want")
        assert out.pop("fused") < 1e-12 and out.pop("fused run-time") < 1e-12
        assert (
            want["0.c.weight"] is None
            and want["0.a.weight"] is not None
            and want["0.b.0.weight" if unequal else "0.b.weight"] is not None
        )
        for how, got in out.items():
            assert isinstance(got, dict), f"{how}: {got}"
            assert got.keys() == want.keys(), how
            for n, g in want.items():
                assert (got[n] is None) == (g is None), (how, n)
                if g is not None:
                    torch.testing.assert_close(got[n], g, rtol=1e-12, atol=1e-12, msg=f"{how} {n}")
