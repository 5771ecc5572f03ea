"""CUDA graphs of the run-time cuts' reverse steps (``cuda_graphs=True``): a cut call's rebuild and
local vjp captured once per module and call layout, then replayed with the call's values copied in,
as ``torch.cuda.make_graphed_callables`` replays a module's backward. The host then launches one
graph per cut instead of every kernel of the rebuild and the vjp.

    key(call) = (module, its parameters' storage, the layouts of its inputs, costates and buffers,
                 the plain values it is passed, modes, autocast, whether it draws from torch's RNG)
    first call of a key:  the eager step (its gradients are the ones returned), then the step
                          captured on static copies of this call's values
    later calls:          static inputs, costates and buffers <- the call's; torch's generators at
                          the call's forward's state (a captured dropout reads the generator's seed
                          and offset when replayed); replay; the gradients cloned out of the graph
    the first replay:     on other values than the capture's, beside the eager step: its gradients
                          (bit for bit, or within 8 epsilons in norm where kernels add with atomics),
                          or the key runs eagerly from then on, with a warning

A graph replays the kernels it captured: the plain attributes of the cut's modules (a dropout's
``p``) and torch's kernel settings (TF32, the attention backends) are part of its key, but what else
the module's Python reads (a config object, a global flag of its own) is fixed at its capture:
change such state and call ``ef.clear_caches()``. A call that cannot be replayed runs eagerly (``why_eager``): it writes
into its inputs, draws from Python's or numpy's generator, reseeds torch's, is passed a tensor on
another device or an object other than a plain value, reuses kept op outputs (``remat.save``), or its
backward writes a parameter's ``.grad`` itself (Reformer's reversible layers).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any, cast

import torch
from torch import nn

from .. import tree as T
from ..cache import register
from ..core import early_stop as ES
from ..core import replay
from ..core import vjp as V
from ..core.options import Options
from ..core.timing import timer
from ..program.slots import module_lock
from .cut_call import ACTIVE, Call, holding, local_params

__all__ = ["CAPTURE", "GRAPHS", "check_device", "graphed", "key_of", "why_eager"]

Step = Callable[[], list[torch.Tensor | None]]
Captured = tuple[Callable[[], None], list[torch.Tensor | None]]


def cuda_capture(step: Step, device: torch.device) -> Captured:
    """``step`` warmed up on a side stream, then captured into a CUDA graph (one memory pool shared by
    every graph: they replay one at a time and their outputs are copied out before the next):
    ``(replay, the step's outputs as the graph writes them)``."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()  # autograd's and the allocator's first-call work, outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=_pool(device)):
        outs = step()
    return graph.replay, outs


_POOLS: dict[torch.device, Any] = {}


def _pool(device: torch.device) -> Any:
    if device not in _POOLS:
        _POOLS[device] = torch.cuda.graph_pool_handle()
    return _POOLS[device]


CAPTURE: dict[str, Callable[[Step, torch.device], Captured]] = {"cuda": cuda_capture}  # by device type


@dataclasses.dataclass
class Graph:
    """One key's graph: its module (weakly), the static copies the replay reads (the call's leaves,
    costates and buffers) and writes (``outs``: the input costates, then the trained parameters'
    gradients); ``replay`` is ``None`` where the key runs eagerly; ``checked`` once a replay on other
    values than the capture's gave its eager step's gradients."""

    module: weakref.ref[nn.Module]
    leaves: list[Any]
    costates: list[torch.Tensor]
    buffers: dict[str, torch.Tensor]
    replay: Callable[[], None] | None = None
    outs: list[torch.Tensor | None] = dataclasses.field(default_factory=lambda: cast("list[torch.Tensor | None]", []))
    checked: bool = False


GRAPHS: dict[Any, Any] = {}
LIMIT = 256  # graphs kept, the oldest captured dropped
register("cuda graphs", f"cut calls' captured reverse steps, by module and call layout; at most {LIMIT}",
         lambda: (GRAPHS.clear(), _POOLS.clear()))  # fmt: skip


def check_device(device: torch.device) -> None:
    """Refuse ``cuda_graphs=True`` where the model's tensors are on a device no graph captures."""
    if device.type not in CAPTURE:
        raise ValueError(
            f"cuda_graphs=True captures CUDA kernels, and the model runs on {device}: leave cuda_graphs out "
            f"there (each cut's reverse step runs eagerly), or move the model and its inputs to a CUDA device"
        )


PLAIN = (bool, int, float, str, type(None))  # values a key holds as they are


def why_eager(call: Call, leaves: list[Any], device: torch.device) -> str | None:
    """Why ``call``'s reverse step cannot be replayed from a graph (``None``: it can)."""
    if call.written:
        return "it writes into its inputs"
    if call.host is not None:
        return "it draws from Python's or numpy's generator"
    if call.sums is not None:
        return "it seeds torch's generator afresh"
    if call.cached is not None:
        return "remat.save keeps some of its ops' outputs"
    for t in leaves:
        if isinstance(t, torch.Tensor):
            if t.device != device:
                return f"it is passed a tensor on {t.device}"
        elif not isinstance(t, PLAIN):
            return f"it is passed an argument of type {type(t).__name__}, which a graph would fix at its capture"
    return None


def numerics() -> tuple[Any, ...]:
    """torch's global settings that pick kernels (TF32, reduced-precision reductions, deterministic
    algorithms, the attention backends): a graph keeps the kernels picked at its capture."""
    matmul, sdp = torch.backends.cuda.matmul, torch.backends.cuda
    return (
        torch.get_float32_matmul_precision(),
        matmul.allow_tf32,
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
        torch.backends.cudnn.allow_tf32,
        torch.are_deterministic_algorithms_enabled(),
        sdp.flash_sdp_enabled(),
        sdp.mem_efficient_sdp_enabled(),
        sdp.math_sdp_enabled(),
        sdp.cudnn_sdp_enabled(),
    )


def key_of(call: Call, leaves: list[Any], costates: list[torch.Tensor]) -> Hashable:
    """What a graph of ``call``'s reverse step is captured for: the module and its parameters'
    storage, the layouts of the inputs (plain values as they are), costates and buffers, which
    inputs and parameters are differentiated, the modes and the plain attributes of its modules (a
    dropout's ``p``, a norm's ``eps``), autocast, whether it draws, and torch's kernel settings."""
    trained = {id(p) for p in call.trained}
    attributes = tuple(tuple((k, v) for k, v in m.__dict__.items() if isinstance(v, PLAIN)) for m, _ in call.modes)
    return (
        id(call.module),
        tuple((n, p.data_ptr(), p.requires_grad, id(p) in trained) for n, p in call.params.items()),
        call.spec,
        tuple(map(ES.described, leaves)),
        tuple(call.inputs),
        tuple(map(ES.layout, costates)),
        tuple((n, ES.layout(b)) for n, b in call.buffers.items()),
        call.through,
        tuple(training for _, training in call.modes),
        attributes,
        call.autocast,
        call.rng is None,
        numerics(),
    )


def step_of(call: Call, graph: Graph) -> Step:
    """The call's reverse step on the graph's static copies: the module rebuilt with grad at its
    parameters (their own storage), then one vjp; the input costates and trained gradients."""
    kind, enabled, dtype = call.autocast

    def step() -> list[torch.Tensor | None]:
        local, trained = local_params(call)
        fed = list(graph.leaves)
        for i in call.inputs:
            fed[i] = graph.leaves[i].detach().requires_grad_()
        args, kwargs = T.unflatten(fed, call.spec)
        ACTIVE.depth = getattr(ACTIVE, "depth", 0) + 1
        try:
            with (
                torch.enable_grad(),
                replay.in_modes(call.modes),
                # autocast as the call ran, without its cache of cast weights, which a graph would read
                # where a cast made outside the capture was (as make_graphed_callables requires)
                torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=False),
                module_lock(call.module),
                holding(call.module, {**local, **{n: b.clone() for n, b in graph.buffers.items()}}),
            ):
                out = call.forward(*args, **kwargs)
        finally:
            ACTIVE.depth -= 1
        rebuilt = T.flatten_output(out)[0]
        edges = V.places([rebuilt[i] for i in call.through])
        return list(V.pull_back(edges, graph.costates, [*(fed[i] for i in call.inputs), *trained]))

    return step


