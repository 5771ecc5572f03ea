"""The seconds of a sweep's parts: a block's wall time added to a stage's counter, the GPU's own
between two CUDA events on a CUDA device (read lazily), inside a profiler range while a profiler runs.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.profiler import record_function

from ..lazy import event_seconds
from .options import Options
from .replay import NULL

__all__ = ["timed", "timer"]


class timed:  # noqa: N801 - used as a context manager, like contextlib's
    """Add the seconds of the block to ``stats[key]``, inside a profiler range ``label`` while a
    profiler runs (a range costs about as much as a tiny stage's kernel, so none is opened otherwise).
    On a CUDA ``device`` the seconds are the GPU's, between two CUDA events, read only when used
    (``Lazy``): the host only queues the work, so its clock would measure the launches."""

    __slots__ = ("stats", "key", "label", "range", "start", "cuda")

    def __init__(self, stats: dict[Any, Any], key: str, label: str, device: torch.device | None = None):
        self.stats, self.key, self.label, self.range = stats, key, label, None
        self.cuda = device is not None and device.type == "cuda"

    def __enter__(self):
        if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
            self.range = record_function(self.label)
            self.range.__enter__()
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()

    def __exit__(self, *exc: Any):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.stats[self.key] = self.stats.get(self.key, 0) + event_seconds(self.start, end)
        else:
            self.stats[self.key] = self.stats.get(self.key, 0) + time.perf_counter() - self.start
        if self.range is not None:
            self.range.__exit__(*exc)


def timer(opts: Options, stats: dict[Any, Any], key: str, label: str, device: torch.device | None = None):
    """``timed(stats, key, label, device)`` if ``opts.timers``, else a context that does nothing."""
    return timed(stats, key, label, device) if opts.timers else NULL
