"""Peak memory and step time of one gradient step of a Hugging Face GPT-2: autograd,
HF activation checkpointing and eae_func.

Workload: ``GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=256, n_head=8, vocab_size=256,
n_positions=256, use_cache=False))``, built from the config (no download), seed 0, fp32,
train mode with the config's default dropout (0.1), random token ids of shape
(batch 8, seq 256). A step is forward + parameter gradients (no optimizer) of the
next-token loss ``cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())``:

    autograd      loss(model(ids, use_cache=False), ids).backward()
    hf-checkpoint model.gradient_checkpointing_enable(), then the same
    eae_func      eae_func.value_and_grad(model, dict(model.named_parameters()), ids, ids,
                  loss=loss, split_at=["transformer.h.*"])   (``grad`` plus the loss; the
                  model's forward runs as written, each decoder layer's call cut at run time)

Each method runs in its own fresh subprocess (this script with ``--_worker METHOD``), one
after the other, with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc serves every tensor above
64 KiB with its own mmap and unmaps it when freed, so the resident set follows live
memory) and ``torch.set_num_threads(--threads)``. The worker builds the model and input,
notes its resident set, and resets the kernel's high-water mark to it (``5`` to
/proc/self/clear_refs; where that fails, ``ru_maxrss`` is used and the figures include
import transients). It then runs 1 warm-up step and ``--steps`` timed steps, the global
RNG seeded with ``torch.manual_seed(step)`` before each, so every method draws the same
dropout masks. "peak MB above setup" is the high-water mark over the timed steps minus
the resident set after setup; "warm-up peak" is the same for the warm-up step alone
(for eae_func it includes each layer's first rebuild, which learns its early stop). Step time
is the median of the timed steps.
Every worker reports the loss and global gradient norm of its first timed step; the
three methods should agree to about 1e-5 relative.

    python examples/bench_hf.py               # 12 layers, batch 8, seq 256, 3 timed steps
    python examples/bench_hf.py --quick       # smoke run: 2 layers, batch 2, seq 32, 1 step

``--regimes`` compares eae_func (run-time cuts at every decoder layer) with HF gradient
checkpointing side by side in one process, on GPT-2 and Llama, full fine-tunes and LoRA
(``peft``, rank 8 on the attention projections, the base frozen), in two regimes: width 256,
6 layers, seq 128, batch 4 (compute-bound on a CPU) and width 16, 12 layers, seq 8, batch 2
(per-call host work dominates, as it does for every step on a GPU). The methods alternate
step by step (``--rounds`` rounds, each step after ``torch.manual_seed(round)``); the table
gives median step times, their ratio, and each method's peak of live tensor bytes in one
more step (a ``TorchDispatchMode`` counter, ``bench_memory.LiveBytes``: allocator-free,
exact), then a cProfile of eae_func's small-width GPT-2 step.

    python examples/bench_hf.py --regimes     # 8 cells x 2 methods, 21 rounds (pip install -e ".[hf,bench]")

``--keep-heap`` runs ``--regimes`` with glibc keeping the memory it frees mapped
(``peak_rss.keep_heap``: trim threshold 1 GiB, mmap threshold 32 MiB), for both methods alike, so
no step faults in pages an earlier step gave back. ``--no-early-stop`` runs HF checkpointing without
its early stop (``torch.utils.checkpoint.set_checkpoint_early_stop(False)``): its recompute then runs
each layer to its end, as eae_func's rebuild does, where by default it stops at the layer's last
saved tensor and skips the matrix product after it (Llama's ``down_proj``).

``--loops`` runs ``bench_loops.py``: ``ef.enable`` against HF checkpointing inside a plain loop,
Accelerate, Lightning and DDP.

``--capture-check`` times what a graph capture (``capture="graph"``) checks on every call to
know the model is unchanged since it was captured, on the small-width 12-layer GPT-2: the full
``watch.fingerprint`` walk and the ``watch.Watch`` identity pass that replaces it.

    python examples/bench_hf.py --capture-check
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time

from extras import extra

METHODS = ("autograd", "hf-checkpoint", "eae_func")
MB = 2**20
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def loss_fn(out, ids):
    import torch.nn.functional as F

    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def reset_peak() -> bool:
    """Reset the resident-set high-water mark to the current resident set, if the kernel allows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss(reset: bool) -> int:
    return _status_kb("VmHWM") * 1024 if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(spec: dict) -> dict:
    import torch

    with extra("hf"):
        import transformers

    import eae_func

    torch.set_num_threads(spec["threads"])
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=spec["layers"], n_embd=256, n_head=8, vocab_size=256, n_positions=256, use_cache=False
    )
    model = transformers.GPT2LMHeadModel(config).train()
    params = dict(model.named_parameters())
    ids = torch.randint(0, config.vocab_size, (spec["batch"], spec["seq"]), generator=torch.Generator().manual_seed(1))
    method = spec["method"]
    if method == "hf-checkpoint":
        model.gradient_checkpointing_enable()

    def step():
        if method == "eae_func":
            loss, grads = eae_func.value_and_grad(model, params, ids, ids, loss=loss_fn, split_at=["transformer.h.*"])
            return loss.detach(), list(grads.values())
        for p in params.values():
            p.grad = None
        loss = loss_fn(model(ids, use_cache=False), ids)
        loss.backward()
        return loss.detach(), [p.grad for p in params.values()]

    setup_rss = _status_kb("VmRSS") * 1024
    reset = reset_peak()
    times, loss, gnorm, warm_peak = [], None, None, 0
    for k in range(1 + spec["steps"]):
        torch.manual_seed(k)
        start = time.perf_counter()
        out_loss, grads = step()
        elapsed = time.perf_counter() - start
        if k == 0:
            warm_peak = peak_rss(reset)
            del grads
            reset = reset and reset_peak()
            continue
        times.append(elapsed)
        if k == 1:
            loss = float(out_loss)
            gnorm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads if g is not None])))
        del grads  # the previous step's gradients are not alive during the next step
    for p in params.values():
        p.grad = None
    return {
        "peak_bytes": peak_rss(reset) - setup_rss,
        "warm_bytes": warm_peak - setup_rss,
        "setup_bytes": setup_rss,
        "reset": reset,
        "times": times,
        "loss": loss,
        "grad_norm": gnorm,
    }


