"""eae_func.distributed across real processes (gloo on 127.0.0.1): a pipeline of 2 and 4 ranks on
every schedule of torch.distributed.pipelining (gpipe, 1f1b, interleaved 1f1b, zero bubble) gives
exactly the gradients, loss, trace and pass state of one single-process sweep, with and without
passes and wire codecs; int8 costates cost a quarter of the bytes; pipeline x data parallel
averages exactly; a dead rank or a bad costate makes every other rank raise within the timeout.

Each spawned run checks several things and returns numbers; the tests assert on them.
"""

import os
import time

import optree
import pytest
import torch
import torch.distributed as dist

import eae_func as ef
import eae_func.distributed as D
from eae_func import estimators as E
from eae_func import passes as P
from eae_func.models import lm_loss, transformer_lm
from eae_func.tree import NAMESPACE

VOCAB = 32


def _lm(dim=16, depth=3):
    torch.manual_seed(0)
    return ef.from_module(transformer_lm(VOCAB, dim, depth, n_heads=4, n_kv_heads=2, ffn_hidden=24), loss=lm_loss)


def _batch(n, t=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, t), generator=g), torch.randint(0, VOCAB, (n, t), generator=g)


def _max_error(pipe, res, ref):
    """Largest |grad difference| over this rank's stages (tied weights included)."""
    assert tuple(res.stages) == tuple(pipe.stages)
    return max(
        (
            (res.grads[pipe.stages.index(i)][n] - ref.grads[i][n]).abs().max().item()
            for i in pipe.stages
            for n in ref.grads[i]
        ),
        default=0.0,
    )


def _trace_error(res, ref):
    """This rank's boundary records against the same boundaries of the single-process trace:
    largest value difference, and whether index, stage and history all agree."""
    by_index = {a.index: a for a in ref.adjoints}
    same = all((a.stage, a.history) == (by_index[a.index].stage, by_index[a.index].history) for a in res.adjoints)
    same = same and all(
        optree.tree_structure(a.value, none_is_leaf=True, namespace=NAMESPACE)
        == optree.tree_structure(by_index[a.index].value, none_is_leaf=True, namespace=NAMESPACE)
        for a in res.adjoints
    )
    err = max(
        (
            (u - v).abs().max().item()
            for a in res.adjoints
            for u, v in zip(
                optree.tree_leaves(a.value, namespace=NAMESPACE),
                optree.tree_leaves(by_index[a.index].value, namespace=NAMESPACE),
            )
        ),
        default=0.0,
    )
    return err, same, [a.index for a in res.adjoints]


def _compare(chain, params, x, y, *, schedule, microbatches, passes=None, codec=None, key=3, ranges=None):
    """One pipeline sweep and the single-process reference (codec.as_pass() at the cut boundaries)."""
    pipe = D.Pipeline(chain, ranges, params=params, schedule=schedule, costate_codec=codec, timeout=30)
    res = pipe.sweep(params, x, y, passes=passes, microbatches=microbatches, key=key)
    cuts = [lo for lo, _ in pipe.ranges[1:]]
    ref_passes = passes if codec is None else ef.compose(passes or ef.identity(), P.only(codec.as_pass(), indices=cuts))
    ref = ef.sweep(chain, params, x, y, passes=ref_passes, microbatches=microbatches, key=key)
    trace_err, trace_same, indices = _trace_error(res, ref)
    return {
        "grad_err": _max_error(pipe, res, ref),
        "loss_err": abs(res.loss.item() - ref.loss.item()),
        "trace_err": trace_err,
        "trace_same": trace_same,
        "indices": indices,
        "state": (res.pass_state, ref.pass_state),
        "stats": {k: res.stats[k] for k in ("wire", "schedule")},
    }


def _state_error(state, ref_state):
    """error_feedback keeps one residual per boundary: this rank's must equal the reference's."""
    mine, (theirs, _) = state["residuals"], ref_state  # the reference composes the (stateless) codec pass after it
    theirs = theirs["residuals"]
    return max((mine[i] - theirs[i]).abs().max().item() for i in mine if mine[i] is not None), sorted(mine)


# ----------------------------------------------------------------------------- one engine


