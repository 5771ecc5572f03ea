"""``update=`` and ``microbatches=`` on a model cut at run time: the optimizer steps inside the
backward (``eae_func.drivers.in_backward``), bit for bit what autograd + ``optimizer.step()`` gives, with no
torch.export, and without the whole network's gradients alive at once."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import eae_func as ef

from live_bytes import LiveBytes

F64 = torch.float64


class Body(nn.Module):
    """Embedding, blocks (one called twice), a final norm and a head, as a causal LM is laid out."""

    def __init__(self, width=8, depth=3, vocab=11):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for block in [*self.blocks, self.blocks[0]]:  # blocks.0 twice: due after its second call
            h = h + block(h)
        return self.head(self.norm(h))


def ce(logits, labels):
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten())


def data(vocab=11, rows=4, seq=5):
    g = torch.Generator().manual_seed(1)
    return torch.randint(vocab, (rows, seq), generator=g), torch.randint(vocab, (rows, seq), generator=g)


OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def no_export(monkeypatch):
    def exported(*args, **kwargs):
        raise AssertionError("torch.export called")

    monkeypatch.setattr(torch.export, "export", exported)


def trained(model, steps, make_opt, step, scheduler=False):
    """``model``'s parameters after ``steps`` of ``step(model, opt)``, and the optimizer."""
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if scheduler else None
    for _ in range(steps):
        step(model, opt)
        if sched is not None:
            sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt


def autograd_step(inputs, loss):
    def step(model, opt):
        opt.zero_grad(set_to_none=True)
        loss(model(inputs[0]), *inputs[1:]).backward()
        opt.step()

    return step


def fused_step(inputs, loss, split_at, **kw):
    def step(model, opt):
        res = ef.sweep(model, dict(model.named_parameters()), *inputs, loss=loss, split_at=split_at, update=opt, **kw)
        assert res.grads is None

    return step


def assert_same(a, b):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("scheduler", [False, True])
def test_fused_at_run_time_is_autograd_and_step_bit_for_bit(monkeypatch, opt, scheduler):
    torch.manual_seed(0)
    model = Body().double()
    inputs = data()
    want, _ = trained(copy.deepcopy(model), 3, OPTIMIZERS[opt], autograd_step(inputs, ce), scheduler)
    no_export(monkeypatch)
    got, o = trained(model, 3, OPTIMIZERS[opt], fused_step(inputs, ce, ["blocks.*"]), scheduler)
    assert_same(got, want)
    assert all(p.grad is None for p in model.parameters())  # no gradient left behind
    assert all(o.state[p]["step"] == 3 for p in model.parameters()) if opt == "adamw" else True


def test_two_microbatches_fused_are_the_full_batch(monkeypatch):
    """``microbatches=2``: each piece's forward and backward in turn, the step in the last one's
    backward on the sum; equal to autograd on the whole batch (mean loss) up to rounding of the sum."""
    torch.manual_seed(0)
    model = Body().double()
    inputs = data(rows=6)
    want, _ = trained(copy.deepcopy(model), 3, OPTIMIZERS["sgd-momentum"], autograd_step(inputs, ce))
    no_export(monkeypatch)
    step = fused_step(inputs, ce, ["blocks.*"], microbatches=2)
    got, _ = trained(model, 3, OPTIMIZERS["sgd-momentum"], step)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-14, msg=n)
    # and the unfused run-time microbatches give the same gradients as autograd
    torch.manual_seed(0)
    fresh = Body().double()
    grads = ef.grad(fresh, dict(fresh.named_parameters()), *inputs, loss=ce, split_at=["blocks.*"], microbatches=3)
    ce(fresh(inputs[0]), inputs[1]).backward()
    for n, p in fresh.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-12, atol=1e-14, msg=n)


