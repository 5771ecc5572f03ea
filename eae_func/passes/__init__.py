"""Pure passes over ``AdjointState`` and the combinators that compose them.

A stateless pass maps ``adj -> adj``; a stateful one is a ``StatefulPass(init, update)``
with ``update(adj, state) -> (adj, state)``. Every built-in pass is a small factory that
returns a pure pass, appends its name to ``adj.history`` and records what it measured in
``adj.meta`` (Python scalars, which reach ``res.stats["boundaries"][l]``).
"""

from .combinators import Pass, StatefulPass, apply, compose, identity, init, is_stateful, only, tap, when
from .feedback import error_feedback
from .guards import check_finite
from .observe import costate_statistics, log, stats
from .precision import cast, fp8, int8
from .scaling import clip, gaussian_noise, scale
from .sparsify import randk, topk
from .synthetic import synthetic

__all__ = [
    "Pass", "StatefulPass", "apply", "cast", "check_finite", "clip", "compose", "costate_statistics",
    "error_feedback", "fp8", "gaussian_noise", "identity", "init", "int8", "is_stateful", "log", "only", "randk",
    "scale", "stats", "synthetic", "tap", "topk", "when",
]
