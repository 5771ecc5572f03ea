"""``torch.export`` as a capture runs it: torch's RNG forked, Python's generators watched and put
back, custom autograd Functions refused; one capture at a time (``LOCK``)."""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Any

import numpy as np
import torch
from torch import nn

from .watch import numpy_drew

__all__ = ["LOCK", "Refused", "custom_functions", "data_dependent", "exported"]


def exported(module: nn.Module, args: tuple[Any, ...], kwargs: dict[Any, Any]) -> tuple[Any, list[str]]:
    """``(program, drew)``: ``torch.export.export(module, args, kwargs, strict=False)`` with torch's
    RNG forked (a capture draws no random numbers the next forward should see); ``drew`` names the
    Python-level generators (``random``, ``numpy.random``) the forward drew from, whose states are
    put back: a capture would bake that one draw into every later call. A forward that applies a
    custom ``torch.autograd.Function`` is refused: export traces its forward and drops its backward."""
    python_rng, numpy_rng = random.getstate(), np.random.get_state(legacy=False)
    try:
        with torch.random.fork_rng(), custom_functions() as applied:
            program = torch.export.export(module, args, kwargs, strict=False)
    finally:
        drew = [
            name
            for name, moved in (("random", random.getstate() != python_rng), ("numpy.random", numpy_drew(numpy_rng)))
            if moved
        ]
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)
    if applied:
        raise Refused(
            f"capture: the forward applies the custom autograd Function{'s' if len(applied) > 1 else ''} "
            f"{', '.join(sorted(applied))}; torch.export traces its forward and drops its own backward, so the "
            f"gradients would silently differ. Cut a model at run time (capture='run', the default for a model "
            f"with split_at), which runs it as written"
        )
    return program, drew


class Refused(ValueError):
    """What a capture refuses to run (it would differ from eager silently), raised as it is."""


LOCK = threading.RLock()
"""Held by a capture from first look to cache entry: ``torch.export`` swaps a model's tensors for fake
ones while it traces, so a second thread capturing (or fingerprinting) the same model meanwhile would
read the fakes. One capture at a time; the second finds the first's in the cache."""


@contextlib.contextmanager
def custom_functions():
    """The names of the custom ``torch.autograd.Function`` classes applied in the block (a set)."""
    applied: set[str] = set()
    function = torch.autograd.Function
    original = function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if cls.__module__.split(".")[0] != "torch":  # torch's own Functions export with their backward
            applied.add(cls.__qualname__)
        return original.__func__(cls, *args, **kwargs)

    with LOCK:
        function.apply = classmethod(apply)  # type: ignore[method-assign, assignment]
        try:
            yield applied
        finally:
            function.apply = original  # type: ignore[method-assign]


def data_dependent(e: BaseException) -> bool:
    """Whether an export failed on a branch on a tensor's value (a guard on data)."""
    return "data-dependent" in str(e) or "GuardOnDataDependent" in type(e).__name__
