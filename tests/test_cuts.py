"""Run-time cuts (``eae_func.drivers.cuts``): a model's forward runs as written and each call of a module
matched by ``split_at`` is one stage. What graph capture got silently wrong or refused is exact here:
custom autograd Functions, hooks whose behaviour changes between calls, a module called twice,
data-dependent control flow (Hugging Face MoE models in float64); the live peak is checkpointing's."""

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import eae_func as ef
from eae_func import passes as P

from helpers import TiedInside
from live_bytes import LiveBytes

F64 = torch.float64


def autograd_grads(model, x, y, loss=F.mse_loss, seed=1):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    value = loss(model(x), y)
    value.backward()
    return value.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_exact(grads, reference, rel=1e-12):
    assert set(grads) == set(reference)
    for name, g in reference.items():
        if g is None:
            assert grads[name] is None, name
            continue
        scale = g.abs().max().item() or 1.0
        assert (grads[name] - g).abs().max().item() <= rel * scale, name


class Stack(nn.Module):
    """An embedding, residual blocks called in the order ``calls`` (a block may be called twice), a head."""

    def __init__(self, width=6, blocks=3, calls=(0, 1, 2), inner=None):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(inner() if inner else nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, 3)
        self.calls = calls

    def forward(self, x):
        h = self.embed(x)
        for i in self.calls:
            h = h + torch.tanh(self.blocks[i](h))
        return self.head(h)


def sweep_and_autograd(model, x, y, **options):
    params = dict(model.named_parameters())
    torch.manual_seed(1)
    res = ef.sweep(model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"], **options)
    loss, reference = autograd_grads(model, x, y)
    return res, loss, reference


@settings(max_examples=20, deadline=None)
@given(
    calls=st.lists(st.integers(0, 2), min_size=1, max_size=5),
    width=st.integers(1, 5),
    rows=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_gradients_equal_autograds_for_any_order_of_calls(calls, width, rows, seed):
    """Any sequence of block calls (blocks repeated, skipped): loss and gradients equal autograd's, and
    the trace has one record per call, last first, a repeated call named ``path#k``."""
    torch.manual_seed(seed)
    model = Stack(width, 3, tuple(calls)).double()
    x, y = torch.randn(rows, 4, dtype=F64), torch.randn(rows, 3, dtype=F64)
    res, loss, reference = sweep_and_autograd(model, x, y)
    torch.testing.assert_close(res.loss, loss, rtol=1e-13, atol=0)
    assert_exact(res.grads, reference)
    seen: dict[int, int] = {}
    names = []
    for i in calls:
        seen[i] = seen.get(i, 0) + 1
        names.append(f"blocks.{i}" if seen[i] == 1 else f"blocks.{i}#{seen[i]}")
    assert [a.stage for a in res.adjoints] == names[::-1]
    assert [a.index for a in res.adjoints] == list(range(len(calls), 0, -1))


class StraightThrough(torch.autograd.Function):
    """round() forward, identity backward: a quantisation-aware layer."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class ScaleGradient(torch.autograd.Function):
    """Identity forward, gradient times 0.3 backward (gradient reversal / scaling layers)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return 0.3 * g


class WithFunction(nn.Module):
    def __init__(self, fn, width=6):
        super().__init__()
        self.linear, self.fn = nn.Linear(width, width), fn

    def forward(self, h):
        return self.fn.apply(self.linear(h))


@pytest.mark.parametrize("fn", [StraightThrough, ScaleGradient], ids=lambda f: f.__name__)
def test_a_custom_autograd_function_inside_a_cut_keeps_its_own_backward(fn):
    torch.manual_seed(0)
    model = Stack(inner=lambda: WithFunction(fn)).double()
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)
    res, _, reference = sweep_and_autograd(model, x, y)
    assert_exact(res.grads, reference)


def test_a_forward_hook_is_honoured_at_every_call_as_its_flag_changes():
    torch.manual_seed(0)
    model = Stack().double()
    flag = {"scale": 1.0}
    model.blocks[1].register_forward_hook(lambda m, args, out: out * flag["scale"])
    model.blocks[0].register_forward_pre_hook(lambda m, args: (args[0] * (2 - flag["scale"]),))
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)
    for scale in (1.0, 0.25, 3.0):
        flag["scale"] = scale
        res, _, reference = sweep_and_autograd(model, x, y)
        assert_exact(res.grads, reference)


def test_a_module_called_twice_is_two_stages_with_summed_gradients():
    torch.manual_seed(0)
    shared = nn.Linear(6, 6)
    model = nn.Sequential(nn.Linear(4, 6), shared, nn.Tanh(), shared, nn.Linear(6, 3)).double()
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)
    params = dict(model.named_parameters())  # the shared layer once, as "1.*"
    res = ef.sweep(model, params, x, y, loss=F.mse_loss, split_at=["1"])
    _, reference = autograd_grads(model, x, y)
    assert [a.stage for a in res.adjoints] == ["1#2", "1"]
    assert_exact(res.grads, reference)


