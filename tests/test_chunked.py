"""``ef.chunked_loss``: the LM head and its loss over token chunks, each differentiated as the forward
makes it, equal to the unchunked loss for any chunk count, with one chunk of logits alive at a time."""

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import eae_func as ef

from live_bytes import LiveBytes

F64 = torch.float64


def _case(tokens, vocab, dim, seed, ignored):
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(dim, vocab).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, dim, generator=g, dtype=F64))
        head.bias.copy_(torch.randn(vocab, generator=g, dtype=F64))
    hidden = torch.randn(2, tokens, dim, generator=g, dtype=F64, requires_grad=True)
    labels = torch.randint(0, vocab, (2, tokens), generator=g)
    labels[torch.rand(2, tokens, generator=g) < ignored] = -100
    return head, hidden, labels


def _grads(loss, hidden, head):
    return torch.autograd.grad(loss, [hidden, *head.parameters()])


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 12),
    vocab=st.integers(2, 9),
    chunks=st.integers(1, 30),
    seed=st.integers(0, 2**16),
    ignored=st.sampled_from([0.0, 0.3]),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_any_chunk_count_gives_the_unchunked_loss_and_gradients(tokens, vocab, chunks, seed, ignored, reduction):
    head, hidden, labels = _case(tokens, vocab, 5, seed, ignored)
    labels[0, 0] = 1  # at least one token counts
    want = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction=reduction)
    got = ef.chunked_loss(head, chunks=chunks, reduction=reduction)(hidden, labels)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    for a, b in zip(_grads(got, hidden, head), _grads(want, hidden, head)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_a_per_token_loss_of_its_own_and_a_scalar_one_refused():
    head, hidden, labels = _case(6, 7, 4, 0, 0.0)
    smoothed = functools.partial(F.cross_entropy, label_smoothing=0.1, reduction="none")
    got = ef.chunked_loss(head, smoothed, chunks=3)(hidden, labels)
    want = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), label_smoothing=0.1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match=r"one loss per token, shape \(4,\), got shape \(\)"):
        ef.chunked_loss(head, F.cross_entropy, chunks=3)(hidden, labels)  # a mean per chunk would be wrong
    with pytest.raises(ValueError, match=r"labels must have hidden's shape without its last dim \(2, 6\)"):
        ef.chunked_loss(head)(hidden, labels[:, 1:])
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        ef.chunked_loss(head, chunks=0)


def test_a_tied_head_gets_both_uses_and_a_frozen_bias_none():
    """The head's weight is the embedding's: autograd sums the two uses as for any glue parameter."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(11, 6).double(), nn.Linear(6, 11).double()
    head.weight = emb.weight
    head.bias.requires_grad_(False)
    ids = torch.randint(0, 11, (3, 5))
    got = {}
    for chunked in (False, True):
        emb.weight.grad = None
        h = torch.tanh(emb(ids))[:, :-1]
        if chunked:
            loss = ef.chunked_loss(head, chunks=4)(h, ids[:, 1:])
        else:
            loss = F.cross_entropy(head(h).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        got[chunked] = emb.weight.grad
        assert head.bias.grad is None
    torch.testing.assert_close(got[True], got[False], rtol=1e-12, atol=1e-14)


def test_bfloat16_logits_are_upcast_as_hugging_face_does():
    head, hidden, labels = _case(8, 13, 4, 3, 0.0)
    head, hidden = head.bfloat16(), hidden.detach().bfloat16()
    want = F.cross_entropy(head(hidden).float().flatten(0, 1), labels.flatten())
    got = ef.chunked_loss(head, chunks=5)(hidden, labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_one_chunk_of_logits_is_alive_at_a_time():
    """Live bytes of forward + backward: the unchunked head holds all N x V logits (and their gradient);
    chunked by 8 the peak is far below one copy of them."""
    torch.manual_seed(0)
    tokens, vocab, dim = 256, 2048, 8
    head = nn.Linear(dim, vocab, bias=False).double()
    hidden = torch.randn(1, tokens, dim, dtype=F64, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    logits_bytes = tokens * vocab * 8
    peaks = {}
    for name, fn in {
        "whole": lambda: F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten()),
        "chunked": lambda: ef.chunked_loss(head, chunks=8)(hidden, labels),
    }.items():
        with LiveBytes() as meter:
            loss = fn()
            grads = torch.autograd.grad(loss, [hidden, head.weight])
        del loss, grads
        peaks[name] = meter.peak
    assert peaks["whole"] >= 3 * logits_bytes  # logits, their log-softmax and their gradient
    # the same three for one chunk, the head's gradient summed so far and the chunk's, dLoss/dh, scalars
    floor = 3 * logits_bytes // 8 + 2 * vocab * dim * 8 + tokens * dim * 8
    assert floor <= peaks["chunked"] <= floor + 1024, peaks


class Tiny(nn.Module):
    """Embedding, two cut layers, a final norm; the head an attribute the loss reads (glue)."""

    def __init__(self, vocab=17, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


def test_in_a_sweep_at_run_time_the_gradients_are_autograds():
    """At run time the head is glue: its (tied) weight gets both uses. A captured chain differentiates its
    loss only at the chain's output: a loss that closes over the head is refused there, never dropped."""
    torch.manual_seed(0)
    model = Tiny().double()
    ids = torch.randint(0, 17, (3, 7))
    chunked = ef.chunked_loss(model.head, chunks=4)

    def loss(hidden, ids):
        return chunked(hidden[:, :-1], ids[:, 1:])

    params = dict(model.named_parameters())
    grads = ef.grad(model, params, ids, ids, loss=loss, split_at=["layers.*"])
    h = model(ids)[:, :-1]
    F.cross_entropy(model.head(h).flatten(0, 1), ids[:, 1:].flatten()).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-13, msg=n)
    with pytest.raises(ValueError, match=r"loss: it depends on tensors that require grad besides the chain's output"):
        ef.grad(model, params, ids, ids, loss=loss, split_at=["layers.*"], capture="graph")


def test_the_head_runs_once_per_chunk_and_the_backward_only_scales():
    """Where a backward follows, each chunk is differentiated as the forward makes it: the head runs
    ``chunks`` times in all (not again in the backward), the loss's scale reaches the gradients, a
    second backward is refused; without grad the forward differentiates nothing."""
    head, hidden, labels = _case(12, 7, 5, 0, 0.3)
    calls = []
    head.register_forward_hook(lambda *a: calls.append(1))
    loss = ef.chunked_loss(head, chunks=3)
    value = loss(hidden, labels)
    want = _grads(F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten()) * 2.5, hidden, head)
    calls.clear()
    got = torch.autograd.grad(value * 2.5, [hidden, *head.parameters()], retain_graph=True)
    assert not calls  # the backward ran no head
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="a second backward through the same loss"):
        torch.autograd.grad(value, [hidden])
    with torch.no_grad(), LiveBytes() as live:
        loss(hidden, labels)
    assert live.peak < 12 * 7 * 8 + 12 * 5 * 8  # a chunk's logits, no gradient of the hidden states
