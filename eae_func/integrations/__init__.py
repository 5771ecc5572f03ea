"""Where users train: ``eae_func.integrations.transformers.EAETrainer`` (Hugging Face Trainer) and
``eae_func.integrations.lightning.manual_step`` (Lightning)."""

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["missing", "replicas_of"]


def missing(where: str, extra: str, e: ModuleNotFoundError) -> ModuleNotFoundError:
    """The error for an integration whose library is not installed, naming the extra that brings it."""
    return ModuleNotFoundError(
        f"{where}: {e.name} is not installed; it comes with eae_func's {extra} extra: pip install 'eae_func[{extra}]'",
        name=e.name,
    )


def replicas_of(wrapped: Any) -> Any:
    """The process group of the ``DistributedDataParallel`` model ``wrapped`` is, or wraps (its
    ``.module`` chain), for ``data_parallel=``; ``None`` where there is none. The sweep runs the
    unwrapped model, whose gradients DDP's reducer never sees, so the sweep averages them itself:
    every step (every micro-step of gradient accumulation, where DDP reduces the sum on the last:
    the same mean)."""
    while isinstance(wrapped, nn.Module):
        if isinstance(wrapped, DistributedDataParallel):
            return wrapped.process_group
        wrapped = getattr(wrapped, "module", None)
    return None
