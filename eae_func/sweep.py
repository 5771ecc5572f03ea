"""The EAE sweep: a forward sweep that keeps only boundary states, then the
reverse sweep as an explicit fold over per-stage ``torch.func.vjp`` closures.

    forward:  x_l = h_l(W_l, x_{l-1})              (no autograd graph)
    boundary: p_L = d loss(x_L) / d x_L
    reverse:  (grad W_l, p_{l-1}) = vjp(h_l, (W_l, x_{l-1}))(p_l),  l = L..1

Every costate passes through the pass pipeline before it is used; the closure
of stage l is built from its saved input, applied once and dropped before
stage l-1 is touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import optree
import torch
from torch.func import vjp
from torch.profiler import record_function

from . import boundary as B
from .adjoint import NAMESPACE, AdjointState, fold_in
from .chain import Chain
from .passes import combinators as C


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """loss: the scalar loss; grads: same tree as params; adjoints: one
    ``AdjointState`` per boundary, L down to 0, as they were after the passes;
    buffers: updated buffers, one dict per stage; pass_state: the threaded
    pass state; stats: per stage ``stats[name]`` the forward, recompute, vjp and
    pass seconds and the bytes of its stored input boundary, ``stats["loss"]``,
    and ``stats["boundaries"][l]``: what the passes recorded in ``meta`` at boundary l."""

    loss: torch.Tensor
    grads: tuple
    adjoints: tuple
    buffers: tuple
    pass_state: Any
    stats: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Options:
    passes: Any = None
    key: int = 0
    boundary: B.Policy = B.Policy()
    autocast: torch.dtype | None = None
    estimator: Any = None
    physical: tuple[int, ...] = ()
    recompute: bool = True
    keep_costates: bool = True


@dataclasses.dataclass(frozen=True)
class Problem:
    """What an estimator sees of one sweep (one microbatch).

    An estimator is any object with
      ``prepare(problem) -> prepared``: called once after the forward sweep
          (model-level estimators probe the network here), and
      ``stage_vjp(problem, prepared, i, h_in, costate) -> (grads_i, input_costate, cost)``:
          the reverse step of physical stage ``i`` given its input state and the
          (processed) costate at its output; ``input_costate`` mirrors ``h_in``
          (``None`` at integer leaves) and ``cost`` is a dict of counters
          (queries, forward_calls, backward_calls) added to ``res.stats[stage]``.
    Digital stages always take the exact local vjp.
    """

    chain: Chain
    params: tuple
    buffers: tuple
    x: Any
    loss_args: tuple
    physical: tuple[int, ...]
    key: int
    loss_scale: float


def _where(chain: Chain, i: int) -> str:
    return f"stage {i} ({chain.stages[i].name!r})"


def _check_params(chain: Chain, params: Any) -> tuple:
    if not isinstance(params, (tuple, list)) or len(params) != len(chain):
        got = f"{len(params)} entries" if isinstance(params, (tuple, list)) else type(params).__name__
        raise ValueError(f"params: expected a tuple with one entry per stage ({len(chain)}), got {got}")
    for i, (s, p) in enumerate(zip(chain.stages, params)):
        if s.param_names is not None:
            if not isinstance(p, Mapping):
                raise TypeError(f"params of {_where(chain, i)}: expected a dict name -> tensor, got {type(p).__name__}")
            missing, extra = set(s.param_names) - set(p), set(p) - set(s.param_names)
            if missing or extra:
                raise ValueError(f"params of {_where(chain, i)} do not match its module: "
                                 f"missing {sorted(missing)}, unexpected {sorted(extra)}")
        for leaf in optree.tree_leaves(p, namespace=NAMESPACE):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"params of {_where(chain, i)}: leaves must be tensors, found {type(leaf).__name__}")
    return tuple(params)


def _check_buffers(chain: Chain, buffers: Any) -> tuple:
    if buffers is None:
        return chain.buffers()
    if not isinstance(buffers, (tuple, list)) or len(buffers) != len(chain):
        raise ValueError(f"buffers: expected a tuple with one dict per stage ({len(chain)}), got {buffers!r:.80}")
    return tuple(buffers)


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replay_rng(state: tuple, device: torch.device):
    """Run with the global RNG as it was when ``state`` was taken (dropout masks repeat)."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if cuda is not None else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def _autocast(dtype: torch.dtype | None, device: torch.device):
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _device_of(tree: Any) -> torch.device:
    flat = optree.tree_leaves(tree, namespace=NAMESPACE)
    return flat[0].device if flat else torch.device("cpu")


