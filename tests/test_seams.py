"""Trust at the seams: where real training code meets eae_func, plain PyTorch's answer or a clear
error. Frozen and unused parameters, optimizer hooks, black boxes that write into their input,
fused steps that fail half-way."""

import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import eae_func as ef
from eae_func import estimators as E

F64 = torch.float64


def _mlp(seed=0):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)]
    return torch.nn.Sequential(*layers).double()


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 5, generator=g, dtype=F64), torch.randn(8, 3, generator=g, dtype=F64)


def _autograd(model, x, y):
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@settings(max_examples=20, deadline=None)
@given(frozen=st.lists(st.booleans(), min_size=6, max_size=6), flat=st.booleans())
def test_frozen_parameters_get_none_and_the_trainable_ones_autograds_gradients(frozen, flat):
    """``requires_grad=False`` (set before or after ``from_module``): ``None``, as autograd's ``.grad``."""
    model = _mlp()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    for p, off in zip(model.parameters(), frozen):
        p.requires_grad_(not off)
    x, y = _batch()
    reference = _autograd(model, x, y)
    if flat:
        grads = ef.grad(model, dict(model.named_parameters()), x, y, loss=F.mse_loss)
    else:
        per_stage = ef.grad(chain, params, x, y)
        grads = {f"{i}.{n}": g for i, stage in enumerate(per_stage) for n, g in stage.items()}
    assert set(grads) == set(reference)
    for name, expected in reference.items():
        if expected is None:
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name], expected, rtol=1e-12, atol=1e-14)
    ef.write_grads(model, grads)
    assert all((p.grad is None) == (not p.requires_grad) for p in model.parameters())


def test_a_parameter_the_forward_never_reads_gets_none_and_weight_decay_leaves_it():
    """AdamW over every parameter: an unused one has no gradient, so no step moves it (plain
    autograd's answer), unfused or fused."""

    class WithSpare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.spare = torch.nn.Linear(5, 3).double(), torch.nn.Parameter(torch.ones(4, dtype=F64))

        def forward(self, h):
            return self.lin(h)

    x, y = _batch()
    for fused in (False, True):
        model = torch.nn.Sequential(WithSpare())
        chain, params = ef.from_module(model, loss=F.mse_loss)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        for _ in range(3):
            if fused:
                ef.sweep(chain, params, x, y, update=opt)
            else:
                grads = ef.grad(chain, params, x, y)
                assert grads[0]["spare"] is None
                ef.write_grads(model, grads)
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert torch.equal(model[0].spare, torch.ones(4, dtype=F64)), fused


