"""Model-level estimators: node perturbation (np) and direct projection.

For physical stages l with exact input costates g_l and probes u_{l,i}:

    np:     D_i = Σ_l <u_{l,i}, g_l>  (ONE scalar per probe and sample: summed over the
            physical stages and over the positions of a sample); ĝ_l = (1/n) Σ_i u_{l,i} D_i
    direct: ĝ_l = (1/n) Σ_i u_{l,i} <u_{l,i}, g_l>  (per stage; scalar per probe and batch
            position), no cross-stage terms

Forms of the scalars:
    oracle  g_l from one exact reverse sweep (``ef.sweep`` without estimator), then projected
    jvp     directional derivatives of the per-sample losses by forward-mode AD through the
            network (np: all physical inputs shifted at once) or through the suffix from stage l
            (direct); no backward pass
    fd      central differences (ℓ_b(+εu) − ℓ_b(−εu)) / 2ε of the per-sample losses, the chunk's
            ± copies folded into the batch dim; every stage only run forward, on plain tensors

Per-sample losses (jvp, fd): the loss must be a ``reduction`` ("mean" or "sum") over dim 0
of per-sample terms; sample b's term is ``chain.loss`` on the batch of one (x_L[b:b+1],
loss_args[b:b+1]) (tensor loss_args with a leading batch dim are sliced, others passed
whole), evaluated with ``vmap`` over the samples, and its share of the loss is that term
/ B ("mean") or itself ("sum"), times the microbatch's loss_scale. ``prepare`` checks that
the shares add up to the loss. With ``batch_dims > 1`` the jvp and fd forms take their
scalar per sample (dim 0), so direct's jvp/fd differ from its per-position oracle (both
unbiased); with ``batch_dims=0`` the scalar is the whole batch's loss. Probing a sample
alone assumes the stages treat samples independently (no train-mode BatchNorm).

Replay: the core's reverse sweep gets ĝ_l as the input costate of physical stage l;
its parameters get the exact local vjp from the costate arriving at its output (oracle,
jvp) or probed parameter directions (fd). Cost per physical stage: ``queries`` per sample,
the same for every form (np: 2n full-network forwards, shared by all physical stages;
direct: 2n·k stage forwards for the k-th physical stage from the end, since it probes
through every downstream one, 2n·Σk in all); the rows and calls actually run are counted by
``problem.charge``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch.func import jvp, vmap

from .. import boundary as B
from ..chain import Chain, stage
from ..microbatch import merge_counters
from ..physical import rows_of
from ..tree import NAMESPACE
from .base import Problem
from .local import (
    Flat,
    call,
    check_eps,
    check_probes,
    exact_param_grads,
    fd_param_grads,
    fold,
    forward_mode,
    per_position,
    perturb_folded,
    where,
)
from .probes import Probes, guide

__all__ = ["ModelLevel", "NodePerturbation", "Prepared", "direct", "node_perturbation"]


FORMS = ("oracle", "jvp", "fd")
REDUCTIONS = ("mean", "sum")


@dataclasses.dataclass(frozen=True)
class Prepared:
    """ĝ_l as ``(*batch_shape, d_l)`` per probed physical stage, and each physical stage's cost."""

    costates: dict
    costs: dict


