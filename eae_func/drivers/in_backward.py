"""A fused update at run time: with ``update=``, the optimizer steps inside the backward of a model cut
at run time (``eae_func.drivers.cuts``), each group of parameters as soon as autograd has accumulated their
gradients, so the whole network's gradients never exist at once (PyTorch's optimizer-in-backward
recipe, by post-accumulate-grad hooks, grouped by stage as the fold steps a chain's stages).

    group of a parameter:  the cut module it is in (the outermost one), else the module that owns it
                           (the glue: embeddings, final norm, head); a tensor the loss reads beside
                           the swept model (a head beside its body) that the optimizer holds: its own
    hook on each:          its gradient accumulated (all of its uses: a cut's calls, a tied head and
                           embedding, every microbatch) -> through the model parameter's tensor hooks,
                           kept; once every member of its group has one: clipped by the group's norm
                           (``max_norm``), the group stepped, the gradients dropped
    with replicas:         each complete group's gradients averaged over them first (the fold's
                           ``Reducer``: DDP's arithmetic, zeros where a replica has none), the groups
                           launched in one order every replica shares (outside tensors, then the
                           groups by their last parameter in ``params``, last first: the backward's
                           order on a model that registers its modules as it calls them), so the
                           all_reduces pair up whatever order a replica completes them in
    after the backward:    a group still waiting (a member with no gradient) stepped with what it has;
                           each optimizer's ``step()`` once with no gradient left, so its step hooks and
                           schedulers count one step per sweep (under ``ef.enable``, the loop's own
                           ``step()`` does both: a second backward before it is refused)

The pure form ``ef.fused(fn, state)`` takes ``state`` in params' structure (an entry per parameter
name) and ``fn(params_g, grads_g, state_g)`` gets the dicts of a group's names; nothing is written,
the new tensors and state come back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn

from ..core.update import STEPPED, Fused, clipped, step_with
from ..program.chain import through_hooks
from ..program.module_chain import check_same_tensor

__all__ = ["InBackward"]


@dataclasses.dataclass
class InBackward:
    """The update of one run-time sweep: ``spec``; ``targets``: each trained name's optimizer and its own
    parameter (torch.optim); ``groups``: each trained name's group, ``members`` each group's names;
    ``hooked``: the model parameters with tensor hooks, by name; ``outside``: the optimizer's other
    trainable tensors; ``given``: the sweep's params; ``params`` / ``state``: a pure update's new
    tensors and state so far; ``waiting``:
    each group's gradients so far; ``stepped``: the groups updated, in order."""

    spec: Fused
    targets: dict[Any, Any]
    groups: dict[Any, Any]
    members: dict[Any, Any]
    hooked: Mapping[Any, Any]
    outside: list[Any]
    given: Mapping[Any, Any]
    params: dict[Any, Any]
    state: dict[Any, Any]
    waiting: dict[Any, Any] = dataclasses.field(default_factory=cast("Callable[[], dict[Any, Any]]", dict))
    stepped: list[Any] = dataclasses.field(default_factory=cast("Callable[[], list[Any]]", list))
    arrived: set[Any] = dataclasses.field(default_factory=cast("Callable[[], set[Any]]", set))
    reducer: Any = None
    order: list[Any] = dataclasses.field(default_factory=cast("Callable[[], list[Any]]", list))
    complete: dict[Any, Any] = dataclasses.field(default_factory=cast("Callable[[], dict[Any, Any]]", dict))
    launched: int = 0

    @classmethod
    def prepare(
        cls,
        spec: Fused,
        model: nn.Module,
        params: Mapping[Any, Any],
        trained: list[str],
        cuts: list[str],
        hooked: Mapping[Any, Any],
    ) -> InBackward:
        """The update of ``spec`` for a sweep of ``model`` at ``params`` training ``trained``, cut at the
        module paths ``cuts``, every parameter found and every state entry checked before any step
        (``averaging`` then makes it average over replicas)."""
        groups = {n: _group(n, cuts) for n in trained}
        members: dict[str, list[Any]] = {}
        for n, g in groups.items():
            members.setdefault(g, []).append(n)
        targets, outside = _targets(spec.optimizers, model, params, trained) if spec.optimizers else ({}, [])
        for k, (o, p) in enumerate(outside):
            targets[f"#{k}"], groups[f"#{k}"] = (o, p), f"a tensor of shape {tuple(p.shape)} the loss reads"
            members.setdefault(groups[f"#{k}"], []).append(f"#{k}")
        state: dict[Any, Any] = {}
        if spec.fn is not None:
            if not isinstance(cast(object, spec.state), Mapping) or set(trained) - set(spec.state):
                got = (
                    sorted(set(trained) - set(spec.state))
                    if isinstance(cast(object, spec.state), Mapping)
                    else spec.state
                )
                raise TypeError(
                    f"fused: a model cut at run time takes the pure update's state in params' structure, a dict "
                    f"with an entry per trainable parameter name; missing {got!r:.200}"
                )
            state = dict(spec.state)
        frozen = {g: frozenset(m) for g, m in members.items()}
        return cls(spec, targets, groups, frozen, hooked, [p for _, p in outside], params, {}, state)

    def averaging(self, reducer: Any) -> None:
        """Average each group's gradients by ``reducer`` (``data_parallel.Reducer``) before its step."""
        position = {n: i for i, n in enumerate(self.given)}
        outside = [g for g, m in self.members.items() if min(m)[0] == "#"]
        last = {g: max(position[n] for n in m) for g, m in self.members.items() if g not in outside}
        self.reducer, self.order = reducer, outside + sorted(last, key=last.__getitem__, reverse=True)

    def like(self, group: str) -> dict[Any, Any]:
        """The layout a group's gradients are averaged over: each member's tensor, by name."""
        return {n: self.targets[n][1] if n[0] == "#" else self.given[n] for n in sorted(self.members[group])}

    def install(self, leaves: Mapping[str, torch.Tensor]) -> list[Any]:
        """The hooks on the sweep's trained leaves and the outside tensors: handles to remove."""
        handles: list[Any] = [
            leaves[n].register_post_accumulate_grad_hook(self._arrival(n))  # pyright: ignore[reportUnknownMemberType]
            for n in self.groups
            if n[0] != "#"
        ]
        handles += [p.register_post_accumulate_grad_hook(self._arrival(f"#{k}")) for k, p in enumerate(self.outside)]
        return handles

    def _arrival(self, name: str):
        def hook(t: torch.Tensor) -> None:
            g, t.grad = t.grad, None
            if name in self.arrived:
                raise RuntimeError(
                    f"fused: {name!r} got a second gradient before the optimizer's step() (a second backward, as "
                    f"gradient accumulation runs, or a custom Function's own backward running autograd on it), "
                    f"and its group was stepped on the first: the fused update steps in each backward; "
                    f"accumulate without update=, then optimizer.step()"
                )
            self.arrived.add(name)
            group = self.groups[name]
            due = self.waiting.setdefault(group, {})
            due[name] = through_hooks(self.hooked[name], g) if name in self.hooked else g
            if len(due) == len(self.members[group]):
                self._complete(group, self.waiting.pop(group))

        return hook

    def _complete(self, group: str, due: dict[Any, Any]) -> None:
        """A group's gradients all here: stepped, or (with replicas) launched in ``order`` as soon as
        every group before it was, and the groups whose averages arrived stepped."""
        if self.reducer is None:
            return self._use(group, due)
        self.complete[group] = due
        while self.launched < len(self.order) and self.order[self.launched] in self.complete:
            self._launch(self.complete.pop(self.order[self.launched]))
        for k, averaged in self.reducer.ready(wait=False):
            self._use(self.order[k], averaged)

    def _launch(self, due: dict[Any, Any]) -> None:
        self.reducer.start(self.launched, due, self.like(self.order[self.launched]))
        self.launched += 1

    def _use(self, group: str, due: dict[Any, Any]) -> None:
        due = clipped({n: g for n, g in due.items() if g is not None}, self.spec.max_norm)
        if not due:
            return
        if self.spec.fn is None:
            for optimizer in dict.fromkeys(self.targets[n][0] for n in due):
                names = [n for n in due if self.targets[n][0] is optimizer]
                step_with(optimizer, [self.targets[n][1] for n in names], [due[n] for n in names])
        else:
            current = {n: self.params.get(n, self.given[n]) for n in due}
            new, state = self.spec.fn(current, due, {n: self.state[n] for n in due})
            self._check(group, due, new)
            self.params.update(new)
            self.state.update(state)
        self.stepped.append(group)

    def _check(self, group: str, due: dict[Any, Any], new: Any) -> None:
        where = f"fused: the update of {group!r}"
        if not isinstance(cast(object, new), dict) or set(new) != set(due):
            got = sorted(new) if isinstance(cast(object, new), dict) else type(new).__name__
            raise ValueError(f"{where} returned params {got}; it was given {sorted(due)}, the same names")
        for n, t in new.items():
            old = self.given[n]
            if not isinstance(t, torch.Tensor) or (t.shape, t.dtype, t.device) != (old.shape, old.dtype, old.device):
                raise ValueError(f"{where} returned {n!r} unlike the parameter ({tuple(old.shape)} {old.dtype})")

    def flush(self) -> None:
        """The groups still waiting (a member with no gradient) stepped with what they have; the next
        backward may bring every gradient again. With replicas: every group not yet launched is, in
        ``order`` (one no replica has a gradient of stays unstepped), and each stepped on its average."""
        if self.reducer is not None:
            while self.launched < len(self.order):
                group = self.order[self.launched]
                self._launch(self.complete.pop(group, None) or self.waiting.pop(group, {}))
            for k, averaged in self.reducer.ready(wait=True):
                self._use(self.order[k], averaged)
            self.launched = 0
        for group in list(self.waiting):
            self._use(group, self.waiting.pop(group))
        self.arrived, self.stepped = set(), []

    def finish(self) -> None:
        """``flush``, then each optimizer's ``step()`` once (its hooks, schedulers)."""
        self.flush()
        for optimizer in self.spec.optimizers:
            optimizer.step()

    def failed(self, e: BaseException) -> None:
        """After a failure: the outside tensors' ``.grad`` as they were (``None``), and a note on ``e``
        of the groups a torch.optim update had already stepped (an update cannot be taken back)."""
        for p in self.outside:
            p.grad = None
        if (
            self.stepped
            and self.spec.optimizers
            and not any(n.startswith(STEPPED) for n in getattr(e, "__notes__", ()))
        ):
            e.add_note(f"{STEPPED} {', '.join(map(repr, self.stepped))}; the others were not)")