def _check_costate(chain: Chain, i: int, adj: Any, layout: B.Layout) -> list:
    """The costate's tensors, in the order of the boundary's leaves (``None`` for integer leaves)."""
    where = f"costate entering {_where(chain, i)} at boundary {i + 1}"
    if not isinstance(adj, AdjointState):
        raise TypeError(f"{where}: a pass returned {type(adj).__name__}, expected an AdjointState")
    flat, spec = optree.tree_flatten(adj.value, none_is_leaf=True, namespace=NAMESPACE)
    expected = optree.tree_structure(layout.spec.unflatten([0] * layout.spec.num_leaves),
                                     none_is_leaf=True, namespace=NAMESPACE)
    if spec != expected:
        raise ValueError(f"{where}: costate structure {spec} differs from the stage output {expected}")
    for t, shape in zip(flat, layout.shapes):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where}: costate shape {got} differs from the stage output shape {tuple(shape)}")
    return flat


def _new_stats(chain: Chain) -> dict:
    keys = ("forward_s", "recompute_s", "vjp_s", "pass_s", "boundary_bytes")
    return {name: dict.fromkeys(keys, 0) for name in chain.names} | {"loss": {"forward_s": 0.0, "pass_s": 0.0}}


class _Timer:
    def __init__(self, stats: dict, key: str, label: str):
        self.stats, self.key, self.label = stats, key, label

    def __enter__(self):
        self.range = record_function(self.label)
        self.range.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.stats[self.key] += time.perf_counter() - self.start
        self.range.__exit__(*exc)


def _local(s, buffers: Mapping, rebuild):
    """Stage ``s`` as a function of its params and its input's differentiable leaves: ``(out, buffers')``."""
    return lambda p, f: s.call(p, buffers, rebuild(f))


def _traced(adj: AdjointState, opts: Options) -> AdjointState:
    """The record as the trace keeps it: without the boundary state, and without the costate
    unless ``keep_costates`` (so ``grad`` does not hold L costates at its peak)."""
    return adj.replace(boundary=None) if opts.keep_costates else adj.replace(boundary=None, value=None)


def _run_passes(opts: Options, adj: AdjointState, state: Any, stats: dict, label: str):
    with _Timer(stats, "pass_s", label):
        return C.apply(opts.passes, adj, state)


def loss_costate(chain: Chain, h: Any, loss_args: tuple, key: int, loss_scale: float, stats: dict):
    """``(loss, AdjointState of p_L = loss_scale * d loss / d x_L)`` before the passes."""
    with _Timer(stats, "forward_s", "eae/loss"):
        floats, rebuild, costate_like = B.split(h, "input of the loss")
        loss, loss_vjp = vjp(lambda f: chain.loss(rebuild(f), *loss_args), floats)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss: expected a scalar tensor, got {shape}")
        (p,) = loss_vjp(torch.full_like(loss, loss_scale), retain_graph=False)
    L = len(chain)
    return loss.detach(), AdjointState(costate_like(list(p)), L, chain.stages[-1].name, fold_in(key, L), boundary=h)


