"""Optimizer updates fused into the reverse fold: the same parameters as sweeping, then stepping."""

import copy
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import eae_func as ef
from eae_func.core import fold
from eae_func.core.update import Updater
from eae_func.models import lm_loss, transformer_lm

STEPS = 3


def lm(dropout: float = 0.1):
    torch.manual_seed(0)
    model = transformer_lm(vocab=32, dim=16, depth=2, n_heads=4, n_kv_heads=2, ffn_hidden=24, dropout=dropout)
    g = torch.Generator().manual_seed(1)
    data = [(t[:, :-1], t[:, 1:]) for t in torch.randint(0, 32, (STEPS, 4, 9), generator=g)]
    return model, data


def optimizers():
    return {
        "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    }


def train(model, data, make_optimizer, fused: bool, microbatches: int = 1, **fused_options):
    opt = make_optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    chain, params = ef.from_module(model, loss=lm_loss)
    for step, (x, y) in enumerate(data):
        torch.manual_seed(100 + step)  # dropout: the same masks in both runs
        if fused:
            res = ef.sweep(
                chain,
                params,
                x,
                y,
                key=step,
                microbatches=microbatches,
                update=ef.fused(opt, **fused_options) if fused_options else opt,
            )
            assert res.grads is None
        else:
            opt.zero_grad(set_to_none=True)
            res = ef.sweep(chain, params, x, y, key=step, microbatches=microbatches)
            ef.write_grads(model, res.grads)
            opt.step()
        scheduler.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(optimizers()))
@pytest.mark.parametrize("microbatches", [1, 2, 3])
def test_fused_steps_give_bit_identical_parameters(name, microbatches):
    """Dropout, a tied embedding/head (updated once, with both uses' gradients), an LR scheduler,
    and with microbatches the update in the last microbatch's fold, on every piece's gradients
    (three pieces: the middle one's too)."""
    model, data = lm()
    fused = train(copy.deepcopy(model), data, optimizers()[name], fused=True, microbatches=microbatches)
    plain = train(copy.deepcopy(model), data, optimizers()[name], fused=False, microbatches=microbatches)
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert not all(torch.equal(a, b.detach()) for a, b in zip(fused, model.parameters()))  # it trained


def test_one_optimizer_per_stage_equals_one_for_all():
    model, data = lm()
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    chain_a, params_a = ef.from_module(a, loss=lm_loss)
    chain_b, params_b = ef.from_module(b, loss=lm_loss)
    one = torch.optim.AdamW(a.parameters(), lr=1e-2)
    # the tied weight belongs to its first stage's optimizer (the embedding), where it is due
    per_stage = [
        torch.optim.AdamW(
            [p for p in child.parameters() if k == 0 or p is not b[0].weight] or [torch.zeros(0, requires_grad=True)],
            lr=1e-2,
        )
        for k, child in enumerate(b)
    ]
    for step, (x, y) in enumerate(data):
        torch.manual_seed(step)
        ef.sweep(chain_a, params_a, x, y, update=one)
        torch.manual_seed(step)
        ef.sweep(chain_b, params_b, x, y, update=per_stage)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_the_pure_form_threads_its_state_and_equals_the_unfused_update():
    """``fn(params_l, grads_l, state_l) -> (params_l, state_l)``: SGD with momentum written by hand,
    against the same update applied after an unfused sweep, each tensor once."""
    model, data = lm(dropout=0.0)
    chain, params = ef.from_module(model, loss=lm_loss)

    def sgd(p, g, state):
        velocity = {n: 0.9 * state.get(n, torch.zeros_like(t)) + g[n] for n, t in p.items()}
        return {n: t - 0.1 * velocity[n] for n, t in p.items()}, {**state, **velocity}

    fused_params, state = params, tuple({} for _ in params)
    plain_params, velocity = params, {}
    for x, y in data:
        res = ef.sweep(chain, fused_params, x, y, update=ef.fused(sgd, state))
        fused_params, state = res.params, res.update_state
        grads = ef.grad(chain, plain_params, x, y)  # a tied weight: the summed gradient in both places
        new: dict = {}  # id(old tensor) -> new tensor, so a tied weight is updated once and stays one tensor
        for i, stage in enumerate(plain_params):
            for n, t in stage.items():
                if id(t) not in new:
                    key = next((j, m) for j, st in enumerate(plain_params) for m, u in st.items() if u is t)
                    velocity[key] = 0.9 * velocity.get(key, torch.zeros_like(t)) + grads[i][n]
                    new[id(t)] = t - 0.1 * velocity[key]
        plain_params = tuple({n: new[id(t)] for n, t in stage.items()} for stage in plain_params)
    for a, b in zip(fused_params, plain_params):
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=1e-6, atol=1e-7)
    assert fused_params[0]["weight"] is fused_params[-1]["weight"]  # the tied weight stays one tensor
    assert set(state[0]) == {"weight"} and "weight" not in state[-1]