def run_worker(spec: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(spec)],
        env={**os.environ, **MMAP_ENV},
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-3000:] or f"exit status {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt_ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


REGIMES = {"compute": dict(width=256, layers=6, seq=128, batch=4), "host": dict(width=16, layers=12, seq=8, batch=2)}


def build(family: str, tune: str, width: int, layers: int):
    """``(model, split_at)``: a tiny random GPT-2 or Llama, all of it trained or LoRA on a frozen base."""
    with extra("hf"):
        import transformers

    torch_seed(0)
    heads = 4
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=heads, vocab_size=256, n_positions=256, use_cache=False
        )
        model, split_at, targets = transformers.GPT2LMHeadModel(config), ["transformer.h.*"], ["c_attn"]
    else:
        config = transformers.LlamaConfig(
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads // 2,
            vocab_size=256,
            use_cache=False,
        )
        model, split_at, targets = transformers.LlamaForCausalLM(config), ["model.layers.*"], ["q_proj", "v_proj"]
    if tune == "lora":
        with extra("bench"):
            import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets))
        split_at = [f"base_model.model.{p}" for p in split_at]
    return model.train(), split_at


def torch_seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def regimes(args: argparse.Namespace) -> None:
    """The side-by-side table of ``--regimes`` (see the module docstring)."""
    import cProfile
    import pstats

    import torch

    with extra("hf"):
        import transformers

    import eae_func

    from bench_memory import LiveBytes

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    if args.keep_heap:
        from peak_rss import keep_heap

        keep_heap()
    print("# Hugging Face models: eae_func's run-time cuts against HF gradient checkpointing\n")
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, cpu, {args.threads} threads, "
        f"{args.rounds} interleaved rounds, fp32, train mode"
        f"{', glibc keeping freed memory mapped' if args.keep_heap else ''}"
        f"{', HF checkpointing without early stop' if args.no_early_stop else ''}\n"
    )
    print(
        "| model | regime | fine-tune | HF checkpointing ms | eae_func ms | step ratio | live MB HF ckpt | live MB eae_func | peak ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    profiled = None
    for family in ("gpt2", "llama"):
        for regime, size in REGIMES.items():
            for tune in ("full", "lora"):
                model, split_at = build(family, tune, size["width"], size["layers"])
                ids = torch.randint(0, 256, (size["batch"], size["seq"]), generator=torch.Generator().manual_seed(1))
                params = dict(model.named_parameters())
                trained = [p for p in params.values() if p.requires_grad]

                def checkpointed(model=model, ids=ids, trained=trained):
                    model.activation_checkpointing_enable()  # transformers' name for gradient_checkpointing_enable
                    try:
                        loss_fn(model(input_ids=ids, use_cache=False), ids).backward()
                    finally:
                        model.activation_checkpointing_disable()
                    for p in trained:
                        p.grad = None

                def eae(model=model, ids=ids, params=params, split_at=split_at):
                    eae_func.value_and_grad(model, params, {"input_ids": ids}, ids, loss=loss_fn, split_at=split_at)

                methods = {"hf": checkpointed, "eae": eae}
                times: dict[str, list[float]] = {m: [] for m in methods}
                for r in range(args.rounds + 2):
                    for m, step in methods.items():
                        torch.manual_seed(r)
                        start = time.perf_counter()
                        step()
                        if r >= 2:  # two warm-up rounds
                            times[m].append(time.perf_counter() - start)
                peaks = {}
                for m, step in methods.items():
                    with LiveBytes() as live:
                        step()
                    peaks[m] = live.peak
                med = {m: statistics.median(t) for m, t in times.items()}
                print(
                    f"| {family} | {regime} | {tune} | {med['hf'] * 1e3:.1f} | {med['eae'] * 1e3:.1f} "
                    f"| {med['eae'] / med['hf']:.2f}x | {peaks['hf'] / MB:.2f} | {peaks['eae'] / MB:.2f} "
                    f"| {peaks['eae'] / peaks['hf']:.2f}x |",
                    flush=True,
                )
                if family == "gpt2" and regime == "host" and tune == "full":
                    profiled = eae
    if profiled is not None:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(50):
            profiled()
        profile.disable()
        print("\neae_func's small-width GPT-2 step, cProfile, 50 steps, by own time:\n\n```")
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(12)
        print("```")


def capture_check(args: argparse.Namespace) -> None:
    """What a graph capture's staleness check costs per call (``--capture-check``)."""
    import torch

    with extra("hf"):
        import transformers

    from eae_func.program import watch

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    size = REGIMES["host"]
    print(f"# The graph capture's staleness check, GPT-2 {size['layers']} layers, width {size['width']}\n")
    print("| check | per call ms (median of 200) |\n|---|---|")
    model, _ = build("gpt2", "full", size["width"], size["layers"])
    watcher = watch.Watch(model)
    for name, check in (
        ("watch.fingerprint (a full walk)", lambda: watch.fingerprint(model)),
        ("watch.Watch.current (identity pass)", watcher.current),
    ):
        times = []
        for _ in range(200):
            start = time.perf_counter()
            check()
            times.append(time.perf_counter() - start)
        print(f"| {name} | {statistics.median(times) * 1e3:.3f} |")
    assert watcher.current() is watcher


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=None, help="GPT-2 decoder layers (default 12)")
    parser.add_argument("--batch", type=int, default=None, help="default 8")
    parser.add_argument("--seq", type=int, default=None, help="default 256 (at most 256, n_positions)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per process (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every process")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 layers, batch 2, seq 32, 1 timed step")
    parser.add_argument("--regimes", action="store_true", help="the side-by-side table against HF checkpointing")
    parser.add_argument("--rounds", type=int, default=21, help="--regimes: interleaved rounds")
    parser.add_argument(
        "--keep-heap", action="store_true", help="--regimes: glibc keeps freed memory mapped (no page faults)"
    )
    parser.add_argument(
        "--no-early-stop", action="store_true", help="--regimes: HF checkpointing recomputes each layer to its end"
    )
    parser.add_argument("--capture-check", action="store_true", help="what the graph capture's staleness check costs")
    parser.add_argument("--loops", action="store_true", help="ef.enable in training loops (bench_loops.py)")
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = dict(layers=2, batch=2, seq=32, steps=1) if args.quick else dict(layers=12, batch=8, seq=256, steps=3)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args._worker:
        print(json.dumps(worker(json.loads(args._worker))))
        return
    if args.regimes:
        from torch.utils.checkpoint import set_checkpoint_early_stop

        with set_checkpoint_early_stop(not args.no_early_stop):
            regimes(args)
        return
    if args.capture_check:
        capture_check(args)
        return
    if args.loops:
        import bench_loops

        bench_loops.main(bench_loops.parse_args(["--quick"] if args.quick else []))
        return
    import torch

    with extra("hf"):
        import transformers

    print("# Hugging Face GPT-2: one gradient step\n")
    print(
        f"Command: `{shlex.join([os.path.basename(sys.executable), *(sys.argv if argv is None else ['bench_hf.py', *argv])])}`\n"
    )
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, cpu, {args.threads} threads; "
        f"GPT-2 {args.layers} layers, n_embd 256, 8 heads, vocab 256, batch {args.batch}, seq {args.seq}, fp32, "
        f"train mode (dropout 0.1); 1 warm-up + {args.steps} timed steps per process, "
        f"MALLOC_MMAP_THRESHOLD_=65536\n",
        flush=True,
    )
    t0 = time.perf_counter()
    results = {}
    for m in args.methods:
        print(f"  running {m}", file=sys.stderr, flush=True)
        spec = dict(
            method=m, layers=args.layers, batch=args.batch, seq=args.seq, steps=args.steps, threads=args.threads
        )
        results[m] = run_worker(spec)
    ok = {m: r for m, r in results.items() if "error" not in r}
    ref = ok.get("autograd")
    ref_mem, ref_s = (ref["peak_bytes"], statistics.median(ref["times"])) if ref else (None, None)
    print(
        "| method | peak MB above setup | warm-up peak MB above setup | median step s | peak / autograd "
        "| step / autograd |"
    )
    print("|---|---|---|---|---|---|")
    for m, r in results.items():
        if "error" in r:
            print(f"| {m} | failed | failed | failed | - | - |")
            continue
        med = statistics.median(r["times"])
        print(
            f"| {m} | {r['peak_bytes'] / MB:.1f} | {r['warm_bytes'] / MB:.1f} | {med:.3f} "
            f"| {fmt_ratio(r['peak_bytes'], ref_mem)} | {fmt_ratio(med, ref_s)} |"
        )
    print()
    for m, r in ok.items():
        rel = (
            (
                f" (rel. diff vs autograd: loss {abs(r['loss'] - ref['loss']) / abs(ref['loss']):.1e}, "
                f"grad norm {abs(r['grad_norm'] - ref['grad_norm']) / ref['grad_norm']:.1e})"
            )
            if ref and m != "autograd"
            else ""
        )
        print(
            f"{m}: loss {r['loss']:.7f}, grad norm {r['grad_norm']:.7f}{rel}; "
            f"step times {', '.join(f'{t:.3f}' for t in r['times'])} s; RSS after setup {r['setup_bytes'] / MB:.0f} MB"
        )
    if not all(r["reset"] for r in ok.values()):
        print(
            "WARNING: could not reset the RSS high-water mark (/proc/self/clear_refs): peaks are ru_maxrss "
            "and include import transients."
        )
    for m, r in results.items():
        if "error" in r:
            print(f"\n{m} FAILED:\n```\n{r['error']}\n```")
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if len(ok) < len(results):
        sys.exit(1)


if __name__ == "__main__":
    main()
