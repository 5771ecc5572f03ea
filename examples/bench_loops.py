"""Step time of ``ef.enable`` inside the training loops people run, against Hugging Face gradient
checkpointing in the same loop.

Workload: two copies of one random GPT-2 (``GPT2Config(n_layer=4, n_embd=128, n_head=4,
vocab_size=256)``, seed 0, fp32, train mode, dropout 0.1), batch 4 x 64 tokens, AdamW (lr 1e-4):
one with ``model.activation_checkpointing_enable({"use_reentrant": False})`` (transformers' new name
for ``gradient_checkpointing_enable``),
one with ``ef.enable(model, split_at=["transformer.h.*"])``. Each loop is written once and run on
both, a step of one, then a step of the other (interleaved rounds, the RNG seeded alike), and the
table gives the median step time of each and their ratio:

    plain        loss.backward(); opt.step(); opt.zero_grad()
    accelerate   accelerate.Accelerator(gradient_accumulation_steps=2): accelerator.backward(loss)
                 in accelerator.accumulate(model); a step is 2 micro-batches
    lightning    Lightning's automatic optimization (Trainer.fit, gradient_clip_val=1.0): the two
                 models' fits alternate, the steps timed by a callback (its first step left out)
    ddp          DistributedDataParallel over 2 gloo ranks on 127.0.0.1, each rank 1 thread

    python examples/bench_loops.py                 # 9 rounds
    python examples/bench_loops.py --quick         # smoke run: 2 layers, width 32, 2 rounds
    python examples/bench_hf.py --loops            # the same
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

from extras import extra

LOOPS = ("plain", "accelerate", "lightning", "ddp")


def models(args: argparse.Namespace) -> dict:
    """``{"hf": checkpointed GPT-2, "eae": enabled GPT-2}``, the same weights."""
    import torch

    import eae_func as ef

    with extra("hf"):
        import transformers

    transformers.logging.set_verbosity_error()
    made = {}
    for method in ("hf", "eae"):
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=256, n_positions=256, use_cache=False
        )
        model = transformers.GPT2LMHeadModel(config).train()
        if method == "hf":
            model.activation_checkpointing_enable({"use_reentrant": False})  # gradient_checkpointing_enable
        else:
            ef.enable(model, split_at=["transformer.h.*"])
        made[method] = model
    return made


def batches(args: argparse.Namespace, n: int, seed: int = 0) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (args.batch, args.seq), generator=g) for _ in range(n)]


def interleaved(steps: dict, rounds: int) -> dict:
    """Median seconds of each of ``steps`` (``{name: step(r)}``), alternating, after one warm-up round."""
    import torch

    times: dict = {m: [] for m in steps}
    for r in range(rounds + 1):
        for m, step in steps.items():
            torch.manual_seed(r)
            start = time.perf_counter()
            step(r)
            if r:
                times[m].append(time.perf_counter() - start)
    return {m: statistics.median(t) for m, t in times.items()}


def plain(args: argparse.Namespace, wrap=lambda model: model, seed: int = 0) -> dict:
    """``loss.backward()``, ``opt.step()``, ``opt.zero_grad()`` on each model as ``wrap`` wraps it."""
    import torch

    made, data = models(args), batches(args, args.rounds + 1, seed)

    def loop(model):
        run, opt = wrap(model), torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(r):
            run(input_ids=data[r], labels=data[r]).loss.backward()
            opt.step()
            opt.zero_grad()

        return step

    return interleaved({m: loop(model) for m, model in made.items()}, args.rounds)


def accelerate(args: argparse.Namespace) -> dict:
    import torch

    with extra("hf"):
        from accelerate import Accelerator

    made, data = models(args), batches(args, 2 * (args.rounds + 1))

    def loop(model):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

        def step(r):
            for ids in data[2 * r : 2 * r + 2]:
                with accelerator.accumulate(model):
                    accelerator.backward(model(input_ids=ids, labels=ids).loss)
                    opt.step()
                    opt.zero_grad()

        return step

    return interleaved({m: loop(model) for m, model in made.items()}, args.rounds)


def lightning(args: argparse.Namespace) -> dict:
    import torch

    with extra("lightning"):
        import lightning.pytorch as pl

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # its tips and device lines

    class LM(pl.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, ids, batch_idx):
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Timed(pl.Callback):
        def __init__(self):
            self.times: list[float] = []

        def on_train_batch_start(self, *a):
            self.start = time.perf_counter()

        def on_train_batch_end(self, *a):
            self.times.append(time.perf_counter() - self.start)

    made = models(args)
    modules = {m: LM(model) for m, model in made.items()}
    times: dict = {m: [] for m in made}
    steps = 3
    for r in range(max(1, args.rounds // steps)):
        for m, module in modules.items():
            timed = Timed()
            trainer = pl.Trainer(
                accelerator="cpu", max_steps=steps + 1, gradient_clip_val=1.0, callbacks=[timed], logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
            torch.manual_seed(r)
            trainer.fit(module, torch.utils.data.DataLoader(batches(args, steps + 1, seed=r), batch_size=None))
            times[m] += timed.times[1:]
    return {m: statistics.median(t) for m, t in times.items()}


def ddp_rank(args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    warnings.filterwarnings("ignore")
    return plain(args, DistributedDataParallel, seed=dist.get_rank())


def ddp(args: argparse.Namespace) -> dict:
    import eae_func.distributed as D

    return D.run(ddp_rank, 2, args, timeout=1800, pg_timeout=600)[0]


def main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # transformers' and Lightning's deprecation notes
    print(
        f"# ef.enable in the loops people run, against HF gradient checkpointing in the same loop\n\n"
        f"GPT-2 {args.layers} layers, width {args.width}, batch {args.batch} x {args.seq}, AdamW, fp32, "
        f"{args.threads} thread(s), {args.rounds} interleaved rounds, torch {torch.__version__}\n"
    )
    print("| loop | HF checkpointing ms / step | ef.enable ms / step | ratio |\n|---|---|---|---|")
    for name in args.loops:
        med = globals()[name](args)
        print(
            f"| {name} | {med['hf'] * 1e3:.1f} | {med['eae'] * 1e3:.1f} | {med['eae'] / med['hf']:.2f}x |", flush=True
        )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (each DDP rank uses 1)")
    parser.add_argument("--loops", nargs="+", default=list(LOOPS), choices=LOOPS)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 layers, width 32, 2 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.seq, args.rounds = 2, 32, 16, 3
    return args


if __name__ == "__main__":
    main(parse_args())
