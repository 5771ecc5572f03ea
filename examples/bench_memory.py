"""Peak memory and step time of an EAE step vs autograd, checkpointing and eae-runtime.

Workload: a stack of pre-norm transformer blocks ``eae_func.models.Block(dim=256,
n_heads=8, n_kv_heads=4, ffn_hidden=1024)``, the same module definition and seed for
every method, input ``x = randn(batch, seq, 256)``, loss ``mean((out - target)^2)``
with a fixed random target, fp32 (``--block eae-runtime``: the peer package's own
``eae_runtime.contrib.PreNormTransformerBlock`` of the same sizes, ``max_seq_len=256``).
A step is forward + parameter gradients (no optimizer). Methods:

    autograd      loss.backward() through the whole stack
    checkpoint    torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False) per block
    eae-runtime   eae_runtime 0.1.1: EAERuntime(nn.ModuleList(blocks), None, RuntimeConfig())
                  .compute_gradients(x, loss_fn)
    eae_func      ef.value_and_grad(*ef.from_module(nn.ModuleList(blocks), loss=loss_fn), x, target)

How memory is measured (CPU)
----------------------------------------------
Every (method, depth, allocator) runs in its own fresh subprocess, one after the
other (never two at once), all importing the same modules (torch, eae_func,
eae_runtime), building the same model, input and target, then running
``warmup + steps`` steps. The peak is the kernel's resident-set high-water mark
(``VmHWM`` in /proc/self/status, the figure behind ``getrusage().ru_maxrss``): it
sees every transient peak, however short, and costs nothing while the steps run,
which a psutil sampling thread cannot promise (it misses peaks shorter than its
period and steals a core from a 2-core machine while the steps are being timed).
Before anything is measured, every process runs one step of every method on a
tiny model, so all of them have loaded the same code (the first use of
checkpointing, torch.func or eae-runtime imports hundreds of modules, tens of MB,
once per process: not a step's memory). The high-water mark only grows, and
importing torch alone peaks higher than a small model's whole step, so right after
setup the worker resets it by writing
``5`` to /proc/self/clear_refs (Linux >= 4.0) and notes the resident set then;
its figure is ``HWM after the steps - RSS at the reset``. (Where the reset is not
possible it falls back to ``ru_maxrss``, which then includes import transients;
the output says so.) A **baseline** subprocess of the same kind builds the same
model and runs only the forward under ``torch.no_grad()`` (same number of times),
measured the same way; the reported figure is ``peak(method) - peak(baseline)``:
the memory a method needs beyond parameters, input, target, interpreter and
library code, and beyond the transient of a graph-free forward.

Each measurement is done twice: with ``MALLOC_MMAP_THRESHOLD_=65536`` in the
subprocess's environment (glibc then serves every tensor above 64 KiB with its own
mmap and unmaps it when freed, so RSS follows live memory) and with the default
allocator (glibc keeps freed blocks in its heap, so RSS shows what a user would
see, blurred by reuse). The mmap-threshold figure is the one the targets use.

For a third, allocator-free view, one extra step per method (after the timed ones,
so it affects neither timing nor the peak) runs under a ``TorchDispatchMode`` that
adds the bytes of every storage an operator creates and subtracts them when the
storage dies (as tests/live_bytes.py): "live MB" is the peak of tensor bytes
created inside the step and alive at once.

Floor of the EAE sweep: parameter gradients + one stage's tape +
the boundaries still needed (+ the costate entering and leaving the stage). With
``G`` one block's gradient bytes, ``A`` one boundary (batch*seq*dim*4 bytes), ``T``
one block's tape (bytes of the tensors autograd saves in a block's forward,
counted with saved_tensors_hooks, params and input excluded) the live memory while
stage i (1-based) is reversed is at least ``(L-i+1) G + (i-1) A + T + 2A``
(grads of stages i..L, boundaries x_1..x_{i-1}, x_0 being the caller's input, the
tape, costates p_i and p_{i-1}); the floor is its max over i. The script prints it
beside the measured live MB, and, made comparable with the RSS figures, minus the
graph-free forward's own transient (which the baseline already contains).

Step time: the median over ``--steps`` timed steps after ``--warmup`` warm-up steps,
torch.set_num_threads(--threads, default: the usable cores) in every process. Two
figures: "own process", the median of each method's default-allocator process (the
mmap-threshold ones pay a page fault per large allocation), and "interleaved", from
one more process per depth that builds every method on the same model and runs
their steps in turn (A B C D A B C D ...), so a burst of load from other tenants of
the machine hits every method alike. On a shared 2-core machine the own-process
medians were seen to swing 5x between runs (a neighbour taking a core stalls every
2-thread kernel), so the targets use the interleaved medians.

Before the runs, the gradients of eae_func and eae-runtime are compared with
autograd's once at a small size (max abs difference printed), and every full-size
process reports its loss and gradient norm, so all methods compute the same thing.

On CUDA (``--device cuda``) each method runs once per depth in its own process and
memory is ``torch.cuda.max_memory_allocated()`` above what was allocated after
setup, minus the same figure for the forward-only baseline.

    python examples/bench_memory.py                       # depths 6 12 24, batch 8, seq 256
    python examples/bench_memory.py --depths 12 --steps 7
    python examples/bench_memory.py --quick               # smoke run, small sizes
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
import weakref

from extras import extra

METHODS = ("autograd", "checkpoint", "eae-runtime", "eae_func")
DIM, HEADS, KV_HEADS, FFN = 256, 8, 4, 1024
MB = 2**20
BLOCK = "eae_func"  # --block: eae_func.models.Block, or eae-runtime's contrib.PreNormTransformerBlock
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


# ---------------------------------------------------------------------------
# Shared pieces (parent and workers)
# ---------------------------------------------------------------------------


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def build(depth: int, batch: int, seq: int, device: str, seed: int = 0):
    """The same blocks (seed ``seed``), input and target for every method."""
    import torch

    from eae_func.models import Block

    torch.manual_seed(seed)
    if BLOCK == "eae-runtime":  # the peer package's own block, as its users build it
        with extra("bench"):
            from eae_runtime.contrib import PreNormTransformerBlock

        blocks = [
            PreNormTransformerBlock(DIM, HEADS, KV_HEADS, max_seq_len=max(seq, 256), ffn_hidden_dim=FFN).to(device)
            for _ in range(depth)
        ]
    else:
        blocks = [Block(DIM, HEADS, KV_HEADS, FFN).to(device) for _ in range(depth)]
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, seq, DIM, generator=gen).to(device)
    target = torch.randn(batch, seq, DIM, generator=gen).to(device)
    return blocks, x, target


def loss_fn(out, target):
    return (out - target).square().mean()


def make_step(method: str, blocks: list, x, target):
    """A function running one step (forward + all parameter gradients); returns (loss, grads)."""
    import torch
    from torch import nn

    if method in ("autograd", "checkpoint"):
        from torch.utils.checkpoint import checkpoint

        params = [p for b in blocks for p in b.parameters()]

        def step():
            for p in params:
                p.grad = None
            h = x
            for b in blocks:
                h = checkpoint(b, h, use_reentrant=False) if method == "checkpoint" else b(h)
            loss = loss_fn(h, target)
            del h
            loss.backward()
            return loss.detach(), [p.grad for p in params]

        return step
    if method == "eae-runtime":
        with extra("bench"):
            from eae_runtime import EAERuntime, RuntimeConfig

        rt = EAERuntime(nn.ModuleList(blocks), None, RuntimeConfig())
        params = [p for b in blocks for p in b.parameters()]

        def step():
            loss, grads = rt.compute_gradients(x, lambda out: loss_fn(out, target))
            return loss, [grads[p] for p in params]

        return step
    if method == "eae_func":
        import eae_func as ef

        chain, params = ef.from_module(nn.ModuleList(blocks), loss=loss_fn)

        def step():
            loss, grads = ef.value_and_grad(chain, params, x, target)
            return loss, [g for stage in grads for g in stage.values()]

        return step
    if method == "baseline":

        def step():
            with torch.no_grad():
                h = x
                for b in blocks:
                    h = b(h)
                return loss_fn(h, target), []

        return step
    raise ValueError(f"unknown method {method!r}")


class LiveBytes:
    """Peak bytes of tensor storages created inside the block and alive at once (allocator-free).
    With ``breakdown``, ``at_peak`` counts the bytes alive at the peak by the operator and shape
    that made them. Storages FSDP frees and refills in place (``resize_``) are not seen."""

    def __init__(self, breakdown: bool = False):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        counter = self

        def pointers(tensors) -> set:
            seen = set()
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    try:
                        seen.add(t.untyped_storage().data_ptr())
                    except RuntimeError:  # a storage resized to nothing (FSDP's unsharded parameters)
                        pass
            return seen

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = pointers(tree_leaves((args, kwargs)))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and pointers([t]):
                        counter._add(t.untyped_storage(), inputs, f"{func.__name__} {tuple(t.shape)}")
                return out

        self.mode, self.live, self.peak, self._tracked = Mode(), 0, 0, {}
        self.breakdown, self.at_peak = breakdown, collections.Counter()

    def _add(self, storage, inputs, what: str = "") -> None:
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in self._tracked or ptr in inputs:
            return
        self._tracked[ptr] = (what, nbytes)
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
            if self.breakdown:
                self.at_peak = collections.Counter()
                for name, n in self._tracked.values():
                    self.at_peak[name] += n
        weakref.finalize(storage, self._free, ptr, nbytes)

    def _free(self, ptr: int, nbytes: int) -> None:
        self._tracked.pop(ptr, None)
        self.live -= nbytes

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


# ---------------------------------------------------------------------------
# Worker: one (method, depth, allocator) per process
# ---------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def reset_peak_rss() -> tuple[int, bool]:
    """(resident bytes now, whether the high-water mark could be reset to it)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb("VmRSS") * 1024, True
    except OSError:
        return 0, False


