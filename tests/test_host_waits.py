"""A step makes no host wait a GPU would stall on: no ``.item()``, ``.tolist()``, ``float()``,
``int()`` or ``bool()`` of a tensor inside the fold, the built-in passes (but ``check_finite("raise")``,
which must read its count to raise) or a fused update, over microbatches and several steps; a
pipeline step after the first also pickles nothing (no object collective) and still equals one
process's sweep bit for bit, and ranks given different options later still both refuse the step."""

import collections
import contextlib

import optree
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import eae_func as ef
import eae_func.distributed as D
from eae_func import estimators as E
from eae_func import passes as P
from eae_func import remat
from eae_func.tree import NAMESPACE

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "send_object_list", "recv_object_list")


SYNCING = {  # the ops that wait for the device on a GPU: a scalar read, data-dependent shapes, comparisons
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten.repeat_interleave.Tensor,
}


class DeviceWaits(TorchDispatchMode):
    """Counts the dispatched ops of ``SYNCING`` by name: what a read from C++ (a ``torch.equal``, an
    ``.item()`` inside a torch function) does, which no patch of a Python method sees."""

    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def spying(dispatched: bool = True):
    """Counts, by name, of the reads of a tensor's value on the host (patched methods, and with
    ``dispatched`` the syncing ops as dispatched) and of the object collectives. A pipeline compares
    digests it keeps in host memory with ``torch.equal``, which a CPU run cannot tell from a device
    read: its steps are spied on without ``dispatched``."""
    counts: collections.Counter = collections.Counter()
    with pytest.MonkeyPatch.context() as patch, DeviceWaits(counts) if dispatched else contextlib.nullcontext():
        for owner, names in ((torch.Tensor, READS), (dist, OBJECT_COLLECTIVES)):
            for name in names:
                real = getattr(owner, name)

                def spy(*args, _name=name, _real=real, **kwargs):
                    counts[_name] += 1
                    return _real(*args, **kwargs)

                patch.setattr(owner, name, spy)
        yield counts


@pytest.fixture
def reads():
    with spying() as counts:
        yield counts


def every_pass():
    return ef.compose(
        P.clip_by_global_norm(1.0),
        P.clip_by_value(0.5),
        P.scale(0.9),
        P.gaussian_noise(1e-3),
        P.error_feedback(P.int8()),
        P.topk(0.5),
        P.randk(0.5),
        P.cast(torch.bfloat16),
        P.fp8(),
        P.int8(),
        P.stats(),
        P.check_finite("zero"),
        P.synthetic(warmup=1),
        P.only(P.scale(2.0), indices=[1]),
        P.when(lambda adj: True, P.scale(1.0)),
    )


@pytest.mark.parametrize("update", ["none", "torch.optim", "pure"])
def test_a_sweep_reads_no_tensor_value_on_the_host(reads, update):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.1), nn.Linear(16, 4))
    chain, params = ef.from_module(model, loss=lambda out, y: (out - y).square().mean())
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    state, fused_state = None, [{} for _ in params]
    for _ in range(3):
        if update == "torch.optim":
            options = {"update": torch.optim.SGD(model.parameters(), lr=0.1)}
        elif update == "pure":
            options = {"update": ef.fused(lambda p, g, s: ({n: t - 0.1 * g[n] for n, t in p.items()}, s), fused_state)}
        else:
            options = {}
        res = ef.sweep(chain, params, x, y, passes=every_pass(), pass_state=state, microbatches=2, **options)
        state = res.pass_state
        if update == "pure":
            params, fused_state = res.params, res.update_state
    assert not reads, dict(reads)


