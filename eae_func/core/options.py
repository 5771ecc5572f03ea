"""How a sweep runs: the one record of its options, checked once when it is made.

``ef.sweep``, ``ef.grad``, ``ef.value_and_grad`` and ``Pipeline.sweep`` take these as keyword
arguments (``SweepOptions`` spells them for editors and type checkers) and build one ``Options``
from them; every part of the engine reads that record and nothing checks an option again.

    opts = Options(passes=P.int8(), key=3, recompute=remat.budget(64 << 20))
    opts = opts.bind(chain)        # physical stages as indices, the estimator checked against them
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch

from ..passes import Pass, compose
from . import remat
from .boundary import Policy
from .update import Fused, fused

if TYPE_CHECKING:
    from ..program.chain import Chain

__all__ = ["NAMES", "Options", "Request", "SweepOptions", "make"]


REDUCTIONS = ("mean", "sum")
CAPTURES = ("run", "graph")


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of a sweep: the keyword arguments of ``ef.sweep``, ``ef.grad``,
    ``ef.value_and_grad`` and ``Pipeline.sweep``. Each is declared once, here: its default, its
    doc, and its check in ``__post_init__`` (``SweepOptions`` spells what each accepts)."""

    passes: Any = None
    """A pass (``compose(...)``, or a plain ``adj -> adj`` callable) applied to every costate
    p_L..p_0 before use (``None``: none)."""
    key: int = 0
    """int seed; boundary l gets ``fold_in(key, l)``. Dropout draws from the global torch RNG
    exactly as a plain forward would, and is replayed."""
    boundary_dtype: torch.dtype | None = None
    """Store boundary states in this floating dtype (``None``: as computed)."""
    offload: bool = False
    """Keep stored boundary states on the CPU (pinned, prefetched a stage ahead on CUDA)."""
    autocast: torch.dtype | None = None
    """Run stages under ``torch.autocast`` with this floating dtype."""
    microbatches: int = 1
    """Split x and the tensor loss_args on dim 0 into this many pieces and sum their gradients;
    equal to the full batch's unless a stage mixes samples (BatchNorm's batch statistics) or
    draws random numbers (dropout masks differ per piece), as in plain PyTorch. A model cut at run
    time runs each piece's forward and backward in turn into one set of gradients."""
    reduction: str = "mean"
    """How the loss reduces over dim 0 (``"mean"`` or ``"sum"``), to weigh the microbatches."""
    estimator: Any = None
    """How physical stages get their reverse step (``eae_func.estimators``); digital stages
    always take the exact local vjp."""
    physical: Any = None  # Sequence[int | str] | None; bound: tuple[int, ...]
    """Names or indices of the physical stages (``None``: those made with ``physical=True`` or
    ``ef.black_box``); they need an estimator (``E.exact()`` differentiates a torch simulation
    exactly). After ``bind``, their sorted indices. On a model cut at run time: names of cut
    modules (``physical_cuts``)."""
    budget: int | None = None
    """Rows the physical stages may be run on in one call, forward included; a call that would
    exceed it raises before it runs (``None``: no limit)."""
    recompute: Any = True
    """The remat policy (``eae_func.core.remat``): ``True`` rebuilds each stage's graph from its saved
    input; ``False`` keeps every graph from the forward (memory like plain autograd); a predicate
    ``(index, name) -> bool`` rebuilds the stages it is true for; an int is a byte budget for the
    graphs kept. Same results at every setting. On a model cut at run time, the k-th cut call of a
    forward is stage ``k - 1`` and its name the call's (``"blocks.0#2"`` for a second call); a byte
    budget builds graphs it then drops only on the first forward: later ones know the sizes."""
    keep_costates: bool = True
    """``False`` returns the trace records with ``value=None`` (history and meta kept), saving L
    costates of memory (``grad`` and ``value_and_grad``'s default)."""
    update: Any = None
    """An optimizer step fused into the fold (``eae_func.core.update``): a ``torch.optim`` optimizer
    (or one per stage) steps stage l's parameters in place as soon as its gradients exist, or
    ``ef.fused(fn, state)`` a pure ``fn(params_l, grads_l, state_l) -> (params_l, state_l)``;
    ``res.grads`` is then ``None`` and ``res.params`` / ``res.update_state`` hold the result. On a
    model cut at run time each cut module's parameters are stepped in the backward once its last
    call's reverse step has run, the glue's (and tensors the loss reads that the optimizer holds)
    once autograd has accumulated them; a pure update's state is a dict by parameter name
    (``eae_func.drivers.in_backward``)."""
    timers: bool = True
    """Time each stage's parts into its stats and open profiler ranges (``False``: no ``*_s``
    seconds; ``grad`` and ``value_and_grad``'s default)."""
    data_parallel: Any = None
    """A process group (or 1-D ``DeviceMesh``) of replicas: each stage's gradients are averaged
    over it by an asynchronous all-reduce as soon as the fold has them (run-time cuts: the final
    gradients, once), over a fixed layout of the trained parameters: one no replica used stays
    ``None``, as under DDP (a DDP model means its own group); ``False``: this rank's gradients, on purpose. The replicas must be one model: the first
    step with a layout checks it (one all_gather of a digest) and every rank raises ``PeerError``
    naming any difference. After ``__post_init__``, the group."""
    compile: Any = None
    """``torch.compile`` each digital stage's forward and its reverse step (on a chain the recompute
    and the local vjp as one graph; at run time the cut call's forward, rebuilt with grad, and its
    compiled backward; ``eae_func.core.compiled``): ``True``, a mode string or a dict of
    ``torch.compile``'s keyword arguments; stages running the same code on the same shapes share
    their graphs. After ``__post_init__``, that dict (``None``: off)."""
    capture: str | None = None
    """How a model (an ``nn.Module``) with ``split_at`` is cut: ``"run"`` (its forward runs as
    written, each call of a matched module one stage: ``eae_func.drivers.cuts``), ``"graph"`` (a chain
    captured by ``torch.export``), or ``None``: ``"run"``, unless params come as one dict per stage
    or the model holds FSDP2 shards. An option only a chain implements (``model_sweep.needs_graph``)
    is refused, naming it, unless ``"graph"`` is given: it never captures a model silently. Both cut the model at the same boundaries, the cuts' outputs in call order,
    and pass the same records to the passes."""

    early_stop: bool = True
    """Rebuild a stage without running the kernels of the ops after the last tensor its graph
    saves, as ``torch.utils.checkpoint`` stops its recompute (``eae_func.core.early_stop``); the same
    gradients, bit for bit. ``False``: every rebuild runs its stage in full (a module that keeps its
    output in Python state, or reads it with ``.tolist()``, sees NaN in a stopped rebuild)."""
    cuda_graphs: bool = False
    """On a model cut at run time on a CUDA device: each cut call's rebuild and local vjp captured as a
    CUDA graph once per module and call layout, then replayed, so the host launches one graph per cut
    (``eae_func.drivers.cut_graphs``); each graph's first replay is checked against its eager step (bit
    for bit, or within 8 epsilons in norm where kernels add with atomics). A graph reads the module's
    parameters where they are stored and keeps static copies of its call's inputs, costates and
    buffers and of its gradients (one more set of the cut modules' parameter gradients in all). Its
    modules' plain attributes (a dropout's ``p``) and torch's kernel settings are part of a graph's
    key; other Python state it reads (a config object) is fixed at the capture: ``ef.clear_caches()``
    after changing it. Refused on the CPU, on a chain and with ``compile=``."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "passes", compose(self.passes) if self.passes is not None else compose())
        if isinstance(self.key, bool) or not isinstance(self.key, numbers.Integral):
            raise TypeError(f"sweep: key must be an int seed, got {type(self.key).__name__}")
        set_(self, "key", int(self.key))
        for name in ("boundary_dtype", "autocast"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise TypeError(
                    f"sweep: {name} must be a floating torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}"
                )
        if self.capture is not None and self.capture not in CAPTURES:
            raise ValueError(
                f"sweep: capture must be 'run', 'graph' or None (chosen by the options), got {self.capture!r}"
            )
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"sweep: reduction must be 'mean' or 'sum', got {self.reduction!r}")
        m = self.microbatches
        if not isinstance(m, numbers.Integral) or isinstance(m, bool) or m < 1:  # pyright: ignore[reportUnnecessaryIsInstance]  # bool is an Integral at run time (numbers registers int), not to pyright
            raise ValueError(f"sweep: microbatches must be a positive int, got {m!r}")
        if self.estimator is not None and not all(
            callable(getattr(self.estimator, f, None)) for f in ("prepare", "stage_vjp")
        ):
            raise TypeError(
                f"sweep: estimator must have prepare(problem) and stage_vjp(...) (eae_func.estimators), "
                f"got {type(self.estimator).__name__}"
            )
        b = self.budget
        if b is not None and (isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1):
            raise TypeError(f"sweep: budget must be None or an int >= 1 (rows per step), got {b!r}")
        if self.physical is not None:
            if isinstance(self.physical, (str, int)) or not isinstance(cast(object, self.physical), Sequence):
                raise TypeError(f"sweep: physical must be a list of stage names or indices, got {self.physical!r}")
            set_(self, "physical", tuple(self.physical))
        set_(self, "recompute", remat.policy(self.recompute))
        for name in ("offload", "keep_costates", "timers", "early_stop", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"sweep: {name} must be True or False, got {getattr(self, name)!r}")
        if self.update is not None and not isinstance(self.update, Fused):
            set_(self, "update", fused(self.update))
        set_(self, "data_parallel", replicas(self.data_parallel))
        set_(self, "compile", compiling(self.compile))
        if self.cuda_graphs and self.compile is not None:
            raise ValueError(
                "sweep: cuda_graphs=True and compile= both make the cuts' reverse steps into graphs: give one "
                "(compile={'mode': 'reduce-overhead'} makes CUDA graphs of the compiled steps)"
            )

    @property
    def boundary(self) -> Policy:
        """Where boundary states live between the sweeps."""
        return Policy(self.boundary_dtype, self.offload)

    @property
    def no_passes(self) -> bool:
        """The passes are ``identity()`` (the empty composition)."""
        return self.passes.members == ()

    def bind(self, chain: Chain) -> Options:
        """These options for ``chain``: ``physical`` as sorted stage indices (``None``: the stages
        marked physical), checked against the estimator (and by its ``check(chain, physical)``, if it has
        one); the stage names the passes apply at (``P.only``) checked against the chain's."""
        if self.cuda_graphs:
            raise ValueError(
                "sweep: cuda_graphs=True captures the reverse steps of a model cut at run time (an nn.Module "
                "with split_at= and a flat params dict, without FSDP2 shards), not a chain's stages: give such "
                "a module, or compile={'mode': 'reduce-overhead'}"
            )
        given = [i for i, s in enumerate(chain.stages) if s.physical] if self.physical is None else self.physical
        physical = tuple(sorted({chain.index(p) for p in given}))
        digital_boxes = [
            chain.where(i) for i, s in enumerate(chain.stages) if not s.differentiable and i not in physical
        ]
        if digital_boxes:
            raise ValueError(
                f"sweep: {', '.join(digital_boxes)} cannot be differentiated (a black box) but is not "
                f"among physical={list(physical)}: its reverse step must come from an estimator"
            )
        if physical and self.estimator is None:
            raise ValueError(
                f"sweep: {', '.join(chain.where(i) for i in physical)} is physical (run forward only) "
                f"but no estimator was given: pass estimator= (E.zbp, E.node_perturbation, E.direct, "
                f"E.twin, E.frozen), or estimator=E.exact() for a torch-differentiable simulation"
            )
        if getattr(self.estimator, "differentiates", False):
            boxes = [chain.where(i) for i in physical if not chain.stages[i].differentiable]
            if boxes:
                raise ValueError(
                    f"sweep: {self.estimator!r} differentiates the physical stages, but "
                    f"{', '.join(boxes)} cannot be differentiated (a black box); use a forward-only "
                    f"estimator (zbp with method='fd', node_perturbation or direct with form='fd', "
                    f"twin, frozen)"
                )
        if physical and callable(getattr(self.estimator, "check", None)):
            self.estimator.check(chain, physical)
        self.passes.check_stages((*chain.names, "input"))  # the records' stage names, boundaries L..1 and 0
        if physical == self.physical:
            return self
        bound = copy.copy(self)  # checked when it was made: only ``physical`` changes, to indices
        object.__setattr__(bound, "physical", physical)
        return bound


