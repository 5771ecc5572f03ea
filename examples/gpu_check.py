"""Five-minute GPU check of the CUDA paths CI never runs: one PASS / FAIL line per check, then a summary.

    (a) a transformer with residual dropout 0.1 in train mode: gradients of ``ef.sweep`` with
        ``offload``, ``offload + boundary_dtype=bf16`` and ``autocast=bf16`` against autograd with
        the same seed (and against the plain sweep with a pass that sleeps on the GPU, to widen
        any race window between the offload copies and the compute stream)
    (b) ``x`` on the CPU, the first stage moving it to the GPU: dropout still replayed
    (c) autocast with an estimator on a physical stage (bf16 boundary into fp32 params)
    (d) host syncs counted with ``torch.cuda.set_sync_debug_mode("warn")`` over one sweep: none
        with no passes, none with offload; with ``check_finite`` + ``clip_by_global_norm``, counted;
        none over two steps with 2 microbatches, a fused ``torch.optim.SGD`` update (``update=``)
        and every built-in pass that reads no value on the host (all but ``check_finite("raise")``)
    (e) ``torch.cuda.max_memory_allocated`` of the memory benchmark's workload (12 blocks of width
        256, batch 8, seq 256) for autograd, checkpoint and eae_func
    (f) ``compile=``: gradients against autograd with dropout 0.1 replayed inside the compiled
        graphs, and its steady step time beside the eager sweep's

On the memory benchmark's workload, against what a PyTorch user would run instead (gradients
compared; each step the median of interleaved steps, each peak that of one step above what was
allocated before it: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` on CUDA,
the live tensor bytes of ``bench_memory.LiveBytes`` on the CPU; the ratios are printed, not judged):

    (g) checkpointing: ``ef.grad`` against ``torch.utils.checkpoint`` per block (``use_reentrant=False``)
    (h) FSDP2 on one process (world size 1; NCCL on CUDA, gloo on the CPU): ``ef.grad`` on the model
        with ``fully_shard`` on each block and the root against FSDP2 + checkpoint per block
    (i) compile + checkpointing: ``compile=True`` against ``torch.compile`` of the checkpointed model
        (whole-model) and of each checkpointed block (regional); and the graphs ``compile=`` compiles
        for identical blocks (one forward and one reverse expected, checked)
    (j) the remat curve at one point: the largest ``recompute=`` byte budget whose peak is within
        ``checkpoint_sequential``'s (3 segments; 2 with ``--quick``), its step beside that one's
    (l) ``cuda_graphs=True`` on the memory workload cut at run time (dropout 0.1): gradients within
        1e-5 of the eager sweep's over four steps, the graphs replayed from the third; the step against
        the eager sweep, autograd and eae-runtime (``memory="none"``); on the CPU, refused
    (k) a training step with AdamW on a Llama of TinyLlama's 1.1B shape (bf16, 4 x 2048; with
        ``--quick`` and on the CPU a small fp32 one), ``examples/bench_train_hf.py``'s methods one at a
        time (each alone in memory, so not interleaved): the step and its peak above the weights and
        optimizer state against HF checkpointing + ``AdamW.step()``; passes where the fused step with the
        head in chunks peaks below HF checkpointing's and every method's loss is finite

    python examples/gpu_check.py                       # on a machine with CUDA
    python examples/gpu_check.py --device cpu --quick  # the same checks' logic on the CPU, small

Exits 0 with "no GPU: skipped" where CUDA is absent (unless ``--device cpu``); 1 if a check fails.
On the CPU, (d) and (e) do not run (they need CUDA's counters), and (h)'s live bytes do not see
the storages FSDP resizes in place (its unsharded parameters); on CUDA the allocator sees all.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import typing
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import eae_func as ef
from eae_func import estimators as E
from eae_func import passes as P
from eae_func.models import Block

from bench_memory import LiveBytes  # examples/ is on the path of a script run from it

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


class Checkpointed(nn.Module):
    """A block run through ``torch.utils.checkpoint`` (non-reentrant), as a PyTorch user would."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, h):
        return checkpoint(self.block, h, use_reentrant=False)


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


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_steps(device, runs: dict, steps: int) -> dict[str, float]:
    """Each run's median seconds over ``steps`` rounds after a warm-up round, the runs interleaved
    (A B A B ...) so that a burst of load from other tenants hits each alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(steps + 1):
        for name, run in runs.items():
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            if r:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def storages(tree) -> list:
    """The storages of the tensors in ``tree``, through tensor subclasses (a DTensor: its local tensor)."""
    found, stack = [], list(tree_leaves(tree))
    while stack:
        t = stack.pop()
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            stack.extend(getattr(t, name) for name in t.__tensor_flatten__()[0])
        else:
            found.append(t.untyped_storage())
    return found


class LiveTensorBytes(LiveBytes):
    """``bench_memory.LiveBytes`` through tensor subclasses: a DTensor counts by its local tensor."""

    def __init__(self):
        super().__init__()
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {storage.data_ptr() for storage in storages((args, kwargs))}
                for storage in storages(out):
                    counter._add(storage, inputs)
                return out

        self.mode = Mode()


def peak_bytes(device, run) -> int:
    """Peak bytes of one call of ``run`` above what was allocated before it: on CUDA
    ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``; on the CPU the peak of the
    bytes of tensors created in the call and alive at once."""
    if device.type != "cuda":
        with LiveTensorBytes() as live:
            run()
        return live.peak
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def versus(times: dict, peaks: dict, ours: str, theirs: str) -> str:
    """``ours``'s step and peak as ratios to ``theirs``'s."""
    return (
        f"{ours} / {theirs}: step {times[ours] / times[theirs]:.2f}x, peak {peaks[ours] / peaks[theirs]:.2f}x "
        f"({peaks[ours] / 2**20:.2f} / {peaks[theirs] / 2**20:.2f} MB)"
    )


def taken(module: nn.Module) -> list:
    """The parameters' ``.grad`` of a step just run, which the module then forgets (the next step's
    gradients are new tensors, so each step's peak counts them)."""
    grads = [p.grad for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return grads


def cat(grads) -> torch.Tensor:
    """A list of gradients (DTensors gathered) as one float vector."""
    return torch.cat([(g.full_tensor() if hasattr(g, "full_tensor") else g).float().flatten() for g in grads])


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


def every_pass():
    """Every built-in pass that reads no value on the host (``check_finite("raise")`` must, to raise),
    as tests/test_host_waits.py composes them."""
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
    update = torch.optim.SGD(net.parameters(), lr=1e-3)
    state = None

    def steps(count: int) -> None:
        nonlocal state
        for _ in range(count):
            res = ef.sweep(
                chain, params, x, target, passes=every_pass(), pass_state=state, microbatches=2, update=update
            )
            state = res.pass_state

    steps(1)  # warm-up: the passes' state, the optimizer's
    n = count_syncs(lambda: steps(2))
    report(
        "(d) host syncs, 2 steps: 2 microbatches, fused SGD, every built-in pass",
        n == 0,
        f"{n} synchronizing calls (expected none)",
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


def check_checkpointing(device, depth, dim, batch, seq, steps) -> None:
    """(g): eae_func against ``torch.utils.checkpoint`` per block on the memory workload: gradients,
    then the step and the peak as ratios to checkpointing's."""
    net = model(depth, dim, device, 0.0)
    x, target = torch.randn(batch, seq, dim, device=device), torch.randn(batch, seq, dim, device=device)
    chain, params = ef.from_module(net, loss=mse)
    checkpointed = nn.Sequential(*[Checkpointed(block) for block in net])  # the same weights

    def torch_checkpoint():
        mse(checkpointed(x), target).backward()
        return taken(net)

    runs = {"eae_func": lambda: ef.grad(chain, params, x, target), "checkpoint": torch_checkpoint}
    err = relative(flat(runs["eae_func"]()), cat(torch_checkpoint()))
    times = median_steps(device, runs, steps)
    peaks = {name: peak_bytes(device, run) for name, run in runs.items()}
    report(
        "(g) against checkpoint per block",
        err < 1e-4,
        f"relative gradient error {err:.2e}; {versus(times, peaks, 'eae_func', 'checkpoint')}",
    )


def check_cuda_graphs(device, depth, dim, batch, seq, steps) -> None:
    """(l): ``cuda_graphs=True`` on the memory workload cut at run time, residual dropout 0.1: over
    four steps on new data, gradients the eager sweep's on the same seed (within 1e-5: attention's
    backward adds with atomics; bit for bit or not, it says), replays from the
    third step on (a key's first replay is checked beside its eager step); then the step against
    the eager sweep, autograd and eae-runtime. On the CPU: refused, naming the device."""
    net = model(depth, dim, device, 0.1)
    named = dict(net.named_parameters())

    def sweep(x, target, seed, **options):
        torch.manual_seed(seed)
        return ef.sweep(net, named, x, target, loss=mse, split_at=["*"], timers=False, **options)

    x, target = torch.randn(batch, seq, dim, device=device), torch.randn(batch, seq, dim, device=device)
    if device.type != "cuda":
        try:
            sweep(x, target, 0, cuda_graphs=True)
            report("(l) cuda_graphs=", False, "not refused on the CPU")
        except ValueError as e:
            report("(l) cuda_graphs=", "captures CUDA kernels" in str(e), f"refused on the CPU: {e}")
        return
    ef.clear_caches()
    equal, err, replays = True, 0.0, []
    for k in range(4):
        x, target = torch.randn(batch, seq, dim, device=device), torch.randn(batch, seq, dim, device=device)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            graphed = sweep(x, target, k, cuda_graphs=True)
        eager = sweep(x, target, k)
        equal &= all(torch.equal(graphed.grads[n], eager.grads[n]) for n in named)
        err = max(err, relative(cat(graphed.grads.values()), cat(eager.grads.values())))
        replays.append(sum(s.get("graph_replays", 0) for n, s in graphed.stats.items() if n != "boundaries"))
        for w in said:
            print(f"    {w.message}")

    def autograd():
        net.zero_grad(set_to_none=True)
        mse(net(x), target).backward()

    runs = {
        "cuda_graphs=True": lambda: sweep(x, target, 0, cuda_graphs=True),
        "eager": lambda: sweep(x, target, 0),
        "autograd": autograd,
    }
    try:  # the peer where it is installed (the bench extra)
        from eae_runtime import EAERuntime, RuntimeConfig

        runtime = EAERuntime(net, None, RuntimeConfig(memory="none", enable_profiler=False))
        runs["eae-runtime"] = lambda: runtime.compute_gradients(x, lambda out: mse(out, target))
    except ImportError:
        pass
    times = median_steps(device, runs, steps)
    ratios = ", ".join(f"{times['cuda_graphs=True'] / times[n]:.2f}x {n}" for n in runs if n != "cuda_graphs=True")
    peer = f"; eager {times['eager'] / times['eae-runtime']:.2f}x eae-runtime" if "eae-runtime" in times else ""
    report(
        "(l) cuda_graphs=",
        err < 1e-5 and replays[:2] == [0, 0] and replays[2:] == [depth, depth],
        f"gradients {'bit for bit' if equal else f'within {err:.1e} of'} the eager sweep's; replays per step "
        f"{replays}; step {ratios}{peer}",
    )


def check_fsdp(device, depth, dim, batch, seq, steps) -> None:
    """(h): FSDP2 on one process: ``ef.grad`` on the model with ``fully_shard`` on each block and the
    root against FSDP2 + checkpoint per block; gradients, step and peak ratios. The process group
    is made here (world size 1, an in-process store) and destroyed after."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    name = "(h) FSDP2: eae_func against FSDP2 + checkpoint per block"
    if dist.is_initialized():
        report(name, False, "a process group already exists: this check makes its own")
        return
    try:
        if device.type == "cuda":  # an index is needed: torch.device("cuda") alone is refused
            torch.cuda.set_device(torch.cuda.current_device() if device.index is None else device.index)
        store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
        mesh = init_device_mesh(device.type, (1,))
        net = model(depth, dim, device, 0.0)
        x, target = torch.randn(batch, seq, dim, device=device), torch.randn(batch, seq, dim, device=device)

        def sharded(wrap):
            root = nn.Sequential(*[fully_shard(wrap(copy.deepcopy(block)), mesh=mesh) for block in net])
            return typing.cast(nn.Module, fully_shard(root, mesh=mesh))

        fsdp, fsdp_checkpointed = sharded(lambda block: block), sharded(Checkpointed)
        params = dict(fsdp.named_parameters())

        def fsdp_checkpoint():
            mse(fsdp_checkpointed(x), target).backward()
            return taken(fsdp_checkpointed)

        runs = {
            "eae_func": lambda: list(ef.grad(fsdp, params, x, target, loss=mse).values()),
            "fsdp2 + checkpoint": fsdp_checkpoint,
        }
        err = relative(cat(runs["eae_func"]()), cat(fsdp_checkpoint()))
        times = median_steps(device, runs, steps)
        peaks = {method: peak_bytes(device, run) for method, run in runs.items()}
        report(
            name,
            err < 1e-5,
            f"relative gradient error {err:.2e}; {versus(times, peaks, 'eae_func', 'fsdp2 + checkpoint')}",
        )
    except Exception as e:  # noqa: BLE001 - a check reports, never stops the run
        report(name, False, f"{type(e).__name__}: {e}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def check_compile_against_torch(device, depth, dim, batch, seq, steps) -> None:
    """(i): ``compile=True`` against compile + checkpointing: ``torch.compile`` of the model with a
    checkpoint per block (whole-model) and of each checkpointed block (regional, PyTorch's regional
    compilation); gradients and step ratios. The graphs ``compile=`` compiles for ``depth`` identical
    blocks are counted from dynamo's counter after a reset: one forward and one reverse expected."""
    from torch._dynamo.utils import counters

    name = "(i) compile=: against compile + checkpoint"
    try:
        torch._dynamo.reset()  # the graphs of (f) would otherwise be reused, not counted
        net = model(depth, dim, device, 0.0)
        x, target = torch.randn(batch, seq, dim, device=device), torch.randn(batch, seq, dim, device=device)
        chain, params = ef.from_module(net, loss=mse)
        before = counters["stats"]["unique_graphs"]
        got = flat(ef.grad(chain, params, x, target, compile=True))
        graphs = counters["stats"]["unique_graphs"] - before
        whole = torch.compile(nn.Sequential(*[Checkpointed(block) for block in net]))  # the same weights
        regional = nn.Sequential(*[typing.cast(nn.Module, torch.compile(Checkpointed(block))) for block in net])

        def compiled(module):
            def step():
                mse(module(x), target).backward()
                return taken(net)

            return step

        runs = {
            "compile=": lambda: ef.grad(chain, params, x, target, compile=True),
            "compile + checkpoint": compiled(whole),
            "regional compile + checkpoint": compiled(regional),
        }
        err = max(
            relative(got, cat(runs[method]())) for method in ("compile + checkpoint", "regional compile + checkpoint")
        )
        times = median_steps(device, runs, steps)
        ratios = ", ".join(
            f"{times['compile='] / times[method]:.2f}x {method}"
            for method in ("compile + checkpoint", "regional compile + checkpoint")
        )
        report(
            name,
            err < 1e-4 and graphs == 2,
            f"relative gradient error {err:.2e}; {graphs} graphs for {depth} identical blocks (2 expected); "
            f"step {ratios}",
        )
    except Exception as e:  # noqa: BLE001 - a check reports, never stops the run
        report(name, False, f"{type(e).__name__}: {e}")


def graph_bytes(block: nn.Module, h: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves in one block's forward, its parameters and input excluded."""
    own = {p.untyped_storage().data_ptr() for p in block.parameters()} | {h.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(h.detach().requires_grad_(True))
    return sum(saved.values())


def check_remat_curve(device, depth, dim, batch, seq, steps, segments) -> None:
    """(j): one point of the remat curve: ``checkpoint_sequential`` with ``segments`` segments, and
    the sweep with the largest ``recompute=`` byte budget (graphs kept: ``depth`` down to 0, a
    budget of a block's graph and boundary per graph, as ``bench_train.py --curve`` spends it)
    whose peak is within checkpoint_sequential's; gradients, step and peak ratios."""
    net = model(depth, dim, device, 0.0)
    x, target = torch.randn(batch, seq, dim, device=device), torch.randn(batch, seq, dim, device=device)
    chain, params = ef.from_module(net, loss=mse)

    def sequential():
        mse(checkpoint_sequential(net, segments, x, use_reentrant=False), target).backward()
        return taken(net)

    reference = cat(sequential())  # and the warm-up
    ceiling = peak_bytes(device, sequential)
    per_graph = graph_bytes(net[0], x) + x.numel() * x.element_size()
    kept, within = depth, False
    while True:
        budget = kept * per_graph + per_graph // 2 if kept else 0
        sweep = lambda budget=budget: ef.grad(chain, params, x, target, recompute=budget)
        sweep()  # the first forward at a budget measures the graphs' sizes
        within = peak_bytes(device, sweep) <= ceiling
        if within or kept == 0:
            break
        kept -= 1
    ours, theirs = f"eae_func (a budget of {kept} graphs)", f"checkpoint_sequential ({segments} segments)"
    runs = {ours: sweep, theirs: sequential}
    err = relative(flat(sweep()), reference)
    times = median_steps(device, runs, steps)
    peaks = {method: peak_bytes(device, run) for method, run in runs.items()}
    report(
        "(j) remat curve at checkpoint_sequential's peak",
        err < 1e-4,
        f"relative gradient error {err:.2e}; {versus(times, peaks, ours, theirs)}"
        + ("" if within else "; no budget came within its peak, not even 0"),
    )


def check_train_hf(device, quick: bool) -> None:
    """(k): bench_train_hf's training step at TinyLlama's shape (a small Llama with --quick), each
    method measured alone: its median step over 3 steps after two warm-ups, and its step's peak."""
    import argparse as ap

    import bench_train_hf as T

    name = "(k) a training step on a Llama (1.1B on CUDA): eae_func against HF checkpointing + AdamW"
    methods = ("hf-checkpoint", "autograd", "hf-checkpoint + in-bw", "eae_func update=", "+ chunked head",
               "ef.enable update= + chunks")  # fmt: skip
    small = quick or device.type != "cuda"
    args = ap.Namespace(
        family="llama", device=str(device), rounds=3, shape=None if small else "tinyllama",
        dtype="float32" if small else "bfloat16", **(
            dict(layers=2, hidden=64, vocab=512, batch=2, seq=64) if small
            else {**{k: T.TINYLLAMA[k] for k in ("layers", "hidden", "vocab")}, "batch": 4, "seq": 2048}
        ),
    )  # fmt: skip
    rows = {}
    try:
        for m in methods:
            times, peaks, losses, _, _ = T.measure(args, args.seq, (m,))
            rows[m] = (times[m], peaks[m], losses[m])
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - the check reports it
        report(name, False, f"{type(e).__name__}: {e}"[:300])
        return
    t0, p0 = rows["hf-checkpoint"][:2]
    table = "; ".join(
        f"{m} {t / t0:.2f}x step, {p / p0:.2f}x peak ({p / 2**20:.0f} MB)" for m, (t, p, _) in rows.items()
    )
    ok = rows["+ chunked head"][1] < p0 and all(torch.isfinite(torch.tensor(v[2])) for v in rows.values())
    shape = f"{args.layers} x {args.hidden}, vocab {args.vocab}, {args.batch} x {args.seq}, {args.dtype}"
    report(name, ok, f"{shape}: {table}")


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
    workload, steps, segments = ((4, 32, 2, 16), 3, 2) if args.quick else ((12, 256, 8, 256), 5, 3)
    start = time.perf_counter()
    check_gradients(device, depth, dim, batch, seq)
    check_input_on_cpu(device, dim, batch, seq)
    check_physical_under_autocast(device, dim, batch, seq)
    check_compiled(device, depth, dim, batch, seq)
    if device.type == "cuda":
        check_syncs(device, dim, batch, seq)
        check_memory(device, 12, 256, 8, 256)
    check_checkpointing(device, *workload, steps)
    check_fsdp(device, *workload, steps)
    check_compile_against_torch(device, *workload, steps)
    check_remat_curve(device, *workload, steps, segments)
    check_train_hf(device, args.quick)
    check_cuda_graphs(device, *workload, steps)
    failed = [name for name, ok, _ in RESULTS if not ok]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(
        f"\n{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed on {where} in "
        f"{time.perf_counter() - start:.0f} s" + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
