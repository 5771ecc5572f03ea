"""A stage of a captured model (capture.cut_model): Piece, the part of the exported graph it runs and the boundary it carries, and CapturedStage, that piece as an nn.Module over the model's own parameters and buffers."""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch import nn

from ..compat import pytree as torch_pytree
from ..tree import NAMESPACE

__all__ = ["CapturedStage", "Piece", "layout", "register_output_types"]


_NATIVE = (tuple, list, dict, collections.OrderedDict, collections.defaultdict, collections.deque, type(None))

_REGISTERED: set[Any] = set()


def register_output_types(spec) -> None:
    """Make optree (in this library's namespace) see through the output's pytree nodes the way
    torch's pytree does (``ModelOutput`` and other registered classes)."""
    cls = spec.type
    if cls in torch_pytree.SUPPORTED_NODES and cls not in _NATIVE and cls not in _REGISTERED:
        node = torch_pytree.SUPPORTED_NODES[cls]
        optree.register_pytree_node(
            cls, node.flatten_fn, lambda context, children: node.unflatten_fn(children, context), namespace=NAMESPACE
        )
        _REGISTERED.add(cls)
    for child in spec.children():
        register_output_types(child)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One stage of a split graph: ``graph`` (``None``: no operation of its own) maps ``inputs``
    (graph node names) to ``outputs``; ``sources[name]`` says where a non-boundary input comes
    from (``("parameter" | "buffer", qualified name)`` or ``("constant", key)``); the boundary it
    returns is ``{name: value}`` of the ``carried`` nodes, or the user's output (``out_spec``) for
    the last piece. The first piece reads the user's input, flattened by ``flatten``, and refuses
    one whose layout is not ``example``'s."""

    graph: nn.Module | None
    inputs: list[Any]
    outputs: list[Any]
    sources: dict[Any, Any]
    carried: list[Any]
    user_inputs: list[Any] | None
    user_outputs: list[Any] | None
    out_spec: Any
    constants: dict[Any, Any]
    example: list[Any]
    flatten: Callable[[Any], list[Any]]

    def environment(self, h: Any) -> dict[Any, Any]:
        if self.user_inputs is None:
            return dict(h)
        flat = self.flatten(h)
        got = layout(flat)
        if got != self.example:
            raise ValueError(
                f"captured stage: the model was captured for inputs {self.example}, got {got}; "
                f"capture again with this input (ef.grad(model, ...) captures once per input layout)"
            )
        return dict(zip(self.user_inputs, flat))

    def bind(self, lookup: Callable[[str], torch.Tensor], h: Any) -> tuple[list[Any], dict[Any, Any]]:
        """``(args, env)``: the graph's positional inputs on boundary ``h`` (its parameters and buffers
        read by ``lookup(name)``), and the values known so far by node name."""
        env = self.environment(h)
        args = []
        for name in self.inputs:
            kind, key = self.sources.get(name, ("value", name))
            args.append(
                lookup(key)
                if kind in ("parameter", "buffer")
                else self.constants[key]
                if kind == "constant"
                else env[name]
            )
        return args, env

    def collect(self, env: dict[Any, Any], outs: Sequence[Any]) -> Any:
        """The piece's output from ``env`` and the graph's outputs ``outs``: the boundary it carries,
        or the user's output for the last piece."""
        env.update(zip(self.outputs, outs))
        if self.user_outputs is not None:
            return torch_pytree.tree_unflatten([env[n] for n in self.user_outputs], self.out_spec)
        return {name: env[name] for name in self.carried}

    def run(self, lookup: Callable[[str], torch.Tensor], h: Any) -> Any:
        """The piece on boundary ``h``, its parameters and buffers read by ``lookup(name)``."""
        args, env = self.bind(lookup, h)
        return self.collect(env, self.graph(*args) if self.graph is not None else ())


def layout(leaves: list[Any]) -> list[Any]:
    """What a capture is specialised to: each tensor leaf's shape and dtype, any other leaf itself."""
    return [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves]


class CapturedStage(nn.Module):
    """One piece of a captured forward: ``h -> h'`` over the model's own parameters and buffers.

    Its submodules mirror the model's module paths, so ``named_parameters()`` gives the
    model's names; the engine substitutes the given tensors for them, and BatchNorm running statistics
    are updated in place in the buffers it is given, as the model's own forward would.
    """

    def __init__(self, model: nn.Module, piece: Piece, training: bool):
        super().__init__()
        # Everything but the mirrored tensors lives in one attribute whose name no module path uses.
        self._eae = types.SimpleNamespace(piece=piece, training=training, model=weakref.ref(model))
        for kind, name in piece.sources.values():
            if kind not in ("parameter", "buffer"):
                continue
            owner, leaf = self._mirror_owner(name)
            if leaf in owner._parameters or leaf in owner._buffers:
                continue
            if kind == "parameter":
                owner.register_parameter(leaf, model.get_parameter(name))
            else:
                owner.register_buffer(leaf, model.get_buffer(name))

    def _mirror_owner(self, name: str) -> tuple[nn.Module, str]:
        """The submodule of this stage at ``name``'s module path (made where missing) and the leaf name."""
        *path, leaf = name.split(".")
        module: nn.Module = self
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        return module, leaf

    def _lookup(self, name: str) -> torch.Tensor:
        return functools.reduce(getattr, name.split("."), self)

    @property
    def piece(self) -> Piece:
        """The piece of the captured graph this stage runs, refused if the model changed mode since."""
        plan = self._eae
        model = plan.model()
        if model is not None and model.training != plan.training:
            mode = "train" if plan.training else "eval"
            raise ValueError(
                f"captured stage: the model was captured in {mode} mode and is now in the other; "
                f"capture again (ef.grad(model, ...) captures once per mode)"
            )
        return plan.piece

    def forward(self, h: Any) -> Any:
        return self.piece.run(self._lookup, h)
