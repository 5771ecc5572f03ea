"""One engine, one set of options: every entry point takes the same options record, the pipeline
and the model-level estimators run the same per-range runner as ``ef.sweep``, and ties have one
home. The two wrong answers the copies had drifted into are pinned here."""

import dataclasses
import typing

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import eae_func as ef
import eae_func.distributed as D
from eae_func import estimators as E
from eae_func import passes as P
from eae_func import remat
from eae_func.core.options import NAMES, Options, SweepOptions
from eae_func.lazy import Lazy

F64 = torch.float64


# ----------------------------------------------------------------------------- options


def test_the_typed_keywords_are_the_records_fields():
    """``SweepOptions`` (what editors see) and ``Options`` (what runs) list the same names."""
    assert set(typing.get_type_hints(SweepOptions)) == set(NAMES) == {f.name for f in dataclasses.fields(Options)}


def _chain():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    chain, params = ef.from_module(model, loss=F.mse_loss)
    return model, chain, params, torch.randn(6, 4), torch.randn(6, 3)


EVERY_OPTION = dict(
    passes=P.scale(1.0),
    key=3,
    boundary_dtype=None,
    offload=False,
    autocast=None,
    microbatches=2,
    reduction="mean",
    estimator=None,
    physical=None,
    budget=None,
    recompute=remat.budget(1 << 10),
    keep_costates=True,
    timers=True,
    data_parallel=False,
    compile=None,
    capture="graph",
    early_stop=True,
    cuda_graphs=False,  # on a chain it is refused (tests/test_cuda_graphs.py)
)


def test_grad_value_and_grad_and_sweep_accept_every_option():
    model, chain, params, x, y = _chain()
    assert set(EVERY_OPTION) | {"update"} == set(NAMES)
    reference = ef.sweep(chain, params, x, y, **EVERY_OPTION).grads
    for call in (ef.grad, lambda *a, **k: ef.value_and_grad(*a, **k)[1]):
        got = call(chain, params, x, y, **EVERY_OPTION)
        assert all(torch.equal(got[i][n], reference[i][n]) for i in range(3) for n in reference[i])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model[0].weight.detach().clone()
    assert ef.grad(chain, params, x, y, update=opt, keep_costates=True, timers=True) is None  # consumed in the fold
    assert torch.allclose(model[0].weight, before - 0.1 * reference[0]["weight"], atol=1e-6)


@pytest.mark.parametrize("entry", ["sweep", "grad", "value_and_grad"])
def test_an_unknown_option_is_named_with_the_options_there_are(entry):
    _, chain, params, x, y = _chain()
    with pytest.raises(TypeError, match=rf"{entry}: unknown option 'recomptue'; the options are passes, key"):
        getattr(ef, entry)(chain, params, x, y, recomptue=False)


def test_options_are_checked_once_when_made():
    for bad, match in (
        (dict(key=1.5), "key must be an int"),
        (dict(microbatches=0), "microbatches"),
        (dict(reduction="max"), "reduction"),
        (dict(budget=0), "budget"),
        (dict(recompute=-1), "recompute"),
        (dict(boundary_dtype=torch.int8), "boundary_dtype"),
        (dict(estimator=object()), "estimator"),
        (dict(physical="box"), "physical"),
        (dict(update=3), "fused"),
    ):
        with pytest.raises((TypeError, ValueError), match=match):
            Options(**bad)
    opts = Options(recompute=True, update=None)
    assert opts.recompute == remat.always() and dataclasses.replace(opts, key=2).recompute == remat.always()


@settings(max_examples=15, deadline=None)
@given(kept=st.lists(st.booleans(), min_size=3, max_size=3), nbytes=st.integers(0, 1 << 12))
def test_remat_policies_give_the_shorthands_results(kept, nbytes):
    """Every remat policy gives the same gradients; a policy and its shorthand are one record."""
    _, chain, params, x, y = _chain()
    assert remat.policy(True) == remat.always() and remat.policy(False) == remat.never()
    assert remat.policy(nbytes) == remat.budget(nbytes)
    reference = ef.grad(chain, params, x, y)
    for policy in (remat.never(), remat.where(lambda i, name: not kept[i]), remat.budget(nbytes)):
        got = ef.grad(chain, params, x, y, recompute=policy)
        assert all(torch.equal(got[i][n], reference[i][n]) for i in range(3) for n in reference[i])


# ----------------------------------------------------------------------------- records


def test_records_with_different_measurements_tree_map_together_without_reading_them():
    """Measurements (meta) never make two records' structures differ, and comparing them reads
    no lazy device number."""
    reads = []
    a = ef.AdjointState(torch.ones(3), 2, "s", meta={"scale": Lazy(lambda: reads.append(1) or 1.0)})
    b = ef.AdjointState(torch.zeros(3), 2, "s", meta={"scale": Lazy(lambda: reads.append(2) or 2.0), "kept": 0.5})
    total = ef.tree_map(torch.add, a, b)
    assert torch.equal(total.value, torch.ones(3)) and total.index == 2 and reads == []
    assert ef.tree_structure(a) == ef.tree_structure(b) and reads == []
    assert ef.tree_structure(a) != ef.tree_structure(ef.AdjointState(torch.ones(3), 1, "s"))  # index is structure


