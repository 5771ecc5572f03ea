"""The Hugging Face zoo (``examples/hf_zoo.py``): every causal, masked and sequence-to-sequence LM type
transformers builds from a tiny float64 config, and the other families with repeated layers (vision,
audio, multimodal, MoE), cut at run time at their repeated layers, against plain autograd. None
silently wrong, none left uncut, none failing inside the model, and at least 120 LM types bit-exact
(1e-12 relative), both in full and with every layer's rebuild stopped early (each sweep run twice:
the first learns the tails, the second skips their kernels)."""

import collections
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hf_zoo  # noqa: E402


def test_every_hugging_face_lm_type_is_exact_or_refused_never_silently_wrong(capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        outcomes = hf_zoo.main(["--stop-every-tail"])
    finally:
        torch.set_num_threads(threads)
    table = capsys.readouterr().out
    counts = collections.Counter(outcomes.values())
    assert counts["wrong"] == counts["no cut"] == counts["failing"] == 0, table
    assert counts["exact"] >= 120, (counts, table)
    assert all(outcomes[kind] == "exact" for kind in ("mixtral", "qwen2_moe", "olmoe", "switch_transformers")), table
    assert outcomes["xlm"] == "refused", table  # its attentions are passed the cache it always makes
    assert int(table.strip().splitlines()[-1].split()[0]) > 500, table  # kernels skipped


def test_every_other_family_with_repeated_layers_is_exact(capsys):
    """Vision (ViT, Swin-v2, PVT, FocalNet, ConvNeXt, ...), audio (Whisper, Wav2Vec2, ...), multimodal
    (CLIP, SigLIP), MoE LMs and XLM at its feed-forwards, at their layers and, where the layers return
    the feature map's height and width beside it, at their stages: every one exact, in full and with
    every tail stopped early."""
    import torch

    threads = torch.get_num_threads()
    try:
        outcomes = hf_zoo.main(["--families", "--stop-every-tail"])
    finally:
        torch.set_num_threads(threads)
    table = capsys.readouterr().out
    assert set(outcomes) == set(hf_zoo.FAMILIES)
    assert all(outcome == "exact" for outcome in outcomes.values()), table


# the types remat.save broke before the forward ran its ops as the rebuild does (matmul's kernels, MoE
# routing's clones) and before a write into a kept output through an unversioned alias was seen
# (Nystromformer's ``context += conv(v)`` into matmul's ``_unsafe_view`` of bmm: 6.8e-2 silently)
HARD = ["nystromformer", "funnel", "llama4_text", "longt5", "mixtral", "doge", "convbert", "longformer", "mamba"]


@pytest.mark.parametrize("recompute", ["keep", "save"])
def test_kept_graphs_and_kept_matmuls_are_exact_where_they_once_failed(capsys, recompute):
    """``recompute=False`` (every cut's graph kept from the forward) and ``remat.save()`` (the matrix
    products' outputs kept for the rebuild) on the types that broke ``remat.save``: every one exact."""
    import torch

    threads = torch.get_num_threads()
    try:
        outcomes = hf_zoo.main(["--recompute", recompute, "--types", *HARD, "gpt2", "llama"])
    finally:
        torch.set_num_threads(threads)
    table = capsys.readouterr().out
    assert all(outcome == "exact" for outcome in outcomes.values()), table


@pytest.mark.parametrize("kind", ["llama", "t5", "qwen2", "funnel", "convbert"])
def test_remat_save_on_a_captured_chain_is_exact(kind):
    """``remat.save()`` on the chain graph capture makes of a Hugging Face model: the stage's forward runs
    its ops as the rebuild does (was: refused mid-backward, "aten.view ... not found in storage", as the
    forward ran without the rebuild's grads and the replay covered the boundary's own views)."""
    import eae_func as ef
    from eae_func import remat
    from eae_func.integrations.transformers import layers_of

    cls, causal = hf_zoo.mappings()[kind]
    model, inputs, loss = hf_zoo.lm_case(kind, cls, causal)
    params, split_at = dict(model.named_parameters()), layers_of(model)
    hf_zoo.seed(1)
    want = ef.sweep(model, params, inputs, loss=loss, split_at=split_at).grads
    hf_zoo.seed(1)
    got = ef.sweep(model, params, inputs, loss=loss, split_at=split_at, capture="graph", recompute=remat.save()).grads
    assert hf_zoo.relative(got, want) <= 1e-12