def test_dropout_is_replayed_and_buffers_are_returned_not_written():
    torch.manual_seed(0)
    model = Stack(inner=lambda: nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.BatchNorm1d(6))).double().train()
    before = copy.deepcopy(model)
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)
    res, _, reference = sweep_and_autograd(model, x, y)
    assert_exact(res.grads, reference)
    for name, b in before.named_buffers():
        # the sweep's statistics are those the autograd step wrote into the model (updated once)
        assert torch.equal(res.buffers[name], model.get_buffer(name)), name
        assert not torch.equal(b, model.get_buffer(name)) or "num_batches" in name


def test_passes_see_every_cut_costate_and_their_state_is_threaded():
    torch.manual_seed(0)
    model = Stack().double()
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)
    params = dict(model.named_parameters())
    clipped = ef.sweep(model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"], passes=P.clip_by_global_norm(1e-3))
    assert all(a.value.norm().item() <= 1e-3 * (1 + 1e-9) for a in clipped.adjoints)
    assert all(a.history == ("clip",) and a.meta["clipped"] for a in clipped.adjoints)
    counted = ef.compose(P.error_feedback(P.int8()))
    first = ef.sweep(model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"], passes=counted)
    second = ef.sweep(
        model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"], passes=counted, pass_state=first.pass_state
    )
    assert first.pass_state is not None and second.pass_state is not None
    again = ef.sweep(model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"], passes=counted)
    assert all(torch.equal(a.value, b.value) for a, b in zip(first.adjoints, again.adjoints))  # a value, nothing hidden


def test_a_frozen_parameter_gets_no_gradient():
    torch.manual_seed(0)
    model = Stack().double()
    model.blocks[1].weight.requires_grad_(False)
    model.embed.bias.requires_grad_(False)
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)
    res, _, reference = sweep_and_autograd(model, x, y)
    assert res.grads["blocks.1.weight"] is None and res.grads["embed.bias"] is None
    assert_exact(res.grads, reference)


def test_options_a_chain_implements_fall_back_to_the_graph_and_agree():
    torch.manual_seed(0)
    model = Stack().double()
    x, y = torch.randn(6, 4, dtype=F64), torch.randn(6, 3, dtype=F64)
    params = dict(model.named_parameters())
    run = ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"])
    pieces = ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"], microbatches=2)
    assert_exact(pieces, run, rel=1e-10)


def test_what_cannot_be_cut_is_refused():
    model = Stack().double()
    x, y = torch.randn(2, 4, dtype=F64), torch.randn(2, 3, dtype=F64)
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"no module matched by \['blocks'\].*ran as a stage.*a container"):
        ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["blocks"])  # a ModuleList is never called
    with pytest.raises(ValueError, match=r"split_at: no module of Stack matches"):
        ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["decoder.*"])
    with pytest.raises(ValueError, match=r"not parameters of Stack"):
        ef.grad(model, {"embed.wieght": params["embed.weight"]}, x, y, loss=F.mse_loss, split_at=["blocks.*"])
    with pytest.raises(ValueError, match=r"capture must be 'run', 'graph' or None"):
        ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"], capture="export")
    assert all(p.grad is None for p in model.parameters())  # nothing half-done


def test_the_live_peak_is_checkpointings():
    """Cut at every block, the sweep holds at most what torch.utils.checkpoint around every block holds."""
    torch.manual_seed(0)
    width, rows = 64, 512
    model = Stack(
        width, 6, tuple(range(6)), inner=lambda: nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    )
    x, y = torch.randn(rows, 4), torch.randn(rows, 3)
    params = dict(model.named_parameters())

    def checkpointed():
        h = model.embed(x)
        for block in model.blocks:
            h = h + torch.tanh(checkpoint(block, h, use_reentrant=False))
        F.mse_loss(model.head(h), y).backward()
        model.zero_grad(set_to_none=True)

    checkpointed()
    with LiveBytes() as reference:
        checkpointed()
    with LiveBytes() as cut:
        ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"])
    assert cut.peak <= reference.peak + 4096 and reference.peak > 4 * rows * width * 4


transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
MOE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def hugging_face(kind):
    E = dict(experts_implementation="eager")  # the default grouped_mm kernel has no float64 in eager PyTorch either
    configs = {
        "mixtral": lambda: transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**MOE, vocab_size=64, num_local_experts=4, num_experts_per_tok=2, **E)
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **MOE, moe_intermediate_size=32, vocab_size=64, num_experts=4, num_experts_per_tok=2, head_dim=8, **E
            )
        ),
        "olmoe": lambda: transformers.OlmoeForCausalLM(
            transformers.OlmoeConfig(**MOE, vocab_size=64, num_experts=4, num_experts_per_tok=2, **E)
        ),
        "albert": lambda: transformers.AlbertForMaskedLM(
            transformers.AlbertConfig(
                hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=64
            )
        ),
    }
    split = {"albert": ["albert.encoder.albert_layer_groups.*.albert_layers.*"]}.get(kind, ["model.layers.*"])
    return configs[kind](), split


@pytest.mark.parametrize("kind, stages", [("mixtral", 2), ("qwen3_moe", 2), ("olmoe", 2), ("albert", 3)])
def test_hugging_face_models_graph_capture_refused_are_exact_in_float64(kind, stages):
    """MoE routing (data-dependent: export refused every MoE model in float64) and ALBERT's one layer
    run 3 times (one stage under capture): bit-exact in float64, train mode, one stage per call."""
    torch.manual_seed(0)
    model, split_at = hugging_face(kind)
    model = model.double().train()
    ids = torch.randint(0, 64, (2, 8))
    params = dict(model.named_parameters())
    torch.manual_seed(1)
    res = ef.sweep(model, params, {"input_ids": ids, "labels": ids}, loss=lambda out: out["loss"], split_at=split_at)
    torch.manual_seed(1)
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(res.adjoints) == stages
    assert_exact(res.grads, {n: p.grad for n, p in params.items()})


@pytest.mark.parametrize("fn", [StraightThrough, ScaleGradient], ids=lambda f: f.__name__)
def test_graph_capture_refuses_a_custom_autograd_function_it_would_drop(fn):
    torch.manual_seed(0)
    model = Stack(inner=lambda: WithFunction(fn)).double()
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match=rf"custom autograd Function {fn.__qualname__}; torch.export .* drops"):
        ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"], capture="graph")

    def model_fn(p, h):  # a pure function cut by ef.cut is captured the same way
        return ef.cut(fn.apply(h @ p["w"]), "a") @ p["v"]

    with pytest.raises(ValueError, match=rf"custom autograd Function {fn.__qualname__}"):
        ef.grad(model_fn, {"w": torch.randn(4, 4, dtype=F64), "v": torch.randn(4, 3, dtype=F64)}, x, y, loss=F.mse_loss)


def test_graph_capture_refuses_hooks_run_time_cuts_honour():
    model = Stack().double()
    model.blocks[0].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"has hooks \(blocks.0.forward_pre_hooks\).*capture='run'"):
        ef.grad(model, dict(model.named_parameters()), x, y, loss=F.mse_loss, split_at=["blocks.*"], capture="graph")
    res, _, reference = sweep_and_autograd(model, x, y)
    assert_exact(res.grads, reference)


class HostDraws(nn.Module):
    """A layer that draws its mask from numpy and a scale from Python's random at every call."""

    def __init__(self, width=6):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h):
        import random

        import numpy as np

        mask = torch.from_numpy(np.random.rand(h.shape[-1]) > 0.5).to(h.dtype)
        return self.linear(h) * mask * random.uniform(0.5, 2.0)


