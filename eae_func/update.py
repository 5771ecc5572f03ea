"""Optimizer updates fused into the reverse fold: stage l's parameters are updated as soon as
its gradients exist, and those gradients are dropped at once, so the gradients of the whole
network never exist together (the pattern of PyTorch's optimizer-step-in-backward, and LOMO).

    ef.sweep(chain, params, x, y, update=optimizer)                 # torch.optim, in place
    res = ef.sweep(chain, params, x, y, update=ef.fused(fn, state))  # pure, threaded state
    params, state = res.params, res.update_state

``fn(params_l, grads_l, state_l) -> (params_l, state_l)`` takes the dicts of the parameters
due at stage l. A tied parameter (one tensor in several stages) is due once, at the last of its
uses the fold reaches (the lowest stage), with the sum of every use's gradient; the state of
the pure form is one entry per stage, the tied parameter's in its lowest stage's entry.
``max_norm`` clips the gradients due at each stage by their own norm; a global norm needs
every gradient before the first update, so it cannot be fused. With ``microbatches > 1`` the
updates run in the last microbatch's fold, on the gradients of all microbatches summed.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any

import torch

from .chain import check_same_tensor, through_hooks
from .microbatch import add
from .ties import InFold


@dataclasses.dataclass(frozen=True)
class Fused:
    """What ``ef.sweep(..., update=)`` runs per stage: ``optimizers`` (torch.optim, one for all
    stages or one per stage) or the pure ``fn`` with its per-stage ``state``; ``max_norm``:
    per-stage gradient clipping (``None``: none)."""

    optimizers: tuple = ()
    fn: Callable | None = None
    state: Any = None
    max_norm: float | None = None


def fused(update: Any, state: Any = None, *, max_norm: float | None = None, per: str = "stage") -> Fused:
    """An update to fuse into the fold: a ``torch.optim`` optimizer (or one per stage), or a pure
    ``fn(params_l, grads_l, state_l) -> (params_l, state_l)`` with ``state``: one entry per stage of a
    chain, or, for a function ``model_fn(params, x)``, one tree in params' structure (an entry per leaf;
    ``fn`` then gets the dicts ``{leaf name: ...}`` of the leaves due at each stage).
    ``max_norm`` with ``per="stage"`` clips each stage's gradients by their norm."""
    if per != "stage":
        raise ValueError(
            f"fused: per={per!r}: clipping by the global norm needs every stage's gradient before the "
            "first update, which a fused update cannot wait for; clip per stage (per='stage'), or run "
            "the sweep unfused, then torch.nn.utils.clip_grad_norm_ and optimizer.step()"
        )
    if max_norm is not None and (
        isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm > 0
    ):
        raise ValueError(f"fused: max_norm must be a number > 0 or None, got {max_norm!r}")
    if isinstance(update, torch.optim.Optimizer):
        return Fused(optimizers=(update,), max_norm=max_norm)
    if isinstance(update, (list, tuple)) and update and all(isinstance(o, torch.optim.Optimizer) for o in update):
        return Fused(optimizers=tuple(update), max_norm=max_norm)
    if callable(update):
        if state is None:
            raise TypeError("fused: a pure update fn(params_l, grads_l, state_l) needs state= (one entry per stage)")
        return Fused(fn=update, state=state, max_norm=max_norm)
    raise TypeError(
        f"fused: expected a torch.optim.Optimizer, a list of them (one per stage) or a function "
        f"fn(params_l, grads_l, state_l) -> (params_l, state_l), got {type(update).__name__}"
    )


