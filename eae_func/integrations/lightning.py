"""Lightning manual optimization with the reverse sweep in place of ``manual_backward``.

    class Lit(L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model, self.automatic_optimization = model, False

        def training_step(self, batch, batch_idx):
            x, y = batch
            return manual_step(self, self.model, x, y, loss=F.cross_entropy, gradient_clip_val=0.5)

``manual_step`` unfused: ``ef.value_and_grad``, the gradients written to ``.grad``, Lightning's own
``clip_gradients`` and ``optimizer.step()``, which is what ``manual_backward`` + ``clip_gradients``
+ ``step()`` do (precision plugins' autocast included, as it wraps ``training_step``). Fused
(``fused=True``): the sweep with the optimizer's update fused into the fold runs as the closure of
``optimizer.step(closure=...)``, so Lightning counts the step (``global_step``, ``max_steps``) and
runs its hooks around it.

Under ``strategy="ddp"`` (the module wrapped in DDP, or ``model`` a DDP model) the sweep averages its
gradients over DDP's process group itself (``data_parallel=``), as ``manual_backward`` through DDP does.

The passes' state (error feedback's residuals) is threaded from step to step in
``module.eae_pass_state``; ``PassState()`` among the Trainer's callbacks saves it in each checkpoint
and restores it on resume (with checkpointing on, a stateful pass without it is refused).

Each step logs (``module.log_dict``), per boundary named by its stage (``res.adjoints``' names; the
input's costate left out), ``eae/<stage>/norm``: the 2-norm of the costate of the stage's output after
the passes, a device scalar Lightning reads when it logs; ``log=`` chooses more or fewer
(``eae_func.integrations.logs``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from . import missing, replicas_of

try:
    from lightning.pytorch.callbacks import Callback
except ModuleNotFoundError as e:
    raise missing(__name__, "lightning", e) from e

from ..core.update import fused as fused_update
from ..drivers.sweep import sweep
from ..passes.combinators import stateful
from ..program.module_chain import write_grads
from .logs import DEFAULT, boundary_logs, chosen

__all__ = ["PassState", "manual_step"]


class PassState(Callback):
    """Saves ``module.eae_pass_state`` (what ``manual_step`` threads) in each checkpoint and restores
    it on resume, so a resumed run with error feedback equals one never stopped."""

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint["eae_pass_state"] = getattr(pl_module, "eae_pass_state", None)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        pl_module.eae_pass_state = checkpoint.get("eae_pass_state")


def checkpointed(module: Any, passes: Any) -> None:
    """Refuse stateful passes whose state the Trainer's checkpoints would drop (no ``PassState``)."""
    trainer = module.trainer
    if not trainer.checkpoint_callbacks or any(isinstance(c, PassState) for c in trainer.callbacks):
        return
    if names := stateful(passes):
        raise ValueError(
            f"manual_step: the passes {', '.join(names)} carry state from step to step, which the Trainer's "
            f"checkpoints would not hold (a resumed run would restart it): add "
            f"eae_func.integrations.lightning.PassState() to Trainer(callbacks=[...]), or enable_checkpointing=False"
        )


def logged(module: Any, res: Any, log: str | tuple[str, ...]) -> None:
    """``module.log_dict`` of ``boundary_logs``: the norms as device scalars, the passes' numbers read."""
    if values := boundary_logs(res, log):
        module.log_dict({k: v if isinstance(v, torch.Tensor) else float(v) for k, v in values.items()})


def manual_step(
    module: Any,
    model: nn.Module,
    x: Any,
    *loss_args: Any,
    loss: Callable[..., Any],
    split_at: Sequence[str] | None = None,
    optimizer: Any = None,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str | None = None,
    fused: bool = False,
    log: str | Sequence[str] = DEFAULT,
    **options: Any,
) -> torch.Tensor:
    """One optimizer step of ``module`` (a ``LightningModule`` with ``automatic_optimization =
    False``) on ``model`` (a part of it, or itself) from ``ef.sweep``'s gradients; returns the loss.
    ``optimizer``: one of ``module.optimizers()`` (default: the only one); ``options``: the sweep's.
    Fused, a clip is per stage (``max_norm=``, as ``ef.fused`` clips), and fp16's loss scaler (which
    needs ``.grad`` to check) is refused. The passes' state is threaded from step to step in
    ``module.eae_pass_state`` (and checkpointed by ``PassState``). ``log``: what ``module.log_dict``
    gets per boundary as ``eae/<stage>/<name>``: ``"norm"`` (the costate's 2-norm, the default) and
    names the passes record (``"clip_norm"``, ``"clipped"``, ...; read at every step, where the norm
    stays on the device), ``"all"`` for the norm and every number they record, ``()`` nothing."""
    opt = optimizer if optimizer is not None else module.optimizers()
    if isinstance(opt, list):
        raise ValueError(
            f"manual_step: {type(module).__name__} has {len(opt)} optimizers; say which one steps {type(model).__name__}: "
            f"manual_step(..., optimizer=self.optimizers()[k])"
        )
    log = chosen(log, options, "manual_step(log=...)")
    strategy = getattr(getattr(module, "trainer", None), "strategy", None)
    group = replicas_of(model) or replicas_of(getattr(strategy, "model", None))
    if group is not None:  # DDP: the sweep of the model, which DDP's reducer never sees, averages itself
        options.setdefault("data_parallel", group)
    params = dict(model.named_parameters())
    state = getattr(module, "eae_pass_state", None)
    if state is None:
        checkpointed(module, options.get("passes"))
    run = functools.partial(sweep, model, params, x, *loss_args, loss=loss, split_at=split_at, pass_state=state)
    if not fused:  # value_and_grad's options, with the costates kept for the norm
        options = {"timers": False, "keep_costates": log == "all" or "norm" in log, **options}
        res = run(**options)
        module.eae_pass_state = res.pass_state
        logged(module, res, log)
        opt.zero_grad()
        write_grads(model, res.grads)
        if gradient_clip_val is not None:
            module.clip_gradients(
                opt, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm
            )
        opt.step()
        return res.loss.detach()
    if gradient_clip_val is not None:
        raise ValueError(
            "manual_step: fused=True clips per stage: give max_norm= (ef.fused's per-stage clip) instead of "
            "gradient_clip_val, which needs every gradient before the first update"
        )
    return fused_step(module, opt, run, log, options)


def fused_step(
    module: Any, opt: Any, run: Callable[..., Any], log: str | tuple[str, ...], options: dict[Any, Any]
) -> torch.Tensor:
    """``manual_step`` fused: the sweep (``run``) inside the optimizer's closure, each stage stepped
    in the backward (``ef.fused``, clipped per stage by ``max_norm=``); fp16's loss scaler refused."""
    if getattr(module.trainer, "precision", None) == "16-mixed":
        raise ValueError(
            "manual_step: fused=True under precision='16-mixed': the loss scaler checks .grad for infs before "
            "it steps, and fused updates leave none; use bf16-mixed, or fused=False"
        )
    max_norm = options.pop("max_norm", None)
    out: dict[str, torch.Tensor] = {}

    def closure() -> torch.Tensor:
        res = run(update=fused_update(opt.optimizer, max_norm=max_norm), **options)
        module.eae_pass_state = res.pass_state
        logged(module, res, log)
        out["loss"] = res.loss.detach()
        return out["loss"]

    opt.zero_grad(set_to_none=True)  # a fused step refuses stale .grad
    opt.step(closure=closure)
    return out["loss"]

    opt.zero_grad(set_to_none=True)  # a fused step refuses stale .grad
    opt.step(closure=closure)
    return out["loss"]
