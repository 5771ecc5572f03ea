"""Bad input gets a clear error that names the stage; nothing is half-updated."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import eae_func as ef
from eae_func.passes import Pass


def small():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    chain, params = ef.from_module(model, loss=F.mse_loss)
    return model, chain, params, torch.randn(5, 3), torch.randn(5, 2)


def test_empty_chain():
    with pytest.raises(ValueError, match="empty chain"):
        ef.Chain([], loss=lambda h: h.sum())
    with pytest.raises(ValueError, match="empty chain"):
        ef.from_module(nn.Sequential(), loss=lambda h: h.sum())


def test_params_that_do_not_match_the_chain():
    _, chain, params, x, y = small()
    with pytest.raises(ValueError, match=r"one entry per stage \(3\), got 2"):
        ef.sweep(chain, params[:2], x, y)
    bad = (params[0], params[1], {"weight": params[2]["weight"]})
    with pytest.raises(ValueError, match=r"stage 2 \('Linear_2'\).*missing \['bias'\]"):
        ef.sweep(chain, bad, x, y)
    bad = ({**params[0], "extra": torch.zeros(1)}, params[1], params[2])
    with pytest.raises(ValueError, match=r"stage 0 \('Linear_0'\).*unexpected \['extra'\]"):
        ef.sweep(chain, bad, x, y)


def test_loss_that_is_not_a_scalar():
    model = nn.Sequential(nn.Linear(3, 2))
    chain, params = ef.from_module(model, loss=lambda out: out.sum(0))
    with pytest.raises(ValueError, match=r"loss: expected a scalar floating-point tensor, got shape \(2,\)"):
        ef.sweep(chain, params, torch.randn(4, 3))


def test_costate_whose_shape_differs_from_the_stage_output():
    _, chain, params, x, y = small()
    squash = lambda a: a.replace(value=a.value[:, :1]) if a.index == 2 else a  # noqa: E731
    with pytest.raises(
        ValueError,
        match=r"stage 1 \('Tanh_1'\) at boundary 2: costate shape \(5, 1\) differs "
        r"from the stage output shape \(5, 4\)",
    ):
        ef.sweep(chain, params, x, y, passes=squash)


def test_pass_that_returns_something_else():
    _, chain, params, x, y = small()
    with pytest.raises(
        TypeError,
        match=r"at boundary 3 \(output of stage 'Linear_2'\) returned a Tensor, "
        r"expected an AdjointState",
    ):
        ef.sweep(chain, params, x, y, passes=lambda a: a.value)


def test_non_tensor_boundary_leaf():
    chain = ef.Chain(
        [ef.stage(lambda p, h: h * 2, name="double"), ef.stage(lambda p, h: h.tolist(), name="lister")],
        loss=lambda out: torch.tensor(0.0),
    )
    with pytest.raises(TypeError, match=r"output of stage 1 \('lister'\).*leaf of type float"):
        ef.sweep(chain, ({}, {}), torch.randn(2))


def test_duplicate_stage_names_and_bad_options():
    with pytest.raises(ValueError, match="unique"):
        ef.Chain([ef.stage(lambda p, h: h, name="a"), ef.stage(lambda p, h: h, name="a")], loss=torch.sum)
    _, chain, params, x, y = small()
    with pytest.raises(ValueError, match="microbatches must be a positive int"):
        ef.sweep(chain, params, x, y, microbatches=0)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        ef.sweep(chain, params, x, y, reduction="max")


def test_a_failing_sweep_leaves_pass_state_and_inputs_alone():
    _, chain, params, x, y = small()
    counter = Pass(init=lambda: torch.zeros(()), update=lambda a, s, ctx: (a, s + 1))
    state = torch.zeros(())
    res = ef.sweep(chain, params, x, y, passes=counter, pass_state=state)
    assert res.pass_state == 4 and state == 0
    at_input = Pass(
        init=counter.init, update=lambda a, s, ctx: (a if a.index > 0 else a.replace(value=a.value[:1]), s + 1)
    )
    with pytest.raises(ValueError, match=r"costate at boundary 0 \(the chain's input\): costate shape \(1, 3\)"):
        ef.sweep(chain, params, x, y, passes=at_input, pass_state=state)  # boundary 0 is checked like every other
    broken = Pass(
        init=counter.init, update=lambda a, s, ctx: (a.replace(value=a.value[:1]) if a.index == 1 else a, s + 1)
    )
    with pytest.raises(ValueError, match="costate shape"):
        ef.sweep(chain, params, x, y, passes=broken, pass_state=state)
    assert state == 0


@pytest.mark.parametrize(
    "option",
    [
        {"boundary_dtype": torch.int8},
        {"boundary_dtype": int},
        {"boundary_dtype": "bfloat16"},
        {"autocast": torch.int32},
    ],
)
def test_non_floating_dtypes_are_refused_before_anything_runs(option):
    _, chain, params, x, y = small()
    name = next(iter(option))
    with pytest.raises(TypeError, match=f"{name} must be a floating torch.dtype"):
        ef.sweep(chain, params, x, y, **option)


def test_microbatches_must_fit_the_batch():
    _, chain, params, x, y = small()
    with pytest.raises(ValueError, match=r"microbatches=6 is more than the 5 rows of the batch"):
        ef.sweep(chain, params, x, y, microbatches=6)
    scalar_chain = ef.Chain([ef.stage(lambda p, h: h * p["w"], name="scale")], loss=lambda out: out)
    with pytest.raises(ValueError, match="no tensor with a batch dim"):
        ef.sweep(scalar_chain, ({"w": torch.ones(())},), torch.tensor(2.0), microbatches=2)


def test_a_pass_returning_something_else_than_a_pair_is_named():
    _, chain, params, x, y = small()
    bad = Pass(init=lambda: None, update=lambda a, s, ctx: a, name="forgot_the_state")
    with pytest.raises(TypeError, match=r"pass 'forgot_the_state' at boundary 3 \(.*\): update must return"):
        ef.sweep(chain, params, x, y, passes=bad)


def test_an_error_inside_a_stage_names_the_stage():
    chain = ef.Chain([ef.stage(lambda p, h: h @ p["w"], name="proj")], loss=torch.sum)
    with pytest.raises(RuntimeError) as info:
        ef.sweep(chain, ({"w": torch.ones(3, 2)},), torch.ones(4, 5))
    assert "in the forward of stage 0 ('proj')" in "".join(info.value.__notes__)


def test_a_pass_that_drops_the_costate_is_refused_naming_the_boundary():
    """A pass returning ``value=None`` where the costate was a tensor would zero every gradient
    upstream of that boundary: refused, naming the pass and the boundary."""
    _, chain, params, x, y = small()
    for at in (2, 0):
        drop = Pass(
            init=lambda: None,
            update=lambda a, s, ctx, at=at: (a.replace(value=None) if a.index == at else a, s),
            name="drop",
        )
        with pytest.raises(ValueError, match=rf"pass 'drop' at boundary {at} \(.*\): returned value=None"):
            ef.sweep(chain, params, x, y, passes=drop)


def test_a_misspelt_buffer_name_is_refused_naming_the_known_ones():
    """``buffers=`` whose dict names a buffer the stage's module does not have (``runing_mean``) is
    refused, not ignored in favour of the module's own statistics."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).eval()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    buffers = list(chain.buffers())
    stats = dict(buffers[1])
    stats["runing_mean"] = stats.pop("running_mean") + 1.0
    buffers[1] = stats
    with pytest.raises(
        ValueError,
        match=r"buffers: stage 1 \('BatchNorm1d_1'\) has no buffer \['runing_mean'\]; its buffers are "
        r"\['running_mean', 'running_var', 'num_batches_tracked'\]",
    ):
        ef.sweep(chain, params, torch.randn(5, 3), torch.randn(5, 2), buffers=tuple(buffers))


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_a_loss_arg_without_the_batch_rows_is_named_with_microbatches():
    """A ``(1, d)`` target meant to broadcast cannot be cut into microbatches with the batch: the
    error names microbatches and the argument, and says what to do."""
    _, chain, params, x, y = small()
    with pytest.raises(
        ValueError, match=r"sweep: microbatches=2 cuts loss_args\[0\] on dim 0, .*shape \(1, 2\).*5 rows.*expand"
    ):
        ef.sweep(chain, params, x, y[:1], microbatches=2)
    broadcast = ef.sweep(chain, params, x, y[:1])  # one piece: broadcast as the loss does
    expanded = ef.sweep(chain, params, x, y[:1].expand(5, 2), microbatches=2)
    torch.testing.assert_close(expanded.loss, broadcast.loss)
