"""EAE as a switch: ``ef.enable(model, split_at=[...])`` cuts the matched modules of ``model`` at run
time from then on, as ``gradient_checkpointing_enable()`` installs checkpointing, so any backward
through its output runs the EAE reverse steps and the training loop stays as written.

    ef.enable(model, split_at=["model.layers.*"], passes=P.int8())
    loss = model(ids, labels=ids).loss
    loss.backward()                      # passes on each costate, rebuilds, local vjps into .grad
    optimizer.step()
    ef.records(model)                    # {cut name: AdjointState} of the last backward

Each forward of ``model`` with grad enabled is one sweep (``cuts.Sweep``): the calls of the matched
modules numbered 1, 2, ... in call order, keyed ``fold_in(key, index)`` as ``ef.sweep`` keys them.
The cuts' nodes take the model's own parameters as inputs, so autograd accumulates their gradients
into ``.grad`` as it does without EAE (gradient accumulation, ``clip_grad_norm_``, a GradScaler,
DDP's and FSDP's hooks see them there); a GradScaler's scale is in the costates the passes see.
Without grad (``torch.no_grad()``, inference) a matched module runs as written and nothing is kept.

With ``update=optimizer`` the optimizer steps inside the backward (``in_backward``): each cut module's
parameters once autograd has accumulated all of their gradients, each glue module's likewise, so the
whole network's gradients never exist at once. The loop's own ``optimizer.step()`` then finds no
gradient: it steps what is still waiting (a parameter the backward gave no gradient), runs its hooks
and lets the next backward begin (a second backward before it is refused: the fused step cannot
accumulate); ``clip_grad_norm_`` and a GradScaler see no gradient either (``ef.fused(opt,
max_norm=)`` clips per stage). Under several processes (DDP) it is refused: each replica would step
on its own gradients.

The passes' state threads from backward to backward and is saved in ``model.state_dict()`` under
``eae_pass_state`` (one uint8 tensor, so safetensors and every checkpoint format carry it) and
restored by ``load_state_dict`` (a state dict without it leaves the state as it is).
"""

from __future__ import annotations

import io
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..adjoint import AdjointState
from ..core import boundary as B
from ..core.boundary import is_differentiable
from ..core.options import Options, make
from . import cuts, model_sweep
from .cut_call import cut_modules
from .in_backward import InBackward

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..core.options import SweepOptions

__all__ = ["Switch", "disable", "enable", "enabled", "records"]

KEY = "eae_pass_state"
_SWITCHES: weakref.WeakKeyDictionary[nn.Module, Switch] = weakref.WeakKeyDictionary()