def test_per_stage_clipping_and_what_cannot_be_fused():
    model, data = lm(dropout=0.0)
    chain, params = ef.from_module(model, loss=lm_loss)
    x, y = data[0]
    with pytest.raises(ValueError, match="global norm needs every stage's gradient"):
        ef.fused(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0, per="global")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.zero_grad(set_to_none=True)
    next(model.parameters()).grad = torch.zeros_like(next(model.parameters()))
    with pytest.raises(ValueError, match=r"already have .grad set.*zero_grad\(set_to_none=True\)"):
        ef.sweep(chain, params, x, y, update=opt)
    model.zero_grad(set_to_none=True)
    untouched = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"parameter 'weight' of stage 0 .* not among the optimizer's"):
        ef.sweep(chain, params, x, y, update=torch.optim.SGD(model[1].parameters(), lr=0.1))
    assert all(torch.equal(a, b) for a, b in zip(untouched, model.parameters()))  # refused before any step
    # per-stage clipping: each stage's due gradients scaled to norm <= max_norm, as clip_grad_norm_ per
    # stage: a max_norm between the stages' norms clips some and leaves the others as they are (never
    # scaled up), one below them all clips every stage
    grads = ef.grad(chain, params, x, y)
    last = len(model) - 1  # the tied weight: both uses' sum, due at the embedding, not at the head
    dues = [{n: g for n, g in stage.items() if not (k == last and n == "weight")} for k, stage in enumerate(grads)]
    norms = [torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in d.values()])) for d in dues]
    middle = sorted(n.item() for n in norms)[len(norms) // 2]
    assert min(n.item() for n in norms) < middle < max(n.item() for n in norms)
    for max_norm in (1e-3, middle):
        before = {p: p.detach().clone() for p in model.parameters()}
        ef.sweep(chain, params, x, y, update=ef.fused(opt, max_norm=max_norm))
        for child, due, norm in zip(model, dues, norms):
            scale = min(1.0, max_norm / (norm.item() + 1e-6))
            for n, p in child.named_parameters():
                if n in due:
                    torch.testing.assert_close(p.detach(), before[p] - 0.1 * scale * due[n], rtol=1e-5, atol=1e-8)
        for p, old in before.items():  # back to the weights the gradients were taken at
            p.data.copy_(old)


def test_fused_gradients_never_exist_for_the_whole_network_at_once():
    """Live tensor bytes of a step (sweep + optimizer step): fused, at most one stage's gradients
    (and the SGD step's temporaries) exist at a time; unfused, all L stages' at the end."""
    from live_bytes import LiveBytes

    torch.manual_seed(0)
    L, width, batch = 8, 256, 4
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(L)]
    )
    chain, params = ef.from_module(model, loss=lambda out: out.square().mean())
    x = torch.randn(batch, width)
    stage_grads = (width * width + width) * 4
    peaks = {}
    for fused in (False, True):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with LiveBytes() as live:
            if fused:
                ef.sweep(chain, params, x, update=opt, keep_costates=False)
            else:
                ef.write_grads(model, ef.grad(chain, params, x))
                opt.step()
                opt.zero_grad(set_to_none=True)
        peaks[fused] = live.peak
    assert peaks[False] >= L * stage_grads  # every stage's gradients at once
    assert peaks[True] <= 3 * stage_grads  # one stage's (and copies made by the step)


def _sgd(p, g, state):
    return {n: t - 0.1 * g[n] for n, t in p.items()}, {**state, "steps": state.get("steps", 0) + 1}


def test_a_failing_pure_update_leaves_the_params_and_state_untouched():
    """The pure form commits nothing until the sweep returns: an update that raises at the third
    stage leaves the given params, their tensors and the state as they were."""
    model, data = lm(dropout=0.0)
    chain, params = ef.from_module(model, loss=lm_loss)
    x, y = data[0]
    before = [{n: t.clone() for n, t in stage.items()} for stage in params]
    state = [{} for _ in params]
    calls = []

    def failing(p, g, s):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("update failed")
        return _sgd(p, g, s)

    with pytest.raises(RuntimeError, match="update failed") as caught:
        ef.sweep(chain, params, x, y, update=ef.fused(failing, state))
    assert not any("already stepped" in n for n in getattr(caught.value, "__notes__", []))
    assert state == [{} for _ in params]
    assert all(torch.equal(t, before[i][n]) for i, stage in enumerate(params) for n, t in stage.items())