def test_python_and_numpy_draws_inside_a_cut_are_replayed():
    import random

    import numpy as np

    torch.manual_seed(0)
    model = Stack(inner=HostDraws).double()
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)
    params = dict(model.named_parameters())
    for _ in range(2):  # the first call of a kind is watched, later ones saved and replayed
        random.seed(3), np.random.seed(3)
        res = ef.sweep(model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"])
        random.seed(3), np.random.seed(3)
        _, reference = autograd_grads(model, x, y)
        assert_exact(res.grads, reference)


def reformer(dropout):
    config = transformers.ReformerConfig(
        hidden_size=32,
        axial_pos_embds_dim=(16, 16),
        axial_pos_shape=(4, 2),
        num_attention_heads=2,
        attention_head_size=16,
        attn_layers=["local", "lsh", "local", "lsh"],
        feed_forward_size=64,
        vocab_size=64,
        is_decoder=True,
        local_attn_chunk_length=4,
        lsh_attn_chunk_length=4,
        num_buckets=2,
        max_position_embeddings=8,
        pad_token_id=0,
        eos_token_id=2,
        hash_seed=0,
        hidden_dropout_prob=dropout,
        lsh_attention_probs_dropout_prob=dropout,
        local_attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(0)
    return transformers.ReformerModelWithLMHead(config).double().train()


def test_reformers_reversible_layers_keep_their_own_backward():
    """Reformer's layers run inside a custom autograd Function (reversible: its backward rebuilds them
    and accumulates their parameters' .grad): cut around it, the sweep equals autograd; its layers,
    which autograd never sees, cannot be cut, and a reseeding dropout the rebuild cannot repeat is
    refused rather than differentiated at other masks."""
    ids = torch.randint(1, 64, (2, 8))
    inputs = {"input_ids": ids, "labels": ids}
    model = reformer(0.0)
    params = dict(model.named_parameters())
    torch.manual_seed(1)
    res = ef.sweep(model, params, inputs, loss=lambda out: out.loss, split_at=["reformer.encoder"])
    torch.manual_seed(1)
    model(**inputs).loss.backward()
    assert [a.stage for a in res.adjoints] == ["reformer.encoder"]
    assert_exact(res.grads, {n: p.grad for n, p in params.items()})
    with pytest.raises(ValueError, match=r"ran without autograd .*custom autograd Function"):
        ef.grad(model, params, inputs, loss=lambda out: out.loss, split_at=["reformer.encoder.layers.*"])
    model = reformer(0.1)
    with pytest.raises(ValueError, match=r"seeds torch's generator afresh"):
        ef.grad(model, dict(model.named_parameters()), inputs, loss=lambda out: out.loss, split_at=["reformer.encoder"])


def test_the_rebuild_runs_in_the_modes_the_forward_saw():
    """Another thread switching the model to eval mode mid-sweep (here: a pass, before the last cut's
    rebuild): the rebuilds still run BatchNorm in train mode, as the forward did."""
    torch.manual_seed(0)
    model = Stack(inner=lambda: nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))).double().train()
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)
    _, reference = autograd_grads(copy.deepcopy(model), x, y)

    def switch(adj):
        model.eval()
        return adj

    res = ef.sweep(model, dict(model.named_parameters()), x, y, loss=F.mse_loss, split_at=["blocks.*"], passes=switch)
    assert not model.training
    assert_exact(res.grads, reference)


def test_a_mode_switched_while_a_cut_runs_is_named():
    """Another thread's ``model.eval()`` landing while a cut's forward runs, made deterministic: a
    one-shot forward pre-hook switches the BatchNorm to eval mode mid-call. The forward ran it in eval
    mode, the modes read before the call say train: the sweep names the cut rather than rebuild it in
    train mode; the next step, switched between steps, is autograd's."""
    torch.manual_seed(0)
    model = Stack(inner=lambda: nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))).double().train()
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)
    norm = model.blocks[1][1]

    def once(module, args):
        handle.remove()
        module.eval()

    handle = norm.register_forward_pre_hook(once)
    with pytest.raises(ValueError, match=r"cut 'blocks.1': a BatchNorm1d in it switched to eval mode while its"):
        ef.sweep(model, dict(model.named_parameters()), x, y, loss=F.mse_loss, split_at=["blocks.*"])
    assert not norm.training
    res, _, reference = sweep_and_autograd(model, x, y)
    assert_exact(res.grads, reference)
    chain, params = ef.from_module(nn.Sequential(*model.blocks), loss=F.mse_loss)  # the fold's forwards alike
    for general in ({}, {"recompute": False}):  # the plain fold's, the general one's
        handle = norm.register_forward_pre_hook(once)
        norm.train()
        with pytest.raises(
            ValueError, match=r"stage 1 \('Sequential_1'\): a BatchNorm1d in it switched to eval mode while"
        ):
            ef.sweep(chain, params, torch.randn(5, 6, dtype=F64), torch.randn(5, 6, dtype=F64), **general)


def test_parameter_hooks_act_as_under_autograd():
    """``p.register_hook(fn)`` on a cut module's parameter, on the glue's and on a module called twice
    (a non-linear hook: once, on the summed gradient), at run-time cuts and where an option falls back
    to graph capture: the gradients autograd gives."""
    torch.manual_seed(0)
    model = Stack(blocks=2, calls=(0, 1, 0)).double()
    mask = (torch.rand(6, 4) > 0.5).double()
    model.embed.weight.register_hook(lambda g: g * mask)
    model.blocks[0].weight.register_hook(lambda g: g * g.norm())
    model.blocks[1].bias.register_hook(lambda g: -g)
    x, y = torch.randn(6, 4, dtype=F64), torch.randn(6, 3, dtype=F64)
    res, _, reference = sweep_and_autograd(model, x, y)
    assert_exact(res.grads, reference)
    params = dict(model.named_parameters())
    assert_exact(ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"], microbatches=2), reference, 1e-10)


class Config:
    def __init__(self):
        self.sub = types.SimpleNamespace(scale=1.0, table={"gain": [1.0]})


class Configured(nn.Module):
    """Reads ``self.cfg.sub.scale`` and ``self.cfg.sub.table["gain"][0]``: two and more levels deep."""

    def __init__(self, cfg, width=6):
        super().__init__()
        self.cfg, self.linear = cfg, nn.Linear(width, width)

    def forward(self, h):
        return self.linear(h) * self.cfg.sub.scale * self.cfg.sub.table["gain"][0]


@pytest.mark.parametrize("change", ["cfg.sub.scale", "cfg.sub.table['gain'][0]"])
def test_a_graph_capture_sees_what_its_model_reads_at_any_depth(change):
    """Changed between calls, a value read several levels deep makes a new capture (the gradients
    are the new model's), where a one-level fingerprint kept the stale graph."""
    torch.manual_seed(0)
    cfg = Config()
    model = Stack(inner=lambda: Configured(cfg)).double()
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)
    for value in (1.0, 3.0):
        if change == "cfg.sub.scale":
            cfg.sub.scale = value
        else:
            cfg.sub.table["gain"][0] = value
        res, _, reference = sweep_and_autograd(model, x, y, capture="graph")
        assert_exact(res.grads, reference)