def _mlp_with_a_physical_stage(depth=6, width=8):
    """Pure-function stages ``tanh(h W + b)``; stage 3 is physical (a fixed medium times its own gain)."""
    g = torch.Generator().manual_seed(0)
    medium = torch.randn(width, width, generator=g) / width**0.5
    stages = [ef.stage(lambda p, h: torch.tanh(h @ p["w"] + p["b"]), name=f"layer{i}") for i in range(depth)]
    stages[3] = ef.stage(lambda p, h: torch.tanh(p["gain"] * h @ medium), name="medium", physical=True)
    params = tuple(
        {"w": torch.randn(width, width, generator=g) / width**0.5, "b": torch.zeros(width)} for _ in range(depth)
    )
    params = params[:3] + ({"gain": torch.ones(())},) + params[4:]
    chain = ef.Chain(stages, loss=lambda out, y: torch.nn.functional.mse_loss(out, y))
    return chain, params, torch.randn(6, width, generator=g), torch.randn(6, width, generator=g)


def _random_split(rng, stages, parts):
    cuts = sorted(rng.sample(range(1, stages), parts - 1))
    return list(zip([0] + cuts, cuts + [stages]))


def _schedules(ranks, stages, stateful):
    """The schedules that fit this many ranks and stages, with their ranges per rank."""
    out = [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1)]  # 1f1b with m < p: GPipe's order
    if 2 * ranks <= stages and not stateful:  # a stateful pass needs one process's order of boundaries
        out.append(("interleaved_1f1b", 2))
    return out


def engine_checks(ranks, seed, configs=4):
    """Random stage splits, each with a random mix of the sweep's options (the first config has
    them all: bf16 boundaries, a pass with state and random draws, zbp on the physical stage
    (else the exact estimator), bf16 autocast);
    a random schedule of those that fit; every rank's grads, trace and pass state against one
    single-process ``ef.sweep``."""
    import random

    rng = random.Random(seed)
    chain, params, x, y = _mlp_with_a_physical_stage()
    out = {}
    for c in range(configs):
        use = [True] * 4 if c == 0 else [rng.random() < 0.5 for _ in range(4)]
        m = rng.choice([1, 2, 3])
        fits = _schedules(ranks, len(chain), use[1])
        schedule, per_rank = fits[c % len(fits)]  # every schedule that fits, in turn
        ranges = _random_split(rng, len(chain), ranks * per_rank)
        options = {
            "boundary_dtype": torch.bfloat16 if use[0] else None,
            "passes": ef.compose(P.error_feedback(P.topk(0.5)), P.int8(stochastic=True)) if use[1] else None,
            "estimator": E.zbp(E.Probes(4), method=rng.choice(["jvp", "fd"])) if use[2] else E.exact(),
            "autocast": torch.bfloat16 if use[3] else None,
            "microbatches": m,
            "key": rng.randrange(100),
        }
        pipe = D.Pipeline(chain, ranges, schedule=schedule, ranges_per_rank=per_rank, timeout=60)
        res = pipe.sweep(params, x, y, **options)
        ref = ef.sweep(chain, params, x, y, **options)
        by_index = {a.index: a for a in ref.adjoints}
        grad_err = max(
            (
                (res.grads[pipe.stages.index(i)][n] - ref.grads[i][n]).abs().max().item()
                for i in pipe.stages
                for n in ref.grads[i]
            ),
            default=0.0,
        )
        trace_err = max((a.value - by_index[a.index].value).abs().max().item() for a in res.adjoints)
        state_err = 0.0
        if use[1]:
            mine, theirs = res.pass_state[0]["residuals"], ref.pass_state[0]["residuals"]
            state_err = max((mine[l] - theirs[l]).abs().max().item() for l in mine)
        out[f"{schedule} {ranges} {options}"] = {
            "grad_err": grad_err,
            "loss_err": abs(res.loss.item() - ref.loss.item()),
            "trace_err": trace_err,
            "state_err": state_err,
            "histories": all(a.history == by_index[a.index].history for a in res.adjoints),
        }
    return out


def _assert_engine_checks(results):
    for out in results:
        assert out, "no configurations ran"
        for name, r in out.items():
            assert r["histories"], name
            assert r["grad_err"] == r["loss_err"] == r["trace_err"] == r["state_err"] == 0.0, (name, r)


