"""Count the bytes of tensor storages alive during a computation (a test instrument).

torch.func.vjp refuses ``saved_tensors_hooks`` inside its transform, so the
memory tests watch every storage an operator creates instead: a
``TorchDispatchMode`` adds its bytes when it appears and a weakref finalizer
subtracts them when the storage is freed. Outputs that alias an input (views)
are not new memory. ``peak`` is the most bytes created inside the block and
alive at one moment.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def _free(self, ptr: int, nbytes: int) -> None:
        self._tracked.discard(ptr)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in self._tracked or ptr in inputs:
                continue
            self._tracked.add(ptr)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, ptr, nbytes)
        return out
