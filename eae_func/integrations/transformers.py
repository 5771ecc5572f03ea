"""Hugging Face ``Trainer`` with the reverse sweep in place of ``loss.backward()``.

    trainer = EAETrainer(model=model, args=args, train_dataset=data, eae=dict(passes=ef.compose(...)))
    trainer.train()

``EAETrainer.training_step`` is ``Trainer.training_step`` with its backward replaced: the model is
cut at run time at its repeated layers (``split_at``: by default every stack of repeated layers,
``layers_of``: ``model.layers.*``, or encoder and decoder layers) and swept with the model computing
its own loss from ``labels`` and ``num_items_in_batch``, exactly as ``Trainer.compute_loss`` has it
compute it; the loss is divided by the gradient accumulation steps where Trainer divides it,
multiplied by the fp16 loss scaler's scale where ``accelerator.backward`` multiplies it, and the
gradients are added into ``.grad`` (``ef.write_grads(accumulate=True)``), so gradient accumulation,
clipping, the scaler's unscale and the optimizer step run as Trainer runs them. bf16 runs the stages
under ``torch.autocast``. The passes' state (error feedback's residuals) is threaded from step to
step in ``trainer.eae_state``. What the passes record at each boundary (``meta``) is logged with
Trainer's logs as ``eae/<boundary>/<key>``.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from ..chain import write_buffers, write_grads
from ..lazy import Lazy
from ..sweep import sweep

logger = logging.getLogger(__name__)


def layers_of(model: nn.Module) -> list[str]:
    """``split_at`` for a Hugging Face model: every stack of repeated layers, an ``nn.ModuleList`` of
    two or more modules of one class (where there is none, of one module: a shared layer), innermost
    first (a stack inside another stack's layers is cut, the outer one not), so both stacks of an
    encoder-decoder (BART, T5, Whisper), both towers of CLIP, and every stage's blocks of ConvNeXt and
    Swin are cut. A MoE layer's ``experts`` are run as part of their layer."""
    lists = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len({type(c) for c in m}) == 1 and name.rsplit(".", 1)[-1] != "experts"
    ]
    # a list of one layer is a stack where nothing else is: ALBERT runs its one shared layer N times
    stacks = [n for n, m in lists if len(m) > 1] or [n for n, _ in lists]
    inner = [n for n in stacks if not any(o != n and o.startswith(f"{n}.") for o in stacks)]
    if not inner:
        raise ValueError(
            f"EAETrainer: {type(model).__name__} has no nn.ModuleList of repeated layers to cut at; give split_at=[...]"
        )
    return [f"{n}.*" for n in inner]


class EAETrainer(Trainer):
    """``Trainer`` whose training step is an ``ef.sweep``; ``eae``: the sweep's options (``passes``,
    ``boundary_dtype``, ``recompute``, ...), ``split_at``: where to cut (default ``layers_of(model)``)."""

    def __init__(self, *args: Any, eae: dict | None = None, split_at: Sequence[str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.eae = dict(eae or {})
        for refused in ("update", "microbatches", "loss", "split_at"):
            if refused in self.eae:
                raise ValueError(
                    f"EAETrainer: eae={{{refused!r}: ...}} is Trainer's to decide (its optimizer steps, its "
                    f"gradient accumulation, the model's own loss); give split_at= as its own argument"
                )
        self.split_at = list(split_at) if split_at is not None else None
        self.eae_logs: dict[str, float] = {}
        self.eae_state: Any = None  # the passes' state, threaded from step to step
        if self.split_at is None:
            self.split_at = layers_of(self.accelerator.unwrap_model(self.model, keep_fp32_wrapper=False))
            logger.info("EAETrainer: cutting %s at %s", type(self.model).__name__, ", ".join(self.split_at))

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        if self.label_smoother is not None or self.compute_loss_func is not None:
            raise NotImplementedError(
                "EAETrainer: label smoothing and compute_loss_func are not swept yet; the model's own loss is"
            )
        model.train()
        inputs = self._prepare_inputs(inputs)
        if "labels" not in inputs:
            raise ValueError("EAETrainer: the batch has no 'labels'; the model computes its loss from them")
        unwrapped = self.accelerator.unwrap_model(model, keep_fp32_wrapper=False)
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            n = num_items_in_batch
            inputs = {**inputs, "num_items_in_batch": n if isinstance(n, torch.Tensor) else torch.tensor(n)}
        scaled_for_ga = (
            self.loss_is_scaled_for_ga
            if self.loss_is_scaled_for_ga is not None
            else self.model_accepts_loss_kwargs and num_items_in_batch is not None
        )
        steps = 1 if scaled_for_ga else self.current_gradient_accumulation_steps
        scaler = getattr(self.accelerator, "scaler", None)
        scale = scaler.get_scale() if scaler is not None else 1.0

        def loss(outputs: Any) -> torch.Tensor:
            return outputs["loss"] / steps * scale  # as accelerator.backward scales it

        options = dict(self.eae)
        if self.args.bf16 or self.args.fp16:
            options.setdefault("autocast", torch.bfloat16 if self.args.bf16 else torch.float16)
        res = sweep(
            unwrapped,
            dict(unwrapped.named_parameters()),
            inputs,
            loss=loss,
            split_at=self.split_at,
            pass_state=self.eae_state,
            **options,
        )
        self.eae_state = res.pass_state  # error feedback's residuals, a predictor's weights: carried to the next step
        write_grads(unwrapped, res.grads, accumulate=True)
        write_buffers(unwrapped, res.buffers)
        self.eae_logs = {
            f"eae/{boundary}/{key}": float(value)
            for boundary, meta in res.stats.get("boundaries", {}).items()
            for key, value in meta.items()
            if isinstance(value, numbers.Real | Lazy) or (isinstance(value, torch.Tensor) and value.numel() == 1)
        }
        return (res.loss / scale).detach()

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's logs, with the passes' last measurements at each boundary."""
        super().log({**logs, **self.eae_logs} if "loss" in logs else logs, *args, **kwargs)