class _Run:
    """One ``prepare``: the physical stages' boundaries and probe layouts."""

    def __init__(self, estimator: ModelLevel, problem: Problem):
        self.estimator, self.problem = estimator, problem
        self.physical = problem.physical
        self.loss_args: tuple = problem.loss_args or ()
        self.boundaries: dict = {}
        self.outputs: dict = {}
        self.flats: dict = {}
        self.placements: dict = {}
        self.guides: dict | None = None

    def count(self, i: int, kind: str, rows: int) -> None:
        """One more call of stage i of ``kind`` (forward_calls, jvp_calls, backward_calls) on ``rows`` rows."""
        if i in self.physical:
            self.problem.charge(i, rows, kind)

    def layout(self, i: int, floats: list) -> None:
        """Record the probe space of physical stage i's input from its differentiable leaves."""
        self.flats[i] = Flat(floats, self.estimator.probes.batch_dims, f"input of {where(self.problem, i)}")
        if floats:
            self.placements[i] = (floats[0].dtype, floats[0].device)

    def zeros(self, i: int) -> torch.Tensor:
        """A zero costate estimate ``(*batch_shape, d_i)`` for stage i."""
        dtype, device = self.placements[i]
        return torch.zeros((*self.flats[i].batch_shape, self.flats[i].d), dtype=dtype, device=device)

    @property
    def probed(self) -> list:
        """Physical stages with a differentiable input (an integer input has no costate to estimate)."""
        return [i for i in self.physical if self.flats[i].d > 0]

    def probe_chunks(self, i: int) -> Iterator[torch.Tensor]:
        """Stage i's input probes, chunk by chunk."""
        flat, (dtype, device) = self.flats[i], self.placements[i]
        return self.estimator.probes.chunks(self.problem.probe_seed(i), flat.batch_shape, flat.d, dtype, device)

    def chunks(self, stages: list, dims: int) -> Iterator[dict]:
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

    def exact_costates(self) -> dict:
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

    def run(self, start: int, h: Any, shifts: dict, kind: str, copies: int = 1) -> Any:
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

    def slopes_jvp(self, start: int, probes: dict) -> torch.Tensor:
        """Per-sample directional derivatives of the loss shares, all ``probes[i]`` injected at once."""
        h0, order = self.boundaries[start], list(probes)

        def shares_at(*deltas: torch.Tensor) -> torch.Tensor:
            shifts = {i: (lambda h, i=i, dlt=dlt: self.shift(i, h, dlt)) for i, dlt in zip(order, deltas)}
            return self.shares(self.run(start, h0, shifts, "jvp_calls", len(probes[order[0]])))

        zeros = tuple(torch.zeros_like(probes[i][0]) for i in order)
        with forward_mode():  # every probe sees the tape's dropout masks (its RNG state replayed)
            return vmap(lambda *us: jvp(shares_at, zeros, us)[1], randomness="same")(*(probes[i] for i in order))

    def slopes_fd(self, start: int, probes: dict) -> torch.Tensor:
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


