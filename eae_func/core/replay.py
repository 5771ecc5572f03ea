"""What a stage's rebuild replays of its forward, so it computes the forward's values again:
torch's generators (CPU, and the stage's CUDA device), Python's and numpy's where the stage draws
from them, each module's train/eval mode, and autocast.

    before the forward:  state = rng_state(device); modes = modes_of(module)
    after it:            rng = state if drew(state, device) else None      (nothing to replay)
    the rebuild:         with replay_rng(rng, device), in_modes(modes), autocast(dtype, device): ...
"""

from __future__ import annotations

import contextlib
import ctypes
import random
from collections.abc import Hashable
from typing import Any, cast

import numpy as np
import torch

from ..cache import register
from ..program.watch import numpy_drew

__all__ = [
    "HOST",
    "NULL",
    "HostRandom",
    "autocast",
    "autocast_state",
    "check_modes",
    "drew",
    "host_kind",
    "in_modes",
    "modes_of",
    "replay_autocast",
    "replay_rng",
    "rng_state",
]

NULL = contextlib.nullcontext()


def rng_state(device: torch.device) -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.default_generator.get_state(), cuda


def drew(before: tuple[Any, ...], device: torch.device) -> bool:
    """Whether the global RNG moved since ``before`` was taken (the stage drew random numbers); the
    CPU states are compared as bytes read straight from their 5 kB (a third of the cost of going
    through numpy, a fifth of ``torch.equal``'s)."""
    cpu, cuda = rng_state(device)
    return _bytes(cpu) != _bytes(before[0]) or (cuda is not None and not torch.equal(cuda, before[1]))


def _bytes(state: torch.Tensor) -> bytes:
    """A copy of a CPU generator state's bytes (a contiguous uint8 tensor)."""
    return ctypes.string_at(state.data_ptr(), state.numel())


def replay_rng(state: tuple[Any, ...] | None, device: torch.device):
    """A context that runs with the global RNG as it was when ``state`` was taken (dropout masks
    repeat): ``(cpu, cuda)`` as ``rng_state`` gives them (``(None, None)``: torch's generator is not
    replayed), plus Python's and numpy's states where the stage drew from those (``HostRandom``);
    ``None``: the stage drew nothing, nothing to replay."""
    return NULL if state is None else _replayed(state, device)


@contextlib.contextmanager
def _replayed(state: tuple[Any, ...], device: torch.device):
    cpu, cuda = state[0], state[1]
    forked = NULL if cpu is None else torch.random.fork_rng(devices=[device] if cuda is not None else [])  # pyright: ignore[reportUnknownVariableType, reportUnknownMemberType]  # torch: untyped devices parameter
    with forked, HOST.replay(state[2:] or None):
        if cpu is not None:
            torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


class HostRandom:
    """Python's ``random`` and numpy's global generator, which a stage's forward may draw from
    (BigBird's random attention blocks, a noise layer): their states cost tens of microseconds to
    read, so each kind of stage (the caller's hashable ``kind``) is watched on its first call in the
    process, and only the kinds that drew then have their states saved at every call and replayed by
    the rebuild. A kind that draws only on later calls, or only sometimes, is not seen."""

    def __init__(self):
        self.watched: set[Any] = set()
        self.drawing: set[Any] = set()

    @staticmethod
    def state() -> tuple[Any, ...]:
        return random.getstate(), np.random.get_state(legacy=False)

    def before(self, kind: Any) -> tuple[Any, ...] | None:
        """The states before a call, where its kind draws or has not been watched yet."""
        return self.state() if kind in self.drawing or kind not in self.watched else None

    def after(self, kind: Any, before: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
        """The states to replay for this call (``None``: it draws nothing)."""
        if kind not in self.watched:
            self.watched.add(kind)
            assert before is not None
            if random.getstate() != before[0] or numpy_drew(before[1]):
                self.drawing.add(kind)
        return before if kind in self.drawing else None

    def replay(self, states: tuple[Any, ...] | None):
        """A context in which Python's and numpy's generators are at ``states`` (``None``: as they are)."""
        return NULL if states is None else self._replayed(states)

    @contextlib.contextmanager
    def _replayed(self, states: tuple[Any, ...]):
        now = self.state()
        random.setstate(states[0])
        np.random.set_state(states[1])
        try:
            yield
        finally:
            random.setstate(now[0])
            np.random.set_state(now[1])


HOST = HostRandom()
register("host random", "which kinds of stage draw from Python's or numpy's generator (by module classes and "
         "training flag); watched again", lambda: (HOST.watched.clear(), HOST.drawing.clear()))  # fmt: skip


def host_kind(s: Any, modes: tuple[tuple[torch.nn.Module, bool], ...]) -> Hashable:
    """A stage's kind for ``HostRandom``: the classes of its modules and its training flag (two
    groupings of other layers are two kinds), or its function's code."""
    if s.module is None:
        return getattr(s.fn, "__code__", type(cast(object, s.fn)))
    return tuple(type(m) for m, _ in modes), modes[0][1]


def modes_of(module: torch.nn.Module | None) -> tuple[Any, ...]:
    """``(module, training)`` for ``module`` and every module in it (``()`` for none), in
    ``module.modules()``'s order, each once: the modes a stage runs in, recorded by its forward so
    its recompute runs in them too (walked without ``named_modules``' names, a third of its cost)."""
    return () if module is None else tuple(_walk(module, set(), []))


def _walk(module: torch.nn.Module, seen: set[Any], out: list[Any]) -> list[Any]:
    seen.add(module)
    out.append((module, module.training))
    for child in module._modules.values():  # pyright: ignore[reportPrivateUsage]
        if child is not None and child not in seen:
            _walk(child, seen, out)
    return out


def check_modes(modes: tuple[Any, ...], where: str) -> None:
    """Refuse a stage whose modes (``modes_of``, read before its forward) changed while it ran: its
    recompute could not run in the modes it ran in."""
    m = next((m for m, training in modes if m.training != training), None)
    if m is not None:
        raise ValueError(
            f"{where}: a {type(m).__name__} in it switched to {'train' if m.training else 'eval'} mode while its "
            f"forward ran (model.train() / eval() from another thread, or a hook or forward that switches "
            f"modes), so its rebuild could not run in the modes its forward ran in: switch modes between "
            f"steps, not during one"
        )


def in_modes(modes: tuple[Any, ...]):
    """A context in which every module of ``modes`` (``modes_of``) is in its recorded mode: one
    switched since (``model.eval()`` from another thread) is switched back for the block, then
    left as it was found."""
    changed = [(m, training) for m, training in modes if m.training != training]
    return NULL if not changed else _switched(changed)


@contextlib.contextmanager
def _switched(changed: list[Any]):
    for m, training in changed:
        m.training = training
    try:
        yield
    finally:
        for m, training in changed:
            m.training = not training


def autocast(dtype: torch.dtype | None, device: torch.device):
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else NULL


def autocast_state(device: torch.device) -> tuple[Any, ...]:
    kind = device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


def replay_autocast(state: tuple[Any, ...]):
    """A context with autocast as ``state`` (``autocast_state``) says: nothing to do where it is so."""
    kind, enabled, dtype = state
    if (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) == (enabled, dtype):
        return contextlib.nullcontext()
    return torch.autocast(kind, dtype=dtype, enabled=enabled)