# ----------------------------------------------------------------------------- the estimators' forward


def _dropout_before_a_physical_stage(train: bool):
    """Pure stages with dropout before a physical (simulated) stage of width 8."""
    g = torch.Generator().manual_seed(0)
    drop = torch.nn.Dropout(0.5).train(train)
    stages = [
        ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name="in"),
        ef.stage(lambda p, h: drop(h), name="dropout"),
        ef.stage(lambda p, h: torch.sin(h @ p["m"]), name="medium", physical=True),
        ef.stage(lambda p, h: h @ p["w"], name="out"),
    ]
    params = (
        {"w": torch.randn(5, 8, generator=g, dtype=F64)},
        {},
        {"m": torch.randn(8, 8, generator=g, dtype=F64)},
        {"w": torch.randn(8, 3, generator=g, dtype=F64)},
    )
    chain = ef.Chain(stages, loss=F.mse_loss)
    return chain, params, torch.randn(6, 5, generator=g, dtype=F64), torch.randn(6, 3, generator=g, dtype=F64)


@pytest.mark.parametrize("estimator", ["node_perturbation", "direct"])
@pytest.mark.parametrize("form", ["oracle", "jvp"])
@pytest.mark.parametrize("train", [True, False])
def test_an_exact_projection_through_dropout_equals_the_exact_estimator(estimator, form, train):
    """n = d = 8 orthogonal probes project exactly: the estimate is E.exact()'s, with the dropout
    masks the reverse sweep replays (the estimators' probes run the tape's forward)."""
    chain, params, x, y = _dropout_before_a_physical_stage(train)
    probe = getattr(E, estimator)(E.Probes(8, "orthogonal"), form=form)
    torch.manual_seed(5)
    exact = ef.sweep(chain, params, x, y, estimator=E.exact())
    torch.manual_seed(5)
    got = ef.sweep(chain, params, x, y, estimator=probe)
    assert torch.equal(got.loss, exact.loss)
    for i in (0, 2, 3):
        for n in exact.grads[i]:
            assert torch.allclose(got.grads[i][n], exact.grads[i][n], atol=1e-12, rtol=1e-10), (i, n)


def test_finite_differences_through_dropout_are_refused():
    """The fd form folds probe copies into the batch, whose dropout draws differ from the tape's."""
    chain, params, x, y = _dropout_before_a_physical_stage(True)
    chain = ef.Chain([chain.stages[0], chain.stages[2], chain.stages[1], chain.stages[3]], loss=chain.loss)
    params = (params[0], params[2], params[1], params[3])
    with pytest.raises(ValueError, match=r"form='fd'.*stage 2 \('dropout'\) draws random numbers"):
        ef.sweep(chain, params, x, y, estimator=E.direct(E.Probes(4), form="fd"))


# ----------------------------------------------------------------------------- ties in one place