def test_a_function_capture_sees_what_it_reads_at_any_depth():
    settings_ = {"layer": {"scale": [2.0]}}
    params = {"w": torch.randn(4, 4, dtype=F64), "v": torch.randn(4, 3, dtype=F64)}
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)

    def model_fn(p, h):
        return ef.cut(torch.tanh(h @ p["w"]) * settings_["layer"]["scale"][0], "a") @ p["v"]

    for value in (2.0, 5.0):
        settings_["layer"]["scale"][0] = value
        got = ef.grad(model_fn, params, x, y, loss=F.mse_loss)
        want = torch.func.grad(lambda p: F.mse_loss(model_fn(p, x), y))(params)
        assert_exact(got, want)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_float64_causal_lm_called_with_labels_is_captured(kind):
    """``logits.float()`` in the model's own loss is a real cast in float64: the capture rewired the
    output to it and the last stage failed with ``KeyError: 'linear'``."""
    pytest.importorskip("transformers")
    from test_models import gpt2, llama

    torch.manual_seed(0)
    model, split_at = gpt2() if kind == "gpt2" else llama(layers=2)
    model = model.double().eval()
    ids = torch.randint(0, 64, (2, 8))
    params = dict(model.named_parameters())
    res = ef.sweep(
        model,
        params,
        {"input_ids": ids, "labels": ids},
        loss=lambda out: out["loss"],
        split_at=split_at,
        capture="graph",
    )
    model(input_ids=ids, labels=ids).loss.backward()
    assert_exact(res.grads, {n: p.grad for n, p in params.items()})


EXTRAS = ("scale", "tag", "twice", "ids", "view", "mask", "input", "none")


class Extras(nn.Module):
    """A block that returns beside its output what layers return beside theirs, in the order of
    ``kinds``: an int the next block uses (Swin's height and width), a tag, its output again, an
    integer tensor, a view of its output, the mask it was given (which requires no grad), the input
    it was given, ``None``."""

    def __init__(self, width, kinds):
        super().__init__()
        self.lin, self.kinds = nn.Linear(width, width), kinds

    def forward(self, h, mask, scale):
        out = torch.tanh(self.lin(h)) * scale * mask
        made = {
            "scale": scale + 1,
            "tag": "tag",
            "twice": out,
            "ids": torch.arange(h.shape[-1]),
            "view": out[..., :1],
            "mask": mask,
            "input": h,
            "none": None,
        }
        return (out, *(made[k] for k in self.kinds))


class ExtrasStack(nn.Module):
    def __init__(self, kinds, width=4):
        super().__init__()
        self.blocks = nn.ModuleList(Extras(width, kinds) for _ in range(3))

    def forward(self, x, mask):
        h, scale = x, 2
        for block in self.blocks:
            out, *extras = block(h, mask, scale)
            h = out
            for kind, value in zip(block.kinds, extras):
                if kind == "scale":
                    assert isinstance(value, int)
                    scale = value
                elif kind in ("tag", "none"):
                    assert value == {"tag": "tag", "none": None}[kind]
                elif kind == "ids":
                    assert not value.requires_grad and value.dtype == torch.int64
                    h = h * value.double().mean()
                elif kind == "mask":
                    assert value is mask or not value.requires_grad
                    mask = value
                else:
                    h = h + {"twice": lambda v: 0.5 * v**2, "view": lambda v: v, "input": torch.sin}[kind](value)
        return h * scale


