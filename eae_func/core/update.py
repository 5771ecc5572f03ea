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
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from .. import compat
from ..program.chain import through_hooks
from ..program.module_chain import check_same_tensor
from .boundary import is_differentiable
from .ties import InFold

__all__ = ["Fused", "Pending", "STEPPED", "Updater", "clipped", "fused", "step_with"]


@dataclasses.dataclass(frozen=True)
class Fused:
    """What ``ef.sweep(..., update=)`` runs per stage: ``optimizers`` (torch.optim, one for all
    stages or one per stage) or the pure ``fn`` with its per-stage ``state``; ``max_norm``:
    per-stage gradient clipping (``None``: none)."""

    optimizers: tuple[Any, ...] = ()
    fn: Callable[..., Any] | None = None
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
    if (
        isinstance(cast(object, update), (list, tuple))
        and update
        and all(isinstance(o, torch.optim.Optimizer) for o in update)
    ):
        return Fused(optimizers=tuple(update), max_norm=max_norm)
    if callable(update):
        if state is None:
            raise TypeError("fused: a pure update fn(params_l, grads_l, state_l) needs state= (one entry per stage)")
        return Fused(fn=update, state=state, max_norm=max_norm)
    raise TypeError(
        f"fused: expected a torch.optim.Optimizer, a list of them (one per stage) or a function "
        f"fn(params_l, grads_l, state_l) -> (params_l, state_l), got {type(update).__name__}"
    )


STEPPED = "(eae_func: the fused update had already stepped"


