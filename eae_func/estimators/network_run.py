"""One model-level measurement (``ModelLevel.measurements``): the network run forward from its
input with the physical stages' boundaries kept, the probe layouts, the per-sample loss shares, and
the directional derivatives of those shares along probes injected at the physical inputs (jvp, or
central differences with the probes' copies folded into the batch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import optree
import torch
from torch.func import jvp, vmap

from ..core import boundary as B
from ..core.problem import Problem
from ..program.chain import Chain, stage
from ..program.physical import rows_of
from ..tree import NAMESPACE
from .local import Flat, call, fold, forward_mode, perturb_folded, where
from .probes import Probes, guide

__all__ = ["NetworkRun", "Probing"]


class Probing(Protocol):
    """What a run reads of its model-level estimator (``ModelLevel``)."""

    name: str
    probes: Probes
    form: str
    eps: float
    reduction: str


class NetworkRun:
    """One ``prepare``: the physical stages' boundaries and probe layouts."""

    def __init__(self, estimator: Probing, problem: Problem):
        self.estimator, self.problem = estimator, problem
        self.physical = problem.physical
        self.loss_args: tuple[Any, ...] = problem.loss_args or ()
        self.boundaries: dict[Any, Any] = {}
        self.outputs: dict[Any, Any] = {}
        self.flats: dict[Any, Any] = {}
        self.placements: dict[Any, Any] = {}
        self.guides: dict[Any, Any] | None = None

    def count(self, i: int, kind: str, rows: int) -> None:
        """One more call of stage i of ``kind`` (forward_calls, jvp_calls, backward_calls) on ``rows`` rows."""
        if i in self.physical:
            self.problem.charge(i, rows, kind)

    def layout(self, i: int, floats: list[Any]) -> None:
        """Record the probe space of physical stage i's input from its differentiable leaves."""
        self.flats[i] = Flat(floats, self.estimator.probes.batch_dims, f"input of {where(self.problem, i)}")
        if floats:
            self.placements[i] = (floats[0].dtype, floats[0].device)

    def zeros(self, i: int) -> torch.Tensor:
        """A zero costate estimate ``(*batch_shape, d_i)`` for stage i."""
        dtype, device = self.placements[i]
        return torch.zeros((*self.flats[i].batch_shape, self.flats[i].d), dtype=dtype, device=device)

    @property
    def probed(self) -> list[Any]:
        """Physical stages with a differentiable input (an integer input has no costate to estimate)."""
        return [i for i in self.physical if self.flats[i].d > 0]

    def probe_chunks(self, i: int) -> Iterator[torch.Tensor]:
        """Stage i's input probes, chunk by chunk."""
        flat, (dtype, device) = self.flats[i], self.placements[i]
        return self.estimator.probes.chunks(self.problem.probe_seed(i), flat.batch_shape, flat.d, dtype, device)

    def chunks(self, stages: list[Any], dims: int) -> Iterator[dict[Any, Any]]:
        """``{stage: u}`` chunk by chunk: the probes of ``stages`` drawn in lockstep, guided jointly
        along ``self.guides`` where set (``probes.guide``; ``dims``: the batch dims one scalar keeps)."""
        first = 0
        for chunk in zip(*(self.probe_chunks(i) for i in stages)):
            probes = dict(zip(stages, chunk))
            if self.guides is not None:
                guides = {i: self.guides[i] for i in stages}
                probes = guide(probes, guides, first, self.estimator.probes.n, dims)
            first += len(chunk[0])
            yield probes

    def shift(self, i: int, h: Any, delta: torch.Tensor) -> Any:
        """``h`` with its differentiable leaves shifted by ``delta: (*batch_shape, d_i)``."""
        floats, rebuild, _ = B.split(h, f"input of {where(self.problem, i)}")
        return rebuild([t + dt for t, dt in zip(floats, self.flats[i].leaves(delta))])

    # ---- oracle: exact input costates from one exact sweep ----

    def exact_costates(self) -> dict[Any, Any]:
        """g_l (times loss_scale) for every physical stage, from ``sweep`` without estimator."""
        p, chain = self.problem, self.problem.chain

        def counted(i: int):
            def fn(params, h):
                self.count(i, "forward_calls", rows_of(h))
                out = call(p, i, params, h)
                if i in self.physical and i not in self.outputs:  # the first call: the trace's forward
                    self.boundaries[i], self.outputs[i] = (
                        optree.tree_map(lambda t: t.detach(), tree, namespace=NAMESPACE) for tree in (h, out)
                    )
                return out

            return fn

        counting = Chain([stage(counted(i), name=s.name) for i, s in enumerate(chain.stages)], loss=chain.loss)
        assert p.exact_trace is not None  # checked by prepare
        trace = p.exact_trace(counting)
        for i in self.physical:
            self.count(i, "backward_calls", 0)
        costates = {a.index: a.value for a in trace}
        result = {}
        for i in self.physical:
            floats = optree.tree_leaves(costates[i], namespace=NAMESPACE)
            self.layout(i, floats)
            if self.flats[i].d:
                result[i] = self.flats[i].vector(floats) * p.loss_scale
        return result

    # ---- jvp / fd: per-sample losses of the network run forward ----

    def forward(self) -> Any:
        """Plain forward from x_0, keeping the physical stages' inputs; returns x_L."""
        h = self.problem.x
        with torch.no_grad():
            for i in range(len(self.problem.chain)):
                if i in self.physical:
                    self.boundaries[i] = h
                    self.layout(i, B.split(h, f"input of {where(self.problem, i)}")[0])
                self.count(i, "forward_calls", rows_of(h))
                out = call(self.problem, i, self.problem.params[i], h)
                if i in self.physical:
                    self.outputs[i] = out
                h = self.problem.fed(i, out)
        return h

    def run(self, start: int, h: Any, shifts: dict[Any, Any], kind: str, copies: int = 1) -> Any:
        """Stages ``start..L-1`` on ``h`` (``copies`` of it under vmap); before stage i, ``shifts[i](h)``
        is applied."""
        for i in range(start, len(self.problem.chain)):
            if i in shifts:
                h = shifts[i](h)
            self.count(i, kind, copies * rows_of(h))
            h = self.problem.fed(i, call(self.problem, i, self.problem.params[i], h))
        return h

    def scalar_dims(self) -> int:
        return min(self.estimator.probes.batch_dims, 1)

    def shares(self, out: Any) -> torch.Tensor:
        """Each sample's share of the loss at output ``out`` (``(B,)``; the loss itself when batch_dims=0)."""
        p = self.problem
        if self.scalar_dims() == 0:
            return p.chain.loss(out, *self.loss_args) * p.loss_scale
        size = optree.tree_leaves(out, namespace=NAMESPACE)[0].shape[0]
        sliced = [isinstance(a, torch.Tensor) and a.ndim > 0 and a.shape[0] == size for a in self.loss_args]

        def sample_loss(o: Any, *rows: torch.Tensor) -> torch.Tensor:
            it = iter(rows)
            args = [next(it).unsqueeze(0) if s else a for a, s in zip(self.loss_args, sliced)]
            return p.chain.loss(optree.tree_map(lambda t: t.unsqueeze(0), o, namespace=NAMESPACE), *args)

        losses = vmap(sample_loss)(out, *[a for a, s in zip(self.loss_args, sliced) if s])
        weight = p.loss_scale / size if self.estimator.reduction == "mean" else p.loss_scale
        return losses * weight

    def folded_shares(self, out: Any, k: int) -> torch.Tensor:
        """``shares`` of each of the ``k`` copies folded into the batch dim of ``out``: ``(k, B)``."""
        unfolded = optree.tree_map(lambda t: t.view(k, t.shape[0] // k, *t.shape[1:]), out, namespace=NAMESPACE)
        return vmap(self.shares)(unfolded)

    def check_shares(self, out: Any) -> None:
        p = self.problem
        with torch.no_grad():
            total = p.chain.loss(out, *self.loss_args) * p.loss_scale
            shares = self.shares(out)
        tol = (1e-9 if shares.dtype == torch.float64 else 1e-4) * (shares.abs().sum() + 1e-30)
        if (shares.sum() - total).abs() > tol:
            raise ValueError(
                f"{self.estimator.name}(form={self.estimator.form!r}): the loss is not a per-sample "
                f"{self.estimator.reduction} over dim 0 (loss {total.item():.6g}, per-sample shares sum to "
                f"{shares.sum().item():.6g}); pass reduction='sum' or 'mean' to match the loss, or use form='oracle'"
            )

    def expand(self, scalar: torch.Tensor, i: int) -> torch.Tensor:
        """A per-probe scalar ``(k, *batch_shape[:s])`` broadcastable against probes ``(k, *batch_shape, d_i)``."""
        extra = len(self.flats[i].batch_shape) - (scalar.ndim - 1)
        return scalar.reshape(*scalar.shape, *[1] * (extra + 1))

    def slopes_jvp(self, start: int, probes: dict[Any, Any]) -> torch.Tensor:
        """Per-sample directional derivatives of the loss shares, all ``probes[i]`` injected at once."""
        h0, order = self.boundaries[start], list(probes)

        def shares_at(*deltas: torch.Tensor) -> torch.Tensor:
            shifts = {i: (lambda h, i=i, dlt=dlt: self.shift(i, h, dlt)) for i, dlt in zip(order, deltas)}
            return self.shares(self.run(start, h0, shifts, "jvp_calls", len(probes[order[0]])))

        zeros = tuple(torch.zeros_like(probes[i][0]) for i in order)
        with forward_mode():  # every probe sees the tape's dropout masks (its RNG state replayed)
            return vmap(lambda *us: jvp(shares_at, zeros, us)[1], randomness="same")(*(probes[i] for i in order))

    def slopes_fd(self, start: int, probes: dict[Any, Any]) -> torch.Tensor:
        """Central differences of the loss shares, the ± copies of all probes folded into the batch."""
        eps = self.estimator.eps
        k = next(iter(probes.values())).shape[0]
        drawing = sorted(i for i in self.problem.drawn if i >= start)
        if drawing:
            raise ValueError(
                f"{self.estimator.name}(form='fd'): {where(self.problem, drawing[0])} draws random "
                f"numbers (dropout in train mode), and the probes' copies folded into the batch would "
                f"see other draws than the sweep replays; use form='jvp' or 'oracle', or eval mode"
            )
        shifts = {
            i: (
                lambda h, i=i, u=u: perturb_folded(
                    h, 2 * k, self.flats[i], eps * torch.cat([u, -u]), f"input of {where(self.problem, i)}"
                )
            )
            for i, u in probes.items()
        }
        with torch.no_grad():
            shares = self.folded_shares(
                self.run(start, fold(self.boundaries[start], 2 * k), shifts, "forward_calls"), 2 * k
            )
        return (shares[:k] - shares[k:]) / (2 * eps)