def test_a_pure_update_at_run_time_takes_its_state_by_name():
    torch.manual_seed(0)
    model = Body().double()
    ids, labels = data()
    params = dict(model.named_parameters())

    def sgd(p, g, s):
        return {n: p[n] - 0.1 * g[n] for n in g}, {n: s[n] + 1 for n in g}

    res = ef.sweep(
        model, params, ids, labels, loss=ce, split_at=["blocks.*"], update=ef.fused(sgd, dict.fromkeys(params, 0))
    )
    grads = ef.grad(model, params, ids, labels, loss=ce, split_at=["blocks.*"])
    for n, p in params.items():
        torch.testing.assert_close(res.params[n], p - 0.1 * grads[n], rtol=0, atol=0, msg=n)
    assert res.update_state == dict.fromkeys(params, 1)
    assert all(torch.equal(p, model.get_parameter(n)) for n, p in params.items())  # nothing written
    with pytest.raises(TypeError, match=r"state in params' structure.*missing"):
        ef.sweep(model, params, ids, labels, loss=ce, split_at=["blocks.*"], update=ef.fused(sgd, {"head.bias": 0}))


def tiny_lm(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
        model, split_at = transformers.GPT2LMHeadModel(config), ["transformer.h.*"]
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=32, max_position_embeddings=16,
        )  # fmt: skip
        model, split_at = transformers.LlamaForCausalLM(config), ["model.layers.*"]
    model.config.attn_implementation = "eager"
    return model.double().eval(), split_at


def lm_loss(out, labels):
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fused_on_a_hugging_face_lm_with_its_tied_embedding(monkeypatch, kind):
    model, split_at = tiny_lm(kind)
    ids = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(0))
    want, _ = trained(copy.deepcopy(model), 3, OPTIMIZERS["adamw"], autograd_step((ids, ids), lm_loss))
    no_export(monkeypatch)
    got, _ = trained(model, 3, OPTIMIZERS["adamw"], fused_step((ids, ids), lm_loss, split_at))
    assert_same(got, want)


def test_a_head_beside_the_swept_body_is_glue_the_optimizer_steps(monkeypatch):
    """The issue's form: the body swept, the head and loss in chunks beside it, one optimizer over
    every parameter: the head's are stepped when autograd has accumulated them."""
    model, _ = tiny_lm("llama")
    ids = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(0))
    want, _ = trained(copy.deepcopy(model), 3, OPTIMIZERS["adamw"], autograd_step((ids, ids), lm_loss))

    def step(m, opt):
        chunked = ef.chunked_loss(m.lm_head, functools.partial(F.cross_entropy, reduction="none"), chunks=3)
        body = m.model
        ef.sweep(
            body, dict(body.named_parameters()), ids, ids, split_at=["layers.*"], update=opt,
            loss=lambda out, y: chunked(out.last_hidden_state[:, :-1], y[:, 1:]),
        )  # fmt: skip

    no_export(monkeypatch)
    got, _ = trained(model, 3, OPTIMIZERS["adamw"], step)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-14, msg=n)
    # unfused, the head's gradient would be dropped: refused, naming the remedy
    body = model.model
    chunked = ef.chunked_loss(model.lm_head, functools.partial(F.cross_entropy, reduction="none"), chunks=3)
    with pytest.raises(ValueError, match=r"outside params.*update="):
        ef.grad(
            body, dict(body.named_parameters()), ids, ids, split_at=["layers.*"],
            loss=lambda out, y: chunked(out.last_hidden_state[:, :-1], y[:, 1:]),
        )  # fmt: skip