def replicas(given: Any) -> Any:
    """``data_parallel=`` as a process group (``None`` and ``False`` kept)."""
    if given is None or given is False:
        return given
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(given, DeviceMesh):
        if given.ndim != 1:
            raise ValueError(
                f"sweep: data_parallel= takes a 1-D DeviceMesh (the data-parallel dimension: mesh['dp']), "
                f"got one with {given.ndim} dimensions {given.mesh_dim_names}"
            )
        given = given.get_group()
    if not isinstance(given, dist.ProcessGroup):
        raise TypeError(
            f"sweep: data_parallel= takes a torch.distributed process group or a 1-D DeviceMesh, got "
            f"{type(given).__name__}"
        )
    return given


def compiling(given: Any) -> dict[Any, Any] | None:
    """``compile=`` as ``torch.compile``'s keyword arguments: ``None`` / ``False`` off, ``True`` the
    defaults, a mode string (``"max-autotune"``) or a dict of them."""
    if given is None or given is False:
        return None
    if given is True:
        return {}
    if isinstance(given, str):
        return {"mode": given}
    if isinstance(cast(object, given), Mapping) and all(isinstance(k, str) for k in given):
        return dict(given)
    raise TypeError(
        f"sweep: compile= takes True, a torch.compile mode (e.g. 'max-autotune') or a dict of torch.compile "
        f"keyword arguments, got {type(given).__name__}"
    )


