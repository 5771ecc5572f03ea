"""torch's private parts that eae_func calls, each behind one function with the torch versions it
is known to work on (``tests/test_compat.py`` fails loudly where a torch changes one).

    pull_back_unchecked   torch.autograd.graph._engine_run_backward: ``torch.autograd.grad``
                          without its Python checks of the cotangents (``_make_grads``: a shape
                          comparison per output, 20 us a stage on the CPU); run on torch 2.13
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["pull_back_unchecked"]


def pull_back_unchecked(
    outputs: Sequence[torch.Tensor | GradientEdge], cotangents: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> tuple:
    """``torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)`` for cotangents that
    already have their outputs' shapes (the caller's promise: the engine reduces a cotangent that
    broadcasts to its output's shape instead of refusing it)."""
    return torch.autograd.graph._engine_run_backward(  # pyright: ignore[reportPrivateUsage]
        tuple(outputs), tuple(cotangents), False, False, tuple(inputs), True, accumulate_grad=False
    )