def two_rank_checks():
    chain, params = _lm()
    x, y = _batch(6)
    out = {}
    out["plain gpipe m=1"] = _compare(chain, params, x, y, schedule="gpipe", microbatches=1)
    out["plain 1f1b m=3"] = _compare(chain, params, x, y, schedule="1f1b", microbatches=3)
    random_passes = ef.compose(P.clip_by_global_norm(0.05), P.int8(stochastic=True), P.randk(0.5))
    for schedule in D.SCHEDULES:
        out[f"random passes {schedule} m=2"] = _compare(
            chain, params, x, y, schedule=schedule, microbatches=2, passes=random_passes
        )
    for codec in (D.codecs.int8(), D.codecs.fp8(), D.codecs.cast(torch.bfloat16), D.codecs.topk(0.3)):
        out[f"codec {codec.name}"] = _compare(chain, params, x, y, schedule="zero_bubble", microbatches=2, codec=codec)
    feedback = P.error_feedback(P.topk(0.3))  # one residual per boundary
    r = _compare(
        chain,
        params,
        x,
        y,
        schedule="zero_bubble",
        microbatches=3,
        passes=feedback,
        codec=D.codecs.int8(),
        ranges=[(0, 2), (2, 5)],
    )
    r["state_err"], r["state_keys"] = _state_error(*r.pop("state"))
    out["error feedback + int8 wire"] = r
    try:  # two ranges per rank: the backwards visit a rank's boundaries out of one process's order
        D.Pipeline(chain, params=params, schedule="interleaved_1f1b", timeout=30).sweep(
            params, x, y, microbatches=2, passes=feedback
        )
        out["stateful interleaved"] = "accepted"
    except ValueError as e:
        out["stateful interleaved"] = str(e)
    # Bytes on the wire: float32 vs int8 costates on a wider boundary (8 x 16 x 32).
    chain, params = _lm(dim=32)
    x, y = _batch(8, t=16)
    wire = {}
    for name, codec in (("raw", None), ("int8", D.codecs.int8())):
        pipe = D.Pipeline(chain, [(0, 3), (3, 5)], costate_codec=codec, timeout=30)
        wire[name] = pipe.sweep(params, x, y, microbatches=2).stats["wire"]
    return dist.get_rank(), out, wire, engine_checks(2, seed=2)


@pytest.fixture(scope="module")
def two_ranks():
    return D.run(two_rank_checks, 2, timeout=90)


def test_two_rank_pipeline_equals_single_process_sweep(two_ranks):
    for rank, out, _, _ in two_ranks:
        assert "keep state, and schedule 'interleaved_1f1b' runs" in out["stateful interleaved"], rank
        for name, r in out.items():
            if name == "stateful interleaved":
                continue
            assert r["grad_err"] == r["loss_err"] == 0.0, (rank, name, r["grad_err"], r["loss_err"])


def test_ranks_together_produce_the_single_process_trace(two_ranks):
    """Rank 1 records L down to its first boundary, rank 0 the rest; values, stages and histories
    (codec round trip included) are those of one sweep."""
    for name in set(two_ranks[0][1]) - {"stateful interleaved"}:
        indices = sorted(i for _, out, _, _ in two_ranks for i in out[name]["indices"])
        assert indices == list(range(6)), name
        for rank, out, _, _ in two_ranks:
            assert out[name]["trace_err"] == 0.0 and out[name]["trace_same"], (rank, name)


def test_error_feedback_state_per_rank_is_the_single_process_state(two_ranks):
    keys = []
    for _, out, _, _ in two_ranks:
        r = out["error feedback + int8 wire"]
        assert r["state_err"] == 0.0
        keys += r["state_keys"]
    assert sorted(keys) == list(range(6))


def test_int8_costates_cost_a_quarter_of_the_bytes(two_ranks):
    """The costate bytes rank 1 sends (and rank 0 receives) shrink 4x: n int8 + one float32 scale
    (+ each message's one-byte flag)."""
    (_, _, wire0, _), (_, _, wire1, _) = two_ranks
    raw, int8 = wire1["raw"]["costate_bytes_sent"], wire1["int8"]["costate_bytes_sent"]
    assert raw == 8 * 16 * 32 * 4 + 2  # two microbatches of 4 x 16 x 32 float32, two flags
    assert int8 == 8 * 16 * 32 + 2 * 4 + 2  # int8, two float32 scales, two flags
    assert wire0["int8"]["costate_bytes_received"] == int8
    assert 0.25 < int8 / raw < 0.251
    assert wire1["raw"]["activation_bytes_received"] == raw - 2