def _sweep_once(chain: Chain, params: tuple, buffers: tuple, x: Any, loss_args: tuple,
                opts: Options, pass_state: Any, loss_scale: float):
    L = len(chain)
    device = _device_of(x)
    stats = _new_stats(chain)
    policy = opts.boundary

    # Forward sweep: no graph (unless recompute=False); keep x_0..x_{L-1}, their layouts and
    # the RNG state each stage saw.
    stored, layouts, out_layouts, rng, new_buffers, closures = [], [], [], [], [], [None] * L
    h = kept = x
    for i, s in enumerate(chain.stages):
        B.leaves(h, f"input of {_where(chain, i)}")
        layouts.append(B.Layout.of(h))
        stored.append(kept)
        stats[s.name]["boundary_bytes"] = layouts[i].nbytes(kept)
        rng.append(_rng_state(device))
        with _Timer(stats[s.name], "forward_s", f"eae/{s.name}/forward"), _autocast(opts.autocast, device):
            if opts.recompute or i in opts.physical:
                with torch.no_grad():
                    out, updated = s.call(params[i], buffers[i], h)
            else:
                floats, rebuild, _ = B.split(h, f"input of {_where(chain, i)}")
                out, closures[i], updated = vjp(_local(s, buffers[i], rebuild), params[i], floats, has_aux=True)
        B.leaves(out, f"output of {_where(chain, i)}")
        new_buffers.append(updated)
        out_layouts.append(B.Layout.of(out))
        h = kept = out
        if i < L - 1 and (policy.dtype is not None or policy.offload):
            kept = policy.store(out)
            h = policy.load(kept, out_layouts[i]) if policy.dtype is not None else out
        del out

    # Boundary condition: p_L = d loss / d x_L.
    loss, adj = loss_costate(chain, h, loss_args, opts.key, loss_scale, stats["loss"])
    del h
    adj, pass_state = _run_passes(opts, adj, pass_state, stats["loss"], "eae/loss/passes")

    # Estimators of physical stages probe the network once the forward sweep is done.
    problem = Problem(chain, params, buffers, x, loss_args, opts.physical, opts.key, loss_scale)
    prepared = opts.estimator.prepare(problem) if opts.physical else None

    # Reverse sweep: an explicit fold, carrying the costate, emitting one record per boundary.
    prefetch = B.Prefetcher(policy, device)
    grads, trace = [None] * L, []
    for i in reversed(range(L)):
        s, st = chain.stages[i], stats[chain.stages[i].name]
        cot = _check_costate(chain, i, adj, out_layouts[i])
        trace.append(_traced(adj, opts))
        del adj  # frees x_{i+1} before stage i is recomputed
        h_in = prefetch.get(i, stored[i], layouts[i])
        stored[i] = None
        if i > 0:
            prefetch.start(i - 1, stored[i - 1], layouts[i - 1])
        floats, rebuild, costate_like = B.split(h_in, f"input of {_where(chain, i)}")
        if i in opts.physical:
            with _Timer(st, "vjp_s", f"eae/{s.name}/estimate"), _replay_rng(rng[i], device):
                grads[i], costate_in, cost = opts.estimator.stage_vjp(
                    problem, prepared, i, h_in, out_layouts[i].spec.unflatten(cot))
            for k, v in cost.items():
                st[k] = st.get(k, 0) + v
        else:
            stage_vjp, closures[i] = closures[i], None
            if stage_vjp is None:
                with _Timer(st, "recompute_s", f"eae/{s.name}/recompute"), _replay_rng(rng[i], device), \
                        _autocast(opts.autocast, device):
                    _, stage_vjp, _ = vjp(_local(s, buffers[i], rebuild), params[i], floats, has_aux=True)
            cotangent = out_layouts[i].spec.unflatten(
                [torch.zeros(shape, dtype=dt, device=dev) if c is None else c.to(dt)
                 for c, shape, (dev, dt) in zip(cot, out_layouts[i].shapes, out_layouts[i].placements)])
            with _Timer(st, "vjp_s", f"eae/{s.name}/vjp"):
                grads[i], g_in = stage_vjp(cotangent, retain_graph=False)
            del stage_vjp, cotangent
            costate_in = costate_like(list(g_in))
            del g_in
        del cot
        name = chain.stages[i - 1].name if i > 0 else "input"
        adj = AdjointState(costate_in, i, name, fold_in(opts.key, i), boundary=h_in)
        del costate_in, h_in, floats
        adj, pass_state = _run_passes(opts, adj, pass_state, st, f"eae/{s.name}/passes")
    trace.append(_traced(adj, opts))
    stats["boundaries"] = {a.index: dict(a.meta) for a in trace}
    return loss, tuple(grads), tuple(trace), tuple(new_buffers), pass_state, stats