def test_a_lora_model_steps_only_its_adapters(monkeypatch):
    peft = pytest.importorskip("peft")
    model, split_at = tiny_lm("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    ids = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(0))

    def trainable(m):
        return [p for p in m.parameters() if p.requires_grad]

    reference = copy.deepcopy(lora)
    opt = torch.optim.AdamW(trainable(reference), lr=1e-2)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        lm_loss(reference(ids), ids).backward()
        opt.step()
    no_export(monkeypatch)
    opt = torch.optim.AdamW(trainable(lora), lr=1e-2)
    params = {n: p for n, p in lora.named_parameters() if p.requires_grad}
    for _ in range(3):
        ef.sweep(lora, params, ids, ids, loss=lm_loss, split_at=["base_model.model.model.layers.*"], update=opt)
    for (n, p), q in zip(lora.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


def test_what_a_fused_update_cannot_do_is_refused_before_any_step():
    torch.manual_seed(0)
    model = Body().double()
    ids, labels = data()
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    partial = torch.optim.SGD(list(model.parameters())[:-1], lr=0.1)
    with pytest.raises(ValueError, match=r"'head.bias' is trainable but not among the optimizer"):
        ef.sweep(model, params, ids, labels, loss=ce, split_at=["blocks.*"], update=partial)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.head.bias.grad = torch.zeros_like(model.head.bias)
    with pytest.raises(ValueError, match=r"already have .grad set"):
        ef.sweep(model, params, ids, labels, loss=ce, split_at=["blocks.*"], update=opt)
    model.head.bias.grad = None
    with pytest.raises(ValueError, match=r"global norm"):
        ef.fused(opt, max_norm=1.0, per="global")
    assert all(torch.equal(p, before[n]) for n, p in params.items())


def test_per_stage_clipping_clips_each_cut_module_by_its_own_norm():
    """``ef.fused(opt, max_norm=c)``: each group (a cut module, a glue module) clipped by its own
    norm: plain SGD(lr=1) moves every group by at most c."""
    torch.manual_seed(0)
    model = Body().double()
    ids, labels = data()
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    grads = ef.grad(model, params, ids, labels, loss=ce, split_at=["blocks.*"])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ef.sweep(model, params, ids, labels, loss=ce, split_at=["blocks.*"], update=ef.fused(opt, max_norm=1e-3))
    groups = {}
    for n in params:
        g = next((f"blocks.{i}" for i in range(3) if n.startswith(f"blocks.{i}.")), n.rpartition(".")[0])
        groups.setdefault(g, []).append(n)
    assert set(groups) == {"emb", "blocks.0", "blocks.1", "blocks.2", "norm", "head"}
    for names in groups.values():
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(grads[n]) for n in names])
        )  # fp32 in the library
        scale = min(1.0, 1e-3 / (norm.item() + 1e-6))
        for n in names:
            torch.testing.assert_close(before[n] - params[n], scale * grads[n], rtol=1e-6, atol=1e-12, msg=n)


class Nested(nn.Module):
    """Blocks of two linear layers, each block and its first layer cut (a cut inside a cut's call)."""

    def __init__(self, width=6, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)) for _ in range(depth)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_cut_inside_a_cut_is_clipped_with_the_outer_one():
    """A cut inside another cut's call runs as part of it: its parameters are the outer cut module's
    group, clipped by that whole module's norm."""
    torch.manual_seed(0)
    model = Nested().double()
    x = torch.randn(4, 6, dtype=F64)
    loss = lambda out: out.square().sum()
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    split_at = ["blocks.*", "blocks.*.0"]
    grads = ef.grad(model, params, x, loss=loss, split_at=split_at)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ef.sweep(model, params, x, loss=loss, split_at=split_at, update=ef.fused(opt, max_norm=1e-3))
    for k in range(2):
        names = [n for n in params if n.startswith(f"blocks.{k}.")]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(grads[n]) for n in names]))
        scale = min(1.0, 1e-3 / (norm.item() + 1e-6))
        for n in names:
            torch.testing.assert_close(before[n] - params[n], scale * grads[n], rtol=1e-6, atol=1e-12, msg=n)


def test_a_failure_in_the_last_microbatch_leaves_no_gradient_on_a_tensor_beside_the_model():
    """A tensor the loss reads beside the model, stepped by the fused update: the first microbatch's
    gradient accumulates in its ``.grad``; a failure in the second microbatch leaves it ``None`` again,
    as it was before the sweep."""
    torch.manual_seed(0)
    model = Body().double()
    ids, labels = data()
    scale = nn.Parameter(torch.ones((), dtype=F64))
    calls = []

    def fails_the_second_time(out, y):
        calls.append(scale.grad is None)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return ce(out * scale, y)

    opt = torch.optim.SGD([*model.parameters(), scale], lr=0.1)
    with pytest.raises(RuntimeError, match="boom"):
        ef.sweep(
            model, dict(model.named_parameters()), ids, labels, loss=fails_the_second_time,
            split_at=["blocks.*"], update=opt, microbatches=2,
        )  # fmt: skip
    assert calls == [True, False] and scale.grad is None


