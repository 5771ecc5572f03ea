"""Five-minute GPU check of the CUDA paths CI never runs: one PASS / FAIL line per check, then a summary.

    (a) a transformer with residual dropout 0.1 in train mode: gradients of ``ef.sweep`` with
        ``offload``, ``offload + boundary_dtype=bf16`` and ``autocast=bf16`` against autograd with
        the same seed (and against the plain sweep with a pass that sleeps on the GPU, to widen
        any race window between the offload copies and the compute stream)
    (b) ``x`` on the CPU, the first stage moving it to the GPU: dropout still replayed
    (c) autocast with an estimator on a physical stage (bf16 boundary into fp32 params)
    (d) host syncs counted with ``torch.cuda.set_sync_debug_mode("warn")`` over one sweep: none
        with no passes, none with offload; with ``check_finite`` + ``clip_by_global_norm``, counted
    (e) ``torch.cuda.max_memory_allocated`` of the memory benchmark's workload (12 blocks of width
        256, batch 8, seq 256) for autograd, checkpoint and eae_func
    (f) ``compile=``: gradients against autograd with dropout 0.1 replayed inside the compiled
        graphs, and its steady step time beside the eager sweep's

    python examples/gpu_check.py                       # on a machine with CUDA
    python examples/gpu_check.py --device cpu --quick  # the same checks' logic on the CPU, small

Exits 0 with "no GPU: skipped" where CUDA is absent (unless ``--device cpu``); 1 if a check fails.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import eae_func as ef
from eae_func import estimators as E
from eae_func import passes as P
from eae_func.models import Block

RESULTS: list[tuple[str, bool, str]] = []


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


class Residual(nn.Module):
    """A block with residual dropout: ``h + dropout(block(h) - h)``."""

    def __init__(self, block: nn.Module, p: float):
        super().__init__()
        self.block, self.drop = block, nn.Dropout(p)

    def forward(self, h):
        return h + self.drop(self.block(h) - h)


class ToDevice(nn.Module):
    """The first stage of (b): moves the batch to the model's device, then a linear layer."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x):
        return self.linear(x.to(self.linear.weight.device))


def model(depth: int, dim: int, device, dropout: float, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [Residual(Block(dim, n_heads=8, n_kv_heads=4, ffn_hidden=4 * dim), dropout) for _ in range(depth)]
    return nn.Sequential(*blocks).to(device).train()


def mse(out, target):
    return (out.float() - target).square().mean()


def autograd_grads(net: nn.Module, x, target, seed: int, autocast: bool = False) -> list:
    torch.manual_seed(seed)
    with torch.autocast(next(net.parameters()).device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = mse(net(x), target)
    return list(torch.autograd.grad(loss, list(net.parameters())))


def flat(grads) -> torch.Tensor:
    return torch.cat([g.float().flatten() for stage in grads for g in stage.values()])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def sleeping_pass(cycles: int):
    """Identity on the costate that first keeps the GPU busy (a wider window for any missing wait)."""

    def sleep(adj):
        if torch.cuda.is_available() and adj.tensors() and adj.tensors()[0].is_cuda:
            torch.cuda._sleep(cycles)
        return adj

    return sleep


def check_gradients(device, depth, dim, batch, seq) -> None:
    """(a): offload, offload + bf16 boundaries and autocast against autograd, dropout 0.1 on."""
    net = model(depth, dim, device, 0.1)
    x, target = torch.randn(batch, seq, dim, device=device), torch.randn(batch, seq, dim, device=device)
    chain, params = ef.from_module(net, loss=mse)
    reference = torch.cat([g.flatten() for g in autograd_grads(net, x, target, seed=1)])
    cases = {
        "offload": (dict(offload=True), 1e-4),
        "offload + bf16 boundaries": (dict(offload=True, boundary_dtype=torch.bfloat16), 5e-2),
    }
    for name, (options, tol) in cases.items():
        for label, passes in (("", None), (", a sleeping pass", sleeping_pass(1_000_000))):
            torch.manual_seed(1)
            err = relative(flat(ef.sweep(chain, params, x, target, passes=passes, **options).grads), reference)
            report(f"(a) {name}{label}", err < tol, f"relative gradient error {err:.2e} (bound {tol:g})")
    torch.manual_seed(1)
    got = flat(ef.sweep(chain, params, x, target, autocast=torch.bfloat16).grads)
    amp = torch.cat([g.float().flatten() for g in autograd_grads(net, x, target, seed=1, autocast=True)])
    err = relative(got, amp)
    report("(a) autocast bf16", err < 5e-2, f"relative gradient error to autograd under autocast {err:.2e}")


def check_compiled(device, depth, dim, batch, seq) -> None:
    """(f): compile= (each stage's forward, and its recompute + vjp as one graph) against autograd, dropout
    0.1 replayed inside the compiled graphs; its steady step time beside the eager sweep's."""
    net = model(depth, dim, device, 0.1)
    x, target = torch.randn(batch, seq, dim, device=device), torch.randn(batch, seq, dim, device=device)
    chain, params = ef.from_module(net, loss=mse)
    reference = torch.cat([g.flatten() for g in autograd_grads(net, x, target, seed=3)])
    seconds = {}
    for label, options in (("eager", {}), ("compile=", {"compile": True})):
        for _ in range(2):  # the first compiles
            torch.manual_seed(3)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            grads = flat(ef.grad(chain, params, x, target, **options))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[label] = time.perf_counter() - start
    err = relative(grads, reference)
    report(
        "(f) compile=",
        err < 1e-4,
        f"relative gradient error {err:.2e}; steady step {seconds['compile='] / seconds['eager']:.2f}x the eager sweep's",
    )


def check_input_on_cpu(device, dim, batch, seq) -> None:
    """(b): x on the CPU, a first stage that moves it; dropout must still be replayed on the GPU."""
    torch.manual_seed(0)
    net = nn.Sequential(ToDevice(dim), *model(2, dim, device, 0.1)).to(device).train()
    x, target = torch.randn(batch, seq, dim), torch.randn(batch, seq, dim, device=device)
    chain, params = ef.from_module(net, loss=mse)
    torch.manual_seed(2)
    got = flat(ef.sweep(chain, params, x, target).grads)
    reference = torch.cat([g.flatten() for g in autograd_grads(net, x, target, seed=2)])
    err = relative(got, reference)
    report("(b) x on the CPU, stages on the device", err < 1e-4, f"relative gradient error {err:.2e}")


def check_physical_under_autocast(device, dim, batch, seq) -> None:
    """(c): a physical block under autocast with bf16 boundaries: the estimator runs in the same numerics."""
    net = model(3, dim, device, 0.0)
    x, target = torch.randn(batch, seq, dim, device=device), torch.randn(batch, seq, dim, device=device)
    chain, params = ef.from_module(net, loss=mse, physical=[1])
    try:
        options = dict(autocast=torch.bfloat16, boundary_dtype=torch.bfloat16)
        exact = ef.sweep(chain, params, x, target, estimator=E.exact(), **options)
        probed = ef.sweep(chain, params, x, target, estimator=E.zbp(E.Probes(4, batch_dims=2)), **options)
        ok = all(torch.isfinite(g).all() for stage in probed.grads for g in stage.values())
        err = relative(flat(exact.grads[2:]), flat(probed.grads[2:]))  # downstream of the physical block: exact
        report(
            "(c) autocast + estimator on a physical stage",
            ok and err < 1e-6,
            f"finite estimates, downstream gradients equal to the exact estimator's ({err:.1e})",
        )
    except Exception as e:  # noqa: BLE001 - a check reports, never stops the run
        report("(c) autocast + estimator on a physical stage", False, f"{type(e).__name__}: {e}")


def count_syncs(fn) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message).lower() for w in caught)


