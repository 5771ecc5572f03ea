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


def _feedback():
    return ef.compose(P.error_feedback(P.int8()), P.clip_by_global_norm(10.0))


class Spy:
    """Records each call an integration makes of ``name`` (``sweep``, or ``value_and_grad`` with
    ``has_state=True``) in ``module``: its params, arguments, torch RNG state and gradients, to replay
    them by hand as sweeps with the pass state threaded from ``None``."""

    def __init__(self, monkeypatch, module, name="sweep"):
        self.calls, real = [], getattr(module, name)

        def spy(model, params, *args, pass_state=None, **kw):
            kept = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in params.items()}
            rng = torch.get_rng_state()  # dropout
            out = real(model, params, *args, pass_state=pass_state, **kw)
            grads = out.grads if name == "sweep" else out[0][1]
            kw.pop("has_state", None)
            self.calls.append((model, kept, rng, args, kw, pass_state, grads))
            return out

        monkeypatch.setattr(module, name, spy)

    def replay(self):
        """The hand-threaded loop: every step's gradients equal the integration's, bit for bit, and
        each step was given the state the step before returned."""
        state = None
        for k, (model, kept, rng, args, kw, given, grads) in enumerate(list(self.calls)):
            assert (given is None) == (k == 0)
            before = {n: t.detach().clone() for n, t in model.named_parameters()}
            with torch.no_grad():
                for n, t in model.named_parameters():
                    t.copy_(kept[n])
            torch.set_rng_state(rng)
            res = ef.sweep(model, kept, *args, pass_state=state, **kw)
            with torch.no_grad():
                for n, t in model.named_parameters():
                    t.copy_(before[n])
            state = res.pass_state
            assert res.grads.keys() == grads.keys()
            same = [g is res.grads[n] is None or torch.equal(res.grads[n], g) for n, g in grads.items()]
            assert all(same), f"step {k}"
        return state


transformers = pytest.importorskip("transformers")


def test_eae_trainer_equals_a_hand_threaded_sweep_loop(tmp_path, monkeypatch):
    """On the sweep (``data_parallel=False``: an option the switch leaves to the loop), every step is an
    ``ef.sweep`` given the state the step before returned; on the switch (the default) the same
    training threads the same state and ends at the same weights."""
    from eae_func.integrations import transformers as integration

    from test_integrations import _train

    spy = Spy(monkeypatch, integration)

    class Swept(integration.EAETrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, eae={"passes": _feedback(), "data_parallel": False}, **k)

    class Switched(integration.EAETrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, eae={"passes": _feedback()}, **k)

    swept, _, trainer = _train(Swept, tmp_path / "swept")
    assert trainer._switch is None and len(spy.calls) == 3
    state = spy.replay()
    assert trainer.eae_state[0]["residuals"]
    assert all(torch.equal(a, b) for a, b in zip(optree_leaves(state), optree_leaves(trainer.eae_state)))
    switched, _, trainer = _train(Switched, tmp_path / "switched")
    assert trainer._switch is not None and len(spy.calls) == 3  # no sweep: loss.backward() ran the steps
    worst = max((a - b).abs().max().item() for a, b in zip(optree_leaves(state), optree_leaves(trainer.eae_state)))
    assert worst <= 1e-6, worst
    assert max((a - b).abs().max().item() for a, b in zip(swept.parameters(), switched.parameters())) <= 1e-6


def optree_leaves(tree):
    import optree

    return optree.tree_leaves(tree, none_is_leaf=False)


def test_eae_trainer_resumed_half_way_is_bit_identical(tmp_path, caplog):
    """Four steps of error feedback + int8, against two steps, a checkpoint and two resumed steps;
    a checkpoint without the pass state resumes differently, and says so."""
    from eae_func.integrations.transformers import EAETrainer

    from test_integrations import _train

    class Feedback(EAETrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, eae={"passes": _feedback()}, **k)

    saving = dict(max_steps=4, save_strategy="steps", save_steps=2)
    whole, _, trainer = _train(Feedback, tmp_path / "whole", **saving)
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    assert (checkpoint / "eae_state.pt").is_file()
    resumed, _, _ = _train(Feedback, tmp_path / "resumed", resume_from_checkpoint=str(checkpoint), **saving)
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))
    (checkpoint / "eae_state.pt").unlink()
    with caplog.at_level("WARNING"):
        restarted, _, _ = _train(Feedback, tmp_path / "restarted", resume_from_checkpoint=str(checkpoint), **saving)
    assert "holds no pass state; the passes start from init()" in caplog.text
    assert not all(torch.equal(a, b) for a, b in zip(whole.parameters(), restarted.parameters()))