def peak_rss() -> int:
    try:
        return _status_kb("VmHWM") * 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(spec: dict) -> dict:
    with extra("bench"):
        import eae_runtime  # noqa: F401
    import torch

    import eae_func  # noqa: F401  (every process imports the same modules)

    torch.set_num_threads(spec["threads"])
    global BLOCK
    device, BLOCK = spec["device"], spec["block"]
    cuda = device.startswith("cuda")
    # Load every method's code once on a tiny model, in every process: first use of
    # checkpointing, torch.func or eae-runtime imports hundreds of modules (tens of MB),
    # a one-time cost that is not a step's memory.
    for method in ("baseline", *METHODS):
        tiny = build(1, 1, 8, device, seed=99)
        make_step(method, *tiny)()
    del tiny
    gc.collect()
    blocks, x, target = build(spec["depth"], spec["batch"], spec["seq"], device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if spec["method"] == "interleaved":
        return interleaved_times(spec, blocks, x, target, sync)
    step = make_step(spec["method"], blocks, x, target)
    if cuda:
        sync()
        setup_alloc = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    setup_rss, was_reset = reset_peak_rss() if not cuda else (0, True)

    times, loss, gnorm = [], None, None
    for k in range(spec["warmup"] + spec["steps"]):
        start = time.perf_counter()
        loss, grads = step()
        sync()
        elapsed = time.perf_counter() - start
        if k >= spec["warmup"]:
            times.append(elapsed)
        if k == 0:
            gnorm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        del grads  # the previous step's gradients are not alive during the next step
    result = {
        "peak_bytes": (torch.cuda.max_memory_allocated() - setup_alloc) if cuda else peak_rss() - setup_rss,
        "setup_bytes": setup_rss,
        "reset": was_reset,
        "times": times,
        "loss": float(loss),
        "grad_norm": gnorm,
    }
    if spec.get("live"):
        with LiveBytes() as lb:
            out = step()
        del out
        result["live_bytes"] = lb.peak
    return result


def interleaved_times(spec: dict, blocks: list, x, target, sync) -> dict:
    """Seconds per step of every method, their steps taken in turn on the same model."""
    steps = {m: make_step(m, blocks, x, target) for m in spec["methods"]}
    times = {m: [] for m in steps}
    for k in range(spec["warmup"] + spec["steps"]):
        for m, step in steps.items():
            start = time.perf_counter()
            out = step()
            sync()
            elapsed = time.perf_counter() - start
            del out
            if k >= spec["warmup"]:
                times[m].append(elapsed)
    return {"times": times}


# ---------------------------------------------------------------------------
# Parent: correctness check, floor, scheduling, tables
# ---------------------------------------------------------------------------


def check_gradients(threads: int) -> str:
    """Max abs difference of eae_func's and eae-runtime's gradients from autograd's, small size."""
    import torch

    torch.set_num_threads(threads)
    blocks, x, target = build(depth=3, batch=2, seq=32, device="cpu", seed=123)
    ref_loss, ref = make_step("autograd", blocks, x, target)()
    ref = [g.clone() for g in ref]
    scale = max(float(g.abs().max()) for g in ref)
    parts = []
    for method in ("eae-runtime", "eae_func"):
        loss, grads = make_step(method, blocks, x, target)()
        diff = max(float((g - r).abs().max()) for g, r in zip(grads, ref))
        parts.append(
            f"{method}: max |grad - autograd| = {diff:.2e} (max |grad| {scale:.2e}), "
            f"|loss diff| = {abs(float(loss) - float(ref_loss)):.1e}"
        )
    return "; ".join(parts)


def eae_floor(depth: int, batch: int, seq: int, threads: int) -> dict:
    """Bytes of the EAE sweep's floor (see the module docstring), and the graph-free forward's transient."""
    import torch

    torch.set_num_threads(threads)
    blocks, x, target = build(1, batch, seq, "cpu")
    block = blocks[0]
    G = sum(p.numel() * p.element_size() for p in block.parameters())
    A = x.numel() * x.element_size()
    excluded = {p.untyped_storage().data_ptr() for p in block.parameters()}
    h = x.clone().requires_grad_(True)
    excluded.add(h.untyped_storage().data_ptr())
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in excluded:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(h)
    T = sum(saved.values())
    del out
    two, x2, target2 = build(2, batch, seq, "cpu")
    forward = make_step("baseline", two, x2, target2)
    with LiveBytes() as lb:
        forward()
    forward_transient = lb.peak  # the graph-free forward's transient: a block's internals + its input
    floor = max((depth - i + 1) * G + (i - 1) * A + T + 2 * A for i in range(1, depth + 1))
    return {"G": G, "A": A, "T": T, "floor": floor, "forward_transient": forward_transient}


def run_worker(spec: dict, env_extra: dict, drop: tuple = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker {spec} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, file=sys.stderr, leave=False)


def fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=None, help="numbers of blocks (default 6 12 24)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per process (default 5)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per process (default 2)")
    parser.add_argument("--batch", type=int, default=None, help="default 8")
    parser.add_argument("--seq", type=int, default=None, help="default 256")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=usable_cores(), help="torch.set_num_threads in every process")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument(
        "--block",
        default="eae_func",
        choices=("eae_func", "eae-runtime"),
        help="the stacked block: eae_func.models.Block (default) or eae_runtime.contrib.PreNormTransformerBlock",
    )
    parser.add_argument("--no-live", action="store_true", help="skip the dispatch-mode live-bytes step")
    parser.add_argument("--save", help="also write the raw per-process results to this JSON file")
    parser.add_argument("--load", help="print the tables from a file written by --save (runs nothing)")
    parser.add_argument("--quick", action="store_true", help="smoke run: depths 2 4, batch 2, seq 64, 2 steps")
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = dict(depths=[2, 4], steps=2, warmup=1, batch=2, seq=64)
    full = dict(depths=[6, 12, 24], steps=5, warmup=2, batch=8, seq=256)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None) -> None:
    global BLOCK
    args = parse_args(argv)
    BLOCK = args.block
    if args._worker:
        print(json.dumps(worker(json.loads(args._worker))))
        return

    import torch

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: torch.cuda.is_available() is False")
    allocators = {"cuda": {}} if cuda else {"mmap": MMAP_ENV, "default": {}}
    methods = ["baseline", *args.methods]

    print("# EAE memory/time benchmark\n")
    print(
        f"torch {torch.__version__}, device {args.device}, {args.threads} threads, "
        f"{'Block' if BLOCK == 'eae_func' else 'PreNormTransformerBlock'}(dim={DIM}, heads={HEADS}/{KV_HEADS}, "
        f"ffn={FFN}), batch {args.batch}, seq {args.seq}, fp32, "
        f"{args.warmup} warm-up + {args.steps} timed steps per process\n"
    )
    t0 = time.perf_counter()
    if not args.load:
        print(f"Gradient check (3 blocks, batch 2, seq 32): {check_gradients(args.threads)}\n", flush=True)

    time_alloc = "cuda" if cuda else "default"
    jobs = [(d, m, a) for d in args.depths for a in allocators for m in methods]
    jobs += [(d, "interleaved", time_alloc) for d in args.depths]
    if args.load:
        with open(args.load) as f:
            results = {(d, m, a): r for d, m, a, r in json.load(f)}
        jobs = []
    bar = progress(len(jobs)) if jobs else None
    if not args.load:
        results: dict = {}
    for depth, method, alloc in jobs:
        spec = dict(
            method=method,
            methods=args.methods,
            depth=depth,
            batch=args.batch,
            seq=args.seq,
            device=args.device,
            threads=args.threads,
            steps=args.steps,
            warmup=args.warmup,
            block=args.block,
            live=(alloc != "mmap" and method not in ("baseline", "interleaved") and not args.no_live),
        )
        drop = () if alloc == "mmap" else tuple(MMAP_ENV)
        label = f"depth {depth} {method:<11} {alloc:<7}"
        if bar is None:
            print(f"  running {label}", file=sys.stderr, flush=True)
        else:
            bar.set_description(label)
        results[depth, method, alloc] = run_worker(spec, allocators[alloc], drop)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    if args.save:
        with open(args.save, "w") as f:
            json.dump([[d, m, a, r] for (d, m, a), r in results.items()], f)

    summary = []
    for depth in args.depths:
        mem_alloc = "cuda" if cuda else "mmap"
        base = {a: results[depth, "baseline", a]["peak_bytes"] for a in allocators}
        above = {(m, a): results[depth, m, a]["peak_bytes"] - base[a] for m in args.methods for a in allocators}
        step_s = {m: statistics.median(results[depth, "interleaved", time_alloc]["times"][m]) for m in args.methods}
        own_s = {m: statistics.median(results[depth, m, time_alloc]["times"]) for m in args.methods}
        live = {m: results[depth, m, time_alloc].get("live_bytes") for m in args.methods}
        ref_m, ref_s = above.get(("eae-runtime", mem_alloc)), step_s.get("eae-runtime")
        auto_m, auto_s = above.get(("autograd", mem_alloc)), step_s.get("autograd")

        print(f"## depth {depth}\n")
        if cuda:
            print(
                "| method | peak MB above baseline (cuda max_memory_allocated) | live MB "
                "| median step s (interleaved) | median step s (own process) "
                "| peak / eae-runtime | peak / autograd | step / eae-runtime | step / autograd |"
            )
            print("|---|---|---|---|---|---|---|---|---|")
        else:
            print(
                "| method | peak MB above baseline (mmap threshold) | peak MB above baseline (default allocator) "
                "| live MB | median step s (interleaved) | median step s (own process) | peak / eae-runtime "
                "| peak / autograd | step / eae-runtime | step / autograd |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|")
        for m in args.methods:
            cells = [m, f"{above[m, mem_alloc] / MB:.1f}"]
            if not cuda:
                cells.append(f"{above[m, 'default'] / MB:.1f}")
            cells += [
                f"{live[m] / MB:.1f}" if live[m] is not None else "-",
                f"{step_s[m]:.3f}",
                f"{own_s[m]:.3f}",
                fmt_ratio(above[m, mem_alloc], ref_m or 0),
                fmt_ratio(above[m, mem_alloc], auto_m or 0),
                fmt_ratio(step_s[m], ref_s or 0),
                fmt_ratio(step_s[m], auto_s or 0),
            ]
            print("| " + " | ".join(cells) + " |")
        print()
        base_line = ", ".join(
            f"{a}: {base[a] / MB:.1f} MB above its {results[depth, 'baseline', a]['setup_bytes'] / MB:.0f} MB after setup"
            for a in allocators
        )
        if not all(r.get("reset", True) for r in results.values()):
            print(
                "WARNING: could not reset the RSS high-water mark (/proc/self/clear_refs); "
                "peaks include import transients and may be meaningless."
            )
        print(
            f"Forward-only baseline peak: {base_line}; baseline forward "
            f"{statistics.median(results[depth, 'baseline', time_alloc]['times']):.3f} s."
        )
        sanity = ", ".join(
            f"{m} {results[depth, m, time_alloc]['loss']:.6f}/{results[depth, m, time_alloc]['grad_norm']:.6f}"
            for m in args.methods
        )
        print(f"Loss / grad norm (first step): {sanity}.")
        inter = results[depth, "interleaved", time_alloc]["times"]
        spread = ", ".join(
            f"{m} {min(inter[m]):.3f}-{max(inter[m]):.3f} "
            f"(own process {min(results[depth, m, time_alloc]['times']):.3f}-"
            f"{max(results[depth, m, time_alloc]['times']):.3f})"
            for m in args.methods
        )
        print(f"Step time range, interleaved (s): {spread}.")

        if "eae_func" in args.methods and not cuda and live.get("eae_func"):
            fl = eae_floor(depth, args.batch, args.seq, args.threads)
            comparable = fl["floor"] - fl["forward_transient"]
            measured = above["eae_func", "mmap"]
            print(
                f"EAE floor: L*G + T + 2A = {fl['floor'] / MB:.1f} MB (G {fl['G'] / MB:.2f} MB grads/block, "
                f"T {fl['T'] / MB:.2f} MB tape/block, A {fl['A'] / MB:.2f} MB/boundary); "
                f"eae_func live {live['eae_func'] / MB:.1f} MB = {live['eae_func'] / fl['floor']:.2f}x floor; "
                f"above baseline the floor is {comparable / MB:.1f} MB (minus the no-grad forward's "
                f"{fl['forward_transient'] / MB:.1f} MB transient), eae_func's mmap peak "
                f"{measured / MB:.1f} MB = {fmt_ratio(measured, comparable)} it."
            )
        if {"eae_func", "eae-runtime", "autograd", "checkpoint"} <= set(args.methods):
            ef_m, ck_m = above["eae_func", mem_alloc], above["checkpoint", mem_alloc]
            checks = [
                (f"peak <= 0.9x eae-runtime ({fmt_ratio(ef_m, ref_m)})", ef_m <= 0.9 * ref_m),
                (f"peak < checkpoint ({ef_m / MB:.1f} vs {ck_m / MB:.1f} MB)", ef_m < ck_m),
                (
                    f"step <= 1.05x eae-runtime ({fmt_ratio(step_s['eae_func'], ref_s)})",
                    step_s["eae_func"] <= 1.05 * ref_s,
                ),
                (
                    f"step <= 1.4x autograd ({fmt_ratio(step_s['eae_func'], auto_s)})",
                    step_s["eae_func"] <= 1.4 * auto_s,
                ),
            ]
            line = "; ".join(f"{'MET' if ok else 'MISSED'} {text}" for text, ok in checks)
            print(f"\n**Targets, depth {depth}:** {line}")
            summary.append((depth, all(ok for _, ok in checks), line))
        print()

    if summary:
        print("## Summary\n")
        for depth, ok, line in summary:
            print(f"- depth {depth}: {'all targets met' if ok else 'not all targets met'} — {line}")
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
