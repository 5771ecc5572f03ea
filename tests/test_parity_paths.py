"""One meaning of a pass on every path: a model cut with ``split_at`` at run time (``capture="run"``)
and captured as a chain (``capture="graph"``, which an option only a chain implements used to choose
silently) shows the passes the same boundaries, the cuts' outputs in call order, under the same
indices, names and keys, so every built-in pass gives the same gradients and records on both."""

import functools
import math

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import eae_func as ef
from eae_func import passes as P
from eae_func.adjoint import NAMESPACE

F64 = torch.float64


class Layers(nn.Module):
    """embedding -> three cut layers -> head: glue around the cuts."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class Skip(nn.Module):
    """A skip connection alive across two cuts: a capture carries it beside the stream."""

    def __init__(self):
        super().__init__()
        self.down = nn.Linear(4, 6)
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.up = nn.Linear(6, 3)

    def forward(self, x):
        skip = torch.tanh(self.down(x))
        return self.up(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(skip)))))) + skip)


class Twice(nn.Module):
    """One cut module called twice in a row, then once more after glue: three stages."""

    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 3)

    def forward(self, x):
        h = self.block(self.block(self.inp(x)))
        return self.out(self.block(h * 0.5))


MODELS = {
    "layers": (Layers, ["layers.*"], ["layers.0", "layers.1", "layers.2"]),
    "skip": (Skip, ["a", "b", "c"], ["a", "b", "c"]),
    "twice": (Twice, ["block"], ["block", "block#2", "block#3"]),
}


def passes():
    return {
        "identity": P.identity(),
        "scale": P.scale(2.0),
        "clip": P.clip_by_global_norm(0.05),
        "clip_by_value": P.clip_by_value(0.01),
        "gaussian_noise": P.gaussian_noise(0.1),
        "cast16": P.cast(torch.float16),
        "fp8": P.fp8(),
        "int8": P.int8(),
        "int8_channel": P.int8("channel"),
        "int8_stochastic": P.int8(stochastic=True),
        "topk": P.topk(0.3),
        "randk": P.randk(0.3),
        "check_finite": P.check_finite("zero"),
        "stats": P.stats(),
        "log": P.log(),
        "error_feedback": P.error_feedback(P.int8()),
        "when": P.when(lambda a: a.index > 1, P.scale(3.0)),
        "only_index": P.only(P.scale(0.5), indices=2),
        "composed": ef.compose(P.int8(), P.clip_by_global_norm(0.05), P.stats()),
    }


@functools.cache
def built(name):
    """One model per kind for the whole module (its capture is kept between sweeps), its data."""
    torch.manual_seed(0)
    model = MODELS[name][0]().double()
    return model, torch.randn(6, 4, dtype=F64), torch.randn(6, 3, dtype=F64)


def sweep(name, capture, p, key=7):
    model, x, y = built(name)
    params = dict(model.named_parameters())
    split_at = MODELS[name][1]
    return ef.sweep(model, params, x, y, loss=F.mse_loss, split_at=split_at, passes=p, key=key, capture=capture)


def close(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.allclose(a, b, rtol=1e-9, atol=1e-14)
    if isinstance(a, float | int) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-14)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(close(u, v) for u, v in zip(a, b))
    return a == b


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("name", list(passes()))
def test_every_builtin_pass_means_the_same_at_run_time_and_captured(model, name):
    run, graph = (sweep(model, capture, passes()[name]) for capture in ("run", "graph"))
    assert [(a.index, a.stage) for a in run.adjoints] == [(3, n) for n in MODELS[model][2][2:]] + [
        (2, MODELS[model][2][1]),
        (1, MODELS[model][2][0]),
    ]
    assert [(a.index, a.stage, a.key, a.history) for a in graph.adjoints] == [
        (a.index, a.stage, a.key, a.history) for a in run.adjoints
    ]
    for r, g in zip(run.adjoints, graph.adjoints):
        assert close(r.value, g.value), (r.index, r.stage)
        assert close(dict(r.meta), dict(g.meta)), (r.index, dict(r.meta), dict(g.meta))
    assert run.grads.keys() == graph.grads.keys()
    for k in run.grads:
        assert close(run.grads[k], graph.grads[k]), k
    assert close(run.stats["boundaries"], graph.stats["boundaries"])
    assert optree.tree_structure(run.pass_state, namespace=NAMESPACE) == optree.tree_structure(
        graph.pass_state, namespace=NAMESPACE
    )


def _hugging_face(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
        split_at = ["transformer.h.*"]
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=3,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
        )
        split_at = ["model.layers.*"]
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    return model, split_at, torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def _next_token_loss(out, ids):
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_models_show_the_same_records_on_both_paths(kind):
    """Code nobody here wrote: a capture carries the causal mask (GPT-2) or the rotary tables (Llama)
    across every cut beside the stream; the passes see the layers' outputs alone on both paths."""
    model, split_at, ids = _hugging_face(kind)
    params = dict(model.named_parameters())
    for p in (P.scale(2.0), P.clip_by_global_norm(1e-3), P.int8(), P.randk(0.5)):
        run, graph = (
            ef.sweep(model, params, ids, ids, loss=_next_token_loss, split_at=split_at, passes=p, key=5, capture=c)
            for c in ("run", "graph")
        )
        names = [f"{split_at[0][:-2]}.{k}" for k in (2, 1, 0)]
        assert [(a.index, a.stage) for a in run.adjoints] == list(zip((3, 2, 1), names))
        assert [(a.index, a.stage, a.key, a.history) for a in graph.adjoints] == [
            (a.index, a.stage, a.key, a.history) for a in run.adjoints
        ]
        assert all(close(r.value, g.value) for r, g in zip(run.adjoints, graph.adjoints)), p.name
        assert all(close(run.grads[k], graph.grads[k]) for k in params), p.name