def test_a_captured_models_flat_dict_comes_back_with_every_name():
    """``ef.grad(model, dict(model.named_parameters()), ..., split_at=)`` returns every name given:
    one the captured forward never reads (a spare; an input embedding fed ``inputs_embeds``) has
    ``None``, as plain autograd leaves its ``.grad``, and the returned params keep it as it was."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(5, 6).double(), torch.nn.Linear(6, 3).double()
            self.spare = torch.nn.Parameter(torch.ones(4, dtype=F64))

        def forward(self, h):
            return self.b(torch.tanh(self.a(h)))

    x, y = _batch()
    model = Net()
    params = dict(model.named_parameters())
    grads = ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["a", "b"])
    F.mse_loss(model(x), y).backward()
    assert list(grads) == list(params) and grads["spare"] is None
    assert all(torch.allclose(grads[n], p.grad) for n, p in params.items() if p.grad is not None)
    res = ef.sweep(model, params, x, y, loss=F.mse_loss, split_at=["a", "b"])
    assert list(res.params) == list(params) and res.params["spare"] is params["spare"]


def _with_a_physical_stage():
    """``tanh(x W)``, a physical ``sin``, ``h W``."""
    g = torch.Generator().manual_seed(0)
    stages = [
        ef.stage(lambda p, h: torch.tanh(h @ p["w"]), name="in"),
        ef.stage(lambda p, h: torch.sin(h), name="box", physical=True),
        ef.stage(lambda p, h: h @ p["w"], name="out"),
    ]
    params = ({"w": torch.randn(5, 6, generator=g, dtype=F64)}, {}, {"w": torch.randn(6, 3, generator=g, dtype=F64)})
    return ef.Chain(stages, loss=F.mse_loss), params


def test_frozen_upstream_of_e_frozen_is_not_moved_by_weight_decay():
    """``E.frozen()`` passes no costate upstream: the parameters there get ``None`` and stay put."""
    chain, params = _with_a_physical_stage()
    x, y = _batch()
    res = ef.sweep(chain, params, x, y, estimator=E.frozen())
    assert res.grads[0]["w"] is None and res.grads[2]["w"] is not None
    before = params[0]["w"].clone()

    def adamw(p, grads, state):
        return {n: t * (1 - 0.05) - 0.1 * grads[n].sign() for n, t in p.items()}, state

    out = ef.sweep(chain, params, x, y, estimator=E.frozen(), update=ef.fused(adamw, [()] * 3))
    assert torch.equal(out.params[0]["w"], before) and not torch.equal(out.params[2]["w"], params[2]["w"])


def test_fused_updates_take_an_optimizer_over_the_trainable_parameters_only():
    model = _mlp()
    model[0].requires_grad_(False)
    chain, params = ef.from_module(model, loss=F.mse_loss)
    x, y = _batch()
    twin = _mlp()
    twin[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    twin_opt = torch.optim.SGD([p for p in twin.parameters() if p.requires_grad], lr=0.1)
    frozen_before = model[0].weight.clone()
    ef.sweep(chain, params, x, y, update=opt)
    F.mse_loss(twin(x), y).backward()
    twin_opt.step()
    assert torch.equal(model[0].weight, frozen_before)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    model[2].requires_grad_(False)
    model[0].requires_grad_(True)  # trainable now, but not among the optimizer's
    with pytest.raises(ValueError, match=r"parameter 'weight' of stage 0 .* is trainable but not among"):
        ef.sweep(chain, params, x, y, update=opt)


def test_an_optimizers_step_hooks_and_scheduler_see_one_step_per_sweep():
    """An EMA post-hook runs once per fused step, after every stage was updated."""
    model = _mlp()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    x, y = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls, seen = [], []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: (calls.append("post"), seen.append(model[4].bias.clone())))
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would fail here
        for _ in range(3):
            before = model[0].bias.clone()
            ef.sweep(chain, params, x, y, update=opt)
            schedule.step()
            assert not torch.equal(model[0].bias, before)
    assert calls == ["pre", "post"] * 3
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5**3


def test_a_failed_fused_step_names_the_stages_it_already_stepped():
    """A torch.optim optimizer updates in place stage by stage: a failure names what it already
    stepped (a pure update commits nothing, test_update)."""
    model = _mlp()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    x, y = _batch()
    calls = []

    class Failing(torch.optim.SGD):
        def step(self, closure=None):
            calls.append(len(calls))
            if len(calls) == 2:
                raise KeyboardInterrupt
            return super().step(closure)

    with pytest.raises(KeyboardInterrupt) as info:
        ef.sweep(chain, params, x, y, update=Failing(model.parameters(), lr=0.1))
    assert any(
        "had already stepped stage 4 ('Linear_4'); the other stages were not" in n for n in info.value.__notes__
    ), info.value.__notes__


@pytest.mark.parametrize(
    "boundary, stepped", [(4, "stage 4 ('Linear_4')"), (2, "stage 2 ('Linear_2'), stage 4 ('Linear_4')")]
)
def test_a_failure_after_a_fused_step_in_the_same_reverse_step_names_it(boundary, stepped):
    """A pass failing at boundary l runs after stage l's update, in the same reverse step: the note
    counts that update (the step notes with the value it made, not the one it was given)."""
    model = _mlp()
    chain, params = ef.from_module(model, loss=F.mse_loss)

    def failing(adj, state, ctx):
        if adj.index == boundary:
            raise RuntimeError("pass failed")
        return adj, state

    with pytest.raises(RuntimeError, match="pass failed") as info:
        ef.sweep(
            chain,
            params,
            *_batch(),
            passes=ef.Pass(init=lambda: None, update=failing),
            update=torch.optim.SGD(model.parameters(), lr=0.1),
        )
    notes = [n for n in info.value.__notes__ if "already stepped" in n]
    assert notes == [f"(eae_func: the fused update had already stepped {stepped}; the other stages were not)"]


def test_a_numpy_black_box_cannot_write_into_the_saved_boundary():
    """numpy writes bump no torch version counter: the black box gets a read-only array."""

    def overwrites(params, h):
        return np.tanh(h, out=h)

    box = ef.black_box(overwrites, name="box", numpy=True)
    chain = ef.Chain([ef.stage(lambda p, h: h @ p["w"], name="in"), box], loss=lambda out: out.square().mean())
    params = ({"w": torch.randn(4, 4, dtype=F64)}, {})
    with pytest.raises(ValueError, match="read-only") as info:
        ef.sweep(chain, params, torch.randn(3, 4, dtype=F64), estimator=E.zbp(E.Probes(4), method="fd"))
    assert any("stage 1 ('box')" in n for n in info.value.__notes__)


# ----------------------------------------------------------------------------- a LoRA fine-tune


transformers = pytest.importorskip("transformers")


class LoRA(torch.nn.Module):
    """``base(h) + (h A) B``: a frozen base layer with a trainable low-rank adapter."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.base = base
        n_in, n_out = base.weight.shape  # GPT-2's Conv1D stores (in, out)
        self.a = torch.nn.Parameter(torch.randn(n_in, rank, dtype=base.weight.dtype) / n_in**0.5)
        self.b = torch.nn.Parameter(torch.randn(rank, n_out, dtype=base.weight.dtype) * 0.1)

    def forward(self, h):
        return self.base(h) + (h @ self.a) @ self.b