def test_lightning_manual_step_equals_a_hand_threaded_sweep_loop(monkeypatch):
    pytest.importorskip("lightning.pytorch")
    from test_lightning import Resumable, _fit

    from eae_func.integrations import lightning as integration

    spy = Spy(monkeypatch, integration)
    module, _ = _fit("eae", module=Resumable("eae"))
    assert len(spy.calls) == 3
    state = spy.replay()
    assert all(torch.equal(a, b) for a, b in zip(optree_leaves(state), optree_leaves(module.eae_pass_state)))


def _seeing():
    """A pass whose ``init`` keeps the example it is given (and which changes nothing)."""
    seen = []

    def init(example):
        seen.append(example)
        return ()

    return P.Pass(init, lambda adj, state, ctx: (adj, state), "seeing"), seen


def _shapes(tree):
    from eae_func.tree import tree_map

    return tree_map(lambda t: (tuple(t.shape), t.dtype) if torch.is_tensor(t) else type(t), tree, none_is_leaf=True)


def _blocks():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
    return model, torch.randn(6, 4), torch.randn(6, 4)


def _on(driver, passes, pass_state, blocks=None):
    """One sweep of ``blocks`` (default: ``_blocks()``) on ``driver``: (its records, its pass state)."""
    model, x, y = blocks or _blocks()
    loss = lambda out, y: (out - y).square().mean()  # noqa: E731
    if driver == "switch":
        switch = ef.enable(model, split_at=["*"], passes=passes, keep_costates=True)
        switch.pass_state = pass_state
        loss(model(x), y).backward()
        return list(ef.records(model).values()), switch.pass_state
    if driver == "chain":
        chain, params = ef.from_module(model, loss=loss)
        res = ef.sweep(chain, params, x, y, passes=passes, pass_state=pass_state)
    else:
        capture = {"capture": "graph"} if driver == "graph" else {}
        params = dict(model.named_parameters())
        res = ef.sweep(model, params, x, y, loss=loss, split_at=["*"], passes=passes, pass_state=pass_state, **capture)
    return list(res.adjoints), res.pass_state


@pytest.mark.parametrize("driver", ["chain", "cuts", "graph", "switch"])
def test_the_passes_start_from_the_boundaries_they_will_be_applied_to(driver):
    """On every driver, a sweep given no state starts the passes once, before its first boundary, with
    one record per boundary it shows them (index, stage, costate shapes and dtypes as the records
    have them); error feedback's state then has one structure from the first sweep on."""
    seeing, seen = _seeing()
    passes = ef.compose(seeing, P.error_feedback(P.int8()))
    records, state = _on(driver, passes, None)
    (example,) = seen
    shown = {(a.index, a.stage, str(_shapes(a.value))) for a in example}
    assert {(a.index, a.stage, str(_shapes(a.value))) for a in records if a.value is not None} <= shown
    assert {a.index for a in example} <= {a.index for a in records}
    assert all(t.untyped_storage().nbytes() == t.element_size() for a in example for t in a.tensors())
    _, again = _on(driver, passes, state)
    assert len(seen) == 1 and _shapes(again) == _shapes(state)
    assert set(state[1]["residuals"]) == {a.index for a in example}


@pytest.mark.parametrize("driver", ["chain", "cuts", "switch"])
def test_a_pass_whose_init_fails_is_named_and_nothing_is_updated(driver):
    """An ``init(example)`` that raises stops the sweep before any gradient is written, naming the pass."""

    def init(example):
        raise ValueError("no state for you")

    broken = P.Pass(init, lambda adj, state, ctx: (adj, state), "broken")
    blocks = _blocks()
    model = blocks[0]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="no state for you") as caught:
        _on(driver, ef.compose(broken, P.error_feedback(P.int8())), None, blocks)
    assert any("init of pass 'broken'" in n for n in caught.value.__notes__)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