@settings(max_examples=20, deadline=None)
@given(kinds=st.lists(st.sampled_from(EXTRAS), max_size=6), seed=st.integers(0, 2**16))
def test_a_cut_layers_other_outputs_reach_its_caller_as_computed(kinds, seed):
    """Whatever a cut block returns beside its output (an int the next block uses, a tag, ``None``, an
    integer tensor, its output again, a view of it, the mask and the input it was given, in any order)
    reaches the caller as the forward returned it: gradients equal autograd's, with one costate per
    distinct floating output of its own (an input that requires grad, handed back, is one)."""
    torch.manual_seed(seed)
    model = ExtrasStack(tuple(kinds)).double()
    x, mask = torch.randn(3, 4, dtype=F64), (torch.rand(3, 4) > 0.3).double()
    loss = lambda out: (out**2).sum()
    model.zero_grad(set_to_none=True)
    loss(model(x, mask)).backward()
    reference = {n: p.grad for n, p in model.named_parameters()}
    res = ef.sweep(model, dict(model.named_parameters()), (x, mask), loss=loss, split_at=["blocks.*"])
    assert_exact(res.grads, reference)
    costates = [1 if isinstance(a.value, torch.Tensor) else len(a.value) for a in res.adjoints]
    own = 1 + ("view" in kinds)
    assert costates == [own + ("input" in kinds)] * 2 + [own]  # the first block's input, x, requires no grad


class KeyValues:
    """What a key/value cache offers (Hugging Face's ``Cache``): ``update`` appends and returns all so far."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}

    def update(self, key, value, layer):
        self.keys[layer] = torch.cat([self.keys[layer], key], 1) if layer in self.keys else key
        return self.keys[layer], value

    def get_seq_length(self, layer=0):
        return self.keys[layer].shape[1] if layer in self.keys else 0


class Attention(nn.Module):
    def __init__(self, width, layer):
        super().__init__()
        self.q, self.layer = nn.Linear(width, width), layer

    def forward(self, h, cache):
        keys, _ = cache.update(h, h, self.layer)
        return torch.softmax(self.q(h) @ keys.transpose(1, 2), -1) @ keys


class CachedStack(nn.Module):
    """Parallel lists as XLM's: attentions passed a cache the model makes always, feed-forwards not."""

    def __init__(self, width=4):
        super().__init__()
        self.attentions = nn.ModuleList(Attention(width, i) for i in range(2))
        self.ffns = nn.ModuleList(nn.Linear(width, width) for _ in range(2))

    def forward(self, x):
        cache, h = KeyValues(), x
        for attention, ffn in zip(self.attentions, self.ffns):
            h = h + attention(h, cache)
            h = h + torch.tanh(ffn(h))
        return h


def test_a_cut_passed_a_key_value_cache_is_refused_naming_the_split_to_use():
    """A cut module passed a cache that its forward fills would rebuild attending to its own keys again
    (a shape error, or silently another attention): refused, naming the cut and the split_at without it,
    which is exact."""
    torch.manual_seed(0)
    model = CachedStack().double()
    x = torch.randn(2, 3, 4, dtype=F64)
    loss = lambda out: (out**2).sum()
    with pytest.raises(
        ValueError, match=r"cut 'attentions.0' is passed a key/value cache \(KeyValues\).*split_at=\['ffns.\*'\]"
    ):
        ef.sweep(model, dict(model.named_parameters()), x, loss=loss, split_at=["attentions.*", "ffns.*"])
    model.zero_grad(set_to_none=True)
    loss(model(x)).backward()
    reference = {n: p.grad for n, p in model.named_parameters()}
    res = ef.sweep(model, dict(model.named_parameters()), x, loss=loss, split_at=["ffns.*"])
    assert_exact(res.grads, reference)
    assert len(res.adjoints) == 2


class PythonDraws(nn.Module):
    """A layer whose only randomness is a scale from Python's ``random`` (numpy's generator untouched)."""

    def __init__(self, width=6):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h):
        import random

        return self.linear(h) * random.uniform(0.5, 2.0)


def test_a_cut_drawing_from_pythons_random_alone_is_replayed():
    import random

    torch.manual_seed(0)
    model = Stack(inner=PythonDraws).double()
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)
    params = dict(model.named_parameters())
    for _ in range(2):  # the first call of a kind is watched, later ones saved and replayed
        random.seed(3)
        res = ef.sweep(model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"])
        random.seed(3)
        _, reference = autograd_grads(model, x, y)
        assert_exact(res.grads, reference)


def test_a_weight_tied_inside_a_cut_module_gets_both_uses_gradients():
    torch.manual_seed(0)
    model = Stack(inner=TiedInside).double()
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64)
    res, _, reference = sweep_and_autograd(model, x, y)
    assert "blocks.0.first.weight" in reference and "blocks.0.second.weight" not in reference
    assert_exact(res.grads, reference)