def _split_batch(tree: Any, k: int) -> list:
    """``tree`` cut into ``k`` pieces along dim 0 of every tensor leaf (other leaves repeated)."""
    flat, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    pieces = [t.tensor_split(k) if isinstance(t, torch.Tensor) and t.ndim > 0 else (t,) * k for t in flat]
    return [spec.unflatten([p[j] for p in pieces]) for j in range(k)]


def _join_adjoints(records: Sequence[AdjointState]) -> AdjointState:
    """One record per boundary from the microbatches' records: costates concatenated on dim 0."""
    value = optree.tree_map(lambda *ts: torch.cat(ts), *[r.value for r in records], namespace=NAMESPACE)
    return records[0].replace(value=value, meta={"microbatches": tuple(dict(r.meta) for r in records)})


def _sum_stats(all_stats: Sequence[dict]) -> dict:
    total = {name: dict(entry) for name, entry in all_stats[0].items()}
    total["boundaries"] = {i: {"microbatches": tuple(s["boundaries"][i] for s in all_stats)}
                           for i in all_stats[0]["boundaries"]}
    for stats in all_stats[1:]:
        for name, entry in stats.items():
            if name == "boundaries":
                continue
            for k, v in entry.items():
                total[name][k] = max(total[name][k], v) if k == "boundary_bytes" else total[name][k] + v
    return total


