"""Peak live bytes of the reverse sweep do not grow with depth beyond what it must hold.

Wide inner layers (the tape) and narrow boundaries: a full autograd tape grows
by one stage's internals per stage; the EAE sweep holds one stage's tape plus
the boundaries, costates and parameter gradients, which the test subtracts.
"""

import weakref

import pytest
import torch
from torch import nn

import eae_func as ef
from eae_func import passes as P
from eae_func.models import Block

from live_bytes import LiveBytes

WIDTH, INNER, BATCH = 16, 256, 1024


def chain_of(depth):
    torch.manual_seed(0)
    model = nn.Sequential(
        *[
            nn.Sequential(
                nn.Linear(WIDTH, INNER), nn.Tanh(), nn.Linear(INNER, INNER), nn.Tanh(), nn.Linear(INNER, WIDTH)
            )
            for _ in range(depth)
        ]
    )
    return model, torch.randn(BATCH, WIDTH)


def loss_fn(out):
    return out.square().mean()


def peaks(depth):
    model, x = chain_of(depth)
    chain, params = ef.from_module(model, loss=loss_fn)
    with LiveBytes() as eae:
        ef.sweep(chain, params, x)
    with LiveBytes() as tape:
        loss_fn(model(x)).backward()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    must_hold = param_bytes + depth * x.numel() * x.element_size()  # grads; boundaries, then costates in their place
    return eae.peak - must_hold, tape.peak - param_bytes


def test_live_bytes_do_not_grow_with_depth():
    stage_tape = 2 * BATCH * INNER * 4  # two saved (BATCH, INNER) float32 tensors per stage (the tanh outputs)
    (e4, a4), (e8, a8), (e16, a16) = peaks(4), peaks(8), peaks(16)
    # the instrument sees autograd's tape grow by at least a stage's tape per stage ...
    assert a8 - a4 > 4 * stage_tape * 0.75 and a16 - a8 > 8 * stage_tape * 0.75
    # ... and the EAE sweep's does not grow at all beyond the bytes it must hold
    assert abs(e8 - e4) < 0.1 * stage_tape and abs(e16 - e8) < 0.1 * stage_tape
    assert e16 < 2 * stage_tape


@pytest.mark.parametrize("recompute", [True, False])
def test_no_tape_entry_or_closure_outlives_its_step(recompute):
    """When the passes run at boundary l, the stage inputs x_j of every stage j > l (and so the
    tape entries and vjp closures that hold them) are gone; x_1..x_l are still on the tape."""
    depth, first_inputs = 5, {}

    def layer(i):
        def fn(p, h):
            first_inputs.setdefault(i, weakref.ref(h))  # the forward's call (the recompute sees the same x_i)
            return torch.tanh(h @ p["w"])

        return fn

    chain = ef.Chain([ef.stage(layer(i), name=f"layer{i}") for i in range(depth)], loss=lambda h: h.square().sum())
    params = tuple({"w": torch.randn(4, 4)} for _ in range(depth))
    alive = {}

    def look(adj):
        alive[adj.index] = sorted(j for j, ref in first_inputs.items() if j > 0 and ref() is not None)

    ef.sweep(chain, params, torch.randn(3, 4), passes=P.tap(look), recompute=recompute)
    assert alive == {l: list(range(1, min(l, depth - 1) + 1)) for l in range(depth + 1)}


def test_a_stage_local_backward_holds_what_autograd_grad_holds():
    """The recompute and local backward of one block (no double-backward graph: the closure is
    applied with create_graph=False) peak at torch.autograd.grad's live bytes, within 2%."""
    torch.manual_seed(0)
    block = Block(64, n_heads=4, n_kv_heads=2, ffn_hidden=256)
    x, cot = torch.randn(4, 64, 64), torch.randn(4, 64, 64)
    chain, params = ef.from_module([block], loss=lambda out: (out * cot).sum())  # p_L = cot
    window = LiveBytes()  # open from p_L's passes (after the boundary condition) to p_0's

    def watch(adj):
        window.__enter__() if adj.index == 1 else window.__exit__(None, None, None)

    ef.grad(chain, params, x, passes=P.tap(watch))
    x_leaf = x.clone().requires_grad_()
    with LiveBytes() as reference:
        torch.autograd.grad(block(x_leaf), [*block.parameters(), x_leaf], cot)
    assert window.peak <= 1.02 * reference.peak and reference.peak > 1e6


def test_a_budget_keeps_the_last_graphs_which_cost_no_peak_before_the_first_rebuild():
    """A byte budget of one stage's graph keeps the last stage's: the reverse sweep uses it before it
    rebuilds anything, so the peak is that of rebuilding every stage (while keeping the first stage's
    graph, as a first-to-last budget would, adds a whole graph to it), and one recompute is saved."""
    model, x = chain_of(6)
    chain, params = ef.from_module(model, loss=loss_fn)
    stage_tape = 2 * BATCH * INNER * 4
    with LiveBytes() as rebuilt:
        ef.sweep(chain, params, x)
    with LiveBytes() as last:
        res = ef.sweep(chain, params, x, recompute=int(1.2 * stage_tape))
    with LiveBytes() as first:
        ef.sweep(chain, params, x, recompute=lambda i, name: i != 0)  # keep the first stage's graph
    kept = [s.name for s in chain.stages if res.stats[s.name]["recompute_s"] == 0]
    assert kept == [chain.stages[-1].name]
    assert abs(last.peak - rebuilt.peak) < 0.1 * stage_tape
    assert first.peak - rebuilt.peak > 0.75 * stage_tape