class Chained(nn.Module):
    """``head(b2(b1(b0(embed(x)))))``, each ``b`` a ``tanh(linear)``: a chain of three cuts, no residual."""

    def __init__(self, width=5):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_a_costate_changing_pass_at_the_cuts_gives_the_gradients_computed_by_hand():
    """``scale(2)`` at every cut of a chain: the costate at the output of cut k (of 3) is doubled once
    per cut at or after it, so block k's gradients are 2^(3-k) autograd's, the embedding's (before
    every cut) 2^3, the head's (after them) autograd's. ``clip_by_global_norm(c)`` at every cut is
    autograd with each cut output's gradient clipped as it arrives (a tensor hook)."""
    torch.manual_seed(0)
    model = Chained().double()
    x, y = torch.randn(7, 4, dtype=F64), torch.randn(7, 3, dtype=F64)
    params = dict(model.named_parameters())
    scaled = ef.sweep(model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"], passes=P.scale(2.0))
    _, reference = autograd_grads(model, x, y)
    factor = {"embed": 8.0, "blocks.0": 8.0, "blocks.1": 4.0, "blocks.2": 2.0, "head": 1.0}
    assert_exact(
        scaled.grads,
        {n: factor[n.rsplit(".", 2)[0] if "blocks" in n else n.split(".")[0]] * g for n, g in reference.items()},
    )

    limit = 0.1  # clips at blocks.2 (|p| = 0.26), whose smaller costate then passes blocks.1 and .0 unclipped
    clipped = ef.sweep(model, params, x, y, loss=F.mse_loss, split_at=["blocks.*"], passes=P.clip_by_global_norm(limit))

    def clip(g):
        norm = torch.linalg.vector_norm(g.float()).double()
        return g * (limit / (norm + 1e-6)) if norm > limit else g

    hooks = [b.register_forward_hook(lambda m, args, out: out.register_hook(clip) and None) for b in model.blocks]
    _, reference = autograd_grads(model, x, y)
    for h in hooks:
        h.remove()
    assert [bool(a.meta["clipped"]) for a in clipped.adjoints] == [True, False, False]
    assert_exact(clipped.grads, reference, rel=1e-6)


class Encoder(nn.Module):
    """A feature encoder that makes a view of its input require grad, as HuBERT's does, then blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))

    def forward(self, x):
        h = x[:, None]
        h.requires_grad = True  # a leaf of its own inside the forward: nobody outside holds it
        h = h.squeeze(1)
        for block in self.blocks:
            h = h + block(h)
        return h


def test_a_view_leaf_the_forward_makes_is_its_own_but_a_callers_view_leaf_is_refused():
    """The loss check tells a leaf the forward made from its input (HuBERT's) from a tensor the caller
    made a leaf of and reads beside the model, a view too (``w.detach()[:4].requires_grad_()``), whose
    gradient the sweep would drop: the first is autograd's, the second refused."""
    torch.manual_seed(0)
    model, x = Encoder(), torch.randn(3, 4)
    want = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    got = ef.grad(model, dict(model.named_parameters()), x, loss=lambda h: h.square().mean(), split_at=["blocks.*"])
    for g, (n, _) in zip(want, model.named_parameters()):
        torch.testing.assert_close(got[n], g, rtol=1e-6, atol=1e-7, msg=n)
    scale = torch.randn(8, 4).detach()[:4].requires_grad_()  # a view, and a leaf the caller holds
    with pytest.raises(ValueError, match=r"outside params \(shapes \[\(4, 4\)\]\)"):
        ef.grad(model, dict(model.named_parameters()), x, loss=lambda h: (h @ scale).sum(), split_at=["blocks.*"])


class Shifty(nn.Module):
    """A block that returns a tensor on its first call and a tuple after: its rebuild (a second call)
    returns another structure than its forward."""

    def __init__(self, width=4):
        super().__init__()
        self.linear, self.calls = nn.Linear(width, width), 0

    def forward(self, h):
        self.calls += 1
        out = torch.tanh(self.linear(h))
        return out if self.calls == 1 else (out,)


class ShiftyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Shifty()

    def forward(self, x):
        out = self.block(x)
        return out if isinstance(out, torch.Tensor) else out[0]


def test_a_rebuild_that_returns_another_structure_is_refused():
    torch.manual_seed(0)
    model, x, y = ShiftyNet(), torch.randn(3, 4), torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"cut 'block': its rebuild returned another structure than its forward"):
        ef.grad(model, dict(model.named_parameters()), x, y, loss=F.mse_loss, split_at=["block"])


class Pick(nn.Module):
    """A cut whose output is ``kind``: an integer tensor, the data it was given (as ``nn.Identity`` and
    an eval-mode dropout hand it back), or that data beside a value of its own."""

    def __init__(self, kind):
        super().__init__()
        self.scale, self.kind = nn.Parameter(torch.ones(())), kind

    def forward(self, x):
        if self.kind == "integer":
            return (x * self.scale).argmax(-1, keepdim=True)
        if self.kind == "data":
            return x
        return x, x * self.scale


class Hands(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.block, self.pick = nn.Linear(4, 4), Pick(kind)

    def forward(self, x):
        return self.block(x) + self.pick(x)[-1].to(x.dtype)


@pytest.mark.parametrize("kind", ["integer", "data", "data and a value"])
def test_a_cut_whose_output_has_no_floating_tensor_of_its_own_is_refused(kind):
    """A cut's costate is that of the floating tensors it makes: one that returns an integer tensor, or
    hands back the data it was given, has none, and is refused naming it; the data beside a value of
    its own reaches the caller as the data (no node's output), the value gets autograd's gradient."""
    torch.manual_seed(0)
    model, x = Hands(kind).double(), torch.randn(3, 4, dtype=F64)
    loss = lambda out: out.square().sum()
    params = dict(model.named_parameters())
    if kind != "data and a value":
        with pytest.raises(TypeError, match=r"cut 'pick': its output \(Tensor\) has no floating tensor of its own"):
            ef.grad(model, params, x, loss=loss, split_at=["pick"])
        return
    seen = []
    model.pick.register_forward_hook(lambda m, args, out: seen.append(out[0]))
    got = ef.grad(model, params, x, loss=loss, split_at=["pick"])
    assert [t.data_ptr() == x.data_ptr() and t.grad_fn is None and not t.requires_grad for t in seen] == [True]
    model.zero_grad(set_to_none=True)
    loss(model(x)).backward()
    assert_exact(got, {n: p.grad for n, p in model.named_parameters()})


class Counter(nn.Module):
    """A block whose output reads a buffer its forward advances in place (a step counter), and which
    records whether its weight requires grad each time it runs (``torch.matmul`` picks its kernels by
    which inputs require grad)."""

    def __init__(self, width=4):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("count", torch.zeros(()))
        self.seen = []

    def forward(self, h):
        self.count.add_(1)
        self.seen.append(self.lin.weight.requires_grad)
        return torch.tanh(self.lin(h)) * self.count


@pytest.mark.parametrize("frozen", [False, True])
def test_a_cut_rebuilds_from_the_buffers_and_requires_grad_its_forward_saw(frozen):
    """A cut whose output reads a buffer its forward advances: the rebuild starts from the buffer as it
    was before the call (not as the forward left it), and its parameters require grad as in the
    forward; the gradients and the advanced buffer are autograd's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Counter(), nn.Linear(4, 1)).double()
    model[1].lin.weight.requires_grad_(not frozen)
    x = torch.randn(3, 4, dtype=F64)
    loss = lambda out: out.square().sum()
    reference_model = copy.deepcopy(model)
    loss(reference_model(x)).backward()
    reference = {n: p.grad for n, p in reference_model.named_parameters() if p.requires_grad}
    model[1].seen.clear()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    res = ef.sweep(model, params, x, loss=loss, split_at=["1"])
    assert_exact(res.grads, reference)
    assert torch.equal(res.buffers["1.count"], reference_model[1].count)
    assert model[1].seen == [not frozen, not frozen]  # the forward and its rebuild


@pytest.mark.parametrize("how", ["sweep", "kept graphs", "enable"])
def test_a_cut_inside_a_cut_runs_as_part_of_it(how):
    """Each block and its first layer cut: the inner cut's calls (in the outer's forward, with a graph
    where ``recompute=`` keeps it, and again in its rebuild, where an enabled model's cuts are still
    in place) run as part of the outer call, so the stages are the blocks alone, with autograd's
    gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)) for _ in range(2))).double()
    x = torch.randn(3, 4, dtype=F64)
    loss = lambda out: out.square().sum()
    model.zero_grad(set_to_none=True)
    loss(model(x)).backward()
    reference = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    split_at = ["*", "*.0"]
    if how == "enable":
        with ef.enable(model, split_at=split_at):
            loss(model(x)).backward()
            stages = list(ef.records(model))
        grads = {n: p.grad for n, p in model.named_parameters()}
    else:
        recompute = ef.remat.never() if how == "kept graphs" else ef.remat.always()
        res = ef.sweep(model, dict(model.named_parameters()), x, loss=loss, split_at=split_at, recompute=recompute)
        grads, stages = res.grads, [a.stage for a in res.adjoints]
    assert stages == ["1", "0"]
    assert_exact(grads, reference)