def test_a_pass_scales_the_cut_gradients_it_flows_through_on_both_paths():
    """``P.scale(2)`` at every cut's output: the head (after the last cut) is untouched, layer k's
    gradients carry a factor 2 per cut at or after it, the embedding (before the first) 2**3, on both
    paths: the numbers the two meanings of a pass differed in."""
    plain = sweep("layers", "run", P.identity())
    for capture in ("run", "graph"):
        scaled = sweep("layers", capture, P.scale(2.0))
        factor = {"head": 1, "layers.2": 2, "layers.1": 4, "layers.0": 8, "emb": 8}
        for k, g in scaled.grads.items():
            prefix = next(p for p in factor if k.startswith(p))
            torch.testing.assert_close(g, factor[prefix] * plain.grads[k], rtol=1e-12, atol=0)


def test_microbatches_run_at_run_time_with_the_captured_records(monkeypatch):
    """``microbatches=2`` on a model runs at run time (nothing exported), with the records and
    gradients of the same option on the captured chain (``P.scale(2)`` at the cuts), equal to one piece's."""
    model, x, y = built("layers")
    params = dict(model.named_parameters())
    kw = dict(loss=F.mse_loss, split_at=["layers.*"], passes=P.scale(2.0), key=5)
    one = ef.sweep(model, params, x, y, **kw)
    graph = ef.sweep(model, params, x, y, microbatches=2, capture="graph", **kw)

    def exported(*args, **kwargs):
        raise AssertionError("torch.export called")

    monkeypatch.setattr(torch.export, "export", exported)
    two = ef.sweep(model, params, x, y, microbatches=2, **kw)
    assert [(a.index, a.stage, a.key, a.history) for a in two.adjoints] == [
        (a.index, a.stage, a.key, a.history) for a in graph.adjoints
    ]
    assert close(two.stats["boundaries"], graph.stats["boundaries"])
    assert all(close(r.value, g.value) for r, g in zip(two.adjoints, graph.adjoints))
    assert [(a.index, a.stage) for a in two.adjoints] == [(a.index, a.stage) for a in one.adjoints]
    for k in one.grads:
        assert close(two.grads[k], graph.grads[k]), k
        torch.testing.assert_close(two.grads[k], one.grads[k], rtol=1e-12, atol=1e-15)
    assert close(two.loss, graph.loss)


def test_synthetic_needs_the_boundary_state_and_says_where_it_is():
    """``P.synthetic`` predicts from the boundary state: a capture passes the cut's output; run-time
    cuts keep none and say which path has it."""
    graph = sweep("layers", "graph", P.synthetic(warmup=0, replace=False))
    assert [a.stage for a in graph.adjoints] == ["layers.2", "layers.1", "layers.0"]
    with pytest.raises(ValueError, match=r"capture='graph'"):
        sweep("layers", "run", P.synthetic(warmup=0, replace=False))


def _pipelined_and_run_time():
    """The ``layers`` model captured, on a two-rank pipeline with two microbatches (``P.scale(2)`` and
    ``P.clip_by_value``, which act on each element alike, at the cuts), against the same model cut at run
    time in one process: every rank's records are the run-time trace's."""
    import eae_func.distributed as D

    model, x, y = built("layers")
    split_at, p = MODELS["layers"][1], ef.compose(P.scale(2.0), P.clip_by_value(0.01))
    chain, params = ef.from_module(model, loss=F.mse_loss, split_at=split_at, example=x[:3])
    pipe = D.Pipeline(chain, [(0, 2), (2, len(chain))], params=params, schedule="1f1b", timeout=30)
    res = pipe.sweep(params, x, y, passes=p, microbatches=2, key=7)
    ref = ef.sweep(model, dict(model.named_parameters()), x, y, loss=F.mse_loss, split_at=split_at, passes=p, key=7)
    by_index = {a.index: a for a in ref.adjoints}
    return {
        "records": [(a.index, a.stage, a.history) for a in res.adjoints],
        "expected": [(a.index, by_index[a.index].stage, by_index[a.index].history) for a in res.adjoints],
        "values": all(close(a.value, by_index[a.index].value) for a in res.adjoints),
    }


def test_a_pipeline_of_the_captured_model_shows_the_run_time_records():
    import eae_func.distributed as D

    outs = D.run(_pipelined_and_run_time, 2, timeout=120)
    for out in outs:
        assert out["records"] == out["expected"] and out["values"], out
    assert sorted(i for out in outs for i, _, _ in out["records"]) == [1, 2, 3]