def blocks_of(depth):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(64, n_heads=4, n_kv_heads=2, ffn_hidden=256) for _ in range(depth)]), torch.randn(
        4, 64, 64
    )


def checkpointed_peak(model, x, kept):
    """The live peak of the step with ``torch.utils.checkpoint`` around each block but the last ``kept``."""
    from torch.utils.checkpoint import checkpoint

    def step():
        h = x
        for k, block in enumerate(model):
            h = block(h) if k >= len(model) - kept else checkpoint(block, h, use_reentrant=False)
        h.square().mean().backward()
        model.zero_grad(set_to_none=True)

    step()
    with LiveBytes() as live:
        step()
    return live.peak


@pytest.mark.parametrize("kept", [0, 1, 2, 4])
def test_a_budget_peaks_where_checkpoint_does_with_as_many_blocks_left_unrecomputed(kept):
    """A budget of k graphs on 6 blocks keeps the last k (from the second step on, the others run
    without a graph: the first step measured them), and peaks no higher than checkpointing every
    block but the last k: the same recomputes at the same memory. No rebuilt output or costate
    outlives its use (the vjp runs on the rebuilt output's place in the graph, and the fold alone
    holds p_L)."""
    depth = 6
    model, x = blocks_of(depth)
    chain, params = ef.from_module(model, loss=lambda out: out.square().mean())
    graph = 30 * 4 * 64 * 64 * 4  # a block's saved tensors are 26.2 boundaries: k of these hold k graphs (k < 7)
    ef.grad(chain, params, x, recompute=kept * graph)  # measures every stage's graph
    with LiveBytes() as eae:
        res = ef.sweep(chain, params, x, recompute=kept * graph, keep_costates=False)
    rebuilt = [s.name for s in chain.stages if res.stats[s.name]["recompute_s"] > 0]
    assert rebuilt == list(chain.names[: depth - kept])
    reference = checkpointed_peak(model, x, kept)
    assert eae.peak <= reference + 16 * 1024 and reference > 2e6


# ----------------------------------------------------------------------------- the sweep's memory floor

D, H, ROWS = 32, 128, 1024  # boundaries of ROWS x D floats (A bytes), stages whose inner layer is 4x wider


def mlp_chain(depth):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D)) for _ in range(depth)])
    return model, torch.randn(ROWS, D)


def one_stage_peak(rows):
    """The live peak of one stage's local backward as ``torch.autograd.grad`` holds it: the stage's
    graph, its output, the costate entering and leaving it and its parameter gradients."""
    model, _ = mlp_chain(1)
    x, p = torch.randn(rows, D, requires_grad=True), torch.randn(rows, D)
    with LiveBytes() as live:
        torch.autograd.grad(model(x), [*model.parameters(), x], p)
    return live.peak


def sgd(model, depth):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def pure(model, depth):
    return ef.fused(lambda p, g, s: ({n: t - 0.1 * g[n] for n, t in p.items()}, s), (None,) * depth)


FLOOR_CASES = {
    "grad": dict(entry="grad"),
    "value_and_grad": dict(entry="value_and_grad"),
    "sweep without costates": dict(entry="sweep", keep_costates=False),
    "microbatches": dict(entry="grad", microbatches=4),
    "passes": dict(entry="grad", passes=ef.compose(P.int8(), P.clip_by_global_norm(1.0))),
    "fused torch.optim": dict(entry="sweep", keep_costates=False, update=sgd),
    "fused pure update": dict(entry="sweep", keep_costates=False, update=pure),
    "options off": dict(entry="grad", compile=False, data_parallel=False, recompute=True, timers=True),
}


@pytest.mark.parametrize("case", list(FLOOR_CASES))
def test_the_sweep_holds_the_boundaries_one_stage_graph_and_the_gradients(case):
    """Over L stages the sweep's live peak is at most what it must hold: the boundaries x_1..x_{L-1}
    of a microbatch, the costate p_l entering the stage being reversed, that stage's local backward
    (its graph, output, gradients and p_{l-1}, as torch.autograd.grad holds them) and the gradients
    of the other stages (with microbatches, the earlier microbatches' sum); plus, with passes, the
    costate they make in place of the one they get. Nothing kept per stage or per microbatch
    beyond that: a leak of one boundary per stage is 7 boundaries over the bound. The pipeline,
    FSDP and compile code is imported and present in the fold (``eae_func.distributed``), unused."""
    import eae_func.distributed  # noqa: F401 - present but unused

    depth, options = 8, dict(FLOOR_CASES[case])
    entry, k = getattr(ef, options.pop("entry")), options.get("microbatches", 1)
    model, x = mlp_chain(depth)
    if "update" in options:
        options["update"] = options["update"](model, depth)
    chain, params = ef.from_module(model, loss=lambda out: out.square().mean())
    boundary = x.numel() * x.element_size() // k
    stage_grads = sum(p.numel() * p.element_size() for p in model.parameters()) // depth
    passes = boundary if "passes" in options else 0
    # while stage i (1-based) is reversed: x_1..x_{i-1}, p_i, its local backward, and the gradients (or, with
    # a pure fused update, the new params) of stages i+1..L; with microbatches, of all the others (the sum)
    held = max((i - 1) * boundary + (depth - 1 if k > 1 else depth - i) * stage_grads for i in range(1, depth + 1))
    floor = held + boundary + one_stage_peak(ROWS // k) + passes
    with LiveBytes() as live:
        out = entry(chain, params, x, **options)
        del out
    assert live.peak <= floor + 4096, f"{(live.peak - floor) / boundary:.2f} boundaries over the floor"
    assert live.peak >= (depth - 1) * boundary  # the instrument sees the boundaries
