"""Physical stages: an adapter that makes a simulator or an instrument a stage, and the meter
that counts what every physical stage is run on in one step.

    optics = ef.black_box(simulate, name="optics", numpy=True, per_sample=True, workers=4)
    chain = ef.Chain([encoder, optics, readout], loss=F.cross_entropy)
    res = ef.sweep(chain, params, x, y, estimator=E.zbp(E.Probes(32), method="fd"), budget=10_000)
    res.stats["optics"]["rows"], res.stats["optics"]["calls"]

A black box is only ever run forward, on plain tensors (or numpy arrays): estimators that
differentiate a stage (``exact``, ``zbp(method="jvp")``, the oracle and jvp forms) refuse it
before anything runs.
"""

from __future__ import annotations

import concurrent.futures
import functools
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import optree
import torch

from .. import compat
from ..tree import NAMESPACE
from .chain import Chain, Stage

__all__ = ["Meter", "ProbeChecks", "black_box", "rows_of"]


def rows_of(h: Any) -> int:
    """The rows (leading dim) of a boundary state: the batch a stage is run on."""
    for t in optree.tree_leaves(h, namespace=NAMESPACE):
        if isinstance(t, torch.Tensor):
            return int(t.shape[0]) if t.ndim else 1
    return 1


class Meter:
    """Rows and calls of every physical stage of ``chain`` in one step, against an optional
    ``budget`` of rows (all physical stages together; a stage made with ``repeats=r`` costs r rows
    per row). ``calls`` counts the calls that ran: a black box's calls of ``fn`` (``BlackBox.calls``),
    one per run of any other stage; ``forward_calls``, ``jvp_calls`` and ``backward_calls`` count
    the runs of the stage. ``charge`` is called before a stage runs, so a call that would exceed
    the budget raises and never runs."""

    KINDS = ("forward_calls", "jvp_calls", "backward_calls")

    def __init__(self, chain: Chain, physical: tuple[int, ...], budget: int | None = None):
        self.chain, self.budget, self.total = chain, budget, 0
        self.counts = {i: {"rows": 0, "calls": 0, **dict.fromkeys(self.KINDS, 0)} for i in physical}

    def charge(self, i: int, rows: int, kind: str = "forward_calls") -> None:
        """Count one ``kind`` call of stage i on ``rows`` rows (0 for a backward, which reuses a forward)."""
        if i not in self.counts:
            return
        fn = self.chain.stages[i].fn
        calls = fn.calls(rows) if isinstance(fn, BlackBox) else 1
        rows *= getattr(fn, "repeats", 1)
        if self.budget is not None and self.total + rows > self.budget:
            spent = ", ".join(f"{self.chain.stages[j].name!r} {c['rows']}" for j, c in self.counts.items())
            raise RuntimeError(
                f"budget: {self.chain.where(i)} would run {rows} more rows ({kind}), "
                f"{self.total + rows} in all, over the budget of {self.budget} rows per step "
                f"(rows so far: {spent}); raise budget= or use fewer probes"
            )
        self.total += rows
        counts = self.counts[i]
        counts[kind] += 1
        counts["rows"] += rows
        counts["calls"] += calls if kind != "backward_calls" else 0


class ProbeChecks:
    """Refuse what a physical stage returned on an estimator's probe calls if it is not finite: the
    estimate made from it would be NaN while the loss, from the forward, stays finite. Each call's
    non-finite entries are counted on the device (``add``) and read once per estimate (``check``),
    not once per call, so a probe call waits for nothing. A simulation being differentiated (under
    a torch.func transform: the jvp forms; or with its graph: the exact vjp) measures nothing."""

    def __init__(self, chain: Chain):
        self.chain = chain
        self.counts: dict[int, list[Any]] = {}  # stage -> [non-finite count (device), entries, calls, first call rows]

    def add(self, i: int, out: Any, h: Any) -> None:
        floats = [
            t
            for t in optree.tree_leaves(out, namespace=NAMESPACE)
            if isinstance(t, torch.Tensor)
            and (t.is_floating_point() or t.is_complex())
            and not (t.requires_grad or wrapped(t))
        ]
        if not floats:
            return
        device = floats[0].device
        count = torch.stack([(~torch.isfinite(t)).sum().to(device, non_blocking=True) for t in floats]).sum()
        entry = self.counts.setdefault(i, [0, 0, 0, rows_of(h)])
        entry[0] = count if entry[2] == 0 else entry[0] + count
        entry[1] += sum(t.numel() for t in floats)
        entry[2] += 1

    def check(self) -> None:
        """Read the counts since the last check (one read per stage) and raise on a non-finite one."""
        counts, self.counts = self.counts, {}
        for i, (count, total, calls, rows) in counts.items():
            bad = int(count)
            if bad:
                raise FloatingPointError(
                    f"estimator: {self.chain.where(i)} returned {bad} non-finite values (NaN or inf) of {total} "
                    f"over {calls} probe calls (the first on {rows} rows; inputs or parameters shifted by the probes); "
                    f"the estimate would be NaN while the loss stays finite. Keep the probed points where the "
                    f"stage measures (a smaller eps), or make it return finite values there"
                )


def wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a torch.func transform's tensor (jvp, vjp, vmap), not plain data."""
    return compat.functorch_wrapped(t)


def query(fn: Callable[..., Any], args: Any, repeats: int, piece: Any) -> Any:
    """``fn(args, piece)`` averaged over ``repeats`` queries (a module-level function: picklable)."""
    total = fn(args, piece)
    for _ in range(repeats - 1):
        total = total + fn(args, piece)
    return total / repeats if repeats > 1 else total


class BlackBox:
    """The function of a black-box stage: ``fn`` run on plain data, rows split into calls of at
    most ``max_rows`` (one unbatched row each with ``per_sample``), mapped over ``workers``, each
    call averaged over ``repeats`` queries; the output comes back in the input's dtype and device."""

    def __init__(
        self,
        fn: Callable[..., Any],
        numpy: bool,
        per_sample: bool,
        max_rows: int | None,
        workers: int | concurrent.futures.Executor | None,
        dtype: Any,
        repeats: int,
        name: str | None,
    ):
        self.fn, self.numpy, self.per_sample, self.dtype, self.repeats = fn, numpy, per_sample, dtype, repeats
        self.max_rows = 1 if per_sample else max_rows
        self.workers = workers
        self.__name__ = name or getattr(fn, "__name__", "black_box")

    def __repr__(self) -> str:
        return f"black_box({getattr(self.fn, '__name__', type(self.fn).__name__)})"

    def calls(self, rows: int) -> int:
        """How many times ``fn`` runs for a stage run on ``rows`` rows: ``repeats × ⌈rows / max_rows⌉``."""
        return self.repeats * -(-rows // (self.max_rows or rows or 1))

    def __call__(self, params: Any, h: torch.Tensor) -> torch.Tensor:
        where = f"black box {self.__name__!r}"
        if not isinstance(h, torch.Tensor) or not (h.is_floating_point() or h.is_complex()) or h.ndim < 1:
            got = f"{h.dtype} tensor of shape {tuple(h.shape)}" if isinstance(h, torch.Tensor) else type(h).__name__
            raise TypeError(f"{where}: expected one floating-point tensor with a batch dim as input, got {got}")
        if any(
            wrapped(t) for t in (h, *optree.tree_leaves(params, namespace=NAMESPACE)) if isinstance(t, torch.Tensor)
        ):
            raise RuntimeError(
                f"{where}: called under a torch.func transform (jvp, vjp, vmap); a black box is only "
                "run forward on plain data: use an fd estimator, twin or frozen"
            )
        with torch.no_grad():
            data, args = self._plain(h.detach()), optree.tree_map(self._plain, params, namespace=NAMESPACE)
            step = self.max_rows or len(h)
            pieces = [data[j : j + step] for j in range(0, len(h), step)]
            if self.per_sample:
                pieces = [p[0] for p in pieces]
            outs = self._map(functools.partial(query, self.fn, args, self.repeats), pieces)
            outs = [self._tensor(o, h, where) for o in outs]
            for o, piece in zip(outs, pieces):
                if not self.per_sample and o.ndim == 0:
                    raise ValueError(
                        f"{where}: returned a 0-d tensor (one number) for a call on {len(piece)} rows; a black box "
                        f"returns one row per input row, shape ({len(piece)}, ...) (use per_sample=True for a "
                        "function of one sample, which may return a scalar)"
                    )
            out = torch.stack(outs) if self.per_sample else torch.cat(outs)
        if out.shape[0] != h.shape[0]:
            raise ValueError(
                f"{where}: returned {out.shape[0]} rows for an input of {h.shape[0]}; a black box must "
                "keep the batch dim (use per_sample=True for a function of one sample)"
            )
        return out

    def _plain(self, t: torch.Tensor) -> Any:
        """``t`` as the black box gets it: a read-only numpy array (a write into it would corrupt the
        sweep's saved boundary unseen, numpy writes bumping no torch version counter) or a tensor."""
        t = t.detach()
        if not self.numpy:
            return t.to(self.dtype) if self.dtype is not None else t
        cpu = t.cpu()
        array = (cpu.float() if cpu.dtype == torch.bfloat16 else cpu).numpy()  # numpy has no bfloat16
        array = array.astype(self.dtype) if self.dtype is not None else array
        array.flags.writeable = False
        return array

    def _map(self, fn: Callable[..., Any], pieces: list[Any]) -> list[Any]:
        if isinstance(self.workers, concurrent.futures.Executor):  # a process pool: send pieces in batches
            return list(self.workers.map(fn, pieces, chunksize=max(1, len(pieces) // 16)))
        if self.workers and self.workers > 1 and len(pieces) > 1:
            with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
                return list(pool.map(fn, pieces))
        return [fn(p) for p in pieces]

    @staticmethod
    def _tensor(out: Any, like: torch.Tensor, where: str) -> torch.Tensor:
        if isinstance(out, np.ndarray) or np.isscalar(out):
            out = torch.from_numpy(np.asarray(out))
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{where}: returned {type(out).__name__}, expected a numpy array or a tensor")
        if out.is_complex() and not like.is_complex():
            raise TypeError(
                f"{where}: returned a complex {out.dtype} output for a real {like.dtype} input; return "
                "a real measurement (an intensity, or real and imaginary parts)"
            )
        return out.to(dtype=like.dtype, device=like.device)


def black_box(
    fn: Callable[..., Any],
    name: str | None = None,
    *,
    numpy: bool = False,
    per_sample: bool = False,
    max_rows: int | None = None,
    workers: int | concurrent.futures.Executor | None = None,
    dtype: Any = None,
    repeats: int = 1,
) -> Stage:
    """A physical stage from a simulator or instrument ``fn(params, x) -> y``, run forward only.

    numpy:       ``fn`` gets numpy arrays (``x`` and every parameter) and may return one;
    dtype:       the dtype ``fn`` computes in (numpy or torch, e.g. ``np.float64``; ``None``: the input's);
                 the output always comes back in the input's dtype and on its device.
    per_sample:  ``fn`` takes one sample (no batch dim) per call; otherwise ``max_rows`` caps the
                 rows per call (``None``: the whole batch, probe copies included, in one call).
    workers:     run the calls in a thread pool of this size, or on a ``concurrent.futures`` executor
                 (e.g. a ``ProcessPoolExecutor``, for a picklable ``fn``).
    repeats:     average each call over this many queries (noise std / √repeats; costs repeats × rows).

    Autograd never reaches ``fn``: it runs under ``no_grad`` on detached data, and a call under a
    torch.func transform raises.
    """
    if not callable(fn):
        raise TypeError(f"black_box: expected a callable fn(params, x), got {type(fn).__name__}")
    for what, v in (("max_rows", max_rows), ("repeats", repeats)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
            raise ValueError(f"black_box: {what} must be an int >= 1, got {v!r}")
    if per_sample and max_rows is not None:
        raise ValueError("black_box: per_sample=True calls fn on one sample at a time; max_rows does not apply")
    if (
        workers is not None
        and not isinstance(workers, concurrent.futures.Executor)
        and (isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or workers < 1)
    ):
        raise ValueError(f"black_box: workers must be an int >= 1 or a concurrent.futures.Executor, got {workers!r}")
    box = BlackBox(fn, numpy, per_sample, max_rows, workers, dtype, int(repeats), name)
    return Stage(fn=box, name=name, physical=True, differentiable=False)
