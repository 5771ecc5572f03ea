"""``compile=``: each digital stage's forward and its reverse step (recompute + local vjp) compiled
by ``torch.compile``. On a chain of dropout blocks (two layers of one class, so one pair of
graphs), a function stage and a frozen weight: gradients equal the eager sweep's within 1e-5 over
3 steps with microbatches, the dropout masks replayed (an unreplayed mask would be off by O(1)),
and nothing recompiled after the first step."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import eae_func as ef
from eae_func.models import Block


def _chain():
    torch.manual_seed(0)
    blocks = [Block(16, 2, 1, 32, dropout=0.2) for _ in range(2)]
    blocks[1].ffn.w1.weight.requires_grad_(False)  # frozen: no gradient, compiled or not
    chain, params = ef.from_module([*blocks, nn.Linear(16, 4)], F.mse_loss)
    scale = ef.stage(lambda p, h: torch.tanh(h * p["s"]), name="scaled")
    chain = ef.Chain([*chain.stages[:2], scale, chain.stages[2]], loss=F.mse_loss)
    return chain, (*params[:2], {"s": torch.tensor(1.5)}, params[2])


def test_compiled_stages_equal_the_eager_sweep_and_compile_once():
    from torch._dynamo.utils import counters

    chain, params = _chain()
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 4)
    graphs = []
    for step in range(3):
        torch.manual_seed(step)
        compiled = ef.sweep(chain, params, x, y, compile=True, microbatches=2, key=step)
        torch.manual_seed(step)
        eager = ef.sweep(chain, params, x, y, microbatches=2, key=step)
        assert torch.allclose(compiled.loss, eager.loss, atol=1e-6)
        for got, want in zip(compiled.grads, eager.grads):
            assert got.keys() == want.keys()
            for n in want:
                if want[n] is None:
                    assert got[n] is None
                else:
                    assert (got[n] - want[n]).abs().max().item() < 1e-5
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[0] and graphs[2] == graphs[0]  # compiled once, reused


def test_compile_takes_true_a_mode_or_torch_compile_options():
    assert ef.Options(compile=True).compile == {}
    assert ef.Options(compile="max-autotune").compile == {"mode": "max-autotune"}
    assert ef.Options(compile={"dynamic": False}).compile == {"dynamic": False}
    assert ef.Options(compile=False).compile is None
    with pytest.raises(TypeError, match="compile= takes True, a torch.compile mode"):
        ef.Options(compile=3)


def test_torch_compile_around_the_sweep_runs_it_as_python():
    chain, params = _chain()
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 4)
    torch.manual_seed(0)
    got = torch.compile(lambda p, x, y: ef.value_and_grad(chain, p, x, y))(params, x, y)
    torch.manual_seed(0)
    want = ef.value_and_grad(chain, params, x, y)
    assert torch.equal(got[0], want[0])
    assert all(
        (g is None and w is None) or torch.equal(g, w)
        for gs, ws in zip(got[1], want[1])
        for g, w in zip(gs.values(), ws.values())
    )


def _tree_chain():
    """Function stages passing a dict (with an integer leaf) and then a tuple between them."""
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(6, 6, generator=g), torch.randn(6, 3, generator=g)

    def first(p, h):
        z = F.dropout(torch.tanh(h @ p["w"]), 0.3)
        return {"z": z, "count": torch.full((h.shape[0],), 2, dtype=torch.int64), "skip": h}

    def second(p, d):
        return d["z"] * p["s"] + d["skip"], d["count"].to(d["z"].dtype)

    def third(p, t):
        a, n = t
        return a @ p["w"] + n[:, None]

    stages = [ef.stage(first, name="first"), ef.stage(second, name="second"), ef.stage(third, name="third")]
    params = ({"w": w1}, {"s": torch.tensor(0.7)}, {"w": w2})
    return ef.Chain(stages, loss=F.mse_loss), params


def test_compiled_stages_take_tuple_and_dict_boundaries():
    """Dict and tuple boundaries (an integer leaf among them) compile too: the costates come back in
    the fold's order, equal to eager's, with dropout replayed, and nothing recompiles."""
    from torch._dynamo.utils import counters

    chain, params = _tree_chain()
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    before = counters["stats"]["unique_graphs"]
    graphs = []
    for step in range(3):
        torch.manual_seed(step)
        compiled = ef.sweep(chain, params, x, y, compile=True, key=step)
        torch.manual_seed(step)
        eager = ef.sweep(chain, params, x, y, key=step)
        assert torch.allclose(compiled.loss, eager.loss, atol=1e-6)
        for got, want in zip(compiled.grads, eager.grads):
            for n in want:
                assert (got[n] - want[n]).abs().max().item() < 1e-5, n
        for got, want in zip(compiled.adjoints, eager.adjoints):
            for a, b in zip(torch.utils._pytree.tree_leaves(got.value), torch.utils._pytree.tree_leaves(want.value)):
                assert (a is None) == (b is None)  # the integer leaf has no costate
                assert a is None or (a - b).abs().max().item() < 1e-5
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] - before == 6  # three stages, each a forward and a reverse graph: none ran eager
    assert graphs[1] == graphs[0] == graphs[2]


def test_a_captured_hugging_face_llama_compiles_stage_by_stage():
    """A Llama cut per layer by torch.export (dict boundaries: hidden states, rotary tables, mask)
    runs compiled with no graph break and no recompile, within 1e-5 of eager with dropout on and a
    weight frozen in every layer. Its layers share one forward and one reverse graph: three layers
    compile as many graphs as one (a layer that differs, say in which weights it trains, compiles
    its own)."""
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    from test_models import llama, next_token_loss

    def graphs_compiled(layers):
        torch.manual_seed(0)
        model, split_at = llama(layers=layers)
        model = model.train()
        for layer in model.model.layers:  # frozen in every layer, as a LoRA fine-tune freezes them
            layer.mlp.up_proj.weight.requires_grad_(False)
        ids = torch.randint(0, 64, (2, 6))
        params = dict(model.named_parameters())
        breaks, before, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], []
        for step in range(2):
            torch.manual_seed(step)
            got = ef.grad(
                model, params, ids, ids, loss=next_token_loss, split_at=split_at, compile=True, capture="graph"
            )
            torch.manual_seed(step)
            want = ef.grad(model, params, ids, ids, loss=next_token_loss, split_at=split_at, capture="graph")
            assert [n for n in want if want[n] is None] == [
                f"model.layers.{k}.mlp.up_proj.weight" for k in range(layers)
            ]
            assert all(got[n] is None for n in want if want[n] is None)
            assert max((got[n] - want[n]).abs().max().item() for n in want if want[n] is not None) < 1e-5
            graphs.append(counters["stats"]["unique_graphs"] - before)
        assert sum(counters["graph_break"].values()) == breaks and graphs[0] == graphs[1]
        return graphs[0]

    assert graphs_compiled(3) == graphs_compiled(1) > 0


@pytest.fixture
def no_export(monkeypatch):
    """torch.export refused: a sweep that would capture the model fails."""

    def refused(*args, **kwargs):
        raise AssertionError("torch.export was called")

    monkeypatch.setattr(torch.export, "export", refused)


def test_run_time_cuts_compile_each_cut_call_and_replay_its_dropout(no_export):
    """A model cut with ``split_at`` runs each cut call compiled (its forward without grad, its
    rebuild with grad and autograd's backward on the compiled graph), with no graph capture: within
    1e-5 of the eager run-time sweep over 3 steps with dropout on, 2 microbatches and a frozen weight,
    no graph break, nothing recompiled after the first step; ``ef.enable(..., compile=True)`` too."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(16, 2, 1, 32, dropout=0.2) for _ in range(3)], nn.Linear(16, 4))
    model[1].ffn.w1.weight.requires_grad_(False)
    params, cuts = dict(model.named_parameters()), ["0", "1", "2"]
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 4)
    breaks, before, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], []
    for step in range(3):
        torch.manual_seed(step)
        got = ef.grad(model, params, x, y, loss=F.mse_loss, split_at=cuts, compile=True, microbatches=2, key=step)
        torch.manual_seed(step)
        want = ef.grad(model, params, x, y, loss=F.mse_loss, split_at=cuts, microbatches=2, key=step)
        assert [n for n in got if got[n] is None] == ["1.ffn.w1.weight"] == [n for n in want if want[n] is None]
        assert max((got[n] - want[n]).abs().max().item() for n in want if want[n] is not None) < 1e-5
        graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs[0] > 0 and graphs[0] == graphs[1] == graphs[2]
    ef.enable(model, split_at=cuts, compile=True)
    try:
        torch.manual_seed(5)
        F.mse_loss(model(x), y).backward()
    finally:
        ef.disable(model)
    enabled = {n: p.grad for n, p in model.named_parameters()}
    torch.manual_seed(5)
    want = ef.grad(model, params, x, y, loss=F.mse_loss, split_at=cuts)
    assert max((enabled[n] - want[n]).abs().max().item() for n in want if want[n] is not None) < 1e-5
    assert counters["stats"]["unique_graphs"] - before == 2 * graphs[0]  # the same graphs, for the whole batch's shape
    assert sum(counters["graph_break"].values()) == breaks


