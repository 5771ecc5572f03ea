"""``eae_func.integrations.lightning.manual_step`` trains a LightningModule as ``manual_backward``
does (fp32 and bf16-mixed, with Lightning's clipping), and fused inside ``optimizer.step(closure)``
so ``global_step`` counts and ``max_steps`` stops."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

L = pytest.importorskip("lightning.pytorch")

from eae_func.integrations.lightning import manual_step  # noqa: E402


def _data(n=24):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=6)


class Lit(L.LightningModule):
    def __init__(self, how, clip=None):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3))
        self.automatic_optimization, self.how, self.clip = False, how, clip

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.how == "autograd":
            opt = self.optimizers()
            opt.zero_grad()
            loss = F.cross_entropy(self.model(x), y)
            self.manual_backward(loss)
            if self.clip is not None:
                self.clip_gradients(opt, gradient_clip_val=self.clip)
            opt.step()
            return loss.detach()
        fused = self.how == "fused"
        return manual_step(self, self.model, x, y, loss=F.cross_entropy, gradient_clip_val=self.clip, fused=fused)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(how, precision="32-true", clip=None, module=None):
    module = Lit(how, clip) if module is None else module
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, _data())
    return module, trainer


@pytest.mark.parametrize("precision, clip", [("32-true", None), ("32-true", 0.5), ("bf16-mixed", 0.5)])
def test_manual_step_trains_as_manual_backward_does(precision, clip):
    want, _ = _fit("autograd", precision, clip)
    got, trainer = _fit("eae", precision, clip)
    assert trainer.global_step == 3
    worst = max((a - b).abs().max().item() for a, b in zip(want.parameters(), got.parameters()))
    assert worst <= 1e-6, worst


def test_fused_manual_step_counts_the_step_and_equals_manual_backward():
    want, _ = _fit("autograd")
    fused, trainer = _fit("fused")
    assert trainer.global_step == 3  # max_steps stopped it
    worst = max((a - b).abs().max().item() for a, b in zip(want.parameters(), fused.parameters()))
    assert worst <= 1e-6, worst


class CutLit(Lit):
    """manual_step on the model cut at run time (``split_at``), not one stage per child."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return manual_step(self, self.model, x, y, loss=F.cross_entropy, split_at=["0", "2", "4"])


def _ddp_fit(how):
    """On each of 2 gloo ranks, Lightning's DDP (CPU): the weights after 3 steps of manual_backward and
    of manual_step; and every rank's manual_step weights."""
    import torch.distributed as dist

    fitted = {}
    for h in ("autograd", how):
        module = CutLit("eae") if h == "cuts" else Lit(h)
        trainer = L.Trainer(
            max_steps=3,
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, _data())
        fitted[h] = [p.detach() for p in module.parameters()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, fitted[how])
    return max((a - b).abs().max().item() for a, b in zip(fitted["autograd"], fitted[how])), everyone


@pytest.mark.parametrize("how", ["eae", "fused", "cuts"])
def test_manual_step_under_ddp_trains_as_manual_backward_does_on_every_rank(how):
    """The LightningModule is wrapped in DDP, the model swept is not: manual_step averages over DDP's
    group (was: each rank stepped on its own gradients, 0.05 from Lightning's DDP weights)."""
    import eae_func.distributed as D

    for worst, everyone in D.run(_ddp_fit, 2, how, timeout=240, pg_timeout=120):
        assert worst <= 1e-6, worst  # measured: 0
        assert all(torch.equal(a, b) for a, b in zip(*everyone))


class Logged(Lit):
    """manual_step with a clip, logging the default set or a chosen one."""

    def __init__(self, how, chosen):
        super().__init__(how)
        self.chosen = chosen

    def training_step(self, batch, batch_idx):
        from eae_func import passes as P

        x, y = batch
        log = {} if self.chosen is None else {"log": self.chosen}
        fused = self.how == "fused"
        clip = P.clip_by_global_norm(1.0)
        return manual_step(self, self.model, x, y, loss=F.cross_entropy, fused=fused, passes=clip, **log)