class Updater:
    """What the fold does with each stage's gradients as soon as they exist: the fused updates of
    ``spec``, or, with ``spec=None``, keep them (``kept()``); with a ``reducer``
    (``data_parallel=``), averaged over the replicas first, each stage's reduction on the wire while
    the fold goes on. ``apply(i, grads_i)`` at stage i's reverse step, ``finish()`` once after the
    last. Everything is checked when it is made, before any step; ``groups`` are the tied
    ``(stage, path)`` groups; ``carry`` (set for the last microbatch's fold) holds the earlier
    folds' gradients; ``stepped`` the stages updated so far (an error after the first update says
    which). Frozen parameters (``requires_grad=False``) and ones with no gradient are never stepped,
    so an optimizer over the trainable parameters only is enough.

    ``hooks``: ``(stage, name) -> parameter`` for the parameters with tensor hooks, run on the
    gradients due (``chain.through_hooks``) before their average over replicas, as under DDP.

    ``hold``: with a row budget, the lowest physical stage; updates of the stages above it wait
    until its reverse step ran (holding their gradients), so every charge against the budget comes
    before the first update and a step over budget updates nothing.

    A ``torch.optim`` optimizer steps each stage with its step function itself; its step hooks
    (an EMA, a logger) and learning-rate schedulers then see one ``optimizer.step()`` per sweep,
    called by ``finish`` when every stage is updated (pre-hooks too run then, after the updates)."""

    def __init__(
        self,
        spec: Fused | None,
        chain: Any,
        params: tuple,
        groups: list,
        hold: int | None = None,
        reducer: Any = None,
        hooks: dict | None = None,
    ):
        self.spec, self.chain, self.carry, self.hold, self.reducer = spec or Fused(), chain, None, hold, reducer
        self.hooks = hooks or {}
        self.keeping = spec is None
        self.stepped: list[int] = []
        self.held: list[tuple[int, dict]] = []
        self.due: dict[int, dict] = {}  # kept: the gradients due at each stage (averaged with a reducer)
        what = "data_parallel: the params" if self.keeping else "fused: the params"
        for i, p in enumerate(params):
            if not isinstance(p, dict) or not all(isinstance(t, torch.Tensor) for t in p.values()):
                raise TypeError(
                    f"{what} of {chain.where(i)} must be a dict of tensors (as from_module gives) for "
                    f"the fold to take their gradients stage by stage, got {type(p).__name__}"
                )
        self.params = [dict(p) for p in params]
        if self.spec.fn is not None and not isinstance(self.spec.state, (list, tuple)):
            raise TypeError(f"fused: state must be one entry per stage (a list), got {type(self.spec.state).__name__}")
        self.state: list = list(self.spec.state) if self.spec.state is not None else []
        self.ties = InFold(groups)
        if self.spec.fn is not None and len(self.state) != len(chain):
            raise ValueError(f"fused: state has {len(self.state)} entries, the chain has {len(chain)} stages")
        self.targets: dict = {}  # (stage, name) -> the optimizer's parameter, every one found before any step
        if self.spec.optimizers:
            self.targets = self._targets()

    def _targets(self) -> dict:
        """The optimizer's own parameter for every trainable (stage, name): a module stage's parameter
        by identity, a function stage's tensor by storage."""
        chain, optimizers = self.chain, self.spec.optimizers
        if len(optimizers) not in (1, len(chain)):
            raise ValueError(f"fused: expected one optimizer or one per stage ({len(chain)}), got {len(optimizers)}")
        owned = [{id(p): p for group in o.param_groups for p in group["params"]} for o in optimizers]
        by_storage = [{p.data_ptr(): p for p in o.values() if p.numel()} for o in owned]
        targets = {}
        for i, stage in enumerate(self.params):
            s, k = chain.stages[i], i if len(optimizers) > 1 else 0
            frozen = s.frozen()
            for name, t in stage.items():
                if self.ties.uses(i, name)[0][0] != i or name in frozen:
                    continue  # a tied use (due at its owner) or a frozen parameter (never stepped)
                own = s.module.get_parameter(name) if s.module is not None else t
                check_same_tensor(own, t, "fused: the gradients were computed at", f"{name!r} of {chain.where(i)}")
                p = owned[k].get(id(own))
                if p is None and t.numel():
                    p = by_storage[k].get(t.data_ptr())
                if p is None:
                    raise ValueError(
                        f"fused: parameter {name!r} of {chain.where(i)} is trainable but not among the "
                        f"optimizer's parameters (give one optimizer over every trainable parameter, or "
                        f"one per stage; freeze it with requires_grad_(False) to leave it out)"
                    )
                targets[i, name] = p
        stale = [p for o in owned for p in o.values() if p.grad is not None]
        if stale:
            raise ValueError(
                f"fused: {len(stale)} of the optimizer's parameters already have .grad set; each "
                "fused step would apply them again: call optimizer.zero_grad(set_to_none=True) first"
            )
        return targets

    def apply(self, i: int, grads: dict) -> None:
        """Use the gradients due at stage i (its own plus earlier microbatches', a tied parameter's sum
        at its lowest stage): update with them or keep them, after their average over the replicas;
        or hold them while a physical stage below may still charge the budget."""
        if self.hold is not None:
            if i > self.hold:
                self.held.append((i, grads))
                return
            self.hold, held, self.held = None, self.held, []
            for j, g in held:
                self.apply(j, g)
        if self.carry is not None:
            grads = {n: add(self.carry[i][n], g) for n, g in grads.items()}
        due = {  # None: frozen or unused, never stepped
            n: through_hooks(self.hooks[i, n], g) if (i, n) in self.hooks else g
            for n, g in self.ties.due(i, grads).items()
            if g is not None
        }
        if not due:
            return
        if self.reducer is None:
            self._use(i, due)
            return
        self.reducer.start(i, due)
        for j, averaged in self.reducer.ready(wait=False):  # those already off the wire
            self._use(j, averaged)

    def _use(self, i: int, due: dict) -> None:
        """Keep, or clip and update with, the gradients due at stage i (final: summed and averaged)."""
        if self.keeping:
            self.due[i] = due
            return
        if self.spec.max_norm is not None:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in due.values()]))
            scale = torch.clamp(self.spec.max_norm / (norm + 1e-6), max=1.0)
            due = {n: g * scale.to(g.dtype) for n, g in due.items()}
        if self.spec.fn is not None:
            out = self.spec.fn({n: self.params[i][n] for n in due}, due, self.state[i])
            new, self.state[i] = self._checked(i, due, out)
            for name, t in new.items():
                for j, n in self.ties.uses(i, name):
                    self.params[j][n] = t
        else:
            self._step(i, due)
        self.stepped.append(i)

    def _checked(self, i: int, due: dict, out: Any) -> tuple:
        """The pure update's ``(params_l, state_l)`` for stage i, its params exactly the ones it was
        given (names, shapes, dtypes, devices): a misspelt name would add a stray entry and leave the
        real weight as it was."""
        where = f"fused: the update of {self.chain.where(i)}"
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], dict)):
            raise TypeError(f"{where} must return (params_l, state_l) with params_l a dict, got {type(out).__name__}")
        if set(out[0]) != set(due):
            raise ValueError(f"{where} returned params {sorted(out[0])}; it was given {sorted(due)}, the same names")
        for name, t in out[0].items():
            old = self.params[i][name]
            if not isinstance(t, torch.Tensor) or (t.shape, t.dtype, t.device) != (old.shape, old.dtype, old.device):
                got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"{where} returned {name!r} as {got}; the parameter is {tuple(old.shape)} {old.dtype} on {old.device}"
                )
        return out

    def kept(self) -> tuple:
        """The kept gradients, one dict per stage in the params' structure: a tied parameter's sum in
        each of its uses, ``None`` where there is none (frozen or unused)."""
        out = []
        for i, stage in enumerate(self.params):
            grads = {}
            for name in stage:
                owner_stage, owner_name = self.ties.uses(i, name)[0]
                grads[name] = self.due.get(owner_stage, {}).get(owner_name)
            out.append(grads)
        return tuple(out)

    def _step(self, i: int, due: dict) -> None:
        targets = [self.targets[i, name] for name in due]
        for p, g in zip(targets, due.values()):
            p.grad = g.to(p.dtype)
        optimizer = self.spec.optimizers[i if len(self.spec.optimizers) > 1 else 0]
        step = type(optimizer).step
        try:
            getattr(step, "__wrapped__", step)(optimizer)  # the update itself; hooks run once, in finish
        finally:
            for p in targets:
                p.grad = None

    def finish(self) -> None:
        """After the last stage: the reductions still on the wire waited for and used, then each
        optimizer's ``step()`` once, with no gradient left to apply, so its hooks and schedulers count
        one step."""
        for j, averaged in self.reducer.ready(wait=True) if self.reducer is not None else ():
            self._use(j, averaged)
        for optimizer in self.spec.optimizers:
            optimizer.step()

    def note(self, e: BaseException) -> None:
        """Say on ``e`` which stages a torch.optim optimizer already updated in place (an update cannot
        be taken back); a pure update commits nothing until the sweep returns."""
        if self.stepped and self.spec.optimizers:
            done = ", ".join(self.chain.where(i) for i in sorted(self.stepped))
            e.add_note(f"(eae_func: the fused update had already stepped {done}; the other stages were not)")
