"""Random probe directions ``u`` for forward-only gradient estimators.

A probe set has shape ``(n, *batch_shape, d)``: ``batch_shape`` is the first
``batch_dims`` dimensions of a stage input (independent probes per sample, or
per token with ``batch_dims=2``) and ``d`` the rest flattened. Every kind has
``E[u u^T] = I`` per batch position, so ``(1/n) Σ u_i u_iᵀ g`` is unbiased:

    gaussian    u ~ N(0, I)
    rademacher  u_j = ±1
    sphere      uniform on the sphere of radius √d
    orthogonal  blocks of min(n, d) orthonormal directions scaled to √d
                (Haar-random, independent blocks when n > d)
    antithetic  (any kind) probes come in pairs (v, −v)

Draws are chunk-invariant: base direction j comes from block ``j // S`` drawn
with its own generator, seeded ``fold_in(seed, block)``, so probe i is the same
whatever the chunk size. ``S`` is ``DRAW_BLOCK`` (d for orthogonal: one block is
one orthogonal frame); at most one block is held besides the chunk, so memory
is O(max(chunk, S) × boundary size).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from ..adjoint import fold_in

__all__ = ["Probes", "guide"]


KINDS = ("gaussian", "rademacher", "sphere", "orthogonal")
DRAW_BLOCK = 16


class Probes:
    """``n`` probes of ``kind`` drawn ``chunk`` at a time (``None``: all at once), independent per
    position of the first ``batch_dims`` input dimensions; ``antithetic`` pairs them as (v, −v)."""

    def __init__(
        self, n: int, kind: str = "gaussian", chunk: int | None = None, batch_dims: int = 1, antithetic: bool = False
    ):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"Probes: n must be an int >= 1, got {n!r}")
        if kind not in KINDS:
            raise ValueError(f"Probes: unknown kind {kind!r}; expected one of {KINDS}")
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise ValueError(f"Probes: chunk must be None or an int >= 1, got {chunk!r}")
        if not isinstance(batch_dims, int) or isinstance(batch_dims, bool) or batch_dims < 0:
            raise ValueError(f"Probes: batch_dims must be an int >= 0, got {batch_dims!r}")
        self.n, self.kind, self.batch_dims, self.antithetic = n, kind, batch_dims, bool(antithetic)
        self.chunk = n if chunk is None else min(chunk, n)

    def __repr__(self) -> str:
        return (
            f"Probes(n={self.n}, kind={self.kind!r}, chunk={self.chunk}, batch_dims={self.batch_dims}, "
            f"antithetic={self.antithetic})"
        )

    def chunks(
        self, seed: int, batch_shape: tuple[Any, ...], d: int, dtype: torch.dtype, device: torch.device
    ) -> Iterator[torch.Tensor]:
        """The probes as consecutive chunks of shape ``(chunk, *batch_shape, d)``."""
        stream = _Stream(self, seed, tuple(batch_shape), d, dtype, device)
        for start in range(0, self.n, self.chunk):
            yield stream.draw(start, min(start + self.chunk, self.n))


class _Stream:
    """Probes ``start:stop`` of one probe set, from cached fixed-size blocks of base directions."""

    def __init__(
        self, probes: Probes, seed: int, batch_shape: tuple[Any, ...], d: int, dtype: torch.dtype, device: torch.device
    ):
        self.probes, self.seed, self.batch_shape, self.d, self.dtype, self.device = (
            probes,
            seed,
            batch_shape,
            d,
            dtype,
            device,
        )
        self.n_base = (probes.n + 1) // 2 if probes.antithetic else probes.n
        self.block_size = max(min(d, self.n_base), 1) if probes.kind == "orthogonal" else DRAW_BLOCK
        self.cached: tuple[int, torch.Tensor] | None = None

    def draw(self, start: int, stop: int) -> torch.Tensor:
        if not self.probes.antithetic:
            return self._base(start, stop)
        index = torch.arange(start, stop, device=self.device)
        base = self._base(start // 2, (stop - 1) // 2 + 1)
        sign = (1 - 2 * (index % 2)).to(self.dtype).view(-1, *[1] * (len(self.batch_shape) + 1))
        return base[index // 2 - start // 2] * sign

    def _base(self, start: int, stop: int) -> torch.Tensor:
        pieces = []
        for block in range(start // self.block_size, (stop - 1) // self.block_size + 1):
            first = block * self.block_size
            rows = self._block(block)
            pieces.append(rows[max(start - first, 0) : stop - first])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _block(self, block: int) -> torch.Tensor:
        if self.cached is None or self.cached[0] != block:
            self.cached = None  # free the old block before drawing the next
            count = min(self.block_size, self.n_base - block * self.block_size)
            generator = torch.Generator(device=self.device).manual_seed(fold_in(self.seed, block))
            self.cached = (block, self._sample(count, generator))
        return self.cached[1]

    def _sample(self, count: int, generator: torch.Generator) -> torch.Tensor:
        kind, d, shape = self.probes.kind, self.d, (count, *self.batch_shape, self.d)
        work = self.dtype if self.dtype in (torch.float32, torch.float64) else torch.float32
        if kind == "rademacher":
            u = torch.randint(0, 2, shape, generator=generator, device=self.device).to(work) * 2 - 1
        elif kind == "orthogonal":
            g = torch.randn((*self.batch_shape, d, count), generator=generator, dtype=work, device=self.device)
            q, r = torch.linalg.qr(g)  # Haar-random orthonormal columns once signs follow diag(R)
            q = q * torch.sgn(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
            u = q.movedim(-1, 0) * math.sqrt(d)
        else:
            u = torch.randn(shape, generator=generator, dtype=work, device=self.device)
            if kind == "sphere":
                u = u * (math.sqrt(d) / torch.linalg.vector_norm(u, dim=-1, keepdim=True))
        return u.to(self.dtype)


def guide(chunk: dict[Any, Any], s: dict[Any, Any], first: int, n: int, dims: int) -> dict[Any, Any]:
    """``chunk`` (``{stage: u}``, probes ``first..first+k−1`` of ``n``, each ``(k, *batch_shape, d)``)
    guided along ``s`` (``{stage: (*batch_shape, d)}``): probe 0 is ``√n ŝ`` and probe i ≥ 1 is
    ``√(n/(n−1)) (u_i − ŝ (ŝ·u_i))``, ``ŝ = s / ‖s‖`` with the norm and the inner products taken
    jointly over the stages and over every dim after the first ``dims`` batch dims (what one measured
    scalar sums over). ``E[u uᵀ] = I`` gives ``E[(1/n) Σ ũ ũᵀ] = ŝŝᵀ + (I − ŝŝᵀ) = I``; where ``s`` is
    zero, probe 0 is zero and the others are ``√(n/(n−1)) u``, still ``I`` on average."""

    def scalar(t: torch.Tensor, lead: int) -> torch.Tensor:  # summed over all but the first lead + dims dims
        return t.reshape(*t.shape[: lead + dims], -1).sum(-1)

    def spread(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t.reshape(*t.shape, *[1] * (like.ndim - t.ndim))

    norm2 = torch.stack([scalar(t * t, 0) for t in s.values()]).sum(0)
    inverse = torch.where(norm2 > 0, norm2.rsqrt(), 0.0)
    hat = {i: t * spread(inverse, t) for i, t in s.items()}
    along = torch.stack([scalar(u * hat[i].to(u.dtype), 1) for i, u in chunk.items()]).sum(0)
    guided = {}
    for i, u in chunk.items():
        direction = hat[i].to(u.dtype)
        u = (u - direction * spread(along, u)) * math.sqrt(n / (n - 1))
        guided[i] = torch.cat([math.sqrt(n) * direction.unsqueeze(0), u[1:]]) if first == 0 else u
    return guided
