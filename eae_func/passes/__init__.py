"""Pure passes over ``AdjointState`` and the combinators that compose them.

One pass type, as in optax: ``Pass(init, update)`` with ``update(adj, state, ctx) -> (adj, state)``.
``stateless(fn)`` lifts a plain ``adj -> adj`` function; ``compose`` lifts plain callables
itself and always returns a ``Pass``. Every built-in pass is a small factory that returns a
``Pass``, appends its name to ``adj.history`` and records what it measured in ``adj.meta``
(Python numbers, or ``eae_func.lazy.Lazy`` numbers computed on the device and read when used;
they reach ``res.stats["boundaries"][l]``). No built-in pass reads a number off the device
inside the sweep, except ``check_finite("raise")``, which must read its count to raise.
"""

from .base import Context, Pass, examples, global_norm, identity, map_costate, map_costate_random, stateless
from .combinators import compose, lift, only, tap, when
from .feedback import error_feedback
from .guards import check_finite
from .observe import costate_statistics, log, stats
from .precision import cast, fp8, int8
from .scaling import clip_by_global_norm, clip_by_value, gaussian_noise, scale
from .sparsify import randk, topk
from .synthetic import synthetic

__all__ = [
    "Context",
    "Pass",
    "cast",
    "check_finite",
    "clip_by_global_norm",
    "clip_by_value",
    "compose",
    "costate_statistics",
    "error_feedback",
    "examples",
    "fp8",
    "gaussian_noise",
    "global_norm",
    "identity",
    "int8",
    "lift",
    "log",
    "map_costate",
    "map_costate_random",
    "only",
    "randk",
    "scale",
    "stateless",
    "stats",
    "synthetic",
    "tap",
    "topk",
    "when",
]
