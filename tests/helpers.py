"""Small models and references shared by the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eae_func.models import Block


def mlp(depth: int, width: int = 6) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])


def convnet(depth: int, channels: int = 3) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.GELU()) for _ in range(depth)])


def transformer(depth: int, dim: int = 16) -> nn.Sequential:
    return nn.Sequential(*[Block(dim, n_heads=4, n_kv_heads=2, ffn_hidden=24) for _ in range(depth)])


def build(kind: str, depth: int, dtype: torch.dtype, seed: int):
    """(model, x, target) for a chain of ``kind`` blocks."""
    torch.manual_seed(seed)
    model = {"mlp": mlp, "conv": convnet, "transformer": transformer}[kind](depth).to(dtype)
    shape = {"mlp": (5, 6), "conv": (2, 3, 5, 5), "transformer": (2, 7, 16)}[kind]
    return model, torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def autograd_grads(model: nn.Module, loss_fn, x, *loss_args):
    """Plain autograd: (loss, {param: grad}) for the whole model."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), *loss_args)
    loss.backward()
    return loss.detach(), {p: p.grad.clone() for p in model.parameters()}


def assert_grads_match(chain, grads, reference: dict, rtol: float, atol: float) -> None:
    """Every stage's gradient equals autograd's for the module parameter it belongs to."""
    for stage, stage_grads in zip(chain.stages, grads):
        by_name = dict(stage.module.named_parameters())
        assert set(stage_grads) == set(by_name)
        for name, g in stage_grads.items():
            torch.testing.assert_close(
                g,
                reference[by_name[name]],
                rtol=rtol,
                atol=atol,
                msg=lambda m, stage=stage, name=name: f"{stage.name}.{name}: {m}",
            )


class TiedInside(nn.Module):
    """Two layers sharing one weight inside one module (one tensor under two names): its gradient
    sums both uses."""

    def __init__(self, width: int = 6):
        super().__init__()
        self.first, self.second = nn.Linear(width, width), nn.Linear(width, width)
        self.second.weight = self.first.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(h)))