@pytest.mark.parametrize("how", ["eae", "fused"])
@pytest.mark.parametrize("chosen, keys", [(None, ("norm",)), (("norm", "clipped"), ("norm", "clipped")), ((), ())])
def test_manual_step_logs_named_boundaries(how, chosen, keys):
    """One entry per boundary but the input, named by the stage whose output it is; norm by default."""
    _, trainer = _fit(how, module=Logged(how, chosen))
    stages = ("Linear_0", "Tanh_1", "Linear_2", "GELU_3", "Linear_4")
    logged = {k for k in trainer.callback_metrics if k.startswith("eae/")}
    assert logged == {f"eae/{stage}/{key}" for stage in stages for key in keys}
    if keys:
        assert trainer.callback_metrics["eae/Linear_4/norm"] > 0


class Feedback(Lit):
    """manual_step with error feedback: the residuals must reach the next step."""

    def __init__(self, how):
        super().__init__(how)
        self.fresh = []

    def training_step(self, batch, batch_idx):
        from eae_func import passes as P

        self.fresh.append(getattr(self, "eae_pass_state", None) is None)
        x, y = batch
        passes = P.error_feedback(P.int8())
        return manual_step(self, self.model, x, y, loss=F.cross_entropy, fused=self.how == "fused", passes=passes)


@pytest.mark.parametrize("how", ["eae", "fused"])
def test_manual_step_threads_the_pass_state_from_step_to_step(how):
    module, _ = _fit(how, module=Feedback(how))
    assert module.fresh == [True, False, False]  # only the first step starts from init()
    assert module.eae_pass_state["residuals"]


class Resumable(Feedback):
    def training_step(self, batch, batch_idx):
        self.fresh.append(getattr(self, "eae_pass_state", None) is None)
        x, y = batch
        return manual_step(self, self.model, x, y, loss=F.cross_entropy, passes=_feedback())


def _feedback():
    from eae_func import compose
    from eae_func import passes as P

    return compose(P.error_feedback(P.int8()), P.clip_by_global_norm(10.0))


def test_a_resumed_run_with_error_feedback_is_bit_identical(tmp_path):
    """Four steps, against two steps, a checkpoint (with PassState) and two resumed steps; without
    PassState a checkpointing Trainer refuses the stateful pass."""
    from eae_func.integrations.lightning import PassState

    def fit(root, steps, ckpt_path=None, callbacks=()):
        module = Resumable("eae")
        every = L.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)
        trainer = L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            logger=False,
            callbacks=[every, *callbacks],
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, _data(12), ckpt_path=ckpt_path)  # checkpoints at the ends of epochs
        return module

    whole = fit(tmp_path / "whole", 4, callbacks=[PassState()])
    checkpoint = next((tmp_path / "whole").glob("*step=2.ckpt"))
    resumed = fit(tmp_path / "resumed", 4, ckpt_path=checkpoint, callbacks=[PassState()])
    assert whole.fresh == [True, False, False, False] and resumed.fresh == [False, False]
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))
    saved = torch.load(checkpoint, weights_only=False)
    assert saved.pop("eae_pass_state")[0]["residuals"]
    torch.save(saved, tmp_path / "stateless.ckpt")
    restarted = fit(tmp_path / "restarted", 4, ckpt_path=tmp_path / "stateless.ckpt", callbacks=[PassState()])
    assert restarted.fresh == [True, False]  # the state mattered: without it, the run differs
    assert not all(torch.equal(a, b) for a, b in zip(whole.parameters(), restarted.parameters()))
    with pytest.raises(ValueError, match=r"manual_step: the passes error_feedback\(int8.* add .*PassState\(\)"):
        fit(tmp_path / "refused", 1)


def test_two_optimizers_without_optimizer_are_refused():
    """Was ``'list' object has no attribute 'zero_grad'``."""

    class Two(Lit):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.model[0].parameters(), lr=0.1), torch.optim.SGD(self.model[2:].parameters())]

    with pytest.raises(ValueError, match=r"manual_step: Two has 2 optimizers; .*optimizer=self.optimizers\(\)\[k\]"):
        _fit("eae", module=Two("eae"))
