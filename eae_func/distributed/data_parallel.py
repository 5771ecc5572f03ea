"""Data parallelism: replicas of a stage range average their parameter gradients (after the sweep,
or stage by stage as the fold makes them: ``Reducer``), and a pipeline x data-parallel mesh of ranks.

    average_gradients(grads, group):   g <- (1/R) sum_r g_r        (one all_reduce)
    with a codec:                      g <- (1/R) sum_r decode(encode(g_r))   (all_gather of payloads)

Every replica ends with the same average (bit-identical: all decode the same payloads
and add them in rank order). Replicas must be one model: ``agree`` checks it at the first step.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import sys
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..adjoint import NAMESPACE
from ..core.boundary import is_differentiable
from ..program.chain import Chain
from .codecs import Codec, Encoded
from .launch import PeerError

__all__ = [
    "Mesh",
    "Reducer",
    "agree",
    "average_gradients",
    "average_model_grads",
    "averaged",
    "buckets",
    "digest",
    "host_group",
    "mesh",
    "model_layout",
    "replica_differences",
    "replica_layout",
    "warn_local_gradients",
]


@dataclasses.dataclass(frozen=True)
class Mesh:
    """``pp x dp`` ranks on a ``torch.distributed`` ``DeviceMesh`` of shape ``(dp, pp)`` (dimensions
    ``"dp"`` and ``"pp"``): global rank ``d * pp + s`` is pipeline position ``s`` of replica ``d``.

    pipeline_ranks: the ranks of this rank's pipeline (pass them to ``Pipeline(ranks=...)``).
    data_group:     the process group of the replicas of this rank's stage range
                    (``device_mesh.get_group("dp")``; ``data_parallel=device_mesh["dp"]`` for a sweep).
    """

    pp: int
    dp: int
    stage_rank: int
    replica: int
    pipeline_ranks: tuple[Any, ...]
    data_ranks: tuple[Any, ...]
    data_group: Any
    device_mesh: Any


def mesh(pp: int, dp: int | None = None) -> Mesh:
    """Split the world into ``dp`` pipelines of ``pp`` ranks (``dp`` defaults to world / pp) with
    ``init_device_mesh`` (on ``cuda`` under NCCL, else ``cpu``). Collective: every rank must call it,
    with the same arguments."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // pp if dp is None else dp
    if pp < 1 or dp < 1 or pp * dp != world:
        raise ValueError(f"mesh: pp x dp = {pp} x {dp} does not match the world size {world}")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    grid = init_device_mesh(device, (dp, pp), mesh_dim_names=("dp", "pp"))
    s, d = rank % pp, rank // pp
    return Mesh(
        pp,
        dp,
        s,
        d,
        tuple(grid["pp"].mesh.tolist()),
        tuple(grid["dp"].mesh.tolist()),
        grid.get_group("dp"),
        grid,
    )


def average_gradients(grads: Any, group: Any = None, codec: Codec | None = None, timeout: float = 60.0):
    """``(averaged grads, stats)``: the mean of ``grads`` (any pytree of tensors) over the ranks
    of ``group`` (default: all).

    codec=None: one all_reduce (sum) of the gradients flattened per dtype, divided by R.
    With a codec, each rank encodes each gradient, the payloads are all_gathered and every
    rank decodes all R and averages them: R-1 payloads received instead of ~2 (R-1)/R full
    gradients, so it pays for small R (int8 at R = 2: a quarter of the bytes).

    stats: ``bytes_sent`` / ``bytes_received`` per rank, as a ring algorithm moves them
    (all_reduce 2 (R-1)/R n bytes each way, all_gather (R-1) payloads), and ``seconds``.
    """
    R = dist.get_world_size(group)
    flat, spec = optree.tree_flatten(grads, namespace=NAMESPACE)
    start = time.perf_counter()
    wait = datetime.timedelta(seconds=timeout)
    if codec is None:
        out, nbytes = list(flat), 0
        for dtype in dict.fromkeys(t.dtype for t in flat):
            idx = [i for i, t in enumerate(flat) if t.dtype == dtype]
            bucket = torch.cat([flat[i].reshape(-1) for i in idx])
            _wait(dist.all_reduce(bucket, group=group, async_op=True), wait, "all_reduce of the gradients")
            bucket /= R
            nbytes += bucket.numel() * bucket.element_size()
            for i, piece in zip(idx, bucket.split([flat[i].numel() for i in idx])):
                out[i] = piece.view(flat[i].shape)
        moved = 2 * (R - 1) * nbytes // R
    else:
        out, moved = [], 0
        for t in flat:
            enc = codec.encode(t)
            gathered = []
            for piece in enc.payload:
                into = [torch.empty_like(piece) for _ in range(R)]
                _wait(
                    dist.all_gather(into, piece, group=group, async_op=True),
                    wait,
                    f"all_gather of {codec.name} gradients",
                )
                gathered.append(into)
            decoded = [
                Encoded(codec, enc.shape, enc.dtype, enc.arg, tuple(g[r] for g in gathered)).decode() for r in range(R)
            ]
            out.append(sum(decoded) / R)
            moved += (R - 1) * enc.nbytes
    stats = {"bytes_sent": moved, "bytes_received": moved, "seconds": time.perf_counter() - start}
    return spec.unflatten(out), stats


