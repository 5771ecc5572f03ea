"""A user's function as code: what it reads from outside its arguments (a fingerprint of those values,
the tensors that require grad among them) and where in the user's own lines something happened (an
error's deepest user frame, the first draw from Python's or numpy's global generator).
"""

from __future__ import annotations

import functools
import inspect
import linecache
import os
import random
import sys
import sysconfig
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import optree
import torch
from torch import nn

from . import watch

__all__ = [
    "LIBRARIES",
    "closure",
    "drawn_at",
    "frame_line",
    "is_user",
    "label",
    "reachable",
    "trainable",
    "user_line",
    "values",
]


def label(fn: Callable[..., Any]) -> str:
    """``model_fn (file.py:12)``: the function and where it is defined."""
    target = getattr(fn, "func", fn)
    code = getattr(getattr(target, "__func__", target), "__code__", None)
    name = getattr(target, "__qualname__", type(target).__name__)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def values(fn: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of what ``fn`` reads from outside its arguments: a partial's bound arguments,
    a method's object, a function's closure cells and the globals its code names, a callable object's
    attributes."""
    if isinstance(fn, functools.partial):
        return [("partial", (fn.args, fn.keywords)), *values(fn.func)]
    if inspect.ismethod(fn):
        return [("self", fn.__self__), *values(fn.__func__)]
    if isinstance(fn, types.FunctionType):
        found = inspect.getclosurevars(fn)
        return [*found.nonlocals.items(), *found.globals.items()]
    if callable(fn) and hasattr(fn, "__dict__"):
        return list(vars(fn).items())
    return []


LIBRARIES = (
    *(os.path.dirname(m.__file__ or "") + os.sep for m in (torch, optree, np)),
    os.path.dirname(os.path.dirname(__file__)) + os.sep,  # eae_func's own
    sysconfig.get_paths()["stdlib"] + os.sep,
)


def is_user(filename: str) -> bool:
    return not filename.startswith(LIBRARIES) and not filename.startswith("<frozen")


def reachable(fn: Any, depth: int = 0):
    """``values(fn)``, and those of the user's own helper functions it names, three calls deep."""
    for name, v in values(fn):
        yield name, v
        if isinstance(v, types.FunctionType) and is_user(v.__code__.co_filename) and depth < 3:
            yield from reachable(v, depth + 1)


def closure(fn: Any) -> tuple[Any, ...]:
    """A comparable fingerprint of what ``fn`` reads from outside (``reachable``), each value by
    ``watch.described``: at every depth, so a nested dict or ``cfg.sub.scale`` changed between
    calls makes a new capture."""
    seen: dict[int, Any] = {}
    return tuple((name, watch.described(v, seen)) for name, v in reachable(fn))


def trainable(fn: Callable[..., Any]) -> dict[Any, Any]:
    """``{storage address: name}`` of the tensors that require grad ``fn`` can reach from outside its
    arguments (closed-over tensors, modules' parameters, one level into containers)."""
    found: dict[Any, Any] = {}

    def visit(name: str, v: Any, nested: bool) -> None:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            found.setdefault(v.data_ptr(), repr(name))
        elif isinstance(v, nn.Module):
            for path, t in v.named_parameters():
                if t.requires_grad:
                    found.setdefault(t.data_ptr(), f"{name}.{path}")
        elif isinstance(v, (list, tuple)) and not nested:
            for j, e in enumerate(v):
                visit(f"{name}[{j}]", e, True)
        elif isinstance(v, dict) and not nested:
            for k, e in v.items():
                visit(f"{name}[{k!r}]", e, True)

    for name, v in reachable(fn):
        visit(name, v, False)
    return found


def frame_line(filename: str, lineno: int) -> str:
    return f"{filename}:{lineno} ({linecache.getline(filename, lineno).strip()})"


def user_line(error: BaseException) -> str | None:
    """The deepest line of the user's code in ``error``'s traceback (or its causes')."""
    line, seen, e = None, set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            if is_user(tb.tb_frame.f_code.co_filename):
                line = frame_line(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
            tb = tb.tb_next
        if line is not None:
            return line
        e = e.__cause__ or e.__context__
    return None


def drawn_at(fn: Callable[..., Any], params: Any, inputs: tuple[Any, ...]) -> str | None:
    """Where ``fn`` first draws from Python's ``random`` or numpy's global generator: found by running
    it once more, eagerly, tracing the lines of the user's code and comparing the generators' states
    line by line (the states are put back)."""
    found: list[str] = []
    python_rng, numpy_rng = random.getstate(), np.random.get_state(legacy=False)

    def moved() -> bool:
        return random.getstate() != python_rng or watch.numpy_drew(numpy_rng)

    def trace(frame, event, arg):
        if not is_user(frame.f_code.co_filename):
            return None
        last = [frame.f_lineno]

        def local(frame, event, arg):
            if not found and event in ("line", "return") and moved():
                found.append(frame_line(frame.f_code.co_filename, last[0]))
            last[0] = frame.f_lineno
            return local

        return local

    with torch.random.fork_rng(), torch.no_grad():
        sys.settrace(trace)
        try:
            fn(params, *inputs)
        except Exception:
            pass  # only where it draws matters here
        finally:
            sys.settrace(None)
            random.setstate(python_rng)
            np.random.set_state(numpy_rng)
    return found[0] if found else None
