"""Hugging Face ``Trainer`` with the EAE reverse steps in its backward.

    trainer = EAETrainer(model=model, args=args, train_dataset=data, eae=dict(passes=ef.compose(...)))
    trainer.train()

The model is cut at run time at its repeated layers (``split_at``: by default every stack of
repeated layers, ``layers_of``: ``model.layers.*``, or encoder and decoder layers). Where the switch
serves every option (``switch.refusals``), ``EAETrainer`` switches the model on (``ef.enable``, it
stays on: ``ef.disable(trainer.model)``) and its ``training_step`` is ``Trainer.training_step`` itself:
``compute_loss``, ``accelerator.backward`` (the reverse steps, into ``.grad``), DDP wrapping the
enabled model, gradient accumulation, clipping, the loss scaler and the optimizer as Trainer runs
them, and no second copy of the gradients (``write_grads``). Options the switch cannot serve
(``capture="graph"``, ``compile=``, a model-level estimator, the head in chunks under several
processes, whose body a call past DDP's forward would hide from its reducer) run each step as an
``ef.sweep`` instead, whose program is
``self.compute_loss(model, inputs, num_items_in_batch=...)`` (Trainer's, or a subclass's override);
the loss is divided by the gradient accumulation steps where Trainer divides it,
multiplied by the fp16 loss scaler's scale where ``accelerator.backward`` multiplies it, and the
gradients are added into ``.grad`` (``ef.write_grads(accumulate=True)``), so gradient accumulation,
clipping, the scaler's unscale and the optimizer step run as Trainer runs them. bf16 runs the stages
under ``torch.autocast``. Under DDP (the model Trainer hands ``training_step`` wraps it) the sweep of
the unwrapped model, which DDP's reducer never sees, averages its gradients over DDP's process group
itself (``data_parallel=``), at every micro-step: the mean DDP makes of their sum on the last. The passes' state (error feedback's residuals) is threaded from step to
step in ``trainer.eae_state``, saved in each checkpoint (``eae_state.pt``, one per process) and
restored by ``train(resume_from_checkpoint=...)``.

With Trainer's logs, per cut layer (named as ``res.adjoints`` names it, e.g. ``transformer.h.1``):
``eae/<layer>/norm``, the 2-norm of the costate of the layer's output after the passes, and with
``eae_log=`` what else the passes record there (``eae_func.integrations.logs``), read off the device
only when Trainer logs. The layers' outputs are the trace's only boundaries: the loss and the glue
around the layers (embeddings, head, ``num_items_in_batch``) are differentiated by autograd, so no
costate of the loss itself or of a Trainer input is logged.

With ``eae_loss_chunks=k`` a causal LM's head and loss run in ``k`` chunks of tokens (``ef.chunked_loss``
on ``model.get_output_embeddings()``), so the logits never exist whole: the program swept is the base
model's last hidden state and

    loss = Σ_t CE(head(h_t), y_{t+1}) / n      n = num_items_in_batch, else #{t : y_{t+1} != -100}

which is the model's own loss (labels shifted by one, ``-100`` ignored). A model whose logits are not
just ``head(h)`` (a soft cap, a scale), label smoothing or a ``compute_loss_func`` are refused.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from . import missing, replicas_of

try:
    from transformers import Trainer
except ModuleNotFoundError as e:
    raise missing(__name__, "hf", e) from e

from ..adjoint import AdjointState
from ..chunked import chunked_loss
from ..core.options import make
from ..drivers.sweep import sweep
from ..drivers.switch import Switch, enable, refusals
from ..passes.combinators import carries_state, stateful
from ..program.module_chain import write_buffers, write_grads
from .logs import DEFAULT, boundary_logs, chosen, record_logs

__all__ = ["EAETrainer", "layers_of"]

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


class ComputedLoss(nn.Module):
    """``trainer.compute_loss(model, inputs)`` as a module: the program the sweep cuts is the model's
    forward and the loss as the Trainer (or a subclass overriding ``compute_loss``) computes it, label
    smoothing and ``compute_loss_func`` included. It holds the model's own submodules, parameters and
    buffers under their own names, so stages, gradients and logs are named as the model names them."""

    _eae_loss: Callable[..., Any]
    _eae_model: nn.Module

    def __init__(self, trainer: Trainer, model: nn.Module, chunks: int | None = None):
        super().__init__()
        self._modules, self._parameters, self._buffers = model._modules, model._parameters, model._buffers
        cache = {"use_cache": False} if getattr(getattr(model, "config", None), "use_cache", None) is not None else {}

        def compute_loss(inputs: dict[Any, Any], num_items_in_batch: Any) -> Any:
            # a KV cache the forward fills would be read again by the rebuilds
            return trainer.compute_loss(model, {**inputs, **cache}, num_items_in_batch=num_items_in_batch)

        if chunks is not None:
            compute_loss = chunked_causal_loss(trainer, model, chunks, cache)

        # not submodules, and a function (what a graph capture fingerprints by identity), not the Trainer
        object.__setattr__(self, "_eae_loss", compute_loss)
        object.__setattr__(self, "_eae_model", model)

    def forward(self, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        loss = self._eae_loss(inputs, num_items_in_batch)
        assert isinstance(loss, torch.Tensor)  # return_outputs=False: the loss alone
        return loss


def chunked_causal_loss(trainer: Trainer, model: nn.Module, chunks: int, cache: dict[Any, Any]) -> Callable[..., Any]:
    """The causal-LM loss of ``model`` with its head over ``chunks`` chunks of tokens (the module
    docstring's formula), as ``compute_loss(inputs, num_items_in_batch)``; what it cannot compute as
    the model does is refused."""
    where = "EAETrainer(eae_loss_chunks=...)"
    head, body = model.get_output_embeddings(), getattr(model, "base_model", model)  # type: ignore[operator]
    if not isinstance(head, nn.Module) or body is model:
        raise ValueError(f"{where}: {type(model).__name__} is not a causal LM with a head on a base model")
    config = getattr(model, "config", None)
    changed = [a for a in ("final_logit_softcapping", "logit_scale", "logits_scaling") if getattr(config, a, None)]
    if changed or trainer.args.label_smoothing_factor or trainer.compute_loss_func is not None:
        why = (
            changed[0] if changed else "label smoothing" if trainer.args.label_smoothing_factor else "compute_loss_func"
        )
        raise ValueError(f"{where}: the loss would not be the model's own ({why}); leave eae_loss_chunks out")
    summed = chunked_loss(head, chunks=chunks, reduction="sum")

    def compute_loss(inputs: dict[Any, Any], num_items_in_batch: Any) -> torch.Tensor:
        if "labels" not in inputs:
            raise ValueError(f"{where}: the batch has no labels; give the causal LM its labels")
        labels = inputs["labels"]
        rest = {k: v for k, v in inputs.items() if k != "labels"}
        hidden = body(**{**rest, **cache}).last_hidden_state
        total = summed(hidden[:, :-1], labels[:, 1:])
        n = num_items_in_batch if num_items_in_batch is not None else (labels[:, 1:] != -100).sum()
        return total / n

    return compute_loss


class EAETrainer(Trainer):
    """``Trainer`` whose training step is an ``ef.sweep``; ``eae``: the sweep's options (``passes``,
    ``boundary_dtype``, ``recompute``, ...), ``split_at``: where to cut (default ``layers_of(model)``),
    ``eae_log``: what is logged per cut layer as ``eae/<layer>/<name>``: ``"norm"`` (the costate's
    2-norm, the default) and names the passes record (``"clip_norm"``, ``"clipped"``, ``P.stats()``'s
    ``"mean"``, ``"std"``, ...), ``"all"`` for the norm and every number they record, ``()`` nothing;
    ``eae_loss_chunks``: a causal LM's head and loss over that many chunks of tokens (``ef.chunked_loss``),
    so the logits never exist whole (``None``: the model's own loss)."""

    def __init__(
        self,
        *args: Any,
        eae: dict[Any, Any] | None = None,
        split_at: Sequence[str] | None = None,
        eae_log: str | Sequence[str] = DEFAULT,
        eae_loss_chunks: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self._switch: Switch | None = None
        if eae_loss_chunks is not None and (
            isinstance(eae_loss_chunks, bool) or not isinstance(eae_loss_chunks, int) or eae_loss_chunks < 1
        ):
            raise ValueError(f"EAETrainer: eae_loss_chunks must be a positive int or None, got {eae_loss_chunks!r}")
        self.eae_loss_chunks = eae_loss_chunks
        self.eae = dict(eae or {})
        self.eae_log = chosen(eae_log, self.eae, "EAETrainer(eae_log=...)")
        for refused in ("update", "microbatches", "loss", "split_at"):
            if refused in self.eae:
                raise ValueError(
                    f"EAETrainer: eae={{{refused!r}: ...}} is Trainer's to decide (its optimizer steps, its "
                    f"gradient accumulation, the model's own loss); give split_at= as its own argument"
                )
        self.split_at = list(split_at) if split_at is not None else None
        self.eae_logs: dict[str, Any] = {}  # the last step's, unread until Trainer logs
        self._logs: dict[str, Any] = {}  # the records' logs of the backward running
        self._eae_state: Any = None  # the passes' state, threaded from step to step (the sweep's)
        self._swept: ComputedLoss | None = None  # of the model
        self._chunked: Callable[..., Any] | None = None  # the switch's chunked loss
        if self.split_at is None:
            self.split_at = layers_of(self.accelerator.unwrap_model(self.model, keep_fp32_wrapper=False))
            logger.info("EAETrainer: cutting %s at %s", type(self.model).__name__, ", ".join(self.split_at))
        if not refusals(make("EAETrainer", self.eae)) and not (
            eae_loss_chunks is not None and self.args.world_size > 1
        ):
            assert self.model is not None  # given, or made by model_init
            self._switch = enable(self.model, split_at=self.split_at, **self.eae)
            self._switch.on_costate(self._logged)

    @property
    def eae_state(self) -> Any:
        """The passes' state (error feedback's residuals), threaded from step to step."""
        return self._switch.pass_state if self._switch is not None else self._eae_state

    @eae_state.setter
    def eae_state(self, value: Any) -> None:
        if self._switch is not None:  # None: the passes start afresh, as a sweep given none
            self._switch.pass_state = value
        else:
            self._eae_state = value

    def _logged(self, adj: AdjointState) -> None:
        self._logs.update(record_logs(adj, adj.meta, self.eae_log))

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """Trainer's, or with ``eae_loss_chunks`` on the switch, the causal LM's head and loss in chunks."""
        if self._switch is None or self.eae_loss_chunks is None or return_outputs or not torch.is_grad_enabled():
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if self._chunked is None:
            self._chunked = chunked_causal_loss(self, self._switch.model, self.eae_loss_chunks, {})
        return self._chunked(inputs, num_items_in_batch)

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        if self._switch is None:
            return self._swept_step(model, inputs, num_items_in_batch)
        self._logs = {}
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.eae_logs = self._logs
        return loss

    def _swept_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """One step as an ``ef.sweep`` of ``compute_loss`` (``ComputedLoss``), its gradients added into ``.grad``."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        unwrapped = self.accelerator.unwrap_model(model, keep_fp32_wrapper=False)
        if self._swept is None or self._swept._eae_model is not unwrapped:
            self._swept = ComputedLoss(self, unwrapped, self.eae_loss_chunks)
        scaled_for_ga = (
            self.loss_is_scaled_for_ga
            if self.loss_is_scaled_for_ga is not None
            else self.model_accepts_loss_kwargs and num_items_in_batch is not None
        )
        steps = 1 if scaled_for_ga else self.current_gradient_accumulation_steps
        scaler = getattr(self.accelerator, "scaler", None)
        scale = scaler.get_scale() if scaler is not None else 1.0

        def loss(value: torch.Tensor) -> torch.Tensor:
            return value / steps * scale  # as accelerator.backward scales it

        options = dict(self.eae)
        if (group := replicas_of(model)) is not None:  # DDP: the sweep of the unwrapped model averages itself
            options.setdefault("data_parallel", group)
        if self.args.bf16 or self.args.fp16:
            options.setdefault("autocast", torch.bfloat16 if self.args.bf16 else torch.float16)
        res = sweep(
            self._swept,
            dict(self._swept.named_parameters()),
            {
                "inputs": inputs,
                "num_items_in_batch": n if not isinstance(n := num_items_in_batch, int) else torch.tensor(n),
            },
            loss=loss,
            split_at=self.split_at,
            pass_state=self.eae_state,
            **options,
        )
        self.eae_state = res.pass_state  # error feedback's residuals, a predictor's weights: carried to the next step
        write_grads(self._swept, res.grads, accumulate=True)
        write_buffers(self._swept, res.buffers)
        self.eae_logs = boundary_logs(res, self.eae_log)
        return (res.loss / scale).detach()

    def _state_file(self, checkpoint: str) -> str:
        rank = f"_rank{self.args.process_index}" if self.args.world_size > 1 else ""
        return os.path.join(checkpoint, f"eae_state{rank}.pt")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Trainer's, and the passes' state (each process its own: error feedback's residuals are local)."""
        super()._save_optimizer_and_scheduler(output_dir)
        if carries_state(self.eae_state):
            torch.save(self.eae_state, self._state_file(output_dir))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Trainer's, and the passes' state saved with ``checkpoint`` (none saved: they start from ``init()``)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = self._state_file(checkpoint)
        self.eae_state = loaded = torch.load(path, map_location=self.args.device) if os.path.isfile(path) else None
        if loaded is None and stateful(self.eae.get("passes")):
            logger.warning("EAETrainer: %s holds no pass state; the passes start from init()", checkpoint)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's logs, with the last step's ``eae_log`` per cut layer, read now."""
        if "loss" in logs:
            logs = {**logs, **{k: float(v) for k, v in self.eae_logs.items()}}
        super().log(logs, *args, **kwargs)