def check_syncs(device, dim, batch, seq) -> None:
    """(d): host syncs inside one sweep."""
    net = model(4, dim, device, 0.0)
    x, target = torch.randn(batch, seq, dim, device=device), torch.randn(batch, seq, dim, device=device)
    chain, params = ef.from_module(net, loss=mse)
    ef.sweep(chain, params, x, target)  # warm-up: first-call allocations and lazy inits
    for name, options, expect_none in (
        ("no passes", {}, True),
        ("offload", dict(offload=True), True),
        ("check_finite + clip", dict(passes=ef.compose(P.check_finite(), P.clip_by_global_norm(1.0))), False),
    ):
        n = count_syncs(lambda options=options: ef.sweep(chain, params, x, target, **options))
        report(
            f"(d) host syncs, {name}",
            n == 0 or not expect_none,
            f"{n} synchronizing calls{' (expected none)' if expect_none else ' (counted, one per boundary expected)'}",
        )


def check_memory(device, depth, dim, batch, seq) -> None:
    """(e): peak device memory of one gradient step beyond the model, input and target."""
    net = model(depth, dim, device, 0.0)
    x, target = torch.randn(batch, seq, dim, device=device), torch.randn(batch, seq, dim, device=device)
    chain, params = ef.from_module(net, loss=mse)

    def autograd():
        mse(net(x), target).backward()

    def checkpointed():
        h = x
        for block in net:
            h = checkpoint(block, h, use_reentrant=False)
        mse(h, target).backward()

    def eae():
        ef.value_and_grad(chain, params, x, target)

    peaks = {}
    for name, step in (("autograd", autograd), ("checkpoint", checkpointed), ("eae_func", eae)):
        net.zero_grad(set_to_none=True)
        step()  # warm-up
        net.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        net.zero_grad(set_to_none=True)
    detail = ", ".join(f"{k} {v:.1f} MB" for k, v in peaks.items())
    report(
        "(e) peak memory of one step",
        peaks["eae_func"] < peaks["autograd"],
        f"{detail}; eae_func / checkpoint {peaks['eae_func'] / peaks['checkpoint']:.2f}x",
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes (the logic, not the load)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no GPU: skipped (torch.cuda.is_available() is False)")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
    dim, batch, seq, depth = (32, 2, 16, 3) if args.quick else (512, 8, 512, 6)
    start = time.perf_counter()
    check_gradients(device, depth, dim, batch, seq)
    check_input_on_cpu(device, dim, batch, seq)
    check_physical_under_autocast(device, dim, batch, seq)
    check_compiled(device, depth, dim, batch, seq)
    if device.type == "cuda":
        check_syncs(device, dim, batch, seq)
        check_memory(device, 12, 256, 8, 256)
    failed = [name for name, ok, _ in RESULTS if not ok]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(
        f"\n{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed on {where} in "
        f"{time.perf_counter() - start:.0f} s" + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
