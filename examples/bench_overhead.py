"""Per-stage fixed cost: a sweep over tiny stages against plain autograd and checkpointing.

Stages of ``Linear(16, 16) + Tanh`` on a batch of 4, one thread, so almost no arithmetic: what
is left is each method's Python and dispatch cost per stage. One step is forward + gradients of
``mean(x_L^2)``:

    autograd     loss.backward() through the whole model
    checkpoint   torch.utils.checkpoint.checkpoint(stage, h, use_reentrant=False) per stage
    eae_func     ef.value_and_grad(chain, params, x) (and with compose(int8, clip_by_global_norm));
                 ef.sweep with its defaults (per-stage timers, the costates kept in the trace)
    run-time cuts  ef.value_and_grad(model, dict(model.named_parameters()), x, loss=..., split_at=["*"])
    ef.enable    the model enabled (split_at=["*"]), then loss.backward()
    eae-runtime  eae_runtime 0.1.1's EAERuntime(model, None, RuntimeConfig(memory="none",
                 enable_profiler=False)).compute_gradients(x, loss): the peer's leanest engine

The methods alternate step by step (interleaved), and the table gives the median microseconds
per stage over ``--reps`` rounds. Then tokens/s of a training forward + gradient step of
``examples/train_lm.py``'s model (4 blocks of width 128, sequence 64, batch 8) for the same
three methods, and a cProfile summary of where eae_func's and checkpoint's time goes (``--profile``:
also eae_func's top functions by own time, cProfile's own listing).

    python examples/bench_overhead.py            # 8 and 32 stages, 30 rounds
    python examples/bench_overhead.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import eae_func as ef
from eae_func import passes as P
from eae_func.models import lm_loss, transformer_lm

from extras import extra


def tiny(depth: int) -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(depth)]), torch.randn(4, 16)


def methods(model: nn.Module, x: torch.Tensor, loss_fn, *loss_args, peers: bool = False) -> dict:
    """One gradient step per method, as a function of nothing (``peers``: also run-time cuts, the
    switch and eae-runtime, for a ``Sequential`` whose children are the stages)."""
    chain, params = ef.from_module(model, loss=loss_fn)
    passes = ef.compose(P.int8(), P.clip_by_global_norm(1.0))
    more = {}
    if peers:
        with extra("bench"):
            from eae_runtime import EAERuntime, RuntimeConfig

        runtime = EAERuntime(model, None, RuntimeConfig(memory="none", enable_profiler=False))
        enabled = copy.deepcopy(model)
        ef.enable(enabled, split_at=["*"])
        named = dict(model.named_parameters())

        def switched():
            enabled.zero_grad(set_to_none=True)
            loss_fn(enabled(x), *loss_args).backward()

        more = {
            "run-time cuts": lambda: ef.value_and_grad(model, named, x, *loss_args, loss=loss_fn, split_at=["*"]),
            "ef.enable": switched,
            "eae-runtime": lambda: runtime.compute_gradients(x, lambda out: loss_fn(out, *loss_args)),
        }

    def autograd():
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), *loss_args).backward()

    def checkpointed():
        model.zero_grad(set_to_none=True)
        h = x
        for stage in model:
            h = checkpoint(stage, h, use_reentrant=False)
        loss_fn(h, *loss_args).backward()

    return {
        "autograd": autograd,
        "checkpoint": checkpointed,
        "eae_func": lambda: ef.value_and_grad(chain, params, x, *loss_args),
        "ef.sweep (timers, kept costates)": lambda: ef.sweep(chain, params, x, *loss_args),
        "eae_func + int8, clip": lambda: ef.value_and_grad(chain, params, x, *loss_args, passes=passes),
        **more,
    }


def interleaved(steps: dict, reps: int) -> dict:
    """Median seconds per step of each method, the methods alternating round by round."""
    for step in steps.values():
        step()
    times: dict = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


CATEGORIES = (  # (name, test on cProfile's (file, line, function) key), first match wins
    ("autograd engine (backward kernels)", lambda f, fn: "run_backward" in fn),
    ("torch ops (forward kernels, dispatch)", lambda f, fn: f == "~" and "torch" in fn),
    ("nn.Module calls", lambda f, fn: "torch/nn/" in f),
    ("torch.autograd python", lambda f, fn: "torch/autograd" in f),
    ("torch.utils.checkpoint", lambda f, fn: "torch/utils/checkpoint" in f),
    ("optree", lambda f, fn: "optree" in f or "optree" in fn),
    ("eae_func", lambda f, fn: "eae_func" in f),
    ("other", lambda f, fn: True),
)


def profile(step, rounds: int) -> tuple[dict, str]:
    """cProfile of ``rounds`` steps: (own seconds per step summed per category, the top functions)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(rounds):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    totals = dict.fromkeys((name for name, _ in CATEGORIES), 0.0)
    for (file, _, fn), (_, _, own, _, _) in stats.stats.items():
        totals[next(name for name, test in CATEGORIES if test(file, fn))] += own / rounds
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(12)
    return totals, out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="smoke run: depth 4, 3 rounds, a small LM")
    parser.add_argument("--profile", action="store_true", help="also print eae_func's top functions under cProfile")
    args = parser.parse_args()
    if args.quick:
        args.depths, args.reps = [4], 3
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, median of {args.reps} interleaved rounds\n")
    print("| stages | method | us / stage | vs autograd | vs checkpoint |")
    print("|---|---|---|---|---|")
    for depth in args.depths:
        model, x = tiny(depth)
        med = interleaved(methods(model, x, lambda out: out.square().mean(), peers=True), args.reps)
        for name, t in med.items():
            print(
                f"| {depth} | {name} | {t / depth * 1e6:.0f} | {t / med['autograd']:.2f}x | "
                f"{t / med['checkpoint']:.2f}x |"
            )

    torch.manual_seed(0)
    width, depth, seq, batch = (32, 2, 16, 2) if args.quick else (128, 4, 64, 8)
    lm = transformer_lm(256, width, depth, n_heads=4, n_kv_heads=2)
    ids = torch.randint(0, 256, (batch, seq + 1))
    steps = methods(lm, ids[:, :-1], lm_loss, ids[:, 1:])
    steps.pop("eae_func + int8, clip")
    steps.pop("ef.sweep (timers, kept costates)")
    med = interleaved(steps, args.reps)
    print(f"\n| method | tokens/s ({depth} blocks, width {width}, seq {seq}, batch {batch}) | vs checkpoint |")
    print("|---|---|---|")
    for name, t in med.items():
        print(f"| {name} | {batch * seq / t:,.0f} | {med['checkpoint'] / t:.2f}x |")

    depth = args.depths[-1]
    model, x = tiny(depth)
    steps = methods(model, x, lambda out: out.square().mean())
    rounds = 3 if args.quick else 10
    (ours, top), (theirs, _) = profile(steps["eae_func"], rounds), profile(steps["checkpoint"], rounds)
    print(
        f"\nWhere the time goes ({depth} tiny stages; cProfile's own time in us per stage, which inflates "
        f"Python calls):\n"
    )
    print("| own time in | eae_func | checkpoint |\n|---|---|---|")
    for name in ours:
        print(f"| {name} | {ours[name] / depth * 1e6:.0f} | {theirs[name] / depth * 1e6:.0f} |")
    print(f"| all | {sum(ours.values()) / depth * 1e6:.0f} | {sum(theirs.values()) / depth * 1e6:.0f} |")
    if args.profile:
        print(f"\neae_func's top functions by own time:\n{top}")


if __name__ == "__main__":
    main()