def test_a_failure_in_the_backward_names_the_stages_already_stepped():
    torch.manual_seed(0)
    model = Body().double()
    ids, labels = data()

    def fail(grad):
        raise RuntimeError("boom")

    model.emb.weight.register_hook(fail)  # the last gradient autograd finishes
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="boom") as info:
        ef.sweep(model, dict(model.named_parameters()), ids, labels, loss=ce, split_at=["blocks.*"], update=opt)
    assert any("already stepped" in n and "'head'" in n for n in info.value.__notes__)


class Wide(nn.Module):
    """Blocks with wide weights and narrow activations: the gradients dominate the step's memory."""

    def __init__(self, width=256, depth=6):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def test_the_fused_step_holds_one_stage_of_gradients_not_all():
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(2, 256)
    params = dict(model.named_parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    block = grad_bytes / len(model.blocks)

    def loss(out):
        return out.square().mean()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with LiveBytes() as unfused:
        grads = ef.grad(model, params, x, loss=loss, split_at=["blocks.*"])
        ef.write_grads(model, grads)
        del grads
        opt.step()
        opt.zero_grad(set_to_none=True)
    with LiveBytes() as fused:
        ef.sweep(model, params, x, loss=loss, split_at=["blocks.*"], update=opt)
    assert unfused.peak >= grad_bytes  # every gradient alive at once
    assert fused.peak < 2.5 * block  # one block's gradients, and its rebuild (activations are tiny)


class Trunk(nn.Module):
    """A causal LM's body (embedding, blocks, final norm) beside which the head runs in the loss."""

    def __init__(self, width=16, depth=3, vocab=4096):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.norm(h)


def test_the_fused_step_with_a_chunked_head_never_holds_the_logits():
    """Fused update + ``ef.chunked_loss`` (8 chunks): the step's peak holds one chunk of logits, not
    the (tokens x vocab) logits and their gradient autograd holds; the weights are autograd's."""
    torch.manual_seed(0)
    vocab, width = 4096, 16
    trunk, head = Trunk(width, vocab=vocab), nn.Linear(width, vocab, bias=False)
    ids = torch.randint(vocab, (4, 64), generator=torch.Generator().manual_seed(0))
    per_token = functools.partial(F.cross_entropy, reduction="none")
    logits_bytes = ids.numel() * vocab * 4
    reference_trunk, reference_head = copy.deepcopy(trunk), copy.deepcopy(head)
    opt = torch.optim.SGD([*reference_trunk.parameters(), *reference_head.parameters()], lr=0.1)
    with LiveBytes() as plain:
        out = reference_head(reference_trunk(ids))
        F.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        del out
        opt.step()
    opt = torch.optim.SGD([*trunk.parameters(), *head.parameters()], lr=0.1)
    chunked = ef.chunked_loss(head, per_token, chunks=8)
    with LiveBytes() as fused:
        ef.sweep(
            trunk, dict(trunk.named_parameters()), ids, ids, split_at=["blocks.*"], update=opt,
            loss=lambda h, y: chunked(h[:, :-1], y[:, 1:]),
        )  # fmt: skip
    for a, b in zip(
        [*trunk.parameters(), *head.parameters()], [*reference_trunk.parameters(), *reference_head.parameters()]
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    weights = sum(p.numel() * 4 for p in [*trunk.parameters(), *head.parameters()])
    assert plain.peak > 2 * logits_bytes  # the logits and their gradient
    # one chunk's logits, their gradient and softmax (3 x 1/8), the head's and embedding's gradients
    assert fused.peak < 3 / 8 * logits_bytes + 2 * weights + 0.1 * logits_bytes