def _wait(work, timeout: datetime.timedelta, what: str) -> None:
    try:
        work.wait(timeout)
    except RuntimeError as e:
        raise PeerError(
            f"rank {dist.get_rank()}: {what} failed or timed out ({timeout.total_seconds():g} s): {e}"
        ) from e


class Reducer:
    """The fold's gradients averaged over the replicas of ``group`` as soon as each stage has them.

    ``start(i, grads, like)`` reduces stage i's gradients over a fixed layout, ``like`` (every trained
    parameter due at the stage, the same on every replica, as ``agree`` checks): ``buckets`` of every
    member's gradient, zeros where this replica has none (unused, as DDP's ``find_unused_parameters``
    fills them), divided by R, each summed by one asynchronous ``all_reduce``: DDP's arithmetic, so
    the result is bitwise DDP's average (1/R) sum_r g_r, and the replicas always pair the same
    tensors, whatever each one used. Beside them, one flag per member (used here or not) is summed
    over ``host_group`` in host memory: a member no replica used has no gradient (absent, ``None`` to
    the caller), as DDP leaves its ``.grad``. The fold goes on to the next stage's recompute while the
    buckets are on the wire. ``ready(wait)`` hands back ``(i, averaged grads)`` of the launched stages
    in launch order, those already finished (all of them with ``wait``). ``stats``: bytes sent per rank
    (as a ring moves them, the flags included) and the seconds spent waiting.
    """

    def __init__(self, group: Any):
        self.group, self.size, self.host = group, dist.get_world_size(group), host_group(group)
        self.launched: list[Any] = []
        self.stats = {"bytes_sent": 0, "wait_s": 0.0, "buckets": 0}

    def start(self, i: int, grads: Mapping[str, torch.Tensor | None], like: Mapping[str, torch.Tensor]) -> None:
        flags = torch.tensor([grads.get(n) is not None for n in like], dtype=torch.int32)
        works = [dist.all_reduce(flags, group=self.host, async_op=True)]
        made = buckets(grads, like, self.size)
        works += [dist.all_reduce(bucket, group=self.group, async_op=True) for _, bucket in made]
        for t in (flags, *(bucket for _, bucket in made)):
            self.stats["bytes_sent"] += 2 * (self.size - 1) * t.numel() * t.element_size() // self.size
        self.stats["buckets"] += len(made)
        self.launched.append((i, like, flags, made, works))

    def ready(self, wait: bool) -> list[tuple[int, dict[Any, Any]]]:
        done = []
        while self.launched and (wait or all(work.is_completed() for work in self.launched[0][-1])):
            i, like, flags, made, works = self.launched.pop(0)
            start = time.perf_counter()
            for work in works:
                try:
                    work.wait()
                except RuntimeError as e:
                    raise PeerError(
                        f"rank {dist.get_rank()}: the all_reduce of stage {i}'s gradients failed or timed out: {e}"
                    ) from e
            self.stats["wait_s"] += time.perf_counter() - start
            done.append((i, averaged(made, like, dict(zip(like, flags.tolist())))))
        return done


