"""Starting the processes: ``init`` under torchrun, ``spawn`` for local runs (tests, benchmarks).

    torchrun --nproc-per-node 4 script.py      # script calls eae_func.distributed.init()
    eae_func.distributed.spawn(fn, 4, *args)   # fn(*args) in 4 fresh processes on 127.0.0.1

The backend is NCCL when every process can have its own CUDA device, gloo otherwise.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["Outcome", "PeerError", "default_backend", "free_port", "init", "run", "spawn"]


class PeerError(RuntimeError):
    """A transfer between ranks failed or timed out (a peer died, stalled, or disagrees)."""


def default_backend(local_world_size: int) -> str:
    """``"nccl"`` when CUDA has a device for each local process, else ``"gloo"``."""
    if torch.cuda.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def init(backend: str | None = None, timeout: float = 60.0) -> torch.device:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK); return this process's device. Without that
    environment (a plain ``python script.py``), a group of one process.

    ``timeout`` bounds every collective (and NCCL's watchdog)."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = backend or default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))))
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, timeout=datetime.timedelta(seconds=timeout), device_id=device if backend == "nccl" else None
    )
    return device


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for ``MASTER_PORT`` of a local multi-process run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one spawned rank ended: its return ``value``, or the ``error`` it raised (a formatted
    traceback), or neither when it died (``exitcode``) or was killed at the deadline."""

    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None
    seconds: float = 0.0


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    pg_timeout: float = 30.0,
    threads: int = 1,
) -> list[Outcome]:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes joined in a process group on 127.0.0.1
    (a free port) and return one ``Outcome`` per rank. ``fn`` must be importable (module level).
    Processes still alive after ``timeout`` seconds are killed. Each uses ``threads`` threads."""
    ctx = mp.get_context("forkserver")  # one server imports torch once; ranks fork from it
    ctx.set_forkserver_preload(["eae_func.distributed"])
    results = ctx.SimpleQueue()
    group = Group(nprocs, free_port(), backend, pg_timeout, threads)
    procs = [ctx.Process(target=_worker, args=(fn, args, r, group, results)) for r in range(nprocs)]
    start = time.monotonic()
    for proc in procs:
        proc.start()
    reported: dict[int, tuple[Any, ...]] = {}
    # Drain results while waiting: a rank blocks on a full pipe until its result is read.
    while any(proc.is_alive() for proc in procs) and time.monotonic() - start < timeout:
        _drain(results, reported)
        time.sleep(0.02)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()
    _drain(results, reported)
    outcomes = []
    for rank, proc in enumerate(procs):
        value, error, seconds = reported.get(rank, (None, None, time.monotonic() - start))
        outcomes.append(Outcome(rank, value, error, proc.exitcode, seconds))
    return outcomes


def run(fn: Callable[..., Any], nprocs: int, *args: Any, **options: Any) -> list[Any]:
    """``spawn`` that returns the ranks' values, or raises ``RuntimeError`` with every failed
    rank's traceback (or exit code)."""
    outcomes = spawn(fn, nprocs, *args, **options)
    failed = [o for o in outcomes if o.error is not None or o.exitcode != 0]
    if failed:
        lines = [f"rank {o.rank}: " + (o.error or f"exited with code {o.exitcode} without a result") for o in failed]
        raise RuntimeError("spawned ranks failed:\n" + "\n".join(lines))
    return [o.value for o in outcomes]


def _drain(results, reported: dict[Any, Any]) -> None:
    while not results.empty():
        rank, payload = results.get()
        reported[rank] = pickle.loads(payload)


@dataclasses.dataclass(frozen=True)
class Group:
    """The process group ``spawn`` starts: ``world`` ranks meeting at ``port`` on 127.0.0.1 over
    ``backend``, collectives bounded by ``timeout`` seconds, ``threads`` threads a rank."""

    world: int
    port: int
    backend: str
    timeout: float
    threads: int


def _worker(fn: Callable[..., Any], args: tuple[Any, ...], rank: int, group: Group, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(group.port),
        RANK=str(rank),
        WORLD_SIZE=str(group.world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(group.world),
    )
    torch.set_num_threads(group.threads)
    start = time.monotonic()
    try:
        init(group.backend, timeout=group.timeout)
        value = fn(*args)
        results.put((rank, pickle.dumps((value, None, time.monotonic() - start))))
    except BaseException:
        results.put((rank, pickle.dumps((None, traceback.format_exc(), time.monotonic() - start))))
        # Leave at once: peers blocked on this rank must see it gone, not wait on a teardown.
        os._exit(1)
    dist.destroy_process_group()
