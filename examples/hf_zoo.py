"""The Hugging Face zoo: every causal, masked and sequence-to-sequence LM type that transformers
builds from a tiny config, and (``--families``) the other families with repeated layers, cut at
run time at those layers, against plain autograd.

For each model type of transformers' auto mappings (``MODEL_FOR_CAUSAL_LM``, ``MODEL_FOR_MASKED_LM``,
``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM``): its config with common size fields shrunk (2 layers, width 32,
4 heads, vocab 99), float64, train mode (dropout on), random ids (2 x 8) as ``input_ids`` and
``labels``. Plain autograd runs ``model(**inputs).loss.backward()``; eae_func runs
``ef.sweep(model, dict(model.named_parameters()), inputs, loss=lambda out: out.loss,
split_at=layers_of(model))``, both after ``torch.manual_seed(1)``.

``--families`` (``FAMILIES``): vision (ViT, DeiT, BEiT, DINOv2, Swin, Swin-v2, PVT, PVT-v2, SegFormer,
FocalNet, ConvNeXt), audio (Whisper, Wav2Vec2, HuBERT, WavLM, Data2Vec-audio, AST), multimodal (CLIP,
SigLIP), MoE LMs (Mixtral, Qwen2-MoE, OLMoE) and XLM at its feed-forwards, each from a tiny config
(width <= 32, 2 layers or stages, 32 x 32 images, 400 audio samples), float64, train mode, on
pixel_values / input_values / input_features and decoder ids / pixel_values and ids / ids; the loss
sums the mean square of every floating tensor of the output; ``split_at`` is the family's repeated
layers (and, as rows ``... stages``, the stages whose layers return the feature map's height and
width beside it). Each row lands in one of:

    exact     every gradient within 1e-12 of autograd's, relative to its largest entry
    close     within 1e-6 (the note says why)
    refused   eae_func raised an error naming what it cannot run
    failing   an error raised inside the model (or torch) while eae_func ran it
    wrong     further off: a silent wrong answer
    no cut    no stage ran (nothing cut: no memory saved)
    skipped   the model itself does not build or run a training step in plain PyTorch at this size

    python examples/hf_zoo.py                  # every type, the table and the counts
    python examples/hf_zoo.py --types gpt2 t5  # some of them
    python examples/hf_zoo.py --stop-every-tail
    python examples/hf_zoo.py --families       # the other families' table

``--stop-every-tail`` counts every layer's tail worth an early stop (``early_stop.WORTH = 0``;
these layers are far below it) and runs each sweep twice after the same seed: the first learns
the tails in full, the second skips their kernels; the row is the worse of the two, and the
last line counts the kernels skipped.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
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
    emb_dim=32,
    n_layers=2,
    n_heads=4,
)
IDS = (2, 8)
MAX_PARAMS = 5_000_000

VIT = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8
)
SWIN = dict(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4)
PVT = dict(
    image_size=32,
    num_encoder_blocks=2,
    depths=[2, 2],
    hidden_sizes=[16, 32],
    patch_sizes=[4, 2],
    strides=[4, 2],
    num_attention_heads=[1, 2],
    mlp_ratios=[2, 2],
)
CONVNEXT = dict(num_stages=2, hidden_sizes=[16, 32], depths=[2, 2], image_size=32)
FOCALNET = dict(image_size=32, patch_size=4, embed_dim=16, hidden_sizes=[16, 32], depths=[2, 2], focal_levels=[2, 2])
SPEECH = dict(  # wav2vec2 and its kin: two conv feature layers (stride 8), 2 x 400 samples -> 2 x 48 frames
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    conv_dim=[16, 16],
    conv_stride=[4, 2],
    conv_kernel=[8, 4],
    num_feat_extract_layers=2,
    num_conv_pos_embeddings=8,
    num_conv_pos_embedding_groups=2,
    vocab_size=32,
)
TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
TOWERS = dict(  # CLIP-like: a text and a vision tower
    text_config=dict(TEXT, max_position_embeddings=16),
    vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    ),
)
ENCODER_DECODER = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    vocab_size=99,
    use_cache=False,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
    decoder_start_token_id=0,
)
MOE = dict(
    TEXT,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    use_cache=False,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
# label: model type, class, config fields, inputs, split_at (each family's repeated layers; a stage's
# modules where its layers return the feature map's height and width beside it)
FAMILIES = {
    "vit": ("vit", "ViTForImageClassification", VIT, "pixels", ["vit.layers.*"]),
    "deit": ("deit", "DeiTForImageClassification", VIT, "pixels", ["deit.layers.*"]),
    "beit": ("beit", "BeitForImageClassification", VIT, "pixels", ["beit.layers.*"]),
    "dinov2": ("dinov2", "Dinov2Model", VIT, "pixels", ["encoder.layer.*"]),
    "swin": ("swin", "SwinForImageClassification", SWIN, "pixels", ["swin.encoder.layers.*.blocks.*"]),
    "swinv2": ("swinv2", "Swinv2ForImageClassification", SWIN, "pixels", ["swinv2.encoder.layers.*.blocks.*"]),
    "swinv2 stages": ("swinv2", "Swinv2ForImageClassification", SWIN, "pixels", ["swinv2.encoder.layers.*"]),
    "pvt": (
        "pvt",
        "PvtForImageClassification",
        dict(PVT, sequence_reduction_ratios=[2, 1]),
        "pixels",
        ["pvt.encoder.patch_embeddings.*", "pvt.encoder.block.*.*"],
    ),
    "pvt_v2": (
        "pvt_v2",
        "PvtV2ForImageClassification",
        dict(PVT, sr_ratios=[2, 1], patch_sizes=[7, 3]),
        "pixels",
        ["pvt_v2.encoder.layers.*.blocks.*"],
    ),
    "segformer": (
        "segformer",
        "SegformerForImageClassification",
        dict(PVT, sr_ratios=[2, 1], patch_sizes=[7, 3]),
        "pixels",
        ["segformer.stages.*.blocks.*"],
    ),
    "focalnet": (
        "focalnet",
        "FocalNetForImageClassification",
        FOCALNET,
        "pixels",
        ["focalnet.encoder.stages.*.layers.*"],
    ),
    "focalnet stages": (
        "focalnet",
        "FocalNetForImageClassification",
        FOCALNET,
        "pixels",
        ["focalnet.encoder.stages.*"],
    ),
    "convnext": (
        "convnext",
        "ConvNextForImageClassification",
        CONVNEXT,
        "pixels",
        ["convnext.encoder.stages.*.layers.*"],
    ),
    "convnextv2": (
        "convnextv2",
        "ConvNextV2ForImageClassification",
        CONVNEXT,
        "pixels",
        ["convnextv2.encoder.stages.*.layers.*"],
    ),
    "whisper": (
        "whisper",
        "WhisperForConditionalGeneration",
        dict(ENCODER_DECODER, num_mel_bins=8, max_source_positions=16, max_target_positions=16),
        "features",
        ["model.encoder.layers.*", "model.decoder.layers.*"],
    ),
    "wav2vec2": ("wav2vec2", "Wav2Vec2ForCTC", SPEECH, "audio", ["wav2vec2.encoder.layers.*"]),
    "hubert": ("hubert", "HubertForCTC", SPEECH, "audio", ["hubert.encoder.layers.*"]),
    "wavlm": ("wavlm", "WavLMForCTC", SPEECH, "audio", ["wavlm.encoder.layers.*"]),
    "data2vec-audio": ("data2vec-audio", "Data2VecAudioForCTC", SPEECH, "audio", ["data2vec_audio.encoder.layers.*"]),
    "audio-spectrogram-transformer": (
        "audio-spectrogram-transformer",
        "ASTForAudioClassification",
        dict(VIT, max_length=32, num_mel_bins=16, frequency_stride=8, time_stride=8),
        "spectrogram",
        ["audio_spectrogram_transformer.layers.*"],
    ),
    "clip": (
        "clip",
        "CLIPModel",
        TOWERS,
        "pixels+ids",
        ["text_model.encoder.layers.*", "vision_model.encoder.layers.*"],
    ),
    "siglip": (
        "siglip",
        "SiglipModel",
        TOWERS,
        "pixels+ids",
        ["text_model.encoder.layers.*", "vision_model.encoder.layers.*"],
    ),
    # XLM's layers are parallel lists, its attentions passed a cache it makes even with use_cache=False
    "xlm ffns": (
        "xlm",
        "XLMWithLMHeadModel",
        dict(emb_dim=32, n_layers=2, n_heads=4, vocab_size=99, pad_token_id=0, bos_token_id=0, eos_token_id=0),
        "ids",
        ["transformer.layer_norm1.*", "transformer.ffns.*", "transformer.layer_norm2.*"],
    ),
    "mixtral": ("mixtral", "MixtralForCausalLM", MOE, "ids", ["model.layers.*"]),
    "qwen2_moe": (
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        dict(MOE, shared_expert_intermediate_size=32),
        "ids",
        ["model.layers.*"],
    ),
    "olmoe": ("olmoe", "OlmoeForCausalLM", MOE, "ids", ["model.layers.*"]),
}


def family_case(kind: str, class_name: str, fields: dict, given: str) -> tuple:
    """A family's model (config from ``fields``, float64, train mode), its inputs and the loss: the mean
    square of every floating tensor of the output, summed (logits, embeddings, hidden states)."""
    import torch
    import torch.utils._pytree as pytree

    with extra("hf"):
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[kind](**fields)
    config._experts_implementation = "eager"  # MoE experts: the default grouped_mm kernel has no float64
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config).double().train()
    draw = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 99, IDS, generator=draw)
    pixels = torch.randn(2, 3, 32, 32, generator=draw, dtype=torch.float64)
    inputs = {
        "pixels": lambda: {"pixel_values": pixels},
        "audio": lambda: {"input_values": torch.randn(2, 400, generator=draw, dtype=torch.float64)},
        "features": lambda: {
            "input_features": torch.randn(
                2, config.num_mel_bins, 2 * config.max_source_positions, generator=draw, dtype=torch.float64
            ),
            "decoder_input_ids": ids,
        },
        "spectrogram": lambda: {
            "input_values": torch.randn(2, config.max_length, config.num_mel_bins, generator=draw, dtype=torch.float64)
        },
        "pixels+ids": lambda: {"pixel_values": pixels, "input_ids": ids},
        "ids": lambda: {"input_ids": ids, "labels": ids},
    }[given]()

    def loss(out):
        return sum(
            (t**2).mean() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
        )

    return model, inputs, loss


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


def lm_case(kind: str, class_name: str, causal: bool) -> tuple:
    """An LM type's model, inputs (ids as labels too) and loss (the model's own)."""
    model = build(kind, class_name, causal)
    return model, inputs_of(model), lambda out: out.loss


def check(case, split_at=None, sweeps: int = 1, recompute=True) -> tuple[str, str]:
    """The row of the model, inputs and loss ``case()`` gives, cut at ``split_at`` (default: ``layers_of``),
    with the remat policy ``recompute``."""
    import torch

    import eae_func as ef
    from eae_func.integrations.transformers import layers_of

    try:
        model, inputs, loss = case()
        with torch.no_grad():  # a model may change itself on its first call (BigBird: full attention when short)
            model(**inputs)
        seed(1)
        loss(model(**inputs)).backward()
        reference = {n: p.grad for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    except Exception as e:  # the model, not eae_func
        return "skipped", f"{type(e).__name__}: {str(e)[:80]}"
    try:
        split_at = split_at or layers_of(model)
        params = dict(model.named_parameters())
        results = []
        for _ in range(sweeps):
            seed(1)
            results.append(
                ef.sweep(model, params, inputs, loss=loss, split_at=split_at, keep_costates=False, recompute=recompute)
            )
    except Exception as e:
        return refused_or_failing(e)
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


def refused_or_failing(e: Exception) -> tuple[str, str]:
    """``refused`` where eae_func raised the error itself, ``failing`` where it came from inside the model
    (or torch) while eae_func ran it."""
    import traceback

    import eae_func

    package = eae_func.__file__.rsplit("/", 1)[0]
    frames = traceback.extract_tb(e.__traceback__)
    outcome = "refused" if frames and frames[-1].filename.startswith(package) else "failing"
    return outcome, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


@contextlib.contextmanager
def every_tail_stopped(skipped: list):
    """``eae_func.core.early_stop`` counting every tail worth stopping, each skipped kernel's output
    appended to ``skipped``, its learned kinds apart; all put back afterwards."""
    from eae_func.core import early_stop as ES

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
    parser.add_argument("--families", action="store_true", help="the table of other families (vision, audio, ...)")
    parser.add_argument("--stop-every-tail", action="store_true", help="every tail stopped early, on a second sweep")
    parser.add_argument(
        "--recompute",
        choices=("rebuild", "keep", "save"),
        default="rebuild",
        help="every cut rebuilt (default), every cut's graph kept from the forward, or remat.save's matmuls kept",
    )
    args = parser.parse_args(argv)
    import torch

    with extra("hf"):
        import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    sweeps = 2 if args.stop_every_tail else 1
    from eae_func import remat

    recompute = {"rebuild": True, "keep": False, "save": remat.save()}[args.recompute]
    if args.families:
        cases = {
            label: (cls, functools.partial(family_case, kind, cls, fields, given), split_at)
            for label, (kind, cls, fields, given, split_at) in FAMILIES.items()
        }
    else:
        cases = {
            kind: (cls, functools.partial(lm_case, kind, cls, causal), None)
            for kind, (cls, causal) in mappings().items()
        }
    kinds = args.types or sorted(cases)
    rows, counts, skipped = [], collections.Counter(), []
    start = time.perf_counter()
    with every_tail_stopped(skipped) if args.stop_every_tail else contextlib.nullcontext():
        for kind in kinds:
            class_name, case, split_at = cases[kind]
            outcome, note = check(case, split_at, sweeps, recompute)
            counts[outcome] += 1
            rows.append((kind, class_name, outcome, note))
            print(f"| {kind} | {class_name} | {outcome} | {note} |", flush=True)
    print(f"\n{dict(counts)} of {len(kinds)} types in {time.perf_counter() - start:.0f} s")
    if args.stop_every_tail:
        print(f"{len(skipped)} kernels skipped by early stops")
    return {kind: outcome for kind, _, outcome, _ in rows}


if __name__ == "__main__":
    outcomes = main()
    sys.exit(1 if any(o in ("wrong", "no cut", "failing") for o in outcomes.values()) else 0)
