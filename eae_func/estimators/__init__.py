"""Forward-only gradient estimators for physical (black-box) stages (docs/estimators.md).

    res = ef.sweep(chain, params, x, y, estimator=E.zbp(E.Probes(64), method="fd"), physical=[1, 3])

``exact()``: the exact local vjp (sanity check). ``zbp``: chained zeroth-order
backprop, stage by stage. ``node_perturbation`` / ``direct``: model-level
estimates of every physical stage's input costate from the loss, then replayed.
"""

from .base import Estimator, Problem
from .exact import exact
from .model_level import direct, node_perturbation
from .probes import Probes
from .zbp import zbp

__all__ = ["Estimator", "Problem", "Probes", "direct", "exact", "node_perturbation", "zbp"]