def _group(name: str, cuts: list[str]) -> str:
    """The stage a trained parameter is stepped with: its outermost cut module, else its own module."""
    inside = [c for c in cuts if name.startswith(c + ".")]
    return min(inside, key=len) if inside else name.rpartition(".")[0]


def _targets(
    optimizers: tuple[Any, ...], model: nn.Module, params: Mapping[Any, Any], trained: list[str]
) -> tuple[dict[Any, Any], list[Any]]:
    """``({name: (optimizer, its parameter)}, outside)``: each trained name's parameter among the
    optimizers' (by identity with the given tensor or the module's own, else by storage), and the
    optimizers' trainable tensors that are none of these (a head the loss reads beside the model)."""
    owned = {id(p): (o, p) for o in optimizers for group in o.param_groups for p in group["params"]}
    by_storage = {p.data_ptr(): (o, p) for o, p in owned.values() if p.numel()}
    targets: dict[Any, Any] = {}
    for n in trained:
        t, own = params[n], model.get_parameter(n)
        check_same_tensor(own, t, "fused: the gradients were computed at", repr(n))
        found = owned.get(id(t)) or owned.get(id(own)) or (by_storage.get(t.data_ptr()) if t.numel() else None)
        if found is None:
            raise ValueError(
                f"fused: parameter {n!r} is trainable but not among the optimizer's parameters (give one optimizer "
                f"over every trainable parameter; freeze it with requires_grad_(False) to leave it out)"
            )
        targets[n] = found
    mine = {id(p) for _, p in targets.values()}
    outside = [(o, p) for o, p in owned.values() if id(p) not in mine and p.requires_grad]
    stale = [p for _, p in owned.values() if p.grad is not None]
    if stale:
        raise ValueError(
            f"fused: {len(stale)} of the optimizer's parameters already have .grad set; each fused step would "
            f"apply them again: call optimizer.zero_grad(set_to_none=True) first"
        )
    return targets, outside
