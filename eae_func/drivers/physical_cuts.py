"""Physical modules cut at run time: ``physical=["sim"]`` names cut modules whose reverse step comes
from the estimator, not from a rebuild and a vjp.

    ef.sweep(model, params, x, y, loss=..., split_at=["blocks.*", "sim"], physical=["sim"],
             estimator=E.zbp(E.Probes(16)))

Each call of a physical cut is one stage of a one-stage ``Problem``: ``stage_vjp(problem, None, 0, h, p)``
with ``h`` the call's inputs that require grad, ``p`` the costates of its outputs after the passes,
the module run at the call's other inputs and its parameters, modes and autocast replayed and its own
randomness drawn afresh (as a chain's physical stage). The k-th cut call of a forward is stage k - 1
(``Problem.first``), as a chain of the cut modules numbers its stages, so its probes are that chain's.
Estimators that probe the whole model (``scope == "model"``) need the chain (``capture="graph"``).
``budget=`` counts the physical calls' rows over the step, forward included (``physical.Meter``).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..core.options import Options
from ..core.problem import Problem
from ..program.chain import Chain, Stage
from ..program.physical import Meter, ProbeChecks, rows_of
from .cut_call import Call

__all__ = ["charge_forward", "estimate", "needs_graph", "roster"]


def needs_graph(opts: Options) -> list[str]:
    """What of the physical options only a chain implements, as ``name=``."""
    if opts.physical and opts.estimator is not None and getattr(opts.estimator, "scope", "model") != "stage":
        return [f"estimator={opts.estimator!r} (it probes the whole model: scope 'model')"]
    if opts.physical and opts.budget is not None and opts.update is not None:
        return ["budget= with update= (the updates held until every physical call ran)"]
    return []


def roster(opts: Options, names: Mapping[str, nn.Module]) -> Chain | None:
    """The physical cut modules as a chain of stages in ``opts.physical``'s order (``None``: none), for
    the estimator's checks (``check(chain, physical)``, a twin mapping that misses one) and the meter;
    refused before anything runs: a name that is no cut module, physical modules without an estimator."""
    if not opts.physical:
        return None
    wrong = [p for p in opts.physical if not isinstance(p, str) or p not in names]
    if wrong:
        raise ValueError(
            f"physical: {wrong[0]!r} is not a cut module; at run time physical= names modules that split_at "
            f"matches (cut modules: {list(names)[:8]})"
        )
    if opts.estimator is None:
        raise ValueError(
            f"sweep: {', '.join(map(repr, opts.physical))} is physical (run forward only) but no estimator was "
            f"given: pass estimator= (E.zbp, E.twin, E.frozen, E.control_variate), or E.exact() for a module "
            f"torch can differentiate"
        )
    chain = Chain([Stage(fn=None, name=n, physical=True, module=names[n]) for n in opts.physical], loss=_unused)
    if callable(getattr(opts.estimator, "check", None)):
        opts.estimator.check(chain, tuple(range(len(chain))))
    return chain


def estimate(
    call: Call,
    run: Any,
    h: tuple[Any, ...],
    params: dict[Any, Any],
    costates: list[Any],
    opts: Options,
    meter: Any,
) -> tuple[tuple[Any, ...], dict[Any, Any], dict[Any, Any]]:
    """``(input costates, parameter gradients, cost)`` of one ``call`` of a physical cut module (its
    place in the roster: ``call.physical``) from the estimator: ``run(params, h)`` the call
    again at the parameters ``params`` (the ones it trains) and the inputs ``h`` (those that require
    grad), its outputs of the node; ``costates`` at those outputs. The estimator sees a lone input
    or output as the tensor itself (a twin is ``twin(params, x)`` as on a chain), several as a tuple."""
    name, index, at = call.name.split("#")[0], call.index, call.physical
    assert at is not None  # a physical call's

    one_in, one_out = len(h) == 1, len(costates) == 1  # a lone tensor is given as itself, as a chain's

    def stage(p: Any, x: Any) -> Any:
        out = run(p, (x,) if one_in else tuple(x))
        return out[0] if one_out else out

    def probed(i: int, p: Any, x: Any) -> Any:
        out = stage(p, x)
        checks.add(i, out, x)
        return out

    chain = Chain([Stage(fn=stage, name=name, physical=True)], loss=_unused)
    checks = ProbeChecks(chain)

    def charge(i: int, rows: int, kind: str = "forward_calls") -> Any:
        return meter.charge(at, rows, kind)

    charged = None if meter is None else types.SimpleNamespace(charge=charge)
    problem = Problem(
        chain,
        (params,),
        ({},),
        None,
        None,
        (0,),
        opts.key,
        1.0,
        meter=charged,
        run=probed,
        first=index - 1,
        checks=checks,
    )
    given = (
        (h[0], costates[0])
        if one_in and one_out
        else (h[0] if one_in else h, costates[0] if one_out else tuple(costates))
    )
    grads, costate_in, cost = opts.estimator.stage_vjp(problem, opts.estimator.prepare(problem), 0, *given)
    problem.checked()
    return ((costate_in,) if one_in else tuple(costate_in)), grads, cost


def charge_forward(meter: Meter | None, at: int, call: Any) -> None:
    """Count the physical call's forward against the meter (raises past the budget, before it runs)."""
    if meter is not None:
        meter.charge(at, rows_of(call.leaves))  # its first tensor's rows


def _unused(*args: Any) -> Any:
    raise AssertionError("a roster's loss is never called")
