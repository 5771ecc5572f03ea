"""The LM head and its loss over token chunks, so the logits never exist whole.

    loss(h, y) = (1/n) Σ_c Σ_{t in c} ell(head(h_t), y_t)        n = #{t : y_t != ignore_index}
                                                                 (reduction="sum": n = 1)

The forward runs each chunk of tokens through ``head`` and ``ell`` and, where a backward will follow
(grad enabled and something requires grad), differentiates the chunk at once, one
``torch.autograd.grad`` each, writing the chunk's rows of dLoss/dh and adding up the head's parameter
gradients; the chunk's logits are dropped before the next. The backward only scales what the forward
found by the incoming gradient (a loss is linear in its own scale), so nothing is computed twice, as in
Liger's fused linear cross-entropy. So a training step holds one chunk of logits (and their gradient)
where an unchunked head holds all N x V of them: at a 32k vocabulary and 8k tokens, 1 GiB in fp32.
The head's parameters are inputs of the one autograd node, so autograd accumulates their gradients
as for any glue parameter (a tied embedding gets the sum of both uses). Logits of a 16-bit dtype are upcast to float32 before ``ell``, as Hugging Face's causal-LM
loss does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

__all__ = ["chunked_loss"]

LOW = (torch.float16, torch.bfloat16)  # logits upcast to float32 before the loss


def chunked_loss(
    head: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    chunks: int = 8,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(hidden, labels)``: ``loss_fn(head(hidden), labels)`` reduced over the tokens, computed over
    ``chunks`` chunks of tokens that are each rebuilt in the backward (the module docstring's math).

    hidden:   ``(..., D)``, the body's last hidden states; labels: ``hidden.shape[:-1]``, integer ids
              (shift them as the model's own loss does: ``hidden[:, :-1]``, ``labels[:, 1:]``).
    loss_fn:  per-token losses ``loss_fn(logits (n, V), labels (n,)) -> (n,)``, 0 where a label is
              ignored; ``None``: cross-entropy with ``ignore_index``.
    reduction: ``"mean"`` over the tokens whose label is not ``ignore_index`` (Hugging Face's causal-LM
              loss), or ``"sum"``.
    """
    if not isinstance(head, nn.Module):
        raise TypeError(f"chunked_loss: head must be an nn.Module (the LM head), got {type(head).__name__}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunked_loss: chunks must be a positive int, got {chunks!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_loss: reduction must be 'mean' or 'sum', got {reduction!r}")
    per_token = loss_fn or (lambda logits, y: F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="none"))

    def loss(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not isinstance(hidden, torch.Tensor) or hidden.ndim < 2:
            raise ValueError(f"chunked_loss: hidden must be a (..., D) tensor, got {_shape(hidden)}")
        if not isinstance(labels, torch.Tensor) or labels.shape != hidden.shape[:-1]:
            raise ValueError(
                f"chunked_loss: labels must have hidden's shape without its last dim {tuple(hidden.shape[:-1])}, "
                f"got {_shape(labels)} (shift both as the model's loss does: hidden[:, :-1], labels[:, 1:])"
            )
        named = list(head.named_parameters())
        names, tensors = tuple(n for n, _ in named), tuple(t for _, t in named)
        flat, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        count = (y != ignore_index).sum() if reduction == "mean" else None
        plan = _Plan(head, names, per_token, min(chunks, max(1, flat.shape[0])), count)
        plan.differentiate = torch.is_grad_enabled() and any(t.requires_grad for t in (flat, *tensors))
        return _ChunkedLoss.apply(plan, flat, y, *tensors)

    return loss


def _shape(t: Any) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


class _Plan:
    """What the node needs besides tensors: the head, its parameter names, the per-token loss, the
    number of chunks, the count of tokens the mean divides by (``None``: a sum) and whether the
    forward differentiates (a backward will follow)."""

    def __init__(self, head: nn.Module, names: tuple[Any, ...], per_token: Callable[..., Any], chunks: int, count: Any):
        self.head, self.names, self.per_token, self.chunks, self.count = head, names, per_token, chunks, count
        self.differentiate = False

    def chunk_loss(self, params: dict[Any, Any], h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The chunk's summed token losses (over the mean's count)."""
        logits = functional_call(self.head, params, (h,)) if params else self.head(h)
        if logits.dtype in LOW:
            logits = logits.float()
        losses = self.per_token(logits, y)
        if not isinstance(losses, torch.Tensor) or losses.shape != y.shape:
            raise ValueError(
                f"chunked_loss: loss_fn must return one loss per token, shape {tuple(y.shape)}, got {_shape(losses)} "
                f"(e.g. functools.partial(F.cross_entropy, reduction='none'))"
            )
        total = losses.sum()
        return total if self.count is None else total / self.count


class _ChunkedLoss(torch.autograd.Function):
    """One node: the forward sums the chunks' losses and, where a backward will follow, their gradients
    (dLoss/dh by rows, the head's summed); the backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, hidden: torch.Tensor, labels: torch.Tensor, *params: torch.Tensor) -> Any:  # type: ignore[override]
        wanted = [plan.differentiate and p.requires_grad for p in params]
        local = {n: p.detach().requires_grad_(w) for n, p, w in zip(plan.names, params, wanted)}
        trained = [local[n] for n, w in zip(plan.names, wanted) if w]
        grad_hidden = torch.zeros_like(hidden) if plan.differentiate and hidden.requires_grad else None
        value = torch.zeros((), dtype=torch.float32 if hidden.dtype in LOW else hidden.dtype, device=hidden.device)
        sums: list[Any] = [None] * len(trained)
        rows = 0
        for h, y in zip(hidden.tensor_split(plan.chunks), labels.tensor_split(plan.chunks)):
            h = h.detach().requires_grad_(grad_hidden is not None)
            inputs = ([h] if grad_hidden is not None else []) + trained
            with torch.enable_grad() if inputs else contextlib.nullcontext():
                chunk = plan.chunk_loss(local, h, y)
            value += chunk.detach()
            if not inputs:
                continue
            got = torch.autograd.grad(chunk, inputs, allow_unused=True)
            del chunk  # the chunk's logits go before the next chunk's are made
            if grad_hidden is not None:
                grad_hidden[rows : rows + h.shape[0]] = got[0]
                got = got[1:]
            sums = [g if s is None else s if g is None else s.add_(g) for s, g in zip(sums, got)]
            rows += h.shape[0]
        it = iter(sums)
        ctx.grads = (grad_hidden, *[next(it) if w else None for w in wanted])
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        grads, ctx.grads = ctx.grads, None  # used once
        if grads is None:
            raise RuntimeError("chunked_loss: a second backward through the same loss is not supported")
        scaled = [None if g is None else g * grad.to(g.dtype) for g in grads]
        return (None, scaled[0], None, *scaled[1:])