class Switch:
    """What ``enable`` installed on a model: its cut modules, the options, the passes' state, the
    latest sweep (``current``: the latest forward's) and the latest to run its reverse steps (``last``)."""

    def __init__(self, model: nn.Module, split_at: Sequence[str], opts: Options):
        self.model, self.split_at, self.opts = model, list(split_at), opts
        self.names = cut_modules(model, split_at)
        self.device = B.device_of(dict(model.named_parameters()))
        self.pass_state: Any = None  # the passes start at the first cut reverse step (CutReverse.passes)
        self.listeners: list[Callable[[AdjointState], Any]] = []
        self.current: Step | None = None
        self.last: Step | None = None
        self.originals: list[tuple[nn.Module, Any]] = []
        self.handles: list[Any] = []
        self.update: InBackward | None = None
        self.caching: list[Any] = []  # the configs whose use_cache it turned off
        self.warned = False
        if opts.update is not None:  # every parameter found in the optimizer before anything is installed
            params = dict(model.named_parameters())
            trained = [n for n, p in params.items() if p.requires_grad and is_differentiable(p)]
            self.update = InBackward.prepare(opts.update, model, params, trained, list(self.names), {})

    def __enter__(self) -> Switch:
        return self

    def __exit__(self, *exc: Any) -> None:
        if _SWITCHES.get(self.model) is self:
            disable(self.model)

    def install(self) -> None:
        for name, module in self.names.items():
            self.originals.append((module, module.__dict__.get("forward")))
            module.forward = cuts.cutting(self.sweep, name, module, module.forward)
        saving: Callable[..., None] = lambda *a: self.saved(*a)  # a function: torch marks it
        loading: Callable[..., None] = lambda *a: self.loaded(*a)
        self.handles = [
            self.model.register_forward_pre_hook(self.new_forward),
            self.model.register_state_dict_post_hook(saving),  # pyright: ignore[reportUnknownMemberType]
            self.model.register_load_state_dict_pre_hook(loading),  # pyright: ignore[reportUnknownMemberType]
        ]
        if self.update is not None:
            self.handles += self.update.install(dict(self.model.named_parameters()))
            self.handles += [o.register_step_pre_hook(self.stepping) for o in self.update.spec.optimizers]
        # a Hugging Face model: the KV cache its forward fills would be read again by the rebuilds; every
        # config in it (T5's and BART's stacks hold copies of the model's)
        configs: list[Any] = [getattr(m, "config", None) for m in self.model.modules()]
        self.caching = list({id(c): c for c in configs if getattr(c, "use_cache", None)}.values())
        for config in self.caching:
            config.use_cache = False

    def uninstall(self) -> None:
        for module, own in self.originals:
            if own is None:
                del module.forward
            else:
                module.forward = own
        for h in self.handles:
            h.remove()
        for config in self.caching:
            config.use_cache = True
        self.originals, self.handles, self.update, self.caching = [], [], None, []

    def new_forward(self, module: nn.Module, args: Any) -> None:
        """A forward of the model starts a sweep of its own (made at its first cut call)."""
        self.current = None

    def sweep(self) -> Step | None:
        """The sweep a cut call with grad enabled belongs to (``None`` without grad: nothing kept)."""
        if not torch.is_grad_enabled():
            return None
        if self.update is not None and model_sweep.multi_process():
            raise ValueError(
                f"enable: update= steps {type(self.model).__name__} inside its backward, before DDP or FSDP "
                f"average the gradients, so each replica would train on its own: leave update= out under "
                f"several processes"
            )
        # a new sweep for a new forward of the model, and for a cut call once the current sweep's reverse
        # steps began (a submodule called alone, as a loop with the head in chunks calls the body)
        if self.current is None or self.current.trace:
            self.current = Step(self)
        return self.current

    def stepping(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before the loop's ``optimizer.step()``: what the backward left waiting is stepped, and the
        next backward may begin; the step itself then finds no gradient (said once)."""
        assert self.update is not None
        self.update.flush()
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"ef.enable(update=...): {type(self.model).__name__}'s parameters were stepped inside the "
                f"backward, so {type(optimizer).__name__}.step() finds no gradient and steps nothing more (its "
                f"hooks run; an LR scheduler steps as usual)",
                stacklevel=3,
            )

    def on_costate(self, fn: Callable[[AdjointState], Any]) -> Callable[[], None]:
        """Call ``fn(record)`` with each boundary's record as the backward makes it, its ``value`` the
        costate after the passes (whatever ``keep_costates`` keeps in ``ef.records``): read what to log
        there, keep no reference to it; returns a function that removes it."""
        self.listeners.append(fn)
        return lambda: self.listeners.remove(fn)

    def saved(self, module: nn.Module, state_dict: dict[Any, Any], prefix: str, local_metadata: Any) -> None:
        buffer = io.BytesIO()
        torch.save(self.pass_state, buffer)
        state_dict[prefix + KEY] = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)

    def loaded(self, module: nn.Module, state_dict: dict[Any, Any], prefix: str, *args: Any) -> None:
        saved = state_dict.pop(prefix + KEY, None)
        if saved is not None:
            data = saved.to("cpu", torch.uint8).numpy().tobytes()
            self.pass_state = torch.load(io.BytesIO(data), weights_only=True)


class Step(cuts.Sweep):
    """One forward's sweep under a switch: the switch's options, its passes' state (shared by every
    sweep in flight, threaded in the order autograd runs their reverse steps), its listeners."""

    def __init__(self, switch: Switch):
        self.switch = switch
        super().__init__(switch.model, switch.split_at, switch.opts, switch.pass_state, switch.device, switch.names)

    @property
    def pass_state(self) -> Any:  # type: ignore[override]
        return self.switch.pass_state

    @pass_state.setter
    def pass_state(self, value: Any) -> None:
        self.switch.pass_state = value

    def record(self, adj: AdjointState) -> None:
        """The record kept (``ef.records``), and each listener called with it whole, its costate too."""
        if not self.trace:
            self.switch.last = self  # its reverse steps are the latest
        super().record(adj)
        for fn in list(self.switch.listeners):
            fn(adj)


def enable(model: nn.Module, split_at: Sequence[str], **options: Unpack[SweepOptions]) -> Switch:
    """Cut ``model`` at run time at the module paths ``split_at`` for every forward from now on, so any
    backward through its output runs the EAE reverse steps with ``options`` (``passes``, ``key``,
    ``keep_costates``, ``timers``, ``early_stop``, ``autocast``, ``boundary_dtype``, ``offload``,
    ``cuda_graphs`` (checked at each forward: the model may move to a GPU after this call), and
    ``update=`` a torch.optim optimizer over the model's parameters: stepped inside each backward);
    returns the ``Switch``. Also a context manager: ``with ef.enable(model, ...):`` turns it off on exit.
    Options that need the sweep to own the step (``microbatches=``, ``data_parallel=``, a pure update)
    or a captured graph are refused, naming them."""
    if not isinstance(cast(object, model), nn.Module):
        raise TypeError(f"enable: expected an nn.Module, got {type(model).__name__}")
    if enabled(model) is not None:
        raise ValueError(f"enable: {type(model).__name__} is already enabled; ef.disable(model) first")
    opts = make("enable", options, keep_costates=False, timers=False)
    refused = refusals(opts)
    if refused:
        raise ValueError(
            f"enable: {', '.join(refused)} cannot be switched on in the model: the training loop owns the step "
            f"(the optimizer, the accumulation, the replicas: DDP or FSDP wrap an enabled model) or it needs a "
            f"captured graph; use ef.sweep(model, params, ..., split_at=...) for it"
        )
    switch = Switch(model, split_at, opts)
    switch.install()
    _SWITCHES[model] = switch
    return switch


def refusals(opts: Options) -> list[str]:
    """The options set in ``opts`` that a switch cannot serve, as ``name=`` (``[]``: none): those the
    training loop owns (the accumulation, the replicas, a pure update's results) or a chain needs."""
    owned = [f"{n}=" for n in ("microbatches", "data_parallel") if getattr(opts, n) != getattr(Options(), n)]
    if opts.capture not in (None, "run"):
        owned.append(f"capture={opts.capture!r} (an enabled model is cut at run time, where it calls the modules)")
    if opts.update is not None and opts.update.fn is not None:
        owned.append("update= with a pure function (its new parameters come back from ef.sweep alone)")
    return owned + model_sweep.needs_graph(opts)


def disable(model: nn.Module) -> None:
    """Put ``model`` back as it was before ``enable`` (its forwards, hooks and config)."""
    switch = _SWITCHES.pop(model, None)
    if switch is None:
        raise ValueError(f"disable: {type(model).__name__} is not enabled (ef.enable(model, split_at=...))")
    switch.uninstall()


def enabled(model: nn.Module) -> Switch | None:
    """The ``Switch`` of an enabled model, else ``None``."""
    return _SWITCHES.get(model)


def records(model: nn.Module) -> dict[str, AdjointState]:
    """The records of the last backward of an enabled model, by cut name, in the order it made them."""
    switch = enabled(model)
    if switch is None:
        raise ValueError(f"records: {type(model).__name__} is not enabled (ef.enable(model, split_at=...))")
    return {} if switch.last is None else {a.stage: a for a in switch.last.trace}