def test_pipeline_reports_its_schedule(two_ranks):
    for _, out, _, _ in two_ranks:
        s = out["plain 1f1b m=3"]["stats"]["schedule"]
        assert (s["name"], s["ranks"], s["microbatches"], s["ranges_per_rank"]) == ("1f1b", 2, 3, 1)
        assert s["ideal_bubble"] == pytest.approx(1 / 4)
        assert 0 <= s["bubble"] < 1 and s["busy_s"] <= s["step_s"]


def four_rank_checks():
    chain, params = _lm()
    x, y = _batch(8)
    out = {}
    out["pipeline 4, 1f1b m=4, clip + int8 wire"] = _compare(
        chain, params, x, y, schedule="1f1b", microbatches=4, passes=P.clip_by_global_norm(0.05), codec=D.codecs.int8()
    )
    out["pipeline 4, gpipe m=2"] = _compare(chain, params, x, y, schedule="gpipe", microbatches=2)
    deep, deep_params = _lm(depth=6)  # 8 stages: two ranges on each of 4 ranks
    out["pipeline 4, interleaved 1f1b m=4, clip"] = _compare(
        deep, deep_params, x, y, schedule="interleaved_1f1b", microbatches=4, passes=P.clip_by_global_norm(0.05)
    )
    out["pipeline 4, zero bubble m=4, clip + int8 wire"] = _compare(
        chain,
        params,
        x,
        y,
        schedule="zero_bubble",
        microbatches=4,
        passes=P.clip_by_global_norm(0.05),
        codec=D.codecs.int8(),
    )
    # 2 x 2 mesh: replica d runs rows 4d..4d+3 through a 2-rank pipeline; averaged gradients
    # equal the full batch's (mean loss, equal halves).
    m = D.mesh(pp=2)
    pipe = D.Pipeline(chain, [(0, 2), (2, 5)], ranks=m.pipeline_ranks, timeout=30)
    rows = slice(4 * m.replica, 4 * m.replica + 4)
    res = pipe.sweep(params, x[rows], y[rows], microbatches=2)
    ref = ef.sweep(chain, params, x, y)
    grads, stats = D.average_gradients(res.grads, m.data_group)
    out["mesh raw"] = {
        "grad_err": max(
            (grads[pipe.stages.index(i)][n] - ref.grads[i][n]).abs().max().item()
            for i in pipe.stages
            for n in ref.grads[i]
        ),
        "bytes": stats["bytes_sent"],
    }
    local = ef.grad(chain, params, x[rows], y[rows], data_parallel=False)
    after, _ = D.average_gradients(local, m.data_group)
    during = ef.grad(chain, params, x[rows], y[rows], data_parallel=m.device_mesh["dp"])
    out["mesh dp sweep"] = max(
        (during[i][n] - after[i][n]).abs().max().item() for i in range(len(after)) for n in after[i]
    )
    int8_grads, int8_stats = D.average_gradients(res.grads, m.data_group, codec=D.codecs.int8())
    largest = torch.tensor(max(g.abs().max().item() for s in res.grads for g in s.values()))
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=m.data_group)  # the largest int8 scale * 127
    bound = largest.item() / 127
    out["mesh int8"] = {
        "grad_err": max(
            (int8_grads[i][n] - grads[i][n]).abs().max().item() for i in range(len(grads)) for n in grads[i]
        ),
        "bound": bound,
        "bytes": int8_stats["bytes_sent"],
        "checksum": [sum(g.double().sum().item() * (k + 1) for k, g in enumerate(s.values())) for s in int8_grads],
    }
    out["engine"] = engine_checks(4, seed=4)
    return dist.get_rank(), m.replica, m.stage_rank, out


@pytest.fixture(scope="module")
def four_ranks():
    return D.run(four_rank_checks, 4, timeout=90)


def test_four_rank_pipeline_equals_single_process_sweep(four_ranks):
    for rank, _, _, out in four_ranks:
        for name in (
            "pipeline 4, 1f1b m=4, clip + int8 wire",
            "pipeline 4, gpipe m=2",
            "pipeline 4, zero bubble m=4, clip + int8 wire",
            "pipeline 4, interleaved 1f1b m=4, clip",
        ):
            r = out[name]
            assert r["grad_err"] == r["loss_err"] == r["trace_err"] == 0.0, (rank, name)
            assert r["trace_same"]


def test_pipeline_runs_the_single_process_engine_on_random_splits(two_ranks, four_ranks):
    """Same fold on every rank: exactly the single process's numbers, options included."""
    _assert_engine_checks([checks for *_, checks in two_ranks])
    _assert_engine_checks([out["engine"] for *_, out in four_ranks])