@dataclasses.dataclass(frozen=True)
class Pending:
    """What the fold's updates have made so far: a value each reverse step returns anew (threaded in
    ``fold.Carry.pending``) and never changes in place, so an earlier value stays as it was.

    params:   one dict per stage: a pure update's new tensors where it updated, the given ones elsewhere.
    state:    a pure update's state, one entry per stage (``()`` for any other).
    tied:     ``{tie group: Σ gradients of its uses so far}`` of tied tensors not yet due (``InFold.due``).
    held:     ``(stage, gradients)`` held while a physical stage below may still charge the budget.
    kept:     ``{stage: gradients due}`` without an update (``data_parallel=`` alone).
    stepped:  the stages updated so far, in order.
    """

    params: tuple[Any, ...]
    state: tuple[Any, ...] = ()
    tied: Mapping[Any, Any] = dataclasses.field(default_factory=cast(Callable[[], Mapping[Any, Any]], dict))
    held: tuple[Any, ...] = ()
    kept: Mapping[Any, Any] = dataclasses.field(default_factory=cast(Callable[[], Mapping[Any, Any]], dict))
    stepped: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Updater:
    """What the fold does with each stage's gradients as soon as they exist, fixed and checked before
    any step (``prepare``): the fused updates of ``spec``, or, with ``keeping``, keep them; with a
    ``reducer`` (``data_parallel=``), averaged over the replicas first, each stage's reduction on the
    wire while the fold goes on. It maps pending values (``Pending``), as an optax transformation maps
    its state: ``apply(pending, i, grads_i) -> pending`` at stage i's reverse step, ``finish(pending)
    -> pending`` once after the last. Frozen parameters (``requires_grad=False``) and ones with no
    gradient are never stepped, so an optimizer over the trainable parameters only is enough.

    ties:     the tied ``(stage, name)`` groups (``InFold``).
    hooks:    ``(stage, name) -> parameter`` for the parameters with tensor hooks, run on the gradients
              due (``chain.through_hooks``) before their average over replicas, as under DDP.
    hold:     with a row budget, the lowest physical stage; updates of the stages above it wait until
              its reverse step ran (their gradients ``held``), so every charge against the budget comes
              before the first update and a step over budget updates nothing.
    targets:  ``(stage, name) -> the optimizer's own parameter`` of a torch.optim update.
    trained:  the ``(stage, name)`` of every trained parameter (a float, not ``requires_grad=False``):
              with a ``reducer``, the fixed layout each stage's reduction pairs across replicas.

    Side effects are only those that are so by nature: the reductions in flight, and a ``torch.optim``
    optimizer stepping each stage in place with its step function itself; its step hooks (an EMA, a
    logger) and learning-rate schedulers then see one ``optimizer.step()`` per sweep, called by
    ``finish`` when every stage is updated (pre-hooks too run then, after the updates). A pure update
    commits nothing: its params and state are the final pending value's."""

    spec: Fused
    chain: Any
    keeping: bool
    ties: InFold
    hooks: Mapping[Any, Any]
    hold: int | None
    reducer: Any
    targets: Mapping[Any, Any]
    trained: frozenset[Any] = frozenset()

    @classmethod
    def prepare(
        cls,
        spec: Fused | None,
        chain: Any,
        params: tuple[Any, ...],
        groups: list[Any],
        hold: int | None = None,
        reducer: Any = None,
        hooks: Mapping[Any, Any] | None = None,
    ) -> tuple[Updater, Pending]:
        """The ``Updater`` of ``spec`` (``None``: keep the gradients) for a fold over ``chain`` at ``params``
        (one dict per stage; ``groups``: the tied ``(stage, path)`` groups), everything checked before any
        step, and its first pending value: the params and the pure update's state as given."""
        keeping, spec = spec is None, spec or Fused()
        what = "data_parallel: the params" if keeping else "fused: the params"
        for i, p in enumerate(params):
            if not isinstance(cast(object, p), dict) or not all(isinstance(t, torch.Tensor) for t in p.values()):
                raise TypeError(
                    f"{what} of {chain.where(i)} must be a dict of tensors (as from_module gives) for "
                    f"the fold to take their gradients stage by stage, got {type(p).__name__}"
                )
        if spec.fn is not None and not isinstance(cast(object, spec.state), (list, tuple)):
            raise TypeError(f"fused: state must be one entry per stage (a list), got {type(spec.state).__name__}")
        state = tuple(spec.state) if spec.state is not None else ()
        ties = InFold(groups)
        if spec.fn is not None and len(state) != len(chain):
            raise ValueError(f"fused: state has {len(state)} entries, the chain has {len(chain)} stages")
        targets = cls._targets(spec.optimizers, chain, params, ties) if spec.optimizers else {}
        trained = frozenset(
            (i, n)
            for i, (s, p) in enumerate(zip(chain.stages, params) if reducer is not None else ())
            for frozen in [s.frozen()]
            for n, t in p.items()
            if is_differentiable(t) and n not in frozen
        )
        updater = cls(spec, chain, keeping, ties, hooks or {}, hold, reducer, targets, trained)
        return updater, Pending(tuple(dict(p) for p in params), state)

    @staticmethod
    def _targets(optimizers: tuple[Any, ...], chain: Any, params: tuple[Any, ...], ties: InFold) -> dict[Any, Any]:
        """The optimizer's own parameter for every trainable (stage, name), every one found before any step:
        a module stage's parameter by identity, a function stage's tensor by storage."""
        if len(optimizers) not in (1, len(chain)):
            raise ValueError(f"fused: expected one optimizer or one per stage ({len(chain)}), got {len(optimizers)}")
        owned = [{id(p): p for group in o.param_groups for p in group["params"]} for o in optimizers]
        by_storage = [{p.data_ptr(): p for p in o.values() if p.numel()} for o in owned]
        targets: dict[Any, Any] = {}
        for i, stage in enumerate(params):
            s, k = chain.stages[i], i if len(optimizers) > 1 else 0
            frozen = s.frozen()
            for name, t in stage.items():
                if ties.uses(i, name)[0][0] != i or name in frozen:
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

    def apply(self, pending: Pending, i: int, grads: dict[Any, Any]) -> Pending:
        """``pending`` after the gradients of stage i (its own plus earlier microbatches'): those due (a
        tied parameter's sum at its lowest stage) updated with or kept, after their average over the
        replicas; or held while a physical stage below may still charge the budget. A failure says which
        stages a torch.optim update had stepped by then (``note``)."""
        if self.hold is not None and i > self.hold:
            return dataclasses.replace(pending, held=(*pending.held, (i, grads)))
        released, pending = (*pending.held, (i, grads)), dataclasses.replace(pending, held=())
        try:
            for j, stage_grads in released:
                due, tied = self.ties.due(j, stage_grads, pending.tied)
                pending = dataclasses.replace(pending, tied=tied)
                # the trained parameters due here: every replica's same layout, whatever each one used
                like = {n: pending.params[j][n] for n in due if (j, n) in self.trained}
                due = {  # None: frozen or unused, never stepped
                    n: through_hooks(self.hooks[j, n], g) if (j, n) in self.hooks else g
                    for n, g in due.items()
                    if g is not None
                }
                if self.reducer is None:
                    pending = self._use(pending, j, due) if due else pending
                    continue
                if like:
                    self.reducer.start(j, due, like)
                for k, averaged in self.reducer.ready(wait=False):  # those already off the wire
                    pending = self._use(pending, k, averaged) if averaged else pending
        except BaseException as e:
            self.note(pending, e)
            raise
        return pending

    def _use(self, pending: Pending, i: int, due: dict[Any, Any]) -> Pending:
        """``pending`` with the gradients due at stage i (final: summed and averaged) kept, or clipped and
        used to update: a pure update's new tensors in every use of each, its state in entry i."""
        if self.keeping:
            return dataclasses.replace(pending, kept={**pending.kept, i: due})
        due = clipped(due, self.spec.max_norm)
        if self.spec.fn is None:
            self._step(i, due)
            return dataclasses.replace(pending, stepped=(*pending.stepped, i))
        out = self.spec.fn({n: pending.params[i][n] for n in due}, due, pending.state[i])
        new, state = self._checked(pending, i, due, out)
        changed: dict[Any, Any] = {}  # stage -> {name: new tensor}
        for name, t in new.items():
            for j, n in self.ties.uses(i, name):
                changed.setdefault(j, {})[n] = t
        return dataclasses.replace(
            pending,
            params=tuple({**p, **changed[j]} if j in changed else p for j, p in enumerate(pending.params)),
            state=(*pending.state[:i], state, *pending.state[i + 1 :]),
            stepped=(*pending.stepped, i),
        )

    def _checked(self, pending: Pending, i: int, due: dict[Any, Any], out: Any) -> tuple[Any, ...]:
        """The pure update's ``(params_l, state_l)`` for stage i, its params exactly the ones it was
        given (names, shapes, dtypes, devices): a misspelt name would add a stray entry and leave the
        real weight as it was."""
        where = f"fused: the update of {self.chain.where(i)}"
        if not (isinstance(cast(object, out), tuple) and len(out) == 2 and isinstance(cast(object, out[0]), dict)):
            raise TypeError(f"{where} must return (params_l, state_l) with params_l a dict, got {type(out).__name__}")
        if set(out[0]) != set(due):
            raise ValueError(f"{where} returned params {sorted(out[0])}; it was given {sorted(due)}, the same names")
        for name, t in out[0].items():
            old = pending.params[i][name]
            if not isinstance(t, torch.Tensor) or (t.shape, t.dtype, t.device) != (old.shape, old.dtype, old.device):
                got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"{where} returned {name!r} as {got}; the parameter is {tuple(old.shape)} {old.dtype} on {old.device}"
                )
        return out

    def grads(self, pending: Pending) -> tuple[Any, ...]:
        """The kept gradients, one dict per stage in the params' structure: a tied parameter's sum in
        each of its uses, ``None`` where there is none (frozen or unused)."""
        out: list[dict[Any, Any]] = []
        for i, stage in enumerate(pending.params):
            grads: dict[Any, Any] = {}
            for name in stage:
                owner_stage, owner_name = self.ties.uses(i, name)[0]
                grads[name] = pending.kept.get(owner_stage, {}).get(owner_name)
            out.append(grads)
        return tuple(out)

    def _step(self, i: int, due: dict[Any, Any]) -> None:
        optimizer = self.spec.optimizers[i if len(self.spec.optimizers) > 1 else 0]
        step_with(optimizer, [self.targets[i, name] for name in due], list(due.values()))

    def finish(self, pending: Pending) -> Pending:
        """``pending`` after the last stage: the reductions still on the wire waited for and used, then
        each optimizer's ``step()`` once, with no gradient left to apply, so its hooks and schedulers
        count one step."""
        try:
            for j, averaged in self.reducer.ready(wait=True) if self.reducer is not None else ():
                pending = self._use(pending, j, averaged) if averaged else pending
            for optimizer in self.spec.optimizers:
                optimizer.step()
        except BaseException as e:
            self.note(pending, e)
            raise
        return pending

    def note(self, pending: Pending, e: BaseException) -> None:
        """Say on ``e`` which stages a torch.optim optimizer had updated in place by ``pending`` (an
        update cannot be taken back), once: the first to say it, the innermost handler, knew the latest
        value. A pure update commits nothing until the sweep returns."""
        said = any(n.startswith(STEPPED) for n in getattr(e, "__notes__", ()))
        if pending.stepped and self.spec.optimizers and not said:
            done = ", ".join(self.chain.where(i) for i in sorted(pending.stepped))
            e.add_note(f"{STEPPED} {done}; the other stages were not)")


def clipped(due: dict[Any, Any], max_norm: float | None) -> dict[Any, Any]:
    """``due`` scaled by ``min(1, max_norm / (‖due‖ + 1e-6))``, the norm over all its tensors (``None``: as is)."""
    if max_norm is None:
        return due
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in due.values()]))  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]  # torch.linalg's functions are untyped
    scale = torch.clamp(max_norm / (cast(torch.Tensor, norm) + 1e-6), max=1.0)
    return {n: g * scale.to(g.dtype) for n, g in due.items()}


def step_with(optimizer: torch.optim.Optimizer, targets: list[Any], grads: list[Any]) -> None:
    """One update of ``optimizer``'s parameters ``targets`` by ``grads`` (its others have no gradient and
    are left as they are), without its step hooks: they run once per sweep, at its plain ``step()``."""
    for p, g in zip(targets, grads):
        p.grad = g.to(p.dtype)
    try:
        compat.unhooked_step(optimizer)
    finally:
        for p in targets:
            p.grad = None
