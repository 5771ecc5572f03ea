"""Wire codecs: how a tensor crosses a rank boundary.

A codec maps a tensor ``t`` to a payload (a tuple of tensors) that is what
actually goes on the wire, and back:

    raw:       t                                       (4 bytes / entry for float32)
    cast(d):   t.to(d)                                 float16 / bfloat16: 2 bytes / entry
    int8:      s = max|t| / 127,  q = clamp(round(t / s), -127, 127)    1 byte / entry + s
    fp8(d):    s = max|t| / finfo(d).max,  q = d(clamp(t / s))          1 byte / entry + s,
               sent as its raw bytes viewed as uint8 (gloo has no float8 types)
    topk(r):   the k = ceil(r n) entries of largest |t|: int32 indices + values

``decode(encode(t))`` is exactly what the matching pass of ``eae_func.passes``
computes (``P.cast``, ``P.int8()``, ``P.fp8``, ``P.topk``): both use the math of
``eae_func.quantise``, so a codec on a pipeline boundary and its ``as_pass()`` in a
single process give the same gradients. All-zero tensors stay zero.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import optree
import torch

from .. import quantise as Q
from ..adjoint import AdjointState
from ..checks import check_ratio
from ..passes import Pass, stateless
from ..tree import NAMESPACE

__all__ = ["Codec", "cast", "fp8", "int8", "raw", "topk"]


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A tensor of ``shape`` and ``dtype`` as ``codec`` put it on the wire.

    ``arg`` is the one integer the receiver needs besides shape and dtype to
    allocate the payload (``k`` for top-k, else 0).
    """

    codec: Codec
    shape: tuple[Any, ...]
    dtype: torch.dtype
    arg: int
    payload: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.payload)

    def decode(self) -> torch.Tensor:
        return self.codec.decode(self)


class Codec:
    """Base of the wire codecs: ``encode(t) -> Encoded``, ``decode(Encoded) -> t'`` and
    ``layout(shape, dtype, arg)``, the (shape, dtype) of each payload tensor, which is
    what the receiver allocates before the payload arrives."""

    name = "codec"

    def encode(self, t: torch.Tensor) -> Encoded:
        raise NotImplementedError

    def decode(self, enc: Encoded) -> torch.Tensor:
        raise NotImplementedError

    def layout(self, shape: tuple[Any, ...], dtype: torch.dtype, arg: int) -> tuple[Any, ...]:
        raise NotImplementedError

    def arg_for(self, shape: tuple[Any, ...]) -> int:
        """The ``arg`` of every encoding of a tensor of ``shape`` (what a receiver allocates for)."""
        return 0

    def _encoded(self, t: torch.Tensor, payload: tuple[Any, ...], arg: int = 0) -> Encoded:
        return Encoded(self, tuple(t.shape), t.dtype, arg, tuple(p.contiguous() for p in payload))

    def as_pass(self) -> Pass:
        """The encode -> decode round trip as a pass, as in a pipeline boundary: appends
        ``"wire:<name>"`` to ``adj.history`` and records ``wire_bytes`` (payload bytes)
        and ``wire_ratio`` (payload bytes / the costate's own bytes). Two codecs of one kind and
        settings give equal passes."""
        wire = stateless(lambda adj: round_trip(self, adj)[0], f"wire({self.name})")
        return dataclasses.replace(wire, value=("wire", type(self).__name__, *sorted(vars(self).items())))

    def __repr__(self) -> str:
        return self.name


def round_trip(codec: Codec, adj: AdjointState) -> tuple[AdjointState, list[Any]]:
    """``(adj with each tensor of its costate replaced by decode(encode(tensor)), the Encoded of each
    leaf)``: a costate is a tensor or a pytree of them, ``None`` where a leaf has none (no Encoded)."""
    leaves, spec = optree.tree_flatten(adj.value, none_is_leaf=True, namespace=NAMESPACE)
    for t in leaves:
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{codec.name}: wire codecs take tensor costates, boundary {adj.index} has a {type(t).__name__}"
            )
    encoded = [None if t is None else codec.encode(t) for t in leaves]
    sent = sum(enc.nbytes for enc in encoded if enc is not None)
    own = sum(t.numel() * t.element_size() for t in leaves if t is not None)
    value = spec.unflatten([None if enc is None else enc.decode() for enc in encoded])
    return adj.applied(f"wire:{codec.name}", value, wire_bytes=sent, wire_ratio=sent / own if own else 1.0), encoded