class SweepOptions(TypedDict, total=False):
    """What each of ``Options``' fields accepts as a keyword argument (``**options:
    Unpack[SweepOptions]``): the types a caller may give, before ``Options`` checks and normalises
    them; its names are ``Options``' (a test holds them equal)."""

    passes: Pass | Callable[..., Any] | None
    key: int
    boundary_dtype: torch.dtype | None
    offload: bool
    autocast: torch.dtype | None
    microbatches: int
    reduction: str
    estimator: Any
    physical: Sequence[int | str] | None
    budget: int | None
    recompute: bool | int | Callable[[int, str], bool] | remat.Remat
    keep_costates: bool
    update: Any
    timers: bool
    data_parallel: Any
    compile: bool | str | Mapping[str, Any] | None
    capture: str | None
    early_stop: bool
    cuda_graphs: bool


NAMES = tuple(f.name for f in dataclasses.fields(Options))


def make(where: str, options: Mapping[str, Any], **defaults: Any) -> Options:
    """``Options(**defaults, **options)``; an unknown keyword raises naming ``where`` and the options."""
    unknown = sorted(set(options) - set(NAMES))
    if unknown:
        raise TypeError(
            f"{where}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"the options are {', '.join(NAMES)}"
        )
    return Options(**{**defaults, **options})


@dataclasses.dataclass(frozen=True)
class Request:
    """One call of ``sweep``, as its front ends pass it on: what to differentiate (``model``: a
    ``Chain``, an ``nn.Module``, a DDP model or a function), at ``params``, on ``x`` and
    ``loss_args``, with ``loss`` and ``split_at`` (a model's), the passes' ``pass_state``,
    ``buffers`` and the options made (``opts``); fields as ``sweep``'s arguments."""

    model: Any
    params: Any
    x: Any
    loss_args: tuple[Any, ...]
    loss: Callable[..., Any] | None
    split_at: Sequence[str] | None
    pass_state: Any
    buffers: Any
    opts: Options
