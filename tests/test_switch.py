"""``ef.enable``: the model cut at run time for every forward, so ``loss.backward()`` runs the EAE
reverse steps into ``.grad``: autograd's gradients, ``ef.sweep``'s records, the training loop as written."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import eae_func as ef
from eae_func import passes as P

from live_bytes import LiveBytes


class Net(nn.Module):
    """Embedding, blocks called from Python (one of them twice, with dropout), a final norm and a head."""

    def __init__(self, width=6, depth=3, vocab=9, dropout=0.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(dropout)) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for block in [*self.blocks, self.blocks[0]]:
            h = h + block(h)
        return self.head(self.norm(h))


def ce(logits, labels):
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten())


def batch(vocab=9, rows=3, seq=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (rows, seq), generator=g), torch.randint(vocab, (rows, seq), generator=g)


def grads_of(model):
    return {n: p.grad for n, p in model.named_parameters()}


@settings(max_examples=25, deadline=None)
@given(
    depth=st.integers(1, 4),
    width=st.integers(2, 7),
    cut=st.sampled_from([["blocks.*"], ["blocks.0"], ["blocks.*", "norm"], ["blocks.1", "head"], ["emb", "blocks.*"]]),
    seed=st.integers(0, 2**16),
)
def test_backward_of_an_enabled_model_is_autograds_with_the_sweeps_records(depth, width, cut, seed):
    if depth < 2 and "blocks.1" in cut:
        cut = ["blocks.0"]
    torch.manual_seed(seed)
    model = Net(width, depth).double()
    ids, labels = batch(seed=seed)
    reference = copy.deepcopy(model)
    ce(reference(ids), labels).backward()
    swept = ef.sweep(
        model, dict(model.named_parameters()), ids, labels, loss=ce, split_at=cut, passes=P.scale(1.0), key=3
    )
    with ef.enable(model, split_at=cut, passes=P.scale(1.0), key=3):
        ce(model(ids), labels).backward()
        got = ef.records(model)
    for n, g in grads_of(reference).items():
        torch.testing.assert_close(model.get_parameter(n).grad, g, rtol=1e-12, atol=1e-15, msg=n)
        torch.testing.assert_close(swept.grads[n], g, rtol=1e-12, atol=1e-15, msg=n)
    assert [(a.index, a.stage, a.key, a.history) for a in got.values()] == [
        (a.index, a.stage, a.key, a.history) for a in swept.adjoints
    ]


def loop(model, steps, opt_of, step_of):
    opt = opt_of(model.parameters())
    for k in range(steps):
        step_of(model, opt, k)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_training_loop_with_accumulation_and_clipping_is_unchanged():
    """AdamW, two backwards accumulated per step, ``clip_grad_norm_``, dropout: the weights after
    three steps equal the loop without EAE, in fp32, bit for bit."""
    torch.manual_seed(0)
    model = Net(dropout=0.2)
    data = [batch(seed=s) for s in range(6)]

    def step(m, opt, k):
        opt.zero_grad(set_to_none=True)
        for ids, labels in data[2 * k : 2 * k + 2]:
            torch.manual_seed(k)  # the same dropout masks in both loops
            (ce(m(ids), labels) / 2).backward()
        nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        opt.step()

    def adamw(ps):
        return torch.optim.AdamW(ps, lr=1e-2)

    want = loop(copy.deepcopy(model), 3, adamw, step)
    ef.enable(model, split_at=["blocks.*"])
    got = loop(model, 3, adamw, step)
    ef.disable(model)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)


def test_inference_is_untouched_and_disable_puts_everything_back():
    torch.manual_seed(0)
    model = Net()
    ids, _ = batch()
    with torch.no_grad():
        want = model(ids)
    hooks = dict(model._forward_pre_hooks), dict(model._state_dict_hooks)
    switch = ef.enable(model, split_at=["blocks.*"])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), want, rtol=0, atol=0)
    assert switch.current is None  # nothing made, nothing kept
    model.eval()
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), want, rtol=0, atol=0)
    assert switch.current is None
    ef.disable(model)
    assert all("forward" not in b.__dict__ for b in model.blocks)
    assert (dict(model._forward_pre_hooks), dict(model._state_dict_hooks)) == hooks
    assert "eae_pass_state" not in model.state_dict()
    assert ef.enabled(model) is None


def test_two_forwards_before_one_backward_and_a_second_backward():
    torch.manual_seed(0)
    model = Net().double()
    reference = copy.deepcopy(model)
    (a, y), (b, z) = batch(seed=1), batch(seed=2)
    (ce(reference(a), y) + ce(reference(b), z)).backward()
    with ef.enable(model, split_at=["blocks.*"]):
        (ce(model(a), y) + ce(model(b), z)).backward()  # two sweeps in one backward
        for n, g in grads_of(reference).items():
            torch.testing.assert_close(model.get_parameter(n).grad, g, rtol=1e-12, atol=1e-15, msg=n)
        loss = ce(model(a), y)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match=r"retain_graph=True.*not supported at the cuts"):
            loss.backward()


def test_stateful_passes_resume_bit_identically_from_the_state_dict():
    """Error feedback's residuals thread from backward to backward and travel in ``state_dict``:
    three steps in one run equal two steps, a save and load into a fresh model, and one more."""
    passes = P.error_feedback(P.int8())
    data = [batch(seed=s) for s in range(3)]

    def run(model, steps, opt):
        for ids, labels in data[steps]:
            opt.zero_grad(set_to_none=True)
            ce(model(ids), labels).backward()
            opt.step()

    torch.manual_seed(0)
    whole = Net()
    fresh = copy.deepcopy(whole)
    ef.enable(whole, split_at=["blocks.*"], passes=passes)
    opt = torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9)
    run(whole, slice(0, 2), opt)
    saved = io.BytesIO()
    torch.save({"model": whole.state_dict(), "opt": opt.state_dict()}, saved)
    assert ef.enabled(whole).pass_state is not None
    run(whole, slice(2, 3), opt)

    ef.enable(fresh, split_at=["blocks.*"], passes=passes)
    checkpoint = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    fresh.load_state_dict(checkpoint["model"])
    opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(checkpoint["opt"])
    run(fresh, slice(2, 3), opt)
    for (n, p), q in zip(whole.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    # a state dict without the pass state (saved before enabling) loads strictly and keeps the state
    state = ef.enabled(fresh).pass_state
    fresh.load_state_dict({k: v for k, v in checkpoint["model"].items() if k != "eae_pass_state"})
    assert ef.enabled(fresh).pass_state is state


def test_on_costate_sees_each_record_and_options_the_loop_owns_are_refused():
    torch.manual_seed(0)
    model = Net()
    ids, labels = batch()
    want = {
        a.stage: a.value
        for a in ef.sweep(model, dict(model.named_parameters()), ids, labels, loss=ce, split_at=["blocks.*"]).adjoints
    }
    with ef.enable(model, split_at=["blocks.*"]) as switch:  # keep_costates=False: the records drop them
        seen = []
        remove = switch.on_costate(lambda a: seen.append((a.stage, a.value)))
        ce(model(ids), labels).backward()
        remove()
        assert [s for s, _ in seen] == ["blocks.0#2", "blocks.2", "blocks.1", "blocks.0"]
        assert all(torch.equal(value, want[stage]) for stage, value in seen)  # the listener sees the costate
        assert list(ef.records(model)) == [s for s, _ in seen]
        assert all(a.value is None for a in ef.records(model).values())
        with pytest.raises(ValueError, match="already enabled"):
            ef.enable(model, split_at=["blocks.*"])
    with pytest.raises(ValueError, match=r"enable: microbatches=.*ef.sweep"):
        ef.enable(model, split_at=["blocks.*"], microbatches=2)
    with pytest.raises(ValueError, match=r"enable: capture='graph' \(an enabled model is cut at run time"):
        ef.enable(model, split_at=["blocks.*"], capture="graph")
    assert ef.enabled(model) is None
    with pytest.raises(ValueError, match="not enabled"):
        ef.disable(model)


def test_a_hugging_face_lm_trains_unchanged():
    """GPT-2 with its dropout, three SGD steps with momentum: autograd's weights to float32 rounding.
    (Not to the bit: with attention dropout, or eager attention, the gradients of ``c_attn`` and the tied
    embedding differ from autograd's in the last bits, while a lone block under the same costate is
    exact; and the key bias's gradient is zero up to rounding (softmax ignores a constant per row), so
    AdamW, which divides it by its own size, turns those last bits into steps of the learning rate.)"""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    model.config.attn_implementation = "eager"
    ids = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(0))

    def step(m, opt, k):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(k)  # the same dropout masks in both loops
        m(ids, labels=ids).loss.backward()
        opt.step()

    def sgd(ps):
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9)

    want = loop(copy.deepcopy(model).train(), 3, sgd, step)
    with ef.enable(model.train(), split_at=["transformer.h.*"]):
        assert model.config.use_cache is False
        got = loop(model, 3, sgd, step)
        assert list(ef.records(model)) == ["transformer.h.1", "transformer.h.0"]
    assert model.config.use_cache is True
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7, msg=n)


def test_a_fused_update_steps_inside_loss_backward_as_the_loop_would():
    """``ef.enable(update=opt)``: the loop as written (backward, ``opt.step()``, ``zero_grad``) gives
    autograd + AdamW's weights bit for bit, ``opt.step()`` says once that it finds nothing to step, a
    second backward before it is refused, and ``disable`` gives ``.grad`` back."""
    torch.manual_seed(0)
    model = Net(width=32, dropout=0.2)
    data = [batch(seed=s) for s in range(3)]

    def step(m, opt, k):
        ids, labels = data[k]
        torch.manual_seed(k)
        ce(m(ids), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def adamw(ps):
        return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)

    want = loop(copy.deepcopy(model), 3, adamw, step)
    opt = adamw(model.parameters())
    with ef.enable(model, split_at=["blocks.*"], update=opt):
        with pytest.warns(UserWarning, match=r"stepped inside the backward, so AdamW.step\(\) finds no gradient"):
            step(model, opt, 0)
        for k in (1, 2):
            step(model, opt, k)
        assert all(p.grad is None for p in model.parameters())
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
        ids, labels = data[0]
        ce(model(ids), labels).backward()
        with pytest.raises(RuntimeError, match=r"second gradient before the optimizer's step\(\)"):
            ce(model(ids), labels).backward()  # accumulation: the first backward stepped already
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)
    model.zero_grad(set_to_none=True)
    ce(model(ids), labels).backward()  # disabled: autograd's .grad again
    assert all(p.grad is not None for p in model.parameters())


def test_a_fused_update_the_switch_cannot_serve_is_refused():
    model = Net()
    params = dict(model.named_parameters())
    pure = ef.fused(lambda p, g, s: (p, s), {n: None for n in params})
    with pytest.raises(ValueError, match=r"enable: update= with a pure function"):
        ef.enable(model, split_at=["blocks.*"], update=pure)
    model.head.weight.grad = torch.zeros_like(model.head.weight)
    with pytest.raises(ValueError, match=r"already have .grad set"):
        ef.enable(model, split_at=["blocks.*"], update=torch.optim.SGD(model.parameters(), lr=0.1))
    assert ef.enabled(model) is None


def test_the_fused_backward_holds_one_block_of_gradients_not_all():
    torch.manual_seed(0)
    model, x = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(6))), torch.randn(2, 256)
    grads = sum(p.numel() * 4 for p in model.parameters())
    block = grads / len(model)
    with LiveBytes() as plain:
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ef.enable(model, split_at=["*"], update=opt), pytest.warns(UserWarning, match="finds no gradient"):
        model(x).square().mean().backward()
        opt.step()
        with LiveBytes() as fused:
            model(x).square().mean().backward()
    assert plain.peak >= grads  # every gradient alive at once
    assert fused.peak < 2.5 * block, (fused.peak, block)  # one block's gradients and its rebuild


class Outer(nn.Module):
    """A body and a head, as a causal LM is laid out: the loop may call the body alone."""

    def __init__(self):
        super().__init__()
        self.body = Net(width=6, depth=2)
        self.head = nn.Linear(9, 9)

    def forward(self, ids):
        return self.head(self.body(ids))


def test_each_backward_of_a_submodules_forward_is_a_sweep_of_its_own():
    """The body of an enabled model called alone (as a chunked head's loop does), forward and backward
    twice: each backward's records are those of a fresh sweep (indices from 1, keys folded from them),
    not the continuation of the sweep before."""
    torch.manual_seed(0)
    model = Outer().double()
    ids, labels = batch()
    want = ef.sweep(
        model.body, dict(model.body.named_parameters()), ids, labels, loss=ce, split_at=["blocks.*"], key=5
    ).adjoints
    with ef.enable(model, split_at=["body.blocks.*"], key=5):
        for _ in range(2):
            ce(model.body(ids), labels).backward()
            got = list(ef.records(model).values())
            assert [(a.index, a.key) for a in got] == [(a.index, a.key) for a in want]


def test_the_switch_holds_what_ef_grad_holds_to_the_byte():
    """An enabled model's ``loss.backward()`` peaks at exactly ``ef.grad``'s live bytes on the same
    model and batch: the switch adds nothing to a run-time sweep."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)), nn.Linear(64, 3))
    x, y = torch.randn(256, 64), torch.randint(0, 3, (256,))
    with LiveBytes() as swept:
        grads = ef.grad(
            model, dict(model.named_parameters()), x, y, loss=F.cross_entropy, split_at=["0", "1", "2", "3"]
        )
    del grads
    with ef.enable(model, split_at=["0", "1", "2", "3"]), LiveBytes() as switched:
        F.cross_entropy(model(x), y).backward()
    assert switched.peak == swept.peak, (switched.peak, swept.peak)


def test_a_backward_under_another_autocast_rebuilds_in_the_forwards():
    """The forward under bfloat16 autocast, the backward inside a float16 one: each cut's rebuild runs
    in the autocast its forward ran in (its dtype too, not only whether it was on), so the gradients
    are eager autograd's bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = reference(x).float().square().mean()
    with torch.autocast("cpu", dtype=torch.float16):
        loss.backward()
    with ef.enable(model, split_at=["1"]):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        with torch.autocast("cpu", dtype=torch.float16):
            loss.backward()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), n