def load(graph: Graph, call: Call, leaves: list[Any], costates: list[torch.Tensor]) -> None:
    """The call's values copied into the graph's static tensors (no graph of the copies: a rebuilt
    input requires grad)."""
    with torch.no_grad():
        for s, t in zip(graph.leaves, leaves):
            if isinstance(s, torch.Tensor):
                s.copy_(t)
        for s, t in zip(graph.costates, costates):
            s.copy_(t)
        for n, b in call.buffers.items():
            graph.buffers[n].copy_(b)


def run(graph: Graph, call: Call, leaves: list[Any], costates: list[torch.Tensor], device: torch.device) -> list[Any]:
    """One replay on this call's values, torch's generators at its forward's state; the outputs cloned."""
    assert graph.replay is not None
    load(graph, call, leaves, costates)
    with replay.replay_rng(call.rng, device):
        graph.replay()
    return [None if o is None else o.clone() for o in graph.outs]


def static(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (its strides kept where they are dense, as ``empty_like`` keeps them: an expanded
    costate becomes dense), the place a graph reads it from."""
    with torch.no_grad():
        return torch.empty_like(t).copy_(t)


def capture(call: Call, leaves: list[Any], costates: list[torch.Tensor], device: torch.device) -> Graph:
    """A graph of ``call``'s reverse step on static copies of its values (``replay`` left ``None``,
    with a warning, where the capture fails)."""
    graph = Graph(
        weakref.ref(call.module),
        [static(t) if isinstance(t, torch.Tensor) else t for t in leaves],
        [static(c) for c in costates],
        {n: static(b) for n, b in call.buffers.items()},
    )
    forked = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]  # torch: untyped devices parameter
    try:
        with forked:  # the warm-up and the capture draw nothing the caller's generators would see
            graph.replay, graph.outs = CAPTURE[device.type](step_of(call, graph), device)
    except Exception as e:  # a host read or a data-dependent shape in the module: no graph of it
        eager_for_good(graph)
        warn(call, f"its capture failed ({type(e).__name__}: {e})")
    return graph


def graphed(
    call: Call, leaves: list[Any], costates: list[torch.Tensor], device: torch.device, opts: Options,
    stats: dict[Any, Any], eager: Callable[[], tuple[list[Any], list[Any]]],
) -> list[Any]:  # fmt: skip
    """The call's input costates and trained gradients: replayed from its key's graph, or ``eager()``'s
    (``(gradients, its graph's parameter leaves)``, whose ``.grad`` a backward that accumulates into
    them sets) where the call cannot be replayed, where its key is new (its step is then captured)
    and at the key's first replay, which must give the eager gradients (``same``; else the key runs
    eagerly from then on, with a warning). ``stats`` count ``graph_replays`` (timed as ``graph_s``),
    ``graph_captures`` and ``graph_eager``."""
    why = why_eager(call, leaves, device)
    key = None if why is not None else key_of(call, leaves, costates)
    graph = cast("Graph | None", GRAPHS.get(key))
    if graph is not None and graph.module() is not call.module:  # another module at a freed one's address
        graph = None
    if graph is not None and graph.checked:
        stats["graph_replays"] = stats.get("graph_replays", 0) + 1
        with timer(opts, stats, "graph_s", f"eae/{call.name}/graph"):
            return run(graph, call, leaves, costates, device)
    stats["graph_eager"] = stats.get("graph_eager", 0) + 1
    grads, trained = eager()
    if key is None or graph is not None and graph.replay is None:  # eager for good
        return grads
    if graph is not None:  # its first replay, on other values than its capture's
        if all(same(a, b) for a, b in zip(run(graph, call, leaves, costates, device), grads, strict=True)):
            graph.checked = True
        else:
            eager_for_good(graph)
            warn(call, "its replay differs from its eager step (the module reads a value its capture fixed)")
        return grads
    if any(p.grad is not None for p in trained):
        graph = Graph(weakref.ref(call.module), [], [], {})
        warn(call, "its backward writes a parameter's .grad itself")
    else:
        graph = capture(call, leaves, costates, device)
        stats["graph_captures"] = stats.get("graph_captures", 0) + 1
    GRAPHS.pop(key, None)
    GRAPHS[key] = graph
    while len(GRAPHS) > LIMIT:
        del GRAPHS[next(iter(GRAPHS))]
    return grads


def eager_for_good(graph: Graph) -> None:
    """The key runs eagerly from now on: its graph and static copies let go."""
    graph.replay, graph.outs, graph.leaves, graph.costates, graph.buffers = None, [], [], [], {}


def warn(call: Call, why: str) -> None:
    warnings.warn(f"cuda_graphs: cut {call.name!r} runs its reverse step eagerly: {why}", stacklevel=3)


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """The same gradient: both ``None``, or tensors of one dtype and shape, bit for bit equal (NaN
    included) or within 8 epsilons of their dtype in norm (``|a - b| <= 8 eps |b|``: kernels that add
    with atomics, as attention's backward on CUDA, differ in their last bits from run to run; a
    replay on values its capture fixed is off by far more)."""
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
        return True
    if not (a.is_floating_point() and bool(a.isfinite().all()) and bool(b.isfinite().all())):
        return False
    a64, b64 = a.double(), b.double()
    return bool((a64 - b64).square().sum() <= (8 * torch.finfo(a.dtype).eps) ** 2 * b64.square().sum())
