"""Multi-process EAE on torch.distributed: pipeline and data parallelism, with the costate
(what crosses a pipeline boundary going back) optionally compressed on the wire.

    import eae_func.distributed as D
    D.init()                                            # under torchrun: gloo on CPU, NCCL on GPUs
    pipe = D.Pipeline(chain, params=params, costate_codec=D.codecs.int8(), schedule="zero_bubble")
    res = pipe.sweep(params, x, targets, microbatches=8, passes=..., key=step)
    res.loss, res.grads (this rank's stages), res.stats["wire"], res.stats["schedule"]

    m = D.mesh(pp=2, dp=2)                              # pipeline x data parallel
    pipe = D.Pipeline(chain, ranges, ranks=m.pipeline_ranks)
    grads, stats = D.average_gradients(res.grads, m.data_group)
"""

from . import codecs
from .codecs import Codec
from .data_parallel import Mesh, average_gradients, mesh
from .launch import Outcome, PeerError, default_backend, free_port, init, run, spawn
from .pipeline import Pipeline, PipelineResult
from .plan import SCHEDULES, balance

__all__ = [
    "Codec",
    "Mesh",
    "Outcome",
    "PeerError",
    "SCHEDULES",
    "Pipeline",
    "PipelineResult",
    "average_gradients",
    "balance",
    "codecs",
    "default_backend",
    "free_port",
    "init",
    "mesh",
    "run",
    "spawn",
]
