"""The estimator protocol (the ``Problem`` an estimator sees is ``eae_func.core.problem``'s).

A physical stage can be run forward but not differentiated; an estimator gives it a reverse
step. The engine calls ``prepare(problem)`` once after the forward sweep of a microbatch (a
model-level estimator probes the network there) and ``stage_vjp`` at each physical stage in
the reverse fold. Digital stages always take the exact local vjp.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..core.problem import Problem

__all__ = ["Estimator"]


class Estimator(Protocol):
    """``scope`` (optional, ``"model"`` when absent): ``"stage"`` if the estimator needs only the
    stage (it then runs on any pipeline rank), ``"model"`` if it probes the whole chain in
    ``prepare`` (it needs the chain in one process). ``differentiates`` (optional, ``False`` when
    absent): whether it differentiates the physical stages, so a black box is refused before
    anything runs. ``check(chain, physical)`` (optional): raises, before anything runs, if the
    estimator cannot serve those physical stages (a twin mapping that misses one).

    ``prepare(problem) -> prepared``: once per microbatch, after the forward sweep.
    ``stage_vjp(problem, prepared, i, h_in, costate) -> (grads_i, input_costate, cost)``: the
    reverse step of physical stage i given its input state and the (processed) costate at its
    output; ``input_costate`` mirrors ``h_in`` (``None`` at integer leaves) and ``cost`` is a
    dict of counters (queries, forward_calls, ...) added to ``res.stats[stage]``.
    """

    scope: str

    def prepare(self, problem: Problem) -> Any: ...

    def stage_vjp(self, problem: Problem, prepared: Any, i: int, h_in: Any, costate: Any) -> tuple[Any, ...]: ...