@pytest.mark.parametrize(
    "wrong, match",
    [
        (lambda p: {("wieght" if n == "weight" else n): t for n, t in p.items()}, r"returned params \[.*'wieght'"),
        (lambda p: {**p, "extra": next(iter(p.values()))}, r"returned params \[.*'extra'"),
        (lambda p: {n: t.reshape(-1) if t.dim() > 1 else t for n, t in p.items()}, r"returned '[\w.]+' as \(\d+,\)"),
        (
            lambda p: {n: t.double() for n, t in p.items()},
            r"returned '[\w.]+' as .* torch.float64 on cpu; the parameter is",
        ),
        (lambda p: {n: t.tolist() for n, t in p.items()}, r"returned '[\w.]+' as list"),
    ],
)
def test_a_pure_update_returning_other_params_is_refused(wrong, match):
    """A misspelt name used to add a stray entry and leave the real weight unchanged; a wrong shape
    or dtype was accepted."""
    model, data = lm(dropout=0.0)
    chain, params = ef.from_module(model, loss=lm_loss)

    def update(p, g, s):
        new, s = _sgd(p, g, s)
        return wrong(new), s

    with pytest.raises(ValueError, match=rf"fused: the update of stage \d+ .*{match}"):
        ef.sweep(chain, params, *data[0], update=ef.fused(update, [{} for _ in params]))


def _held_by(pending) -> tuple:
    """What a pending value's containers hold, by identity: equal later only if none was changed in place."""
    return (
        pending.params,
        [tuple((n, id(t)) for n, t in stage.items()) for stage in pending.params],
        [id(s) for s in pending.state],
        sorted((k, id(v)) for k, v in pending.tied.items()),
        [(i, id(g)) for i, g in pending.held],
        sorted((k, id(v)) for k, v in pending.kept.items()),
        pending.stepped,
    )


@settings(max_examples=10, deadline=None)
@given(depth=st.integers(2, 4), tied=st.booleans(), microbatches=st.integers(1, 3), seed=st.integers(0, 99))
def test_a_pure_update_is_a_value_the_fold_threads(depth, tied, microbatches, seed):
    """The fold carries what the updates made (``Pending``): each step's ``apply`` returns a new value
    and leaves the one it was given as it was, the result's params and state are those of the carry
    the fold returned, and they equal the update applied stage by stage to the unfused gradients."""
    torch.manual_seed(seed)
    layers = [m for _ in range(depth) for m in (torch.nn.Linear(4, 4), torch.nn.Tanh())]
    model = torch.nn.Sequential(*layers).double()
    if tied:
        model[-2].weight = model[0].weight
    chain, params = ef.from_module(model, loss=lambda out, y: (out - y).square().mean())
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    apply, reverse, calls, carries = Updater.apply, fold.reverse, [], []

    def applied(self, pending, i, grads):
        held = _held_by(pending)
        new = apply(self, pending, i, grads)
        calls.append((pending, held, new))
        return new

    def reversed_(step, start, tape):
        carry, outs = reverse(step, start, tape)
        carries.append(carry)
        return carry, outs

    with mock.patch.object(Updater, "apply", applied), mock.patch.object(fold, "reverse", reversed_):
        res = ef.sweep(chain, params, x, y, microbatches=microbatches, update=ef.fused(_sgd, [{} for _ in params]))
    assert len(calls) == len(chain)  # one apply per stage, in the last fold alone
    for before, held, after in calls:
        assert after is not before and _held_by(before) == held
    final = carries[-1].pending
    assert res.params is final.params and res.update_state is final.state
    grads = ef.grad(chain, params, x, y, microbatches=microbatches)
    for stage, new, g, state in zip(params, res.params, grads, res.update_state):
        assert new.keys() == stage.keys()
        assert all(torch.equal(new[n], t - 0.1 * g[n]) for n, t in stage.items())
        assert state == ({"steps": 1} if stage else {})  # a stage with params has some due
    if tied:
        assert res.params[0]["weight"] is res.params[-2]["weight"]