class ModelLevel:
    """Shared by node perturbation and direct: forms, probing in ``prepare``, the replay."""

    name = "model_level"
    scope = "model"

    @property
    def differentiates(self) -> bool:
        return self.form != "fd"

    @property
    def fd(self) -> bool:
        """Whether it measures by central differences (and probes the stages' parameters)."""
        return self.form == "fd"

    def __init__(self, probes: Probes, form: str = "oracle", eps: float = 1e-3, reduction: str = "mean"):
        self.probes = check_probes(self.name, probes)
        if form not in FORMS:
            raise ValueError(f"{self.name}: unknown form {form!r}; expected one of {FORMS}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"{self.name}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if form == "fd" and probes.batch_dims < 1:
            raise ValueError(
                f"{self.name}: form 'fd' folds probes into the leading batch dim, so it needs "
                f"Probes(batch_dims >= 1), got batch_dims={probes.batch_dims}"
            )
        self.form, self.eps, self.reduction = form, check_eps(self.name, eps), reduction

    def __repr__(self) -> str:
        return f"{self.name}({self.probes!r}, form={self.form!r}, eps={self.eps:g}, reduction={self.reduction!r})"

    def prepare(self, problem: Problem, guide: Callable[[Any], dict] | None = None) -> Prepared:
        run, chunks = self.measurements(problem, guide=guide)
        totals: dict = {}
        for chunk in chunks:
            for i, (u, scalar) in chunk.items():
                if i not in totals:
                    totals[i] = run.zeros(i)
                totals[i] += (u * run.expand(scalar, i)).sum(0)
        return Prepared({i: t / self.probes.n for i, t in totals.items()}, self.costs(problem))

    def measurements(
        self, problem: Problem, states: Any = None, guide: Callable[[Any], dict] | None = None
    ) -> tuple[Any, Iterator[dict]]:
        """``(run, chunks)``: this microbatch's run (probe layouts; each physical stage's input and
        output as the estimator's forward measured them: ``run.boundaries``, ``run.outputs``) and,
        chunk by chunk, ``{stage: (u, scalar)}``: each probed stage's probes and the scalars the
        estimate multiplies them by (np: ``D_i``, shared by the stages; direct: the stage's own),
        ``ĝ = (1/n) Σ u · scalar``. With ``states`` (an earlier run, jvp and fd forms) nothing is run
        forward: the probes see the earlier run's states (a network of twins probed where the
        hardware was, along its guides). With ``guide(run) -> {stage: s}`` (after the forward, before
        any probe) the probes are guided along ``s`` (``E.guided``)."""
        if problem.x is None or problem.exact_trace is None:
            raise ValueError(
                f"{self.name}: a model-level estimator probes the whole chain from its input, so it "
                f"needs the chain in one process (ef.sweep); in a pipeline use zbp or exact"
            )
        run = _Run(self, problem)
        exact = run.exact_costates() if self.form == "oracle" else None
        if states is not None:
            run.boundaries, run.outputs, run.flats, run.placements, run.guides = (
                states.boundaries,
                states.outputs,
                states.flats,
                states.placements,
                states.guides,
            )
        elif exact is None:
            run.check_shares(run.forward())
        if guide is not None:
            run.guides = guide(run)
        return run, self.probe(run) if exact is None else self.oracle(run, exact)

    def costs(self, problem: Problem) -> dict:
        return {i: {"queries": self.queries(problem, i)} for i in problem.physical}

    def stage_vjp(
        self, problem: Problem, prepared: Prepared, i: int, h_in: Any, costate: Any, param_draw: Callable | None = None
    ):
        """Physical stage i's reverse step: its estimated input costate, and its parameters' gradient
        (``param_draw``: the probed parameter directions, as in ``local.param_directional``)."""
        floats, _, costate_like = B.split(h_in, f"input of {where(problem, i)}")
        flat = Flat(floats, self.probes.batch_dims, f"input of {where(problem, i)}")
        input_costate = costate_like(flat.leaves(prepared.costates[i]) if flat.d else [])
        if self.form == "fd":
            grads, param_cost = fd_param_grads(problem, i, h_in, costate, self.probes, self.eps, param_draw)
        else:
            grads, param_cost = exact_param_grads(problem, i, h_in, costate)
        return grads, input_costate, merge_counters(prepared.costs[i], param_cost)

    def oracle(self, run: _Run, exact: dict) -> Iterator[dict]:
        raise NotImplementedError

    def probe(self, run: _Run) -> Iterator[dict]:
        raise NotImplementedError

    def queries(self, problem: Problem, i: int) -> int:
        raise NotImplementedError


class NodePerturbation(ModelLevel):
    """np: ``ĝ_l = (1/n) Σ_i u_{l,i} D_i``, ``D_i = Σ_l <u_{l,i}, g_l>`` per sample (see module doc)."""

    name = "node_perturbation"

    def oracle(self, run: _Run, exact: dict) -> Iterator[dict]:
        return self._lockstep(
            run, lambda chunks: sum(per_position(u * exact[i], run.scalar_dims()) for i, u in chunks.items())
        )

    def probe(self, run: _Run) -> Iterator[dict]:
        slopes = run.slopes_jvp if self.form == "jvp" else run.slopes_fd
        return self._lockstep(run, lambda chunks: slopes(min(chunks), chunks))

    def _lockstep(self, run: _Run, scalars) -> Iterator[dict]:
        """The probes of all probed stages drawn chunk by chunk in lockstep, one scalar D for all."""
        probed = run.probed
        if not probed:
            return
        for chunks in run.chunks(probed, run.scalar_dims()):
            d = scalars(chunks)
            yield {i: (u, d) for i, u in chunks.items()}

    def queries(self, problem: Problem, i: int) -> int:
        return 2 * self.probes.n


class Direct(ModelLevel):
    """direct: ``ĝ_l = (1/n) Σ_i u_{l,i} <u_{l,i}, g_l>`` per stage (see module doc)."""

    name = "direct"

    def oracle(self, run: _Run, exact: dict) -> Iterator[dict]:
        for i, g in exact.items():
            for chunk in run.chunks([i], self.probes.batch_dims):
                yield {i: (chunk[i], per_position(chunk[i] * g, self.probes.batch_dims))}

    def probe(self, run: _Run) -> Iterator[dict]:
        slopes = run.slopes_jvp if self.form == "jvp" else run.slopes_fd
        for i in run.probed:
            for chunk in run.chunks([i], run.scalar_dims()):
                yield {i: (chunk[i], slopes(i, chunk))}

    def queries(self, problem: Problem, i: int) -> int:
        downstream = sum(1 for j in problem.physical if j >= i)
        return 2 * self.probes.n * downstream


def node_perturbation(
    probes: Probes, form: str = "oracle", eps: float = 1e-3, reduction: str = "mean"
) -> NodePerturbation:
    """Node perturbation: all physical inputs perturbed at once, one scalar per probe and sample
    ``D_i = Σ_l <u_{l,i}, g_l>``, ``ĝ_l = (1/n) Σ_i u_{l,i} D_i``. form: "oracle" | "jvp" | "fd";
    ``reduction``: how the loss reduces over samples (jvp, fd)."""
    return NodePerturbation(probes, form, eps, reduction)


def direct(probes: Probes, form: str = "oracle", eps: float = 1e-3, reduction: str = "mean") -> Direct:
    """Direct projection per physical stage ``ĝ_l = (1/n) Σ_i u_{l,i} <u_{l,i}, g_l>`` (no cross-stage
    terms). form: "oracle" | "jvp" | "fd"; ``reduction``: how the loss reduces over samples (jvp, fd)."""
    return Direct(probes, form, eps, reduction)