def test_pipeline_x_data_parallel_equals_the_full_batch(four_ranks):
    for rank, _, _, out in four_ranks:
        assert out["mesh raw"]["grad_err"] < 1e-6, rank
        assert out["mesh dp sweep"] == 0.0, rank  # data_parallel= on the mesh's "dp" dimension: the same average


def test_compressed_gradient_average_is_identical_on_replicas_and_within_the_int8_bound(four_ranks):
    by_stage = {}
    for rank, _replica, stage_rank, out in four_ranks:
        r = out["mesh int8"]
        assert r["grad_err"] <= r["bound"] / 2 + 1e-7, rank  # mean of errors each <= s/2
        assert r["bytes"] < out["mesh raw"]["bytes"] / 3
        by_stage.setdefault(stage_rank, []).append(r["checksum"])
    for sums in by_stage.values():
        assert sums[0] == sums[1]


# ----------------------------------------------------------------------------- pytree boundaries


def _masked(width=8):
    """A chain whose boundaries are pytrees: ``(h, mask)`` with a boolean mask after stage 0, then a
    dict with the mask, an integer count per row and a float leaf no later stage uses (no costate)."""
    g = torch.Generator().manual_seed(0)

    def first(p, x):
        return torch.tanh(x @ p["w"]), x > 0

    def middle(p, hm):
        h, mask = hm
        return {"h": torch.tanh(h @ p["w"]) * mask, "mask": mask, "n": mask.sum(-1), "unused": 2 * h}

    def gated(p, d):
        return torch.tanh(d["h"] @ p["w"]) * d["mask"] + 0.01 * d["n"].unsqueeze(-1)

    stages = [ef.stage(f, name=f.__name__) for f in (first, middle, gated)] + [
        ef.stage(lambda p, h: h @ p["w"], name="head")
    ]
    params = tuple({"w": torch.randn(width, width, generator=g, dtype=torch.float64) / 3} for _ in stages)
    chain = ef.Chain(stages, loss=lambda out, y: torch.nn.functional.mse_loss(out, y))
    return chain, params, torch.randn(8, width, generator=g, dtype=torch.float64), torch.randn(8, width, generator=g)


def _pytree_boundaries():
    chain, params, x, y = _masked()
    y = y.double()
    out = {
        "(h, mask) gpipe m=2": _compare(chain, params, x, y, schedule="gpipe", microbatches=2, ranges=[(0, 1), (1, 4)]),
        "dict 1f1b m=2": _compare(chain, params, x, y, schedule="1f1b", microbatches=2, ranges=[(0, 2), (2, 4)]),
        "interleaved 1f1b m=2, a cut of each kind on each rank": _compare(
            chain,
            params,
            x,
            y,
            schedule="interleaved_1f1b",
            microbatches=2,
            ranges=[(0, 1), (1, 2), (2, 3), (3, 4)],
        ),
        "dict zero bubble m=2, int8 wire": _compare(
            chain, params, x, y, schedule="zero_bubble", microbatches=2, ranges=[(0, 2), (2, 4)], codec=D.codecs.int8()
        ),
    }
    return {name: {k: r[k] for k in ("grad_err", "loss_err", "trace_err", "trace_same")} for name, r in out.items()}


def test_boundaries_that_are_pytrees_cross_ranks_as_in_one_process():
    """A tuple with a boolean mask, a dict with integer and unused leaves: every rank's gradients, loss
    and trace are the single-process sweep's (int8 costates: with ``codec.as_pass()`` there)."""
    for out in D.run(_pytree_boundaries, 2, timeout=120):
        for name, r in out.items():
            assert r["grad_err"] == r["loss_err"] == r["trace_err"] == 0.0 and r["trace_same"], (name, r)