def next_token_loss(out, ids):
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def test_a_lora_fine_tune_of_gpt2_differentiates_only_the_adapters():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    model.requires_grad_(False)
    for block in model.transformer.h:
        block.attn.c_attn = LoRA(block.attn.c_attn)
    ids = torch.randint(0, 32, (2, 8))
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert len(trainable) == 4 and len(params) > 20
    grads = ef.grad(model, params, ids, ids, loss=next_token_loss, split_at=["transformer.h.*"])
    next_token_loss(model(ids), ids).backward()
    assert {n for n, g in grads.items() if g is not None} == trainable
    for n in trainable:
        assert torch.equal(grads[n], params[n].grad), (n, (grads[n] - params[n].grad).abs().max())


# ----------------------------------------------------------------------------- captures that cannot go stale


class Net(torch.nn.Module):
    """Blocks in a ModuleList, a flag its forward reads, a buffer, a dropout and a tied head."""

    def __init__(self, width=6, depth=3):
        super().__init__()
        self.embed = torch.nn.Linear(4, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.drop = torch.nn.Dropout(0.0)
        self.head = torch.nn.Linear(width, width)
        self.register_buffer("shift", torch.zeros(width))
        self.residual = True

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h)) if self.residual else torch.tanh(block(h))
        return self.head(self.drop(h) + self.shift)


def _changes():
    def replace(m):
        m.blocks[1] = torch.nn.Linear(6, 6).double()

    def toggle(m):
        m.residual = False

    def buffer(m):
        m.shift = torch.ones(6, dtype=F64)

    def hook(m):
        m.blocks[0].register_forward_hook(lambda mod, args, out: out * 2)

    def append(m):
        m.blocks.append(torch.nn.Linear(6, 6).double())

    def dropout(m):
        m.drop.p = 0.5

    def untie(m):
        m.head.weight = torch.nn.Parameter(m.head.weight.detach().clone() + 1)

    def double(m):
        m.float()

    return [replace, toggle, buffer, hook, append, dropout, untie, double]