def buckets(
    grads: Mapping[str, torch.Tensor | None], like: Mapping[str, torch.Tensor], size: int
) -> list[tuple[list[str], torch.Tensor]]:
    """``(members, bucket)`` per dtype of ``like``: the members' gradients flattened and concatenated
    (zeros of a member's size where ``grads`` has none), divided by ``size``; the same members, sizes
    and dtypes on every replica with the same ``like``, whatever each one used."""
    out = []
    for dtype in dict.fromkeys(t.dtype for t in like.values()):
        members = [n for n, t in like.items() if t.dtype == dtype]
        pieces = [like[n].new_zeros(like[n].numel()) if (g := grads.get(n)) is None else g.reshape(-1) for n in members]
        out.append((members, torch.cat(pieces).to(dtype).div_(size)))
    return out


def averaged(summed: list[Any], like: Mapping[str, torch.Tensor], used: Mapping[str, int]) -> dict[Any, Any]:
    """The gradients of the summed ``buckets``, each member in ``like``'s shape, where some replica
    used it (``used[name] > 0``: the number that did); the members none used are left out."""
    out = {}
    for members, bucket in summed:
        for n, piece in zip(members, bucket.split([like[n].numel() for n in members])):
            if used[n] > 0:
                out[n] = piece.view(like[n].shape)
    return {n: out[n] for n in like if n in out}


def model_layout(params: Mapping[str, torch.Tensor]) -> dict[Any, Any]:
    """``replica_layout`` of a model swept whole (run-time cuts): its parameters by name, one entry."""
    entries = [("the model", n, tuple(t.shape), str(t.dtype), trained(t)) for n, t in params.items()]
    return {"stages": ["the model"], "params": entries, "ties": []}


def trained(t: torch.Tensor) -> bool:
    return t.requires_grad and is_differentiable(t)


def average_model_grads(
    group: Any, params: Mapping[str, torch.Tensor], grads: dict[Any, Any]
) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """``(grads averaged over the replicas of group, the Reducer's stats)`` for a model swept whole
    (run-time cuts, whose stages are the calls each replica made: a MoE replica may call other
    experts; the replicas ``agree`` on ``model_layout`` before its forward): one ``Reducer`` step over
    the fixed layout of every trained parameter, so a parameter some replica used gets
    (1/R) sum_r g_r (zero where unused) and one no replica used stays ``None``."""
    like = {n: t for n, t in params.items() if trained(t)}
    reducer = Reducer(group)
    if like:
        reducer.start(0, grads, like)
    averaged = dict(reducer.ready(wait=True)).get(0, {})
    return {n: averaged.get(n) if n in like else g for n, g in grads.items()}, dict(reducer.stats)


def warn_local_gradients(where: str) -> None:
    """Warn (at the caller's own line: the first frame outside eae_func and torch) that a multi-process
    run without ``data_parallel=`` gives this rank's gradients alone."""
    inside = (os.path.dirname(os.path.dirname(__file__)) + os.sep, os.path.dirname(torch.__file__) + os.sep)
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"{where}: in a multi-process run without data_parallel=, the gradients are this rank's batch "
        "alone (not averaged over replicas); give data_parallel=group (or the DDP model itself), or "
        "data_parallel=False for local gradients on purpose",
        stacklevel=level,
    )


def replica_layout(chain: Chain, params: tuple[Any, ...], groups: list[Any]) -> dict[Any, Any]:
    """What the replicas of a ``data_parallel=`` sweep must share for their stage-by-stage reductions to
    pair up: the stages, each parameter leaf's path, shape, dtype and whether it is trained (a float
    and not ``requires_grad=False`` in its module), and the tied groups (``tie_groups``)."""
    entries = []
    for i, (stage, p) in enumerate(zip(chain.stages, params)):
        frozen = stage.frozen()
        paths, leaves, _ = optree.tree_flatten_with_path(p, namespace=NAMESPACE)
        for path, t in zip(paths, leaves):
            name = ".".join(map(str, path))
            trained = is_differentiable(t) and str(path[0]) not in frozen
            entries.append((chain.where(i), name, tuple(t.shape), str(t.dtype), trained))
    ties = [" = ".join(f"{chain.where(i)} {'.'.join(map(str, path))!r}" for i, path in group) for group in groups]
    return {"stages": list(chain.labels), "params": entries, "ties": ties}


