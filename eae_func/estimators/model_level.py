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

from ..core import boundary as B
from ..core.microbatch import merge_counters
from ..core.problem import Problem
from .local import Flat, check_eps, check_probes, exact_param_grads, fd_param_grads, per_position, where
from .network_run import NetworkRun
from .probes import Probes

__all__ = ["ModelLevel", "NodePerturbation", "Prepared", "direct", "node_perturbation"]


FORMS = ("oracle", "jvp", "fd")
REDUCTIONS = ("mean", "sum")


@dataclasses.dataclass(frozen=True)
class Prepared:
    """ĝ_l as ``(*batch_shape, d_l)`` per probed physical stage, and each physical stage's cost."""

    costates: dict[Any, Any]
    costs: dict[Any, Any]


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

    def prepare(self, problem: Problem, guide: Callable[[Any], dict[Any, Any]] | None = None) -> Prepared:
        run, chunks = self.measurements(problem, guide=guide)
        totals: dict[Any, Any] = {}
        for chunk in chunks:
            for i, (u, scalar) in chunk.items():
                if i not in totals:
                    totals[i] = run.zeros(i)
                totals[i] += (u * run.expand(scalar, i)).sum(0)
        return Prepared({i: t / self.probes.n for i, t in totals.items()}, self.costs(problem))

    def measurements(
        self, problem: Problem, states: Any = None, guide: Callable[[Any], dict[Any, Any]] | None = None
    ) -> tuple[Any, Iterator[dict[Any, Any]]]:
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
        run = NetworkRun(self, problem)
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

    def costs(self, problem: Problem) -> dict[Any, Any]:
        return {i: {"queries": self.queries(problem, i)} for i in problem.physical}

    def stage_vjp(
        self,
        problem: Problem,
        prepared: Prepared,
        i: int,
        h_in: Any,
        costate: Any,
        param_draw: Callable[..., Any] | None = None,
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

    def oracle(self, run: NetworkRun, exact: dict[Any, Any]) -> Iterator[dict[Any, Any]]:
        raise NotImplementedError

    def probe(self, run: NetworkRun) -> Iterator[dict[Any, Any]]:
        raise NotImplementedError

    def queries(self, problem: Problem, i: int) -> int:
        raise NotImplementedError


class NodePerturbation(ModelLevel):
    """np: ``ĝ_l = (1/n) Σ_i u_{l,i} D_i``, ``D_i = Σ_l <u_{l,i}, g_l>`` per sample (see module doc)."""

    name = "node_perturbation"

    def oracle(self, run: NetworkRun, exact: dict[Any, Any]) -> Iterator[dict[Any, Any]]:
        return self._lockstep(
            run, lambda chunks: sum(per_position(u * exact[i], run.scalar_dims()) for i, u in chunks.items())
        )

    def probe(self, run: NetworkRun) -> Iterator[dict[Any, Any]]:
        slopes = run.slopes_jvp if self.form == "jvp" else run.slopes_fd
        return self._lockstep(run, lambda chunks: slopes(min(chunks), chunks))

    def _lockstep(self, run: NetworkRun, scalars) -> Iterator[dict[Any, Any]]:
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

    def oracle(self, run: NetworkRun, exact: dict[Any, Any]) -> Iterator[dict[Any, Any]]:
        for i, g in exact.items():
            for chunk in run.chunks([i], self.probes.batch_dims):
                yield {i: (chunk[i], per_position(chunk[i] * g, self.probes.batch_dims))}

    def probe(self, run: NetworkRun) -> Iterator[dict[Any, Any]]:
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
