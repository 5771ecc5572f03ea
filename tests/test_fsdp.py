"""FSDP2 stages (2 gloo ranks on 127.0.0.1): a sweep of a model whose stages are ``fully_shard``ed
runs FSDP's own all-gather, backward and reduce-scatter stage by stage. Its gradients are bitwise
FSDP's ``loss.backward()`` (with microbatches, FSDP's no-sync accumulation), sharded like the
parameters; ``.grad`` is left as it was; the passes see the full costates; a fused AdamW equals
the unfused step; and the model trains on with FSDP's own backward afterwards."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import eae_func as ef
import eae_func.distributed as D
import eae_func.passes as P

F64 = torch.float64


def _plain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _sharded(root_too: bool = True, model: nn.Module | None = None, **options):
    """FSDP2 over every rank (2 ranks), or HSDP (4 ranks: 2 replicas of 2 shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    shape, names = ((world,), None) if world == 2 else ((2, world // 2), ("replicate", "shard"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _plain() if model is None else model
    for m in model:
        if any(True for _ in m.parameters()):
            fully_shard(m, mesh=mesh, **options)
    if root_too:
        fully_shard(model, mesh=mesh, **options)
    return model


def _batch(rank, n=6):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(n, 8, generator=g, dtype=F64), torch.randn(n, 4, generator=g, dtype=F64)


def _local(tree: dict) -> dict:
    return {n: None if t is None else t.to_local().clone() for n, t in tree.items()}


def _max_error(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[n] - want[n]).abs().max().item() for n in want)


def _reference(microbatches: int = 1) -> dict:
    """FSDP2's own backward (no-sync accumulation over the microbatches, mean loss over the batch)."""
    x, y = _batch(dist.get_rank())
    model = _sharded()
    pieces = list(zip(x.chunk(microbatches), y.chunk(microbatches)))
    for j, (xj, yj) in enumerate(pieces):
        model.set_requires_gradient_sync(j == len(pieces) - 1)
        (F.mse_loss(model(xj), yj) / microbatches).backward()
    return _local({n: p.grad for n, p in model.named_parameters()})


def _equivalence(prefetch: bool):
    from eae_func.core import fsdp_reverse

    fsdp_reverse.PREFETCH_ON_CPU = prefetch  # the next stage's all-gather started early, as on an accelerator
    rank = dist.get_rank()
    x, y = _batch(rank)
    want = _reference()
    out: dict = {}

    model = _sharded()
    params = dict(model.named_parameters())
    grads = ef.grad(model, params, x, y, loss=F.mse_loss)
    out["grads"] = _max_error(_local(grads), want)
    out["dtensor"] = all(type(g).__name__ == "DTensor" for g in grads.values())
    out["grad_left"] = all(p.grad is None for p in model.parameters())
    out["microbatches"] = _max_error(
        _local(ef.grad(model, params, x, y, loss=F.mse_loss, microbatches=2)), _reference(microbatches=2)
    )
    chain, per_stage = ef.from_module(model, F.mse_loss)
    by_stage = ef.grad(chain, per_stage, x, y)
    out["chain"] = max(_max_error(_local(g), {n: want[f"{i}.{n}"] for n in g}) for i, g in enumerate(by_stage) if g)

    clip = P.clip_by_global_norm(0.01)
    res = ef.sweep(model, params, x, y, loss=F.mse_loss, passes=clip, keep_costates=True)
    plain = _plain()
    replicated = ef.sweep(
        plain, dict(plain.named_parameters()), x, y, loss=F.mse_loss, passes=clip, data_parallel=False
    )
    out["costates"] = max(
        (a.value - b.value).abs().max().item() for a, b in zip(res.adjoints, replicated.adjoints)
    )  # full (unsharded) costates: this rank's batch through the gathered weights

    ef.write_grads(model, grads)  # then a plain optimizer on the sharded parameters, and FSDP trains on
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    reference = _sharded()
    F.mse_loss(reference(x), y).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    out["stepped"] = _max_error(_local(dict(model.named_parameters())), _local(dict(reference.named_parameters())))
    for m in (model, reference):
        m.zero_grad()
        F.mse_loss(m(x), y).backward()
    out["trains_on"] = _max_error(
        _local({n: p.grad for n, p in model.named_parameters()}),
        _local({n: p.grad for n, p in reference.named_parameters()}),
    )

    fused, unfused = _sharded(), _sharded()
    opt = torch.optim.AdamW(fused.parameters(), lr=0.01)
    ef.sweep(fused, dict(fused.named_parameters()), x, y, loss=F.mse_loss, update=opt, microbatches=2)
    opt2 = torch.optim.AdamW(unfused.parameters(), lr=0.01)
    ef.write_grads(unfused, ef.grad(unfused, dict(unfused.named_parameters()), x, y, loss=F.mse_loss, microbatches=2))
    opt2.step()
    out["fused"] = _max_error(_local(dict(fused.named_parameters())), _local(dict(unfused.named_parameters())))
    return out


@pytest.mark.parametrize("prefetch", [False, True])
def test_fsdp2_stages_give_fsdp2s_gradients_and_the_model_trains_on(prefetch):
    for out in D.run(_equivalence, 2, prefetch, timeout=300, pg_timeout=120):
        assert out["grads"] == 0.0 and out["dtensor"] and out["grad_left"]
        assert out["microbatches"] < 1e-12 and out["chain"] == 0.0
        assert out["costates"] == 0.0
        assert out["stepped"] == 0.0 and out["trains_on"] == 0.0
        assert out["fused"] < 1e-12


def _mixed_precision_and_a_failed_sweep():
    """bf16 compute, fp32 reduction (FSDP's MixedPrecisionPolicy); then a sweep whose pass raises
    halfway, after which FSDP2 trains on as if it had not run."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    x, y = (t.float() for t in _batch(dist.get_rank()))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def loss(out, y):
        return F.mse_loss(out.float(), y)

    reference, model = (_sharded(model=_plain().float(), mp_policy=policy) for _ in range(2))
    loss(reference(x), y).backward()
    out = {
        "grads": _max_error(
            _local(ef.grad(model, dict(model.named_parameters()), x, y, loss=loss)),
            _local({n: p.grad for n, p in reference.named_parameters()}),
        )
    }

    def fail(adj):
        if adj.index == 2:
            raise RuntimeError("a pass failed")
        return adj

    try:
        ef.grad(model, dict(model.named_parameters()), x, y, loss=loss, passes=fail)
    except RuntimeError as e:
        out["failed"] = str(e)
    reference.zero_grad()
    for m in (model, reference):
        loss(m(x), y).backward()
    out["trains_on"] = _max_error(
        _local({n: p.grad for n, p in model.named_parameters()}),
        _local({n: p.grad for n, p in reference.named_parameters()}),
    )
    return out


def test_fsdp2_mixed_precision_and_a_failed_sweep_leave_fsdp_as_it_was():
    for out in D.run(_mixed_precision_and_a_failed_sweep, 2, timeout=300, pg_timeout=120):
        assert out["grads"] == 0.0
        assert out["failed"] == "a pass failed"
        assert out["trains_on"] == 0.0


def _hsdp():
    x, y = _batch(dist.get_rank())
    model = _sharded()
    grads = ef.grad(model, dict(model.named_parameters()), x, y, loss=F.mse_loss, microbatches=2)
    return {"microbatches": _max_error(_local(grads), _reference(microbatches=2))}


def test_hsdp_replicas_of_shards_give_fsdp2s_gradients():
    for out in D.run(_hsdp, 4, timeout=300, pg_timeout=120):
        assert out["microbatches"] < 1e-12


def _refusals():
    x, y = _batch(dist.get_rank())
    out = {}
    outside = _plain()
    outside = _sharded(root_too=True, model=nn.Sequential(*outside))
    bare = nn.Sequential(nn.Linear(8, 8).double(), outside)  # a stage that is not an FSDP module holding DTensors
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(bare, mesh=init_device_mesh("cpu", (2,)))
    for key, call in {
        "outside": lambda: ef.grad(bare, dict(bare.named_parameters()), x, y, loss=F.mse_loss),
        "split_at": lambda: ef.grad(outside, dict(outside.named_parameters()), x, y, loss=F.mse_loss, split_at=["2"]),
        "data_parallel": lambda: ef.grad(
            outside, dict(outside.named_parameters()), x, y, loss=F.mse_loss, data_parallel=dist.group.WORLD
        ),
        "other_params": lambda: ef.grad(
            outside, {n: p.detach().clone() for n, p in outside.named_parameters()}, x, y, loss=F.mse_loss
        ),
    }.items():
        try:
            call()
        except (TypeError, ValueError) as e:
            out[key] = str(e)
    F.mse_loss(outside(x), y).backward()  # FSDP training still works
    out["trained"] = all(p.grad is not None for p in outside.parameters())
    return out


def test_what_an_fsdp2_sweep_cannot_run_is_refused_before_anything_runs():
    for out in D.run(_refusals, 2, timeout=240, pg_timeout=120):
        assert "sharded by an enclosing fully_shard" in out["outside"]
        assert "which a graph capture cannot run" in out["split_at"]
        assert "FSDP stages reduce-scatter their own" in out["data_parallel"]
        assert "not the FSDP module's own sharded parameter" in out["other_params"]
        assert out["trained"]