ESTIMATES = 2 * 2  # steps x microbatches: one estimate of the physical stage each


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"offload": True, "boundary_dtype": torch.bfloat16}, {}),
        ({"recompute": remat.save()}, {}),
        ({"recompute": 4000}, {}),
        # one read per estimate: the physical stage's probe calls held finite (raising needs the count)
        ({"physical": [2], "estimator": E.zbp(E.Probes(4), method="fd")}, {"__int__": ESTIMATES}),
        # and np's check that the loss is a sum of per-sample shares, once per microbatch
        (
            {"physical": [2], "estimator": E.node_perturbation(E.Probes(4), form="jvp")},
            {"__int__": ESTIMATES, "__bool__": ESTIMATES},
        ),
    ],
    ids=["offload bf16", "remat.save", "graph budget", "zbp", "np"],
)
def test_a_sweep_with_stored_boundaries_remat_or_estimators_reads_only_what_it_must(reads, options, expected):
    """The chain's other options over two steps: offloaded low-precision boundaries and remat policies
    read nothing; a physical stage's estimate reads once (its probe calls counted on the device, not
    read per call), np's share check once per microbatch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    chain, params = ef.from_module(model, loss=lambda out, y: (out - y).square().mean())
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    for key in range(2):
        ef.sweep(chain, params, x, y, key=key, microbatches=2, **options)
    scalar_reads = sum(expected.values())
    assert dict(reads) == {**expected, **({"aten._local_scalar_dense.default": scalar_reads} if scalar_reads else {})}


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.1)) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize(
    "path",
    [
        "sweep",
        "sweep fused",
        "sweep bf16 boundaries",
        "sweep kept graphs",
        "sweep graph budget",
        "sweep remat.save",
        "enable",
        "enable fused",
    ],
)
def test_run_time_cuts_and_the_switch_read_no_tensor_value_on_the_host(path):
    """Run-time cuts (``ef.sweep`` of a module with ``split_at``) and an enabled model's backward, with
    the passes, a fused step, stored boundaries and every kind of remat policy: no read of a tensor's
    value, no ``torch.equal``, no ``nonzero``, over several steps."""
    torch.manual_seed(0)
    model = Residual()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    passes = ef.compose(P.clip_by_global_norm(1.0), P.int8(), P.gaussian_noise(1e-3), P.stats())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"update": opt} if "fused" in path else {}
    if "bf16" in path:
        options["boundary_dtype"] = torch.bfloat16
    options["recompute"] = {
        "sweep kept graphs": False,
        "sweep graph budget": 3000,
        "sweep remat.save": remat.save(),
    }.get(path, True)
    if path.startswith("enable"):
        ef.enable(model, split_at=["blocks.*"], passes=passes, **options)
    with spying() as counts, pytest.MonkeyPatch.context() as patch:
        for owner, name in ((torch, "equal"), (torch.Tensor, "nonzero"), (torch, "nonzero")):
            real = getattr(owner, name)

            def spy(*args, _name=name, _real=real, **kwargs):
                counts[_name] += 1
                return _real(*args, **kwargs)

            patch.setattr(owner, name, spy)
        state = None
        for _ in range(3):
            if path.startswith("enable"):
                (model(x) - y).square().mean().backward()
                if "fused" in path:
                    with pytest.warns(UserWarning, match="finds no gradient") if _ == 0 else contextlib.nullcontext():
                        opt.step()
                model.zero_grad()
            else:
                params = dict(model.named_parameters())
                loss = lambda out, y: (out - y).square().mean()  # noqa: E731
                res = ef.sweep(model, params, x, y, loss=loss, split_at=["blocks.*"], passes=passes,
                               pass_state=state, **options)  # fmt: skip
                state = res.pass_state
    if path.startswith("enable"):
        ef.disable(model)
    assert not counts, dict(counts)


# ----------------------------------------------------------------------------- a pipeline over 2 ranks


def _mlp():
    """A 5-stage MLP whose first and last layers share their weight (a pipeline cuts it after stage
    1, so the tie spans the ranks), its params and a batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    model[4].weight = model[0].weight
    chain, params = ef.from_module(model, loss=lambda out, y: (out - y).square().mean())
    return chain, params, torch.randn(8, 8), torch.randn(8, 8)