def test_a_hugging_face_llama_at_run_time_compiles_one_pair_of_graphs_for_its_layers(no_export):
    """A Llama cut per layer at run time (its own forward, keyword arguments and rotary tables)
    compiles one forward and one rebuild graph for all of its layers: three layers as many as one,
    within 1e-5 of eager, no graph break."""
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    from test_models import llama, next_token_loss

    def graphs_compiled(layers):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, split_at = llama(layers=layers)
        ids = torch.randint(0, 64, (2, 6))
        params = dict(model.named_parameters())
        breaks, before = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
        torch.manual_seed(1)  # its dropout draws: replayed in the rebuild
        got = ef.grad(model, params, ids, ids, loss=next_token_loss, split_at=split_at, compile=True, capture="run")
        torch.manual_seed(1)
        want = ef.grad(model, params, ids, ids, loss=next_token_loss, split_at=split_at, capture="run")
        assert max((got[n] - want[n]).abs().max().item() for n in want if want[n] is not None) < 1e-5
        assert sum(counters["graph_break"].values()) == breaks
        return counters["stats"]["unique_graphs"] - before

    assert graphs_compiled(3) == graphs_compiled(1) == 2


def test_a_compiled_cut_that_writes_into_its_input_is_autograd(no_export):
    """A cut module that writes into its input (``h.mul_(2)``) and draws dropout, under ``compile=``:
    its forward and its rebuild both compiled, so the rebuild draws the forward's mask; the gradients
    are autograd's (float64) over two steps."""

    class Writes(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.drop = nn.Linear(8, 8), nn.Dropout(0.3)

        def forward(self, h):
            h.mul_(2)
            return self.drop(torch.tanh(self.lin(h)))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Writes(), nn.Linear(8, 4)).double().train()
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    for step in range(2):
        torch.manual_seed(step)
        got = ef.grad(model, dict(model.named_parameters()), x, y, loss=F.mse_loss, split_at=["1"], compile=True)
        model.zero_grad()
        torch.manual_seed(step)
        F.mse_loss(model(x), y).backward()
        assert max((got[n] - p.grad).abs().max().item() for n, p in model.named_parameters()) < 1e-12


def test_a_compiled_reverse_step_runs_in_the_modes_its_forward_saw():
    """A pass switching the blocks to eval between the forward and the reverse steps (as another thread
    could): the compiled recompute still runs them in train mode with the forward's dropout masks, so
    the gradients are the eager sweep's."""
    chain, params = _chain()
    blocks = [s.module for s in chain.stages[:2]]
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 4)

    def switch(adj):
        for b in blocks:
            b.eval()
        return adj

    runs = []
    for compile in (True, None):
        for b in blocks:
            b.train()
        torch.manual_seed(0)
        runs.append(ef.sweep(chain, params, x, y, compile=compile, passes=switch))
        assert not blocks[0].training
    for got, want in zip(*(r.grads for r in runs)):
        for n in want:
            assert (want[n] is None) == (got[n] is None)
            if want[n] is not None:
                assert (got[n] - want[n]).abs().max().item() < 1e-5, n
