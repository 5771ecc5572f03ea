"""The passes' state flows as a value: ``grad`` and ``value_and_grad`` return it with ``has_state=True``
and refuse passes whose state they would drop; EAETrainer and the Lightning helper thread it."""

import pytest
import torch
from torch import nn

import eae_func as ef
from eae_func import passes as P


def _chain():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    chain, params = ef.from_module(model, loss=lambda out, y: (out - y).square().mean())
    return chain, params, torch.randn(6, 4), torch.randn(6, 2)


@pytest.mark.parametrize("entry", ["grad", "value_and_grad"])
def test_a_stateful_pass_is_refused_where_its_state_would_be_dropped(entry):
    chain, params, x, y = _chain()
    passes = ef.compose(P.clip_by_global_norm(1.0), P.error_feedback(P.int8()))
    with pytest.raises(ValueError, match=rf"{entry}: the passes error_feedback\(int8.*has_state=True"):
        getattr(ef, entry)(chain, params, x, y, passes=passes)
    out = getattr(ef, entry)(chain, params, x, y, passes=ef.compose(P.int8(), P.clip_by_global_norm(1.0)))
    grads = out if entry == "grad" else out[1]  # unchanged for stateless passes: no state returned
    assert len(grads) == len(chain) and all(isinstance(g, dict) for g in grads)


@pytest.mark.parametrize("entry", ["grad", "value_and_grad"])
def test_threading_the_state_through_grad_equals_sweeps(entry):
    """Three steps of error feedback through grad(has_state=True) equal three sweeps threading
    res.pass_state, bit for bit, and the residuals are carried (not restarted from init)."""
    chain, params, x, y = _chain()
    passes = P.error_feedback(P.int8())
    state, swept = None, None
    for _ in range(3):
        out, state = getattr(ef, entry)(chain, params, x, y, passes=passes, pass_state=state, has_state=True)
        grads = out if entry == "grad" else out[1]
        res = ef.sweep(chain, params, x, y, passes=passes, pass_state=swept)
        swept = res.pass_state
        assert all(torch.equal(g[n], r[n]) for g, r in zip(grads, res.grads) for n in r)
    assert state["residuals"] and all(
        torch.equal(state["residuals"][k], swept["residuals"][k]) for k in swept["residuals"]
    )
    restarted = ef.grad(chain, params, x, y, passes=passes, has_state=True)[0]
    assert any(not torch.equal(a[n], b[n]) for a, b in zip(restarted, grads) for n in a)  # the state mattered


def test_has_state_is_a_bool():
    chain, params, x, y = _chain()
    with pytest.raises(TypeError, match="has_state must be True or False"):
        ef.grad(chain, params, x, y, has_state="yes")


transformers = pytest.importorskip("transformers")


def test_eae_trainer_threads_the_pass_state_from_step_to_step(tmp_path):
    from eae_func.integrations.transformers import EAETrainer

    from test_integrations import _train

    seen = []

    class Feedback(EAETrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, eae={"passes": ef.compose(P.error_feedback(P.int8()), P.tap(seen.append))}, **k)

        def training_step(self, *a, **k):
            before = self.eae_state
            out = super().training_step(*a, **k)
            seen.append(("step", before is None))
            return out

    _, _, trainer = _train(Feedback, tmp_path)
    starts = [fresh for item in seen if isinstance(item, tuple) for _, fresh in [item]]
    assert starts == [True, False, False]  # only the first step starts from init()
    assert trainer.eae_state[0]["residuals"]
