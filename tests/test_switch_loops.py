"""``ef.enable`` under the training loops users already have: Accelerate with gradient accumulation,
PEFT LoRA, Lightning's automatic optimization with clipping and accumulation, DDP with ``no_sync``
accumulation and FSDP2 (enabled before or after ``fully_shard``) over 2 gloo ranks, and
``torch.compile``. Each runs the same loop with and without EAE from the same weights: after 3 steps
the weights are equal, bit for bit in float32, and the records show the cuts ran."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import eae_func as ef


class Net(nn.Module):
    def __init__(self, width=8, depth=3, classes=3):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(6, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def batches(n=6, rows=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(n)]


def assert_bitwise(got: nn.Module, want: nn.Module):
    for (n, a), b in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


def test_accelerate_with_gradient_accumulation():
    accelerate = pytest.importorskip("accelerate")

    def train(model):
        accelerate.state.AcceleratorState._reset_state(True)
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = accelerator.prepare(model, opt)
        for x, y in batches():
            with accelerator.accumulate(model):
                accelerator.backward(F.cross_entropy(model(x), y))
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
        return model

    want = train(Net())
    model = Net()
    with ef.enable(model, split_at=["blocks.*"]):
        got = train(model)
        assert list(ef.records(model)) == ["blocks.2", "blocks.1", "blocks.0"]
    assert_bitwise(got, want)


def test_peft_lora_trains_its_adapters_only():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    base = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(0))

    def train(model):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model

    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(1)  # the adapters' random initial weights alike
    want = train(peft.get_peft_model(copy.deepcopy(base), lora))
    torch.manual_seed(1)
    model = peft.get_peft_model(copy.deepcopy(base), lora)
    with ef.enable(model, split_at=["base_model.model.transformer.h.*"]):
        got = train(model)
        assert list(ef.records(model)) == [f"base_model.model.transformer.h.{i}" for i in (1, 0)]
    frozen = [n for n, p in got.named_parameters() if not p.requires_grad]
    assert frozen and all(torch.equal(got.get_parameter(n), base.get_parameter(n.split("base_model.model.")[1]))
                          for n in frozen if "lora" not in n and "base_layer" not in n)  # fmt: skip
    assert_bitwise(got, want)


def test_lightning_automatic_optimization_with_clipping_and_accumulation():
    L = pytest.importorskip("lightning.pytorch")
    x = torch.cat([b[0] for b in batches(12)])
    y = torch.cat([b[1] for b in batches(12)])
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)

    class Lit(L.LightningModule):
        def __init__(self, eae):
            super().__init__()
            self.model = Net()
            if eae:
                ef.enable(self.model, split_at=["blocks.*"])

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.model(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def fit(eae):
        module = Lit(eae)
        trainer = L.Trainer(
            max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5, accelerator="cpu", logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, data)
        assert trainer.global_step == 3
        return module

    want, got = fit(False), fit(True)
    assert list(ef.records(got.model)) == ["blocks.2", "blocks.1", "blocks.0"]
    ef.disable(got.model)
    assert_bitwise(got, want)


def _ddp_no_sync(eae):
    """On each rank: DDP over the (enabled) model, two micro-batches per step, the first under
    ``no_sync``; the weights after 3 steps."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = Net()
    if eae:
        ef.enable(model, split_at=["blocks.*"])
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    data = batches(6, seed=dist.get_rank())
    for k in range(3):
        (a, b), (c, d) = data[2 * k], data[2 * k + 1]
        with ddp.no_sync():
            (F.cross_entropy(ddp(a), b) / 2).backward()
        (F.cross_entropy(ddp(c), d) / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert not eae or list(ef.records(model)) == ["blocks.2", "blocks.1", "blocks.0"]
    return [p.detach().clone() for p in model.parameters()]


def _ddp_both():
    return _ddp_no_sync(False), _ddp_no_sync(True)


def test_ddp_with_no_sync_accumulation_on_two_ranks():
    import eae_func.distributed as D

    ranks = D.run(_ddp_both, 2, timeout=240, pg_timeout=120)
    for want, got in ranks:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0][1], ranks[1][1]))  # the replicas agree


class Unrolled(Net):
    """``Net`` with its blocks called one by one: dynamo gives up on a frame whose loop breaks the graph."""

    def forward(self, x):
        h = self.stem(x)
        h = h + self.blocks[0](h)
        h = h + self.blocks[1](h)
        h = h + self.blocks[2](h)
        return self.head(h)


def test_torch_compile_of_an_enabled_model_breaks_at_the_cuts_and_trains_as_eager():
    """``torch.compile(model)`` on an enabled model: dynamo breaks the graph at each cut call (which
    runs eagerly, its reverse step too: dynamo never traces eae_func's own code, whose guards on its
    bookkeeping would be wrong) and compiles the glue; the weights after the loop equal eager
    autograd's."""

    def train(model, run):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x, y in batches(3):
            F.cross_entropy(run(x), y).backward()
            opt.step()
            opt.zero_grad()
        return model

    eager = Unrolled()
    want = train(eager, eager)
    model = Unrolled()
    with ef.enable(model, split_at=["blocks.*"]):
        torch._dynamo.reset()
        seen = torch._dynamo.explain(model)(batches(1)[0][0])
        assert seen.graph_count == 4 and seen.graph_break_count == 3
        assert all("torch.compiler.disable" in b.reason for b in seen.break_reasons)
        torch._dynamo.reset()
        got = train(model, torch.compile(model))
        assert list(ef.records(model)) == ["blocks.2", "blocks.1", "blocks.0"]
    torch._dynamo.reset()
    assert_bitwise(got, want)


def _fsdp2(eae):
    """On each rank: FSDP2 (``fully_shard`` per block and at the root) over the model, enabled before
    the sharding (``"before"``), after it (``"after"``) or not at all (``None``); the full weights after
    3 steps and the records."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = Net(width=16)
    if eae == "before":
        ef.enable(model, split_at=["blocks.*"])
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if eae == "after":
        ef.enable(model, split_at=["blocks.*"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in batches(3, seed=dist.get_rank()):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    records = list(ef.records(model)) if eae else None
    return [p.full_tensor().detach().clone() for p in model.parameters()], records


def _fsdp2_all():
    return {eae: _fsdp2(eae) for eae in (None, "before", "after")}


def test_fsdp2_over_an_enabled_model_on_two_ranks():
    import eae_func.distributed as D

    for rank in D.run(_fsdp2_all, 2, timeout=240, pg_timeout=120):
        want, _ = rank[None]
        for order in ("before", "after"):
            got, records = rank[order]
            assert records == ["blocks.2", "blocks.1", "blocks.0"], order
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=order)
