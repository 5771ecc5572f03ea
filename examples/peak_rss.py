"""The peak resident set of one step above the set before it, for the benchmarks (Linux).

map_tensors_apart()      glibc maps every allocation above 64 KiB on its own and unmaps it
                         when freed, so the resident set follows live memory
keep_heap()              glibc keeps what is freed mapped, so no step faults in pages that an
                         earlier one gave back (for timing: the same allocator for every method)
step_peak_mb(step)       VmHWM after resetting it (``/proc/self/clear_refs``), minus VmRSS before
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable


def map_tensors_apart() -> None:
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD


def keep_heap() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: the heap's free top is not given back below 1 GiB
    libc.mallopt(-3, 2**25)  # M_MMAP_THRESHOLD at its 64-bit maximum (32 MiB): tensors come from the heap


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(match.group(1)) if match else 0


def step_peak_mb(step: Callable[[], object]) -> float:
    before = status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step()
    return (status_kb("VmHWM") - before) / 1024