@pytest.mark.parametrize("change", _changes(), ids=lambda f: f.__name__)
def test_a_captured_model_changed_after_capture_is_captured_again(change, monkeypatch):
    from eae_func.program import capture

    captures = []
    cut = capture.cut_model
    monkeypatch.setattr(capture, "cut_model", lambda *a: captures.append(1) or cut(*a))
    torch.manual_seed(0)
    model = Net().double()
    model.head.weight = model.blocks[2].weight  # tied, until untied
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 6, dtype=F64)

    def both():
        params = dict(model.named_parameters())
        xs, ys = x.to(params["embed.weight"].dtype), y.to(params["embed.weight"].dtype)
        torch.manual_seed(3)
        grads = ef.grad(model, params, xs, ys, loss=F.mse_loss, split_at=["blocks.*"], capture="graph")
        torch.manual_seed(3)
        reference = _autograd(model, xs, ys)
        assert set(grads) == set(reference)
        for name, expected in reference.items():
            torch.testing.assert_close(grads[name], expected, rtol=1e-5, atol=1e-6)

    both()
    both()
    assert len(captures) == 1  # unchanged: captured once
    change(model)
    if change.__name__ == "hook":  # a captured graph would bake the hook's effect in: refused
        with pytest.raises(ValueError, match=r"has hooks \(blocks.0.forward_hooks\).*capture='run'"):
            both()
        return
    both()
    assert len(captures) == 2


def test_python_randomness_in_forward_is_refused_at_capture():
    import random

    class LayerDrop(Net):
        def forward(self, x):
            h = self.embed(x)
            for block in self.blocks:
                if random.random() > 0.1:
                    h = h + torch.tanh(block(h))
            return self.head(h)

    model = LayerDrop().double()
    state = random.getstate()
    with pytest.raises(ValueError, match=r"draws from Python's random .* bake that one draw"):
        ef.grad(
            model,
            dict(model.named_parameters()),
            torch.randn(2, 4, dtype=F64),
            torch.randn(2, 6, dtype=F64),
            loss=F.mse_loss,
            split_at=["blocks.*"],
            capture="graph",
        )
    assert random.getstate() == state


def test_a_split_at_that_cuts_fewer_places_than_it_matched_says_why():
    class CallsForward(Net):
        def forward(self, x):
            h = self.embed(x)
            for block in self.blocks:
                h = block.forward(h)
            return self.head(h)

    x, y = torch.randn(2, 4, dtype=F64), torch.randn(2, 6, dtype=F64)
    for model, split_at, culprit in (
        (Net().double(), ["blocks"], "a container"),
        (CallsForward().double(), ["blocks.*"], "layer.forward"),
    ):
        with pytest.raises(ValueError, match=rf"run no operation of the captured graph.*{culprit}"):
            ef.grad(model, dict(model.named_parameters()), x, y, loss=F.mse_loss, split_at=split_at, capture="graph")


# ----------------------------------------------------------------------------- params that are not the module's


def test_write_back_and_fused_steps_refuse_params_that_are_no_longer_the_modules():
    model = _mlp()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    x, y = _batch()
    model.load_state_dict(_mlp(seed=5).state_dict(), assign=True)  # new tensors: params hold the old weights
    res = ef.sweep(chain, params, x, y)
    with pytest.raises(ValueError, match=r"write_back: .* no longer the model's parameter stage 0's 'weight'"):
        ef.write_back(model, res)
    with pytest.raises(
        ValueError,
        match=r"fused: the gradients were computed at a tensor that is no longer the model's parameter 'weight' of stage 0",
    ):
        ef.sweep(chain, params, x, y, update=torch.optim.SGD(model.parameters(), lr=0.1))
    chain, params = ef.from_module(model, loss=F.mse_loss)  # made again: accepted
    ef.write_back(model, ef.sweep(chain, params, x, y))
    assert all(p.grad is not None for p in model.parameters())


class Yielding(torch.nn.Linear):
    """A layer whose forward lets other threads run between reading its weight twice."""

    def forward(self, h):
        out = super().forward(h)
        time.sleep(0.002)
        return out + h @ self.weight.T * 0.1


def test_two_threads_sweeping_one_module_leave_it_intact_and_get_its_gradients():
    import threading

    torch.manual_seed(0)
    model = torch.nn.Sequential(Yielding(5, 5), torch.nn.Tanh(), Yielding(5, 3)).double()
    own = list(model.parameters())
    chain, params = ef.from_module(model, loss=F.mse_loss)
    x, y = _batch()
    reference = ef.grad(chain, params, x, y)
    results, errors = [], []

    def work():
        try:
            for _ in range(5):
                results.append(ef.grad(chain, params, x, y))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(a is b for a, b in zip(model.parameters(), own))  # every slot holds the module's own Parameter
    for grads in results:
        assert all(torch.equal(grads[i][n], reference[i][n]) for i in range(len(chain)) for n in reference[i])


