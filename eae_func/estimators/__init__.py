"""Forward-only gradient estimators for physical (black-box) stages (docs/estimators.md).

    res = ef.sweep(chain, params, x, y, estimator=E.zbp(E.Probes(64), method="fd"), physical=[1, 3])

``exact()``: the exact local vjp (sanity check). ``zbp``: chained zeroth-order
backprop, stage by stage. ``node_perturbation`` / ``direct``: model-level
estimates of every physical stage's input costate from the loss, then replayed.
``twin``: physics-aware training through a differentiable twin; ``control_variate``: zbp, np or
direct with the twin as a control variate (unbiased, or shrunk); ``guided``: zbp, np or direct with
one probe along the twin's costate and the rest orthogonal to it (unbiased); ``frozen``: no costate
upstream (readout only). ``suggest_eps``: a finite-difference step from the measured noise.
"""

from ..core.problem import Problem
from .base import Estimator
from .control import control_variate
from .exact import exact
from .guided import guided
from .model_level import direct, node_perturbation
from .noise import NoiseEstimate, suggest_eps
from .probes import Probes
from .twin import frozen, twin
from .zbp import zbp

__all__ = [
    "Estimator",
    "NoiseEstimate",
    "Problem",
    "Probes",
    "control_variate",
    "direct",
    "exact",
    "frozen",
    "guided",
    "node_perturbation",
    "suggest_eps",
    "twin",
    "zbp",
]