def _shared_tensor_chain():
    """Four stages; stages 0 and 3 use one tensor object, not declared in ``chain.ties``."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 6, generator=g, dtype=F64)
    stages = [
        ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name="a"),
        ef.stage(lambda p, h: torch.tanh(h @ p["v"]), name="b"),
        ef.stage(lambda p, h: torch.sin(h), name="c"),
        ef.stage(lambda p, h: h @ p["w"].T, name="d"),
    ]
    params = ({"w": w}, {"v": torch.randn(6, 6, generator=g, dtype=F64)}, {}, {"w": w})
    chain = ef.Chain(stages, loss=F.mse_loss)
    return chain, params, torch.randn(6, 6, generator=g, dtype=F64), torch.randn(6, 6, generator=g, dtype=F64)


def shared_tensor_pipeline():
    """This rank's pipeline gradients and the single-process sweep's, for 1 or 2 ranks."""
    chain, params, x, y = _shared_tensor_chain()
    ranges = [(0, 4)] if dist.get_world_size() == 1 else [(0, 2), (2, 4)]
    pipe = D.Pipeline(chain, ranges, timeout=30)
    res = pipe.sweep(params, x, y, microbatches=2, key=1)
    ref = ef.sweep(chain, params, x, y, microbatches=2, key=1)
    return {i: {n: (res.grads[pipe.stages.index(i)][n], ref.grads[i][n]) for n in ref.grads[i]} for i in pipe.stages}


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_pipeline_sums_a_shared_tensor_as_the_sweep_does(ranks):
    chain, params, x, y = _shared_tensor_chain()
    ref = ef.sweep(chain, params, x, y)
    untied = ef.sweep(chain, tuple({n: t.clone() for n, t in p.items()} for p in params), x, y)
    assert torch.equal(ref.grads[0]["w"], ref.grads[3]["w"])
    assert torch.allclose(ref.grads[0]["w"], untied.grads[0]["w"] + untied.grads[3]["w"])
    for rank in D.run(shared_tensor_pipeline, ranks, timeout=90):
        for i, grads in rank.items():
            for n, (got, expected) in grads.items():
                assert torch.equal(got, expected), (ranks, i, n, (got - expected).abs().max())


def test_tie_sums_of_two_stage_ranges_combined_are_the_whole_chains():
    """``tie_grads`` over part of the stages (a pipeline rank's), with ``combine`` adding both parts'
    sums, gives every use the total it gets over the whole chain, bit for bit."""
    from eae_func.core.microbatch import add
    from eae_func.core.ties import tie_grads, tie_groups

    chain, params, x, y = _shared_tensor_chain()
    untied = ef.sweep(chain, tuple({n: t.clone() for n, t in p.items()} for p in params), x, y).grads
    groups = tie_groups(chain, params)
    whole = tie_grads(params, untied, groups)
    halves, sums = [(0, 1), (2, 3)], []
    for half in halves:
        tie_grads(params, tuple(untied[i] for i in half), groups, half, lambda part: sums.append(part) or part)
    both = lambda part: {n: add(sums[0].get(n), sums[1].get(n)) for n in part}
    for half in halves:
        got = tie_grads(params, tuple(untied[i] for i in half), groups, half, both)
        for k, i in enumerate(half):
            assert all(torch.equal(got[k][n], whole[i][n]) for n in whole[i]), i
    assert torch.equal(whole[0]["w"], untied[0]["w"] + untied[3]["w"])


def fused_on_a_pipeline():
    chain, params, x, y = _shared_tensor_chain()
    pipe = D.Pipeline(chain, [(0, 4)], timeout=30)
    try:
        pipe.sweep(params, x, y, update=ef.fused(lambda p, g, s: (p, s), [None] * 4))
    except ValueError as e:
        return str(e)
    return "accepted"


def test_the_pipeline_names_the_options_that_cannot_cross_ranks():
    """``Pipeline.sweep`` takes ``sweep``'s options; ``update`` says why it cannot run there."""
    (message,) = D.run(fused_on_a_pipeline, 1, timeout=60)
    assert message.startswith("Pipeline.sweep: update= cannot cross ranks")


def disagreeing_step(option):
    """Rank 1 is given another ``option`` for the step than rank 0: both raise, naming it."""
    chain, params, x, y = _shared_tensor_chain()
    pipe = D.Pipeline(chain, [(0, 2), (2, 4)], timeout=30)
    mine = {
        "key": dict(key=dist.get_rank()),
        "passes": dict(passes=P.scale(2.0) if dist.get_rank() else None),
        "boundary_dtype": dict(boundary_dtype=torch.float32 if dist.get_rank() else None),
        "microbatches": dict(microbatches=1 + dist.get_rank()),
    }[option]
    try:
        pipe.sweep(params, x, y, **mine)
    except D.PeerError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("option", ["key", "passes", "boundary_dtype", "microbatches"])
def test_pipeline_ranks_given_different_step_options_both_refuse_the_step(option):
    for rank, message in enumerate(D.run(disagreeing_step, 2, option, timeout=90)):
        assert "were given different options for this step" in message and f"{option}: " in message, (rank, message)


def test_a_pipeline_timeout_must_be_a_positive_number():
    chain, params, x, y = _shared_tensor_chain()
    (messages,) = D.run(_bad_timeouts, 1, timeout=60)
    assert messages == ["Pipeline: timeout must be a finite number of seconds > 0, got 0"] + [
        f"Pipeline: timeout must be a finite number of seconds > 0, got {t}" for t in (-5, "inf")
    ]


def _bad_timeouts():
    chain, _, _, _ = _shared_tensor_chain()
    out = []
    for t in (0, -5, float("inf")):
        try:
            D.Pipeline(chain, [(0, 4)], timeout=t)
        except ValueError as e:
            out.append(str(e))
    return out


def targetless_pipeline():
    """A loss without targets on 2 ranks and 3 microbatches: the last rank weighs by x's rows."""
    chain, params, x, _ = _shared_tensor_chain()
    chain = ef.Chain(chain.stages, loss=lambda out: out.square().mean())
    pipe = D.Pipeline(chain, [(0, 2), (2, 4)], timeout=30)
    refused = ""
    if dist.get_rank() == 1:  # refused before anything is sent: rank 0 does not take part
        try:
            pipe.sweep(params, None, microbatches=3)
        except ValueError as e:
            refused = str(e)
    res = pipe.sweep(params, x, microbatches=3)
    ref = ef.sweep(chain, params, x, microbatches=3)
    return (
        refused,
        torch.equal(res.loss, ref.loss),
        all(
            torch.equal(res.grads[pipe.stages.index(i)][n], ref.grads[i][n]) for i in pipe.stages for n in ref.grads[i]
        ),
    )


def test_a_loss_without_targets_is_weighed_by_the_rows_of_x_on_the_last_rank():
    results = D.run(targetless_pipeline, 2, timeout=90)
    assert "give it x too" in results[1][0]
    assert all(same_loss and same_grads for _, same_loss, same_grads in results)