def test_a_row_budget_holds_the_updates_until_a_physical_first_stage_is_charged():
    """The physical stage first (index 0, with a parameter probed by fd): a fused step over its row
    budget updates no stage (every charge comes before the first update), and one within it updates
    every stage exactly as the unfused sweep's gradients would."""
    import torch.nn.functional as F

    from eae_func import estimators as E

    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    chain = ef.Chain(
        [
            ef.stage(lambda p, h: torch.sin(h * p["a"]), name="box", physical=True),
            ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name="in"),
            ef.stage(lambda p, h: h @ p["w"], name="out"),
        ],
        loss=F.mse_loss,
    )
    params = (
        {"a": torch.randn(5, generator=g, dtype=f64)},
        {"w": torch.randn(5, 6, generator=g, dtype=f64)},
        {"w": torch.randn(6, 3, generator=g, dtype=f64)},
    )
    x, y = torch.randn(8, 5, generator=g, dtype=f64), torch.randn(8, 3, generator=g, dtype=f64)
    estimator = E.zbp(E.Probes(4), method="fd")
    plain = ef.sweep(chain, params, x, y, estimator=estimator, key=2)
    needed = plain.stats["box"]["rows"]
    updated = []

    def sgd(p, grads, state):
        updated.append(state)
        return {n: t - 0.1 * grads[n] for n, t in p.items()}, state

    with pytest.raises(RuntimeError, match="over the budget"):
        ef.sweep(chain, params, x, y, estimator=estimator, key=2, budget=needed - 1, update=ef.fused(sgd, [0, 1, 2]))
    assert updated == []
    res = ef.sweep(chain, params, x, y, estimator=estimator, key=2, budget=needed, update=ef.fused(sgd, [0, 1, 2]))
    assert sorted(updated) == [0, 1, 2]
    for new, old, grads in zip(res.params, params, plain.grads):
        for n in old:
            torch.testing.assert_close(new[n], old[n] - 0.1 * grads[n], rtol=1e-12, atol=1e-14)


def test_a_failure_in_the_fold_names_the_stages_already_stepped():
    """A torch.optim update steps each stage in the reverse fold: a failure at a later boundary says which
    stages were already stepped (an update cannot be taken back)."""
    model, data = lm(dropout=0.0)
    chain, params = ef.from_module(model, loss=lm_loss)
    x, y = data[0]

    def fails_at_1(adj):
        if adj.index == 1:
            raise RuntimeError("boom")
        return adj

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="boom") as caught:
        ef.sweep(chain, params, x, y, update=opt, passes=fails_at_1)
    notes = [n for n in getattr(caught.value, "__notes__", []) if "already stepped" in n]
    assert len(notes) == 1 and chain.where(len(chain) - 1) in notes[0] and chain.where(0) not in notes[0]


def _small():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    ).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    return model, x, torch.nn.functional.mse_loss, torch.randn(6, 1, dtype=torch.float64)


def test_a_fused_step_is_autograds_step_with_hooks_a_frozen_weight_and_one_step_call():
    """One optimizer over the trainable parameters alone (a frozen weight is not in it, and stays), a
    parameter hook that halves its gradient (run on it before the step, as autograd runs it before
    ``optimizer.step()``), and the optimizer's own ``step()`` called once a sweep (its hooks and
    schedulers count one step): the parameters of autograd + ``optimizer.step()``, bit for bit."""
    model, x, loss, y = _small()
    model[2].weight.requires_grad_(False)
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m[4].weight.register_hook(lambda g: g / 2)
    opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        loss(reference(x), y).backward()
        opt.step()
    chain, params = ef.from_module(model, loss=loss)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    steps = []
    opt.register_step_post_hook(lambda *a: steps.append(1))
    for _ in range(2):
        ef.sweep(chain, params, x, y, update=opt)
    assert len(steps) == 2
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), n


def test_a_function_stage_given_a_detached_parameter_is_stepped_in_place():
    """A function stage's tensor found in the optimizer by its storage (the params hold ``w.detach()``,
    the optimizer ``w``): stepped as autograd + ``optimizer.step()`` steps ``w``."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    chain = ef.Chain([ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name="f")], loss=torch.nn.functional.mse_loss)
    want = w.detach().clone()
    want -= 0.1 * torch.autograd.grad(torch.nn.functional.mse_loss(torch.tanh(x @ w), y), w)[0]
    ef.sweep(chain, ({"w": w.detach()},), x, y, update=torch.optim.SGD([w], lr=0.1))
    assert torch.equal(w.detach(), want)