def _gpt2_pipeline():
    """A captured Hugging Face GPT-2 (its cuts carry dicts: the residual stream and the causal mask; the
    tied embedding and head on the two ranks) on two ranks against the single-process sweep."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=4, vocab_size=64, n_positions=32, attn_implementation="eager"
    )
    model = transformers.GPT2LMHeadModel(config).double().eval()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))

    def next_token_loss(out, ids):
        return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    chain, params = ef.from_module(model, loss=next_token_loss, split_at=["transformer.h.*"], example=ids[:2])
    r = _compare(chain, params, ids, ids, schedule="1f1b", microbatches=2, ranges=[(0, 2), (2, 5)])
    return {k: r[k] for k in ("grad_err", "loss_err", "trace_err", "trace_same")}


def test_a_captured_gpt2_pipelines_over_two_ranks_as_in_one_process():
    pytest.importorskip("transformers")
    for r in D.run(_gpt2_pipeline, 2, timeout=120):
        assert r["grad_err"] == r["loss_err"] == r["trace_err"] == 0.0 and r["trace_same"], r


def _hooked_pipeline():
    """Tensor hooks on the tied embedding (its two uses on two ranks) and on a block's weight."""
    chain, params = _lm()
    for p in (chain.stages[0].module.weight, next(chain.stages[2].module.parameters())):
        p.register_hook(lambda g: g * (torch.arange(g.numel()).reshape(g.shape) % 2))
    x, y = _batch(4)
    r = _compare(chain, params, x, y, schedule="1f1b", microbatches=2)
    masked = ef.grad(chain, params, x, y)[0]["weight"].flatten()[::2]
    return {"grad_err": r["grad_err"], "hooked": bool((masked == 0).all())}


def test_parameter_hooks_act_on_a_pipeline_as_in_one_process():
    for r in D.run(_hooked_pipeline, 2, timeout=120):
        assert r == {"grad_err": 0.0, "hooked": True}, r


# ----------------------------------------------------------------------------- faults

TIMEOUT = 4.0


def _sweep_with_fault(kind, dying_rank):
    """Warm up, then a sweep in which ``dying_rank`` dies (os._exit), sends a costate of the wrong
    shape, or encodes its costates with another codec than its neighbour expects.
    Survivors return (error type, message, seconds from the start of the sweep to the error)."""
    chain, params = _lm()
    x, y = _batch(8)
    # Warm up under a generous timeout, then scale the timeout to the measured step: on 2 cores shared
    # with other work, a step of 4 ranks can take longer than TIMEOUT.
    warm_up = time.monotonic()
    D.Pipeline(chain, params=params, schedule="1f1b", timeout=120).sweep(params, x, y, microbatches=4)
    timeout = max(TIMEOUT, 3 * (time.monotonic() - warm_up))
    pipe = D.Pipeline(chain, params=params, schedule="1f1b", timeout=timeout)
    rank = dist.get_rank()
    fault = None
    if kind == "die":
        fault = P.tap(lambda adj: os._exit(3) if rank == dying_rank else None)  # in its first backward
    elif kind == "shape":
        # one pass on every rank (ranks agree on passes by value): it cuts the costate on the dying rank only
        fault = P.only(
            lambda adj: adj.replace(value=adj.value[:, :-1]) if rank == dying_rank else adj,
            indices=pipe.ranges[dying_rank][0],
        )
    start = time.monotonic()
    try:
        if kind == "codec":
            codec = D.codecs.int8() if rank == dying_rank else None
            pipe = D.Pipeline(chain, params=params, schedule="1f1b", timeout=timeout, costate_codec=codec)
        elif kind == "ranges":
            pipe = D.Pipeline(chain, [(0, 2), (2, 5)] if rank == dying_rank else [(0, 3), (3, 5)], timeout=timeout)
        pipe.sweep(params, x, y, microbatches=4, passes=fault)
    except Exception as e:  # noqa: BLE001 - the test inspects whatever each rank raised
        seconds = time.monotonic() - start
        try:  # a pipeline whose step failed is not reused
            pipe.sweep(params, x, y, microbatches=4)
            again = None
        except Exception as later:  # noqa: BLE001
            again = str(later)
        return type(e).__name__, " ".join([str(e), *getattr(e, "__notes__", ())]), seconds, again, timeout
    return None, None, time.monotonic() - start, None, timeout


def _survivors_fail_within_the_bound(outcomes, dying_rank):
    """Each survivor raised within 3 of its timeouts (a receive times out, then its peers' do)."""
    for o in outcomes:
        if o.rank == dying_rank and o.value is None:
            continue
        assert o.error is None, o.error
        kind, message, seconds, again, timeout = o.value
        assert kind is not None, f"rank {o.rank} finished the sweep although rank {dying_rank} failed"
        assert seconds < 3 * timeout, (o.rank, seconds, timeout, message)
        assert f"rank {o.rank}" in message and "stage" in message, message


