"""How a sweep runs: the one record of its options, checked once when it is made.

``ef.sweep``, ``ef.grad``, ``ef.value_and_grad`` and ``Pipeline.sweep`` take these as keyword
arguments (``SweepOptions`` spells them for editors and type checkers) and build one ``Options``
from them; every part of the engine reads that record and nothing checks an option again.

    opts = Options(passes=P.int8(), key=3, recompute=remat.budget(64 << 20))
    opts = opts.bind(chain)        # physical stages as indices, the estimator checked against them
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from . import remat
from .boundary import Policy
from .passes import Pass, compose
from .update import Fused, fused

if TYPE_CHECKING:
    from .chain import Chain

REDUCTIONS = ("mean", "sum")
CAPTURES = ("run", "graph")


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of a sweep (``ef.sweep``'s keyword arguments).

    passes:         the ``Pass`` applied to every costate p_L..p_0 (a plain ``adj -> adj``
                    callable is lifted; ``None``: none).
    key:            int seed; boundary l gets ``fold_in(key, l)``.
    boundary_dtype: store boundary states in this floating dtype (``None``: as computed).
    offload:        keep stored boundary states on the CPU.
    autocast:       run stages under ``torch.autocast`` with this floating dtype.
    microbatches:   cut the batch on dim 0 into this many pieces and sum their gradients.
    reduction:      how the loss reduces over dim 0 (``"mean"`` or ``"sum"``), to weigh the pieces.
    estimator:      the reverse step of physical stages (``eae_func.estimators``).
    physical:       names or indices of the physical stages (``None``: the chain's own marks);
                    after ``bind``, their sorted indices.
    budget:         rows the physical stages may be run on in one step (``None``: no limit).
    recompute:      the remat policy (``eae_func.remat``; ``True``, ``False``, a predicate
                    ``(index, name) -> bool`` or a byte budget are shorthands).
    keep_costates:  keep costate values in the returned trace.
    update:         an optimizer step fused into the fold (``eae_func.update.fused``; a
                    ``torch.optim`` optimizer or a list of them is a shorthand).
    timers:         time each stage's parts into its stats (and open profiler ranges).
    data_parallel:  the replicas to average each stage's gradients over as the fold makes them
                    (a ``torch.distributed`` process group or a 1-D ``DeviceMesh``; after
                    ``__post_init__``, the group); ``False``: this rank's gradients only, said
                    on purpose (no warning in a multi-process run).
    compile:        ``torch.compile`` each digital stage's forward and its reverse step (the recompute
                    and the local vjp as one graph; ``eae_func.compiled``): ``True``, a mode string or a
                    dict of ``torch.compile``'s keyword arguments; after ``__post_init__``, that dict
                    (``None``: off).
    capture:        how a model (an ``nn.Module``) with ``split_at`` is cut: ``"run"`` (its forward runs as
                    written, each call of a matched module one stage: ``eae_func.cuts``; options only a
                    chain implements fall back to ``"graph"``), or ``"graph"`` (a chain captured by
                    ``torch.export``, ``eae_func.capture``).
    """

    passes: Any = None
    key: int = 0
    boundary_dtype: torch.dtype | None = None
    offload: bool = False
    autocast: torch.dtype | None = None
    microbatches: int = 1
    reduction: str = "mean"
    estimator: Any = None
    physical: Any = None  # Sequence[int | str] | None; bound: tuple[int, ...]
    budget: int | None = None
    recompute: Any = True
    keep_costates: bool = True
    update: Any = None
    timers: bool = True
    data_parallel: Any = None
    compile: Any = None
    capture: str = "run"

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
        if self.capture not in CAPTURES:
            raise ValueError(f"sweep: capture must be 'run' or 'graph', got {self.capture!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"sweep: reduction must be 'mean' or 'sum', got {self.reduction!r}")
        m = self.microbatches
        if not isinstance(m, numbers.Integral) or isinstance(m, bool) or m < 1:
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
            if isinstance(self.physical, (str, int)) or not isinstance(self.physical, Sequence):
                raise TypeError(f"sweep: physical must be a list of stage names or indices, got {self.physical!r}")
            set_(self, "physical", tuple(self.physical))
        set_(self, "recompute", remat.policy(self.recompute))
        for name in ("offload", "keep_costates", "timers"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"sweep: {name} must be True or False, got {getattr(self, name)!r}")
        if self.update is not None and not isinstance(self.update, Fused):
            set_(self, "update", fused(self.update))
        set_(self, "data_parallel", replicas(self.data_parallel))
        set_(self, "compile", compiling(self.compile))

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
        marked physical), checked against the estimator."""
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
        return self if physical == self.physical else dataclasses.replace(self, physical=physical)


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


def compiling(given: Any) -> dict | None:
    """``compile=`` as ``torch.compile``'s keyword arguments: ``None`` / ``False`` off, ``True`` the
    defaults, a mode string (``"max-autotune"``) or a dict of them."""
    if given is None or given is False:
        return None
    if given is True:
        return {}
    if isinstance(given, str):
        return {"mode": given}
    if isinstance(given, Mapping) and all(isinstance(k, str) for k in given):
        return dict(given)
    raise TypeError(
        f"sweep: compile= takes True, a torch.compile mode (e.g. 'max-autotune') or a dict of torch.compile "
        f"keyword arguments, got {type(given).__name__}"
    )


class SweepOptions(TypedDict, total=False):
    """``Options``' fields as keyword arguments (``**options: Unpack[SweepOptions]``)."""

    passes: Pass | Callable | None
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
    capture: str


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