def _options(case):
    """``(costate codec, the pipeline's options, the reference sweep's)``: every pass (but
    ``check_finite("raise")``) over an int8 wire, or stage 2 physical under ``E.frozen()`` (no
    costate crosses to rank 0: its stages get ``None``, but for the tied weight's sum from rank 1)."""
    if case == "frozen":
        options = {"physical": [2], "estimator": E.frozen(), "microbatches": 2}
        return None, options, options
    codec = D.codecs.int8()
    options = {"passes": every_pass(), "microbatches": 2}
    return codec, options, {**options, "passes": ef.compose(every_pass(), P.only(codec.as_pass(), indices=[2]))}


def _same(a, b):
    """Bit for bit: one structure, ``None`` at the same leaves, equal tensors elsewhere."""
    (xs, x_spec), (ys, y_spec) = (optree.tree_flatten(t, none_is_leaf=True, namespace=NAMESPACE) for t in (a, b))
    both = [
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(xs, ys)
    ]
    return x_spec == y_spec and all(both)


def pipeline_steps(case, steps=3):
    """``steps`` pipeline steps, each with another key, against one process's sweeps (pass state
    threaded on both): whether each step's loss and grads equal bit for bit, and the counts of host
    reads and object collectives on the steps after the first. Grads and the trace are this rank's."""
    chain, params, x, y = _mlp()
    codec, options, ref_options = _options(case)
    pipe = D.Pipeline(chain, [(0, 2), (2, 5)], costate_codec=codec, timeout=60)
    state = ref_state = None
    equal, counts = [], collections.Counter()
    for key in range(steps):
        with spying(dispatched=False) as seen:
            res = pipe.sweep(params, x, y, key=key, pass_state=state, **options)
        counts += seen if key > 0 else collections.Counter()
        ref = ef.sweep(chain, params, x, y, key=key, pass_state=ref_state, data_parallel=False, **ref_options)
        state, ref_state = res.pass_state, ref.pass_state
        equal.append(_same_step(pipe, res, ref))
    return equal, dict(counts)


def _same_step(pipe, res, ref):
    """Whether a pipeline step's loss, this rank's grads and its trace equal one process's bit for bit."""
    records = {a.index: a.value for a in ref.adjoints}
    return (
        _same(res.loss, ref.loss)
        and _same(res.grads, tuple(ref.grads[i] for i in pipe.stages))
        and all(_same(a.value, records[a.index]) for a in res.adjoints)
    )


def freezing_a_tied_weight():
    """Three steps, the tied weight frozen after the first (its partial sums turn ``None`` on both
    ranks, so the ranks agree anew): whether each step equals one process's bit for bit."""
    chain, params, x, y = _mlp()
    first = chain.stages[0].module
    assert first is not None
    pipe = D.Pipeline(chain, [(0, 2), (2, 5)], timeout=60)
    equal = []
    for step in range(3):
        first.weight.requires_grad_(step == 0)  # the module's own: stages 0 and 4 share it
        res = pipe.sweep(params, x, y, microbatches=2)
        equal.append(_same_step(pipe, res, ef.sweep(chain, params, x, y, microbatches=2, data_parallel=False)))
    return equal


def disagreeing_later(option):
    """Two agreed steps, then rank 1 is given another ``option``: the message each rank raises."""
    chain, params, x, y = _mlp()
    pipe = D.Pipeline(chain, [(0, 2), (2, 5)], timeout=60)
    for _ in range(2):
        pipe.sweep(params, x, y, key=1, microbatches=2)
    theirs = {
        "key": {"key": 1 + dist.get_rank()},
        "passes": {"key": 1, "passes": P.scale(2.0) if dist.get_rank() else None},
        # one name, "scale(1)", two values: ranks agree on passes by value, not by name
        "pass value": {"key": 1, "passes": P.scale(1.0 + 1e-9 * dist.get_rank())},
    }
    try:
        pipe.sweep(params, x, y, microbatches=2, **theirs[option])
    except D.PeerError as e:
        return str(e)
    return "accepted"