class Raw(Codec):
    """The tensor itself."""

    name = "raw"

    def encode(self, t):
        return self._encoded(t, (t,))

    def decode(self, enc):
        return enc.payload[0]

    def layout(self, shape, dtype, arg):
        return ((shape, dtype),)


class Cast(Codec):
    """``t.to(dtype)`` on the wire, cast back on arrival (float16 or bfloat16)."""

    def __init__(self, dtype: torch.dtype):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"cast: dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
        self.dtype, self.name = dtype, f"cast({str(dtype).removeprefix('torch.')})"

    def encode(self, t):
        return self._encoded(t, (t.to(self.dtype),))

    def decode(self, enc):
        return enc.payload[0].to(enc.dtype)

    def layout(self, shape, dtype, arg):
        return ((shape, self.dtype),)


def _scale_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class Int8(Codec):
    """Symmetric per-tensor int8: ``s = max|t| / 127``, ``q = clamp(round(t / s), -127, 127)``
    (int8) plus ``s`` (float32; float64 for float64 tensors); decodes to ``q * s``. 1 byte per entry + 4."""

    name = "int8"

    def encode(self, t):
        q, s = Q.int8_encode(t)
        return self._encoded(t, (q, s.reshape(1)))

    def decode(self, enc):
        q, s = enc.payload
        return Q.int8_decode(q, s, enc.dtype)

    def layout(self, shape, dtype, arg):
        return ((shape, torch.int8), ((1,), _scale_dtype(dtype)))


class FP8(Codec):
    """Scaled float8, per tensor: ``s = max|t| / finfo(dtype).max``, ``q = dtype(clamp(t / s))``,
    sent as q's bytes (uint8) plus ``s`` (float32); decodes to ``float(q) * s``."""

    def __init__(self, dtype: torch.dtype = torch.float8_e4m3fn):
        if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"fp8: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype!r}")
        self.dtype = dtype
        self.name, self.fmax = f"fp8({str(dtype).removeprefix('torch.')})", torch.finfo(dtype).max

    def encode(self, t):
        q, s = Q.fp8_encode(t, self.dtype)
        return self._encoded(t, (q.view(torch.uint8), Q.safe(s).reshape(1)))

    def decode(self, enc):
        q, s = enc.payload
        return Q.fp8_decode(q.view(self.dtype), s, enc.dtype)

    def layout(self, shape, dtype, arg):
        return ((shape, torch.uint8), ((1,), _scale_dtype(dtype)))


class TopK(Codec):
    """The ``k = ceil(ratio n)`` entries of largest ``|t|`` (at least one), sent as int32 flat
    indices (int64 beyond 2^31 entries) and their values; decodes to zeros elsewhere."""

    def __init__(self, ratio: float):
        self.ratio = check_ratio("topk", ratio)
        self.name = f"topk({self.ratio:g})"

    @staticmethod
    def _index_dtype(n: int) -> torch.dtype:
        return torch.int32 if n < 2**31 else torch.int64

    def encode(self, t):
        index = Q.topk_indices(t, Q.kept(self.ratio, t.numel()))
        return self._encoded(t, (index.to(self._index_dtype(t.numel())), t.reshape(-1)[index]), arg=len(index))

    def decode(self, enc):
        index, values = enc.payload
        return Q.scatter(index, values, enc.shape)

    def layout(self, shape, dtype, arg):
        return (((arg,), self._index_dtype(math.prod(shape))), ((arg,), dtype))

    def arg_for(self, shape):
        return Q.kept(self.ratio, math.prod(shape))


def raw() -> Codec:
    """The tensor as it is (no compression)."""
    return Raw()


def cast(dtype: torch.dtype) -> Codec:
    """The tensor cast to ``dtype`` on the wire (fp16, bf16) and back."""
    return Cast(dtype)


def int8() -> Codec:
    """Symmetric per-tensor int8: ``s = max|t| / 127``, ``q = clamp(round(t / s), -127, 127)``, sent with ``s``."""
    return Int8()


def fp8(dtype: torch.dtype = torch.float8_e4m3fn) -> Codec:
    """Scaled per-tensor float8: ``s = max|t| / finfo(dtype).max``, ``q = dtype(clamp(t / s))``, sent with ``s``."""
    return FP8(dtype)


def topk(ratio: float) -> Codec:
    """The ``k = ceil(ratio n)`` entries of largest ``|t|`` (at least one) with their indices; zeros elsewhere."""
    return TopK(ratio)