def replica_differences(layouts: list[Any], ranks: list[Any]) -> list[str]:
    """What differs between each rank's ``replica_layout`` and the first rank's, in words."""
    first, r0 = layouts[0], ranks[0]
    out = []
    for theirs, r in zip(layouts[1:], ranks[1:]):
        if len(theirs["stages"]) != len(first["stages"]):
            out.append(f"{len(first['stages'])} stages on rank {r0}, {len(theirs['stages'])} on rank {r}")
        out += [f"{a} on rank {r0} is {b} on rank {r}" for a, b in zip(first["stages"], theirs["stages"]) if a != b]
        mine = {f"{label} {name!r}": rest for label, name, *rest in first["params"]}
        other = {f"{label} {name!r}": rest for label, name, *rest in theirs["params"]}
        for where, a in mine.items():
            b = other.get(where)
            if b is None:
                out.append(f"{where} ({_described(a)}) only on rank {r0}")
            elif a[:2] != b[:2]:
                out.append(f"{where}: shape {a[0]}, {a[1]} on rank {r0}, shape {b[0]}, {b[1]} on rank {r}")
            elif a[2] != b[2]:
                out.append(f"{where}: {_trained(a[2])} on rank {r0}, {_trained(b[2])} on rank {r}")
        out += [f"{where} ({_described(b)}) only on rank {r}" for where, b in other.items() if where not in mine]
        if theirs["ties"] != first["ties"]:
            ties = [", ".join(layout["ties"]) or "none" for layout in (first, theirs)]
            out.append(f"tied parameters: {ties[0]} on rank {r0}, {ties[1]} on rank {r}")
    return out


def _described(entry: list[Any]) -> str:
    shape, dtype, trained = entry
    return f"shape {shape}, {dtype}, {_trained(trained)}"


def _trained(trained: bool) -> str:
    return "trained" if trained else "frozen (requires_grad=False)"


def digest(value: Any) -> torch.Tensor:
    """32 bytes (uint8, host memory) that equal on two ranks exactly when their ``value`` do (sha256 of
    its repr): what the ranks compare of a replica layout or a pipeline step's options."""
    return torch.frombuffer(bytearray(hashlib.sha256(repr(value).encode()).digest()), dtype=torch.uint8)


_HOST_GROUPS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # group -> a gloo group of its ranks


def host_group(group: Any, timeout: datetime.timedelta | None = None) -> Any:
    """``group`` itself under gloo, else a gloo group of the same ranks (made by their first call
    together, then kept): the ranks compare small values over it in host memory, never a device's."""
    if dist.get_backend(group) == "gloo":
        return group
    made = _HOST_GROUPS.get(group)
    if made is None:
        ranks = dist.get_process_group_ranks(group)
        made = _HOST_GROUPS[group] = dist.new_group(
            ranks, timeout=timeout, backend="gloo", use_local_synchronization=True
        )
    return made


def agree(group: Any, layout: dict[Any, Any]) -> None:
    """Every replica of ``group`` has this ``layout`` (``replica_layout``), or every one raises
    ``PeerError`` naming the difference. Every step all_gathers each replica's 32-byte digest of its
    layout over ``host_group`` (the layouts themselves only when the digests differ), so a replica
    changed on its own is caught at the step it changed, with every rank on the same collective."""
    ranks, rank, host = dist.get_process_group_ranks(group), dist.get_rank(), host_group(group)
    mine = digest(layout)
    everyone = [torch.empty_like(mine) for _ in ranks]
    try:
        dist.all_gather(everyone, mine, group=host)
        if all(torch.equal(d, mine) for d in everyone):
            return
        layouts: list[Any] = [None] * len(ranks)
        dist.all_gather_object(layouts, layout, group=host)
    except RuntimeError as e:
        raise PeerError(
            f"rank {rank}: sweep: data_parallel= exchanging the replicas' layouts failed or timed out: {e}"
        ) from e
    raise PeerError(
        f"sweep: data_parallel= replicas differ, so their gradients cannot be averaged stage by stage: "
        f"{'; '.join(replica_differences(layouts, ranks)[:8])}; give every replica the same model (the same "
        f"stages, and each parameter's name, shape, dtype and requires_grad)"
    )
