"""The Hugging Face zoo: every causal, masked and sequence-to-sequence LM type that transformers
builds from a tiny config, cut at run time at its repeated layers, against plain autograd.

For each model type of transformers' auto mappings (``MODEL_FOR_CAUSAL_LM``, ``MODEL_FOR_MASKED_LM``,
``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM``): its config with common size fields shrunk (2 layers, width 32,
4 heads, vocab 99), float64, train mode (dropout on), random ids (2 x 8) as ``input_ids`` and
``labels``. Plain autograd runs ``model(**inputs).loss.backward()``; eae_func runs
``ef.sweep(model, dict(model.named_parameters()), inputs, loss=lambda out: out.loss,
split_at=layers_of(model))``, both after ``torch.manual_seed(1)``. Each type lands in one row:

    exact     every gradient within 1e-12 of autograd's, relative to its largest entry
    close     within 1e-6 (the note says why)
    refused   eae_func raised an error naming what it cannot run
    wrong     further off: a silent wrong answer
    no cut    no stage ran (nothing cut: no memory saved)
    skipped   the model itself does not build or run a training step in plain PyTorch at this size

    python examples/hf_zoo.py                  # every type, the table and the counts
    python examples/hf_zoo.py --types gpt2 t5  # some of them
    python examples/hf_zoo.py --stop-every-tail

``--stop-every-tail`` counts every layer's tail worth an early stop (``early_stop.WORTH = 0``;
these layers are far below it) and runs each sweep twice after the same seed: the first learns
the tails in full, the second skips their kernels; the row is the worse of the two, and the
last line counts the kernels skipped.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import sys
import time
import warnings

from extras import extra

TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=99,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    n_embd=32,
    n_layer=2,
    n_head=4,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    d_ff=64,
    d_kv=8,
    ffn_dim=64,
    head_dim=8,
    embedding_size=32,
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    max_position_embeddings=64,
    n_positions=64,
    first_k_dense_replace=1,
)
IDS = (2, 8)
MAX_PARAMS = 5_000_000


def mappings():
    with extra("hf"):
        from transformers.models.auto import modeling_auto as MA

    table = {}
    for mapping, causal in (
        (MA.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, True),
        (MA.MODEL_FOR_MASKED_LM_MAPPING_NAMES, False),
        (MA.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, False),
    ):
        for kind, cls in mapping.items():
            table.setdefault(kind, (cls, causal))
    return table


def build(kind: str, class_name: str, causal: bool):
    import torch

    with extra("hf"):
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[kind]()
    present = config.to_dict()
    for key, value in TINY.items():
        if key in present and isinstance(present[key], int):
            setattr(config, key, value)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id"):
        if isinstance(present.get(key), int):
            setattr(config, key, 0)
    if getattr(config, "is_encoder_decoder", False):
        config.decoder_start_token_id = 0
    if causal:
        config.is_decoder = True  # what the LM-head classes of encoders (BERT, Reformer) ask for
    if hasattr(config, "use_cache"):
        config.use_cache = False
    config._experts_implementation = "eager"  # MoE experts: the default grouped_mm kernel has no float64
    cls = getattr(transformers, class_name)
    with torch.device("meta"):  # sized first: a config whose sizes have other names stays large
        size = sum(p.numel() for p in cls(config).parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"{size / 1e6:.0f}M parameters at the shrunk config (sizes under other names)")
    torch.manual_seed(0)
    return cls(config).double().train()


def inputs_of(model):
    import torch

    ids = torch.randint(1, 99, IDS, generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids.clone()}


def seed(n: int) -> None:
    """torch's, Python's and numpy's generators (BigBird draws its random attention blocks from numpy)."""
    import random

    import numpy as np
    import torch

    torch.manual_seed(n)
    random.seed(n)
    np.random.seed(n)


def relative(grads, reference) -> float:
    """The largest difference from autograd's gradients, relative to each tensor's largest entry, or
    to 1e-6 of the model's largest where that is smaller (a gradient that is zero in exact arithmetic,
    as a key projection's bias is under softmax, holds only rounding noise)."""
    largest = max((r.abs().max().item() for r in reference.values() if r is not None and r.numel()), default=1.0)
    worst = 0.0
    for name, ref in reference.items():
        got = grads.get(name)
        if ref is None and got is None:
            continue
        if (ref is None) != (got is None):
            return math.inf
        if ref.numel():
            scale = max(ref.abs().max().item(), 1e-6 * largest)
            worst = max(worst, (got - ref).abs().max().item() / scale)
    return worst


def check(kind: str, class_name: str, causal: bool, sweeps: int = 1) -> tuple[str, str]:
    import torch

    import eae_func as ef
    from eae_func.integrations.transformers import layers_of

    try:
        model = build(kind, class_name, causal)
        inputs = inputs_of(model)
        with torch.no_grad():  # a model may change itself on its first call (BigBird: full attention when short)
            model(**inputs)
        seed(1)
        model(**inputs).loss.backward()
        reference = {n: p.grad for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    except Exception as e:  # the model, not eae_func
        return "skipped", f"{type(e).__name__}: {str(e)[:80]}"
    try:
        split_at = layers_of(model)
        params = dict(model.named_parameters())
        results = []
        for _ in range(sweeps):
            seed(1)
            results.append(
                ef.sweep(model, params, inputs, loss=lambda out: out.loss, split_at=split_at, keep_costates=False)
            )
    except Exception as e:
        return "refused", f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    res = results[-1]
    if not res.adjoints:
        return "no cut", ", ".join(split_at)
    err = max(relative(r.grads, reference) for r in results)
    stages = f"{len(res.adjoints)} stages at {', '.join(split_at)}"
    if err <= 1e-12:
        return "exact", stages
    if err <= 1e-6:
        return "close", f"{err:.1e}; {stages}"
    return "wrong", f"{err:.1e}; {stages}"


@contextlib.contextmanager
def every_tail_stopped(skipped: list):
    """``eae_func.early_stop`` counting every tail worth stopping, each skipped kernel's output
    appended to ``skipped``, its learned kinds apart; all put back afterwards."""
    from eae_func import early_stop as ES

    before = ES.WORTH, ES.allocated, ES._KINDS
    allocated = ES.allocated
    ES.WORTH, ES.allocated, ES._KINDS = 0, lambda *a: skipped.append(a) or allocated(*a), {}
    try:
        yield
    finally:
        ES.WORTH, ES.allocated, ES._KINDS = before


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", help="model types (default: all)")
    parser.add_argument("--stop-every-tail", action="store_true", help="every tail stopped early, on a second sweep")
    args = parser.parse_args(argv)
    import torch

    with extra("hf"):
        import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    table = mappings()
    kinds = args.types or sorted(table)
    rows, counts, skipped = [], collections.Counter(), []
    start = time.perf_counter()
    with every_tail_stopped(skipped) if args.stop_every_tail else contextlib.nullcontext():
        for kind in kinds:
            class_name, causal = table[kind]
            outcome, note = check(kind, class_name, causal, 2 if args.stop_every_tail else 1)
            counts[outcome] += 1
            rows.append((kind, class_name, outcome, note))
            print(f"| {kind} | {class_name} | {outcome} | {note} |", flush=True)
    print(f"\n{dict(counts)} of {len(kinds)} types in {time.perf_counter() - start:.0f} s")
    if args.stop_every_tail:
        print(f"{len(skipped)} kernels skipped by early stops")
    return {kind: outcome for kind, _, outcome, _ in rows}


if __name__ == "__main__":
    outcomes = main()
    sys.exit(1 if any(o in ("wrong", "no cut") for o in outcomes.values()) else 0)