def test_a_dead_rank_makes_every_other_rank_raise_within_the_timeout():
    outcomes = D.spawn(_sweep_with_fault, 4, "die", 2, timeout=120)  # a rank still alive by then is killed
    assert outcomes[2].exitcode == 3 and outcomes[2].value is None
    _survivors_fail_within_the_bound(outcomes, 2)
    messages = {o.rank: o.value[1] for o in outcomes if o.value}
    assert "neighbour died" in messages[1] and "rank 2: stage" in messages[1]  # the neighbours name the dead rank
    assert "PeerError" == outcomes[3].value[0] and "rank 2" in messages[3]


def test_a_costate_of_the_wrong_shape_fails_both_neighbours():
    outcomes = D.spawn(_sweep_with_fault, 2, "shape", 1, timeout=60)
    kinds = {o.rank: o.value[0] for o in outcomes}
    messages = {o.rank: o.value[1] for o in outcomes}
    assert kinds[1] == "ValueError" and "costate entering stage 2 ('Block_2') at boundary 3" in messages[1]
    assert "costate shape (2, 9, 16) differs" in messages[1] and "on rank 1, stages 3-4" in messages[1]
    assert kinds[0] == "PeerError" and "rank 1: stages 3-4" in messages[0]
    _survivors_fail_within_the_bound(outcomes, None)
    for o in outcomes:  # and neither rank runs another step on the broken pipeline
        assert "an earlier step of this pipeline failed" in o.value[3], o.value[3]


@pytest.mark.parametrize(
    "kind, rank_0_says, rank_1_says",
    [
        ("codec", "costate_codec: raw here, int8 on rank 1", "costate_codec: int8 here, raw on rank 0"),
        (
            "ranges",
            "ranges: [[0, 3], [3, 5]] here, [[0, 2], [2, 5]] on rank 1",
            "ranges: [[0, 2], [2, 5]] here, [[0, 3], [3, 5]] on rank 0",
        ),
    ],
)
def test_ranks_disagreeing_on_the_plan_fail_before_the_first_step(kind, rank_0_says, rank_1_says):
    outcomes = D.spawn(_sweep_with_fault, 2, kind, 1, timeout=60)
    messages = {o.rank: o.value[1] for o in outcomes}
    assert {o.value[0] for o in outcomes} == {"PeerError"}
    assert rank_0_says in messages[0] and rank_1_says in messages[1]
    _survivors_fail_within_the_bound(outcomes, None)


# ----------------------------------------------------------------------------- bubbles

UNIT = 0.02  # seconds a stage sleeps per forward and per gradient it computes: robust on a busy CPU


class _Sleepy(torch.autograd.Function):
    """``h * w``, sleeping ``UNIT`` in the forward and ``UNIT`` per input gradient in the backward."""

    @staticmethod
    def forward(ctx, h, w):
        time.sleep(UNIT)
        ctx.save_for_backward(h, w)
        return h * w

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        time.sleep(UNIT * sum(ctx.needs_input_grad))
        return g * w if ctx.needs_input_grad[0] else None, (g * h).sum() if ctx.needs_input_grad[1] else None


def _bubbles():
    chain = ef.Chain(
        [ef.stage(lambda p, h: _Sleepy.apply(h, p["w"]), name=f"s{i}") for i in range(4)],
        loss=lambda out, y: (out - y).square().mean(),
    )
    params = tuple({"w": torch.tensor(1.0 + i / 10)} for i in range(4))
    x, y = torch.randn(8, 3), torch.randn(8, 3)
    out = {}
    for schedule in ("1f1b", "zero_bubble"):
        pipe = D.Pipeline(chain, [(i, i + 1) for i in range(4)], schedule=schedule, timeout=60)
        pipe.sweep(params, x, y, microbatches=8)  # the first step infers the shapes
        out[schedule] = pipe.sweep(params, x, y, microbatches=8).stats["schedule"]["bubble"]
    return out


def test_zero_bubble_leaves_less_idle_time_than_1f1b_at_4_ranks():
    """Pipelining's zero-bubble schedule fills 1F1B's bubbles with the deferred weight halves.
    Stages that sleep make the measurement independent of the CPU's load."""
    bubbles = D.run(_bubbles, 4, timeout=120)
    zb, f1b = (sum(b[s] for b in bubbles) / 4 for s in ("zero_bubble", "1f1b"))
    assert zb < f1b, bubbles
