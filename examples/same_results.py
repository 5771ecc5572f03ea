"""Every result tensor of a fixed set of sweeps, saved or compared bit for bit: the check that a
refactor of the engine changed nothing (gradients, costates, recorded numbers, pass and optimizer
state, updated params) on each driver and front end.

    python examples/same_results.py --save before.pt      # on the old code
    python examples/same_results.py --compare before.pt   # on the new: every tensor equal, or exit 1

Timings (``stats[stage]["seconds"]``-like entries) are left out; everything else is compared,
NaN equal to NaN, dtype and shape included.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

import eae_func as ef
from eae_func import estimators as E
from eae_func import passes as P
from eae_func import remat
from eae_func.lazy import Lazy
from eae_func.models import Block

TIMES = ("seconds", "_s", "time")  # keys of measured times, which no two runs share


def every_pass(synthetic=True):
    """Passes of every kind: measuring, random, stateful (error feedback; synthetic gradients, which
    read the boundary state a chain keeps)."""
    return ef.compose(
        P.clip_by_global_norm(1.0),
        P.scale(0.9),
        P.gaussian_noise(1e-3),
        P.error_feedback(P.int8()),
        P.topk(0.5),
        P.stats(),
        *([P.synthetic(warmup=1)] if synthetic else []),
    )


def blocks(depth=3, dim=16, dropout=0.1):
    torch.manual_seed(0)
    layers = [
        nn.Sequential(Block(dim, n_heads=4, n_kv_heads=2, ffn_hidden=24), nn.Dropout(dropout)) for _ in range(depth)
    ]
    return nn.Sequential(*layers, nn.Linear(dim, dim))


def data(dim=16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, dim, generator=g), torch.randn(4, 6, dim, generator=g)


def chain_cases():
    """The fold: passes over microbatches with state threaded, a fused optimizer step, low-precision
    boundaries under a byte budget, remat.save, physical stages under zbp, np and the control variate."""
    out = {}
    x, y = data()
    model = blocks()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    state = None
    for step in range(2):
        res = ef.sweep(chain, params, x, y, passes=every_pass(), pass_state=state, microbatches=2, key=step)
        state = res.pass_state
        out[f"chain passes {step}"] = res
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        torch.manual_seed(10 + step)
        out[f"chain fused {step}"] = ef.sweep(chain, params, x, y, update=opt, boundary_dtype=torch.bfloat16,
                                              recompute=20_000)  # fmt: skip
        out[f"chain fused {step} params"] = [p.detach().clone() for p in model.parameters()]
    out["chain remat.save"] = ef.sweep(chain, params, x, y, recompute=remat.save(), key=5)
    torch.manual_seed(3)
    small = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    chain, params = ef.from_module(small, loss=F.mse_loss)
    xs, ys = torch.randn(16, 8), torch.randn(16, 8)
    twin = lambda p, h: torch.tanh(h @ p["0.weight"].T * 1.05 + p["0.bias"])  # noqa: E731
    for name, estimator in {
        "zbp": E.zbp(E.Probes(8), method="fd", eps=1e-4),
        "np": E.node_perturbation(E.Probes(8), form="jvp"),
        "direct": E.direct(E.Probes(8)),
        "control variate": E.control_variate(E.zbp(E.Probes(8)), twin, shrink="auto"),
    }.items():
        out[f"estimator {name}"] = ef.sweep(chain, params, xs, ys, physical=[2], estimator=estimator, key=7)
    return out


class Residual(nn.Module):
    def __init__(self, depth=3, dim=16):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(dim, n_heads=4, n_kv_heads=2, ffn_hidden=24) for _ in range(depth))
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        for layer in self.layers:
            x = x + self.drop(layer(x))
        return self.head(x)


def run_time_cases():
    """Run-time cuts (passes, microbatches, fused AdamW, bf16 boundaries, kept graphs) and the switch."""
    out = {}
    x, y = data()
    model = Residual()
    kw = dict(loss=F.mse_loss, split_at=["layers.*"])
    state = None
    for step in range(2):
        torch.manual_seed(20 + step)
        res = ef.sweep(model, dict(model.named_parameters()), x, y, passes=every_pass(False), pass_state=state,
                       microbatches=2, key=step, **kw)  # fmt: skip
        state = res.pass_state
        out[f"cuts passes {step}"] = res
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        torch.manual_seed(30 + step)
        out[f"cuts fused {step}"] = ef.sweep(model, dict(model.named_parameters()), x, y, update=opt,
                                             boundary_dtype=torch.bfloat16, **kw)  # fmt: skip
        out[f"cuts fused {step} params"] = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(40)
    out["cuts kept graphs"] = ef.sweep(model, dict(model.named_parameters()), x, y, recompute=False, **kw)
    model = Residual()
    ef.enable(model, split_at=["layers.*"], passes=P.clip_by_global_norm(1e-2))
    for step in range(2):
        torch.manual_seed(50 + step)
        F.mse_loss(model(x), y).backward()
        out[f"enable {step}"] = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
    ef.disable(model)
    return out


def function_cases():
    """A function cut at its ``ef.cut`` marks."""
    g = torch.Generator().manual_seed(2)
    params = {"w1": torch.randn(8, 8, generator=g), "w2": torch.randn(8, 8, generator=g)}
    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)

    def fn(p, x):
        h = ef.cut(torch.tanh(x @ p["w1"]), "first")
        return torch.tanh(h @ p["w2"])

    return {"function": ef.sweep(fn, params, x, y, loss=F.mse_loss, passes=P.scale(0.5))}


def tensors(tree, prefix=""):
    """``{path: tensor}`` of every tensor and number in ``tree`` (records, dicts, lists, Lazy read)."""
    found = {}
    if isinstance(tree, Lazy):
        tree = tree.value
    if isinstance(tree, torch.Tensor):
        found[prefix] = tree.detach()
    elif isinstance(tree, bool | int | float):
        found[prefix] = torch.tensor(tree)
    elif isinstance(tree, dict):
        for k, v in tree.items():
            if not any(t in str(k) for t in TIMES):
                found |= tensors(v, f"{prefix}.{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            found |= tensors(v, f"{prefix}[{i}]")
    elif hasattr(tree, "__dataclass_fields__"):
        for k in tree.__dataclass_fields__:
            found |= tensors(getattr(tree, k), f"{prefix}.{k}")
    return found


def results() -> dict:
    out = {}
    for case in (chain_cases, run_time_cases, function_cases):
        for name, value in case().items():
            out |= tensors(value, name)
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", help="write every result tensor to this file")
    group.add_argument("--compare", help="compare every result tensor with this file's, bit for bit")
    args = parser.parse_args()
    now = results()
    if args.save:
        torch.save(now, args.save)
        print(f"{len(now)} tensors saved to {args.save}")
        return 0
    before = torch.load(args.compare)
    missing, new = sorted(set(before) - set(now)), sorted(set(now) - set(before))
    differ = [k for k in sorted(set(before) & set(now)) if not same(before[k], now[k])]
    for k in differ[:20]:
        print(f"differs: {k}")
    for k in missing[:10]:
        print(f"missing: {k}")
    for k in new[:10]:
        print(f"new: {k}")
    print(f"{len(now)} tensors: {len(differ)} differ, {len(missing)} missing, {len(new)} new")
    return 1 if differ or missing or new else 0


if __name__ == "__main__":
    sys.exit(main())