def sweep(chain: Chain, params: Sequence, x: Any, *loss_args: Any, passes: Any = None, pass_state: Any = None,
          key: int = 0, buffers: Sequence | None = None, boundary_dtype: torch.dtype | None = None,
          offload: bool = False, autocast: torch.dtype | None = None, microbatches: int = 1,
          reduction: str = "mean", estimator: Any = None, physical: Sequence | None = None,
          recompute: bool = True, keep_costates: bool = True) -> SweepResult:
    """Loss, parameter gradients and the costate trace of ``chain`` at ``params`` on ``x``.

    passes:         a pass (``compose(...)``) applied to every costate p_L..p_0 before use.
    pass_state:     state of stateful passes (``None``: ``init()``); the new one is returned.
    key:            int seed; boundary l gets ``fold_in(key, l)``. Dropout draws from the
                    global torch RNG exactly as a plain forward would, and is replayed.
    buffers:        one dict per stage (``None``: the modules' own); never modified,
                    updated ones come back in ``res.buffers``.
    boundary_dtype: store boundary states in this dtype; offload: keep them on the CPU.
    autocast:       run stages under ``torch.autocast`` with this dtype.
    microbatches:   split x and the tensor loss_args on dim 0 into this many pieces and
                    sum their gradients; ``reduction`` ("mean" or "sum") says how the loss
                    reduces over dim 0, so the result equals the full batch's.
    estimator:      how physical stages get their reverse step (``eae_func.estimators``);
                    ``None`` differentiates every stage exactly.
    physical:       names or indices of the physical stages (``None``: those made with
                    ``physical=True``); only used with an estimator.
    recompute:      ``True`` (the memory-saving sweep) rebuilds each stage's graph from its
                    saved input; ``False`` keeps every stage's vjp closure from the forward
                    (no second forward, memory like plain autograd), same results.
    keep_costates:  ``False`` returns the trace records with ``value=None`` (history and meta
                    kept), saving L costates of memory; ``grad``/``value_and_grad`` use it.
    """
    params = _check_params(chain, params)
    buffers = _check_buffers(chain, buffers)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"sweep: reduction must be 'mean' or 'sum', got {reduction!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"sweep: microbatches must be a positive int, got {microbatches!r}")
    if physical is None:
        physical = [i for i, s in enumerate(chain.stages) if s.physical]
    physical = tuple(sorted({chain.index(p) for p in physical})) if estimator is not None else ()
    opts = Options(passes, int(key), B.Policy(boundary_dtype, offload), autocast, estimator, physical, recompute,
                   keep_costates)
    state = C.init(passes) if pass_state is None else pass_state
    if microbatches == 1:
        loss, grads, trace, new_buffers, state, stats = _sweep_once(
            chain, params, buffers, x, loss_args, opts, state, 1.0)
        return SweepResult(loss, _tie(chain, params, grads), trace, new_buffers, state, MappingProxyType(stats))

    xs, args = _split_batch(x, microbatches), _split_batch(loss_args, microbatches)
    n = [optree.tree_leaves(xj, namespace=NAMESPACE)[0].shape[0] for xj in xs]
    losses, grads, traces, all_stats = [], None, [], []
    for j in range(microbatches):
        weight = n[j] / sum(n) if reduction == "mean" else 1.0
        mb_opts = dataclasses.replace(opts, key=fold_in(opts.key, -1 - j))
        loss, g, trace, buffers, state, stats = _sweep_once(
            chain, params, buffers, xs[j], args[j], mb_opts, state, weight)
        losses.append(loss * weight)
        grads = g if grads is None else optree.tree_map(torch.add, grads, g, namespace=NAMESPACE)
        traces.append(trace)
        all_stats.append(stats)
    trace = tuple(_join_adjoints(records) for records in zip(*traces))
    return SweepResult(torch.stack(losses).sum(), _tie(chain, params, grads), trace, buffers, state, MappingProxyType(_sum_stats(all_stats)))


def _tie(chain: Chain, params: tuple, grads: tuple) -> tuple:
    """Give every use of a shared tensor the sum of all its uses' gradients.

    Shared means the same tensor object in two places of ``params``, or a group
    of ``chain.ties`` (which survives a pure update that unties the objects).
    """
    paths, leaves, specs = zip(*(optree.tree_flatten_with_path(p, namespace=NAMESPACE) for p in params))
    groups: dict = {}
    for i, stage_leaves in enumerate(leaves):
        for j, t in enumerate(stage_leaves):
            groups.setdefault(id(t), set()).add((i, j))
    tied = {frozenset(g) for g in groups.values() if len(g) > 1}
    tied |= {frozenset((i, paths[i].index((name,))) for i, name in group) for group in chain.ties}
    original = [optree.tree_leaves(g, namespace=NAMESPACE) for g in grads]
    flat = [list(g) for g in original]
    for group in tied:
        total = sum(original[i][j] for i, j in group)
        for i, j in group:
            flat[i][j] = total
    return tuple(spec.unflatten(f) for spec, f in zip(specs, flat))


def value_and_grad(chain: Chain, params: Sequence, x: Any, *loss_args: Any, **options: Any):
    """``(loss, grads)`` of ``chain`` at ``params``; options as for ``sweep``."""
    res = sweep(chain, params, x, *loss_args, **{"keep_costates": False, **options})
    return res.loss, res.grads


def grad(chain: Chain, params: Sequence, x: Any, *loss_args: Any, **options: Any):
    """Parameter gradients of ``chain`` at ``params`` (same tree as ``params``); options as for ``sweep``."""
    return sweep(chain, params, x, *loss_args, **{"keep_costates": False, **options}).grads
