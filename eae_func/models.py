"""Reference decoder-only transformer blocks, as ordinary ``nn.Module``s.

RMSNorm, rotary position embeddings, causal grouped-query attention on
``F.scaled_dot_product_attention``, SwiGLU, a pre-norm block, and an LM with a
head tied to its token embedding. ``transformer_lm`` returns an
``nn.Sequential`` (embedding, blocks..., head), one EAE stage per child.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "CausalSelfAttention", "RMSNorm", "SwiGLU", "TiedHead", "lm_loss", "rotary", "transformer_lm"]


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight``."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate pairs ``(x_i, x_{i+d/2})`` of ``x: (B, H, T, d)`` by angle ``t * base^(-2i/d)``."""
    t, d = x.shape[-2], x.shape[-1]
    freqs = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    """Causal attention with ``n_heads`` query heads sharing ``n_kv_heads`` key/value heads, RoPE on q and k."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, dropout: float = 0.0):
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                f"CausalSelfAttention: need dim % n_heads == 0 and n_heads % n_kv_heads == 0, "
                f"got dim={dim}, n_heads={n_heads}, n_kv_heads={n_kv_heads}"
            )
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.dropout = dropout
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(x).view(b, t, 2, self.n_kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotary(q), rotary(k)
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``; ``dropout`` applies to the
    attention weights and to both residual branches."""

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int | None = None, ffn_hidden: int | None = None, dropout: float = 0.0
    ):
        super().__init__()
        self.attn_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = CausalSelfAttention(dim, n_heads, n_kv_heads, dropout)
        self.ffn = SwiGLU(dim, ffn_hidden or 4 * dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x)))
        return x + self.drop(self.ffn(self.ffn_norm(x)))


class TiedHead(nn.Module):
    """Final RMSNorm, then logits ``h @ E^T`` with ``E`` the embedding's weight (the same Parameter)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.norm = RMSNorm(embedding.embedding_dim)
        self.weight = embedding.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(h), self.weight)


def transformer_lm(
    vocab: int,
    dim: int,
    depth: int,
    n_heads: int,
    n_kv_heads: int | None = None,
    ffn_hidden: int | None = None,
    dropout: float = 0.0,
) -> nn.Sequential:
    """``nn.Sequential(embedding, block_1..block_depth, tied head)``: one EAE stage per child."""
    embedding = nn.Embedding(vocab, dim)
    nn.init.normal_(embedding.weight, std=dim**-0.5)
    blocks = [Block(dim, n_heads, n_kv_heads, ffn_hidden, dropout) for _ in range(depth)]
    return nn.Sequential(embedding, *blocks, TiedHead(embedding))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all positions of ``logits: (B, T, V)``."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