class _StopsAfterOneStep:
    """``E.exact()`` for the first step's 2 microbatches, then ``E.frozen()``: a costate that stops
    crossing from one step to the next, which a pipeline refuses (its receiver no longer reads the flags)."""

    scope, differentiates, calls = "stage", True, 0

    def __repr__(self):
        return "stops_after_one_step()"

    def prepare(self, problem):
        return None

    def stage_vjp(self, problem, prepared, i, h_in, costate):
        self.calls += 1
        return (E.exact() if self.calls <= 2 else E.frozen()).stage_vjp(problem, None, i, h_in, costate)


def costate_stops_crossing():
    """Two steps whose costate into rank 0 stops on the second: what each rank raises."""
    chain, params, x, y = _mlp()
    pipe = D.Pipeline(chain, [(0, 2), (2, 5)], timeout=10)
    options = {"physical": [2], "estimator": _StopsAfterOneStep(), "microbatches": 2}
    try:
        for _ in range(2):
            pipe.sweep(params, x, y, **options)
    except Exception as e:  # noqa: BLE001 - the test inspects what each rank raised
        return type(e).__name__, str(e)
    return None, "accepted"


def pipeline_checks():
    """Each rank's results of the checks above, in one process group."""
    out: dict = {case: pipeline_steps(case) for case in ("every pass", "frozen")}
    out |= {option: disagreeing_later(option) for option in ("key", "passes", "pass value")}
    out["freezing"] = freezing_a_tied_weight()
    return out | {"stops": costate_stops_crossing()}  # last: rank 0 waits out the timeout


@pytest.fixture(scope="module")
def two_ranks():
    return D.run(pipeline_checks, 2, timeout=120)


@pytest.mark.parametrize("case", ["every pass", "frozen"])
def test_a_pipeline_step_after_the_first_reads_and_pickles_nothing_and_equals_the_sweep(two_ranks, case):
    for rank, checks in enumerate(two_ranks):
        equal, counts = checks[case]
        assert all(equal), (rank, equal)
        assert not counts, (rank, counts)


def test_a_tied_weight_frozen_after_the_first_step_is_summed_as_in_one_process(two_ranks):
    for rank, checks in enumerate(two_ranks):
        assert checks["freezing"] == [True] * 3, (rank, checks["freezing"])


@pytest.mark.parametrize("option", ["key", "passes", "pass value"])
def test_pipeline_ranks_given_different_options_after_agreeing_both_refuse_the_step(two_ranks, option):
    for rank, checks in enumerate(two_ranks):
        message = checks[option]
        named = {"pass value": "passes"}.get(option, option)
        assert "were given different options for this step" in message and f"{named}: " in message, (rank, message)


def test_a_costate_that_stops_crossing_after_the_first_step_is_refused_by_its_sender(two_ranks):
    (kind_0, message_0), (kind_1, message_1) = (checks["stops"] for checks in two_ranks)
    assert kind_1 == "ValueError" and "the costate at boundary 2" in message_1, message_1
    assert "has a costate on leaves [] of the boundary, and had one on leaves [0] on the first step" in message_1
    assert kind_0 == "PeerError" and "rank 1: stages 2-4" in message_0, message_0


def loss_changes_dtype():
    """Two steps whose loss is float32, then float64 (loss args and options unchanged): what each rank raises."""
    chain, params, x, y = _mlp()
    calls = []

    def loss(out, y):
        calls.append(None)
        value = (out - y).square().mean()
        return value if len(calls) <= 2 else value.double()

    pipe = D.Pipeline(ef.Chain(chain.stages, loss=loss), [(0, 2), (2, 5)], timeout=10)
    try:
        for _ in range(2):
            pipe.sweep(params, x, y, microbatches=2)
    except Exception as e:  # noqa: BLE001 - the test inspects what each rank raised
        return type(e).__name__, str(e)
    return None, "accepted"


def test_a_loss_that_changes_dtype_after_the_first_step_is_refused_by_the_last_rank():
    (kind_0, message_0), (kind_1, message_1) = D.run(loss_changes_dtype, 2, timeout=120)
    assert (
        kind_1 == "ValueError" and "rank 1's loss is torch.float64 this step, torch.float32 on the first" in message_1
    )
    assert kind_0 == "PeerError" and "exchanging the loss from rank 1 failed" in message_0, message_0
