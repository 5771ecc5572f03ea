"""eae_func: Explicit Adjoint Exposure as a functional library over torch.func.

grads = ef.grad(model_fn, params, x, target, loss=loss_fn, passes=ef.compose(...))  # ef.cut(h) in model_fn
chain, params = ef.from_module(model, loss=loss_fn)
res = ef.sweep(chain, params, x, target, passes=ef.compose(...), key=0)
res.loss, res.grads, res.adjoints, res.buffers, res.pass_state, res.stats
out = ef.apply(chain, params, x)  # the chain's output, its stages run forward
"""

import sys

from . import estimators, old_paths, passes
from .adjoint import AdjointState, fold_in
from .cache import clear_caches
from .chunked import chunked_loss
from .core import remat
from .core.options import Options
from .core.problem import Problem
from .core.result import SweepResult
from .core.update import fused
from .drivers.sweep import grad, sweep, value_and_grad
from .drivers.switch import disable, enable, enabled, records
from .estimators.base import Estimator
from .passes import Context, Pass, compose, global_norm, identity, map_costate, stateless
from .program.chain import Chain, Stage, apply, stage
from .program.function import cut
from .program.module_chain import from_module, write_back, write_buffers, write_grads
from .program.physical import black_box
from .tree import tree_leaves, tree_map, tree_structure

__version__ = "0.2.0"

__all__ = [
    "AdjointState",
    "Chain",
    "Context",
    "Estimator",
    "Options",
    "Pass",
    "Problem",
    "Stage",
    "SweepResult",
    "apply",
    "chunked_loss",
    "clear_caches",
    "black_box",
    "compose",
    "cut",
    "disable",
    "enable",
    "enabled",
    "estimators",
    "fold_in",
    "from_module",
    "fused",
    "global_norm",
    "grad",
    "identity",
    "map_costate",
    "passes",
    "records",
    "remat",
    "stage",
    "stateless",
    "sweep",
    "tree_leaves",
    "tree_map",
    "tree_structure",
    "value_and_grad",
    "write_back",
    "write_buffers",
    "write_grads",
]

old_paths.install(sys.modules[__name__])