@pytest.mark.parametrize("what", ["model", "function"])
def test_two_threads_capturing_one_fresh_model_or_function_at_once_both_get_its_gradients(what):
    """torch.export swaps a model's tensors for fake ones while it traces: first captures are serialised."""
    import threading

    x, y = _batch()
    for _ in range(3):  # a fresh model and function each time: both threads miss the cache
        model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
        params = dict(model.named_parameters())
        want = _autograd(model, x, y)

        def fresh(params, h):  # the model's forward as a function with a cut
            h = ef.cut(torch.tanh(F.linear(h, params["0.weight"], params["0.bias"])), "one")
            return F.linear(h, params["2.weight"], params["2.bias"])

        barrier, results = threading.Barrier(2), [None, None]

        def work(k, model=model, params=params, fresh=fresh, barrier=barrier, results=results):
            barrier.wait()
            try:
                if what == "model":
                    results[k] = ef.grad(model, params, x, y, loss=F.mse_loss, split_at=["0", "2"], capture="graph")
                else:
                    results[k] = ef.grad(fresh, params, x, y, loss=F.mse_loss)
            except Exception as e:  # noqa: BLE001 - asserted below
                results[k] = e

        threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for grads in results:
            assert isinstance(grads, dict), grads
            assert all(torch.allclose(grads[n], want[n], rtol=1e-10, atol=1e-12) for n in want)


def test_a_fused_step_over_its_row_budget_updates_nothing():
    """The reverse step's probes of a physical stage are charged before any stage is updated."""
    chain, params = _with_a_physical_stage()
    x, y = _batch()
    calls = []

    def sgd(p, grads, state):
        calls.append(1)
        return {n: t - 0.1 * grads[n] for n, t in p.items()}, state

    estimator = E.zbp(E.Probes(4), method="fd")
    needed = ef.sweep(chain, params, x, y, estimator=estimator).stats["box"]["rows"]
    with pytest.raises(RuntimeError, match="over the budget"):
        ef.sweep(chain, params, x, y, estimator=estimator, budget=needed - 1, update=ef.fused(sgd, [()] * 3))
    assert calls == []
    res = ef.sweep(chain, params, x, y, estimator=estimator, budget=needed, update=ef.fused(sgd, [()] * 3))
    assert len(calls) == 2 and res.stats["box"]["rows"] == needed


# ----------------------------------------------------------------------------- errors anyone can act on


def test_results_records_and_lazy_numbers_pickle():
    import pickle

    from eae_func import passes as P

    model = _mlp()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    x, y = _batch()
    res = ef.sweep(chain, params, x, y, passes=ef.compose(P.clip_by_global_norm(0.01), P.stats()))
    again = pickle.loads(pickle.dumps(res))
    assert torch.equal(again.loss, res.loss) and again.adjoints[1].history == res.adjoints[1].history
    assert float(again.adjoints[1].meta["norm"]) == float(res.adjoints[1].meta["norm"])
    assert dict(again.stats["boundaries"][1]).keys() == dict(res.stats["boundaries"][1]).keys()


def test_a_sweep_under_inference_mode_says_so():
    model = _mlp()
    chain, params = ef.from_module(model, loss=F.mse_loss)
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"inference_mode\(\), which forbids"):
        ef.grad(chain, params, *_batch())


def test_zero_size_parameters_in_two_stages_are_stepped_as_their_own():
    class Empty(torch.nn.Linear):
        def __init__(self):
            super().__init__(5, 5)
            self.nothing = torch.nn.Parameter(torch.zeros(0))

    model = torch.nn.Sequential(Empty(), torch.nn.Tanh(), Empty()).double()
    chain, params = ef.from_module(model, loss=lambda out, t: F.mse_loss(out, t))
    x = torch.randn(4, 5, dtype=F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ef.sweep(chain, params, x, torch.zeros(4, 5, dtype=F64), update=opt)
    assert all(p.grad is None for p in model.parameters())
