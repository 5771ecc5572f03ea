"""Models nobody here wrote, the torch.func way: ``ef.grad(model, dict(model.named_parameters()), x,
..., loss=..., split_at=...)`` on Hugging Face GPT-2 and Llama (tiny random configs, dropout on,
tied embedding and head) and on a UNet-like model whose skip connection crosses two cuts equals
autograd; BatchNorm statistics and gradients reach the module; nothing is dropped silently."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import eae_func as ef

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def next_token_loss(out, ids):
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def gpt2():
    config = transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=4, vocab_size=64, n_positions=32, attn_implementation="eager"
    )
    return transformers.GPT2LMHeadModel(config), ["transformer.h.*"]


def llama(layers=3):
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        attention_dropout=0.1,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config), ["model.layers.*"]


def assert_relative(grads, params, tol):
    assert set(grads) == set(params)
    for name, p in params.items():
        scale = p.grad.abs().max().item() or 1.0
        assert (grads[name] - p.grad).abs().max().item() <= tol * scale, name


@pytest.mark.parametrize("build", [gpt2, llama])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_hugging_face_models_cut_per_layer_give_autograds_gradients(build, dtype, tol):
    torch.manual_seed(0)
    model, split_at = build()
    model = model.to(dtype).train()  # dropout on
    ids = torch.randint(0, 64, (2, 8))
    params = dict(model.named_parameters())
    torch.manual_seed(1)
    loss, grads = ef.value_and_grad(model, params, ids, ids, loss=next_token_loss, split_at=split_at)
    torch.manual_seed(1)
    reference = next_token_loss(model(ids), ids)
    reference.backward()
    torch.testing.assert_close(loss, reference.detach(), rtol=tol, atol=0)
    assert_relative(grads, params, tol)
    # keyword inputs (input_ids, attention_mask) take the same path
    torch.manual_seed(1)
    again = ef.grad(
        model,
        params,
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        ids,
        loss=next_token_loss,
        split_at=split_at,
    )
    assert_relative(again, params, tol)


def test_the_cut_has_one_stage_per_layer_and_carries_the_mask_across():
    torch.manual_seed(0)
    model, split_at = gpt2()
    ids = torch.randint(0, 64, (2, 8))
    chain, params = ef.from_module(model.train(), loss=next_token_loss, split_at=split_at, example=ids)
    assert chain.names == (
        "transformer.wte+transformer.wpe+transformer.drop",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.h.2",
        "transformer.ln_f+lm_head",
    )
    assert chain.ties == (((0, "transformer.wte.weight"), (4, "transformer.wte.weight")),)
    res = ef.sweep(chain, params, ids, ids)
    # the mask crosses every cut beside the stream, but the records are the cuts' outputs alone, as run-time
    # cuts show them: one per layer call, its output's costate
    assert [(a.index, a.stage, tuple(a.value.shape)) for a in res.adjoints] == [
        (3, "transformer.h.2", (2, 8, 32)),
        (2, "transformer.h.1", (2, 8, 32)),
        (1, "transformer.h.0", (2, 8, 32)),
    ]
    with pytest.raises(ValueError, match=r"captured for inputs \[\(\(2, 8\), torch.int64\)\], got \[\(\(3, 8\)"):
        ef.sweep(chain, params, ids[:1].repeat(3, 1), ids[:1].repeat(3, 1))
    model.eval()
    with pytest.raises(ValueError, match="captured in train mode"):
        ef.sweep(chain, params, ids, ids)


class UNet(nn.Module):
    """down1 -> down2 -> mid -> up2 -> up1, with down1's output added back in up1: a skip connection
    alive across the cuts before down2, mid and up2. BatchNorm in train mode in two places."""

    def __init__(self, c=4):
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.Tanh())
        self.down2 = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.Tanh())
        self.mid = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.Tanh())
        self.up2 = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.Tanh())
        self.up1 = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        skip = self.down1(x)
        return self.up1(self.up2(self.mid(self.down2(skip))) + skip)


@pytest.mark.parametrize("capture", ["run", "graph"])
def test_a_skip_connection_crossing_two_cuts_and_batchnorm_statistics(capture):
    torch.manual_seed(0)
    model = UNet().double().train()
    before, twin = copy.deepcopy(model), copy.deepcopy(model)
    x, y = torch.randn(2, 3, 6, 6, dtype=torch.float64), torch.randn(2, 2, 6, 6, dtype=torch.float64)
    params = dict(model.named_parameters())
    res = ef.sweep(model, params, x, y, loss=F.mse_loss, split_at=["down2", "mid", "up2"], capture=capture)
    F.mse_loss(twin(x), y).backward()
    assert_relative(res.grads, dict(twin.named_parameters()), 1e-10)
    # either way one record per cut call, last call first: the costate of its output (a capture carries the
    # skip beside the stream across the cuts before mid and up2, but shows the cuts' outputs alone)
    assert [(a.index, a.stage) for a in res.adjoints] == [(3, "up2"), (2, "mid"), (1, "down2")]
    assert all(a.value.shape == (2, 4, 6, 6) for a in res.adjoints)
    assert all(torch.equal(model.get_buffer(n), b) for n, b in before.named_buffers())  # untouched
    for name, b in twin.named_buffers():
        assert torch.equal(res.buffers[name], b), name  # updated once, returned under the model's names


def convnet():
    return nn.Sequential(
        *[nn.Sequential(nn.Conv2d(c_in, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()) for c_in in (3, 4, 4)],
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 3),
    )


def test_training_with_write_back_keeps_batchnorm_statistics_like_autograd():
    torch.manual_seed(0)
    model, twin = convnet().train(), None
    twin = copy.deepcopy(model)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, twin))
    chain, params = ef.from_module(model, loss=F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 3, 5, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
        ef.write_back(model, ef.sweep(chain, params, x, y))
        opt.step()
        twin_opt.zero_grad()
        F.cross_entropy(twin(x), y).backward()
        twin_opt.step()
    x = torch.randn(4, 3, 5, 5, generator=g)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), twin.eval()(x))


def test_nothing_is_dropped_silently():
    with pytest.raises(TypeError, match=r"from_module: a UNet is not a sequence of stages; cut it .*split_at"):
        ef.from_module(UNet(), loss=F.mse_loss)
    with pytest.raises(ValueError, match=r"split_at: no module of UNet matches \['decoder.\*'\]"):
        ef.from_module(UNet(), loss=F.mse_loss, split_at=["decoder.*"], example=torch.randn(1, 3, 4, 4))
    with pytest.raises(ValueError, match="give example="):
        ef.from_module(UNet(), loss=F.mse_loss, split_at=["mid"])
    blocks = [nn.Linear(4, 4) for _ in range(3)]
    closures = ef.Chain(
        [ef.stage(lambda p, h, b=b: b(h), name=f"block{i}") for i, b in enumerate(blocks)], loss=lambda out: out.sum()
    )
    for recompute in (True, False):  # False: the forward builds the local graph, the check walks it
        with pytest.raises(
            ValueError,
            match=r"stage 0 \('block0'\): its output depends on a tensor that requires "
            r"grad but is not among its params \(shapes \[.*\(4, 4\)",
        ):
            ef.sweep(closures, ({}, {}, {}), torch.randn(2, 4), recompute=recompute)


def test_microbatches_equal_the_full_batch_without_batch_statistics_or_dropout():
    torch.manual_seed(0)
    model, split_at = gpt2()
    model = model.double().eval()
    ids = torch.randint(0, 64, (4, 8))
    params = dict(model.named_parameters())
    full = ef.grad(model, params, ids, ids, loss=next_token_loss, split_at=split_at)
    pieces = ef.grad(model, params, ids, ids, loss=next_token_loss, split_at=split_at, microbatches=2)
    for name in full:
        torch.testing.assert_close(pieces[name], full[name], rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("build", [gpt2, llama])
def test_a_captured_model_under_autocast_gives_eager_autocasts_gradients(build):
    """The capture drops ``x.to(float32)`` where x was float32 already (the model's own loss upcasts
    ``logits.float()``, Llama's RMSNorm its input); under bf16 autocast those conversions matter (the
    graph failed its dtype assertions), and are put back: GPT-2 is bitwise eager autocast's. Llama's
    rotary tables are computed with autocast off in eager, which the captured graph does not keep
    (0.9% off)."""
    torch.manual_seed(0)
    model, split_at = build()
    model.eval()
    ids = torch.randint(0, 64, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
    params = dict(model.named_parameters())
    inputs = {"input_ids": ids, "labels": ids}
    grads = ef.grad(model, params, inputs, loss=lambda out: out["loss"], split_at=split_at, autocast=torch.bfloat16)
    assert_relative(grads, params, 0.0 if build is gpt2 else 2e-2)
