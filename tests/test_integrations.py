"""``EAETrainer`` trains as plain ``Trainer`` does (the model's own loss and ``num_items_in_batch``,
gradient accumulation, clipping, bf16): the same logged losses and gradient norms and the same
final weights, on a tiny GPT-2; ``write_grads(accumulate=True)`` adds into ``.grad``."""

import pytest
import torch
from torch import nn

import eae_func as ef

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from eae_func.integrations.transformers import EAETrainer, layers_of  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16, seq=12, vocab=64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)
        self.ids[::3, -3:] = -100  # some padding in the labels: num_items_in_batch matters

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids.clamp(min=0), "labels": ids}


def _train(cls, tmp_path, resume_from_checkpoint=None, **extra):
    transformers.set_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        **{"save_strategy": "no", "max_steps": 3, **extra},
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = cls(model=model, args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    logs = [(entry["loss"], entry["grad_norm"]) for entry in trainer.state.log_history if "loss" in entry]
    return model, logs, trainer


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"gradient_accumulation_steps": 2},
        {"max_grad_norm": 0.05},
        {"bf16": True, "gradient_accumulation_steps": 2},
    ],
    ids=["plain", "accumulate2", "clip0.05", "bf16"],
)
def test_eae_trainer_trains_as_trainer_does(tmp_path, extra):
    model, logs, _ = _train(transformers.Trainer, tmp_path / "hf", **extra)
    eae_model, eae_logs, trainer = _train(EAETrainer, tmp_path / "eae", **extra)
    tol = 1e-4 if extra.get("bf16") else 1e-6  # measured here: 0 difference in every case
    assert len(logs) == len(eae_logs) == 3
    for (loss, norm), (eae_loss, eae_norm) in zip(logs, eae_logs):
        assert abs(loss - eae_loss) <= tol * abs(loss) and abs(norm - eae_norm) <= tol * abs(norm)
    worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), eae_model.parameters()))
    assert worst <= tol, worst
    assert trainer.state.global_step == 3


@pytest.mark.parametrize("extra", [{}, {"gradient_accumulation_steps": 2}], ids=["plain", "accumulate2"])
def test_eae_trainer_with_the_head_in_chunks_trains_as_trainer_does(tmp_path, extra):
    """``eae_loss_chunks=3``: GPT-2's tied head and its loss over 3 chunks of tokens (labels shifted,
    -100 ignored, ``num_items_in_batch`` honoured) train as Trainer does; what the chunked loss cannot
    compute as the model does is refused."""

    class Chunked(EAETrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, eae_loss_chunks=3, **k)

    model, logs, _ = _train(transformers.Trainer, tmp_path / "hf", **extra)
    eae_model, eae_logs, _ = _train(Chunked, tmp_path / "eae", **extra)
    assert len(logs) == len(eae_logs) == 3
    for (loss, norm), (eae_loss, eae_norm) in zip(logs, eae_logs):
        assert abs(loss - eae_loss) <= 1e-6 * abs(loss) and abs(norm - eae_norm) <= 1e-5 * abs(norm)
    # the chunks' gradients are formed in the forward and scaled by 1 / num_items in the backward, where
    # the model's loss scales before its matrix products: last-bit differences, which AdamW's division by
    # their own size makes visible on gradients that are zero up to rounding (measured: 4.9e-6 at lr 1e-3)
    worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), eae_model.parameters()))
    assert worst <= 1e-5, worst
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "bad"), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match=r"eae_loss_chunks must be a positive int"):
        EAETrainer(model=model, args=args, eae_loss_chunks=0)
    with pytest.raises(ValueError, match=r"would not be the model's own \(label smoothing\)"):
        _train(Chunked, tmp_path / "smooth", label_smoothing_factor=0.1)


def _ddp_weights(accumulate):
    """On each of 2 gloo ranks (DDP): the final weights of Trainer and of EAETrainer after 3 steps of a
    tiny GPT-2, batch 4 per rank; and every rank's EAETrainer weights."""
    import tempfile

    import torch.distributed as dist

    extra = {"gradient_accumulation_steps": accumulate, "ddp_backend": "gloo", "disable_tqdm": True}
    with tempfile.TemporaryDirectory() as out:
        want = _train(transformers.Trainer, out, **extra)[0]
        got = _train(EAETrainer, out, **extra)[0]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [p.detach() for p in got.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(want.parameters(), got.parameters())), everyone


@pytest.mark.parametrize("accumulate", [1, 2])
def test_eae_trainer_under_ddp_trains_as_trainer_does_on_every_rank(accumulate):
    """The model Trainer hands ``training_step`` is DDP: the sweep of the unwrapped model averages its
    gradients over DDP's group (was: each rank trained on its own, 0.04 from Trainer's weights)."""
    import eae_func.distributed as D

    for worst, everyone in D.run(_ddp_weights, 2, accumulate, timeout=240, pg_timeout=120):
        assert worst <= 1e-6, worst  # measured: 0 (no accumulation), 3.4e-7 (2 micro-steps)
        assert all(torch.equal(a, b) for a, b in zip(*everyone))


class Regularised:
    """A subclass's ``compute_loss``: the model's loss plus a penalty on weights read outside its forward."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss + 0.1 * model.transformer.h[0].mlp.c_fc.weight.square().mean()


class OwnLossFunc:
    """``compute_loss_func=``: the Trainer's hook for a loss of the outputs and labels."""

    def __init__(self, *a, **k):
        def mean_logit_loss(outputs, labels, num_items_in_batch=None):
            logits = outputs["logits"][:, :-1]
            return nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)

        super().__init__(*a, compute_loss_func=mean_logit_loss, **k)


@pytest.mark.parametrize("how", ["compute_loss", "compute_loss_func", "label_smoothing"])
def test_eae_trainer_sweeps_the_loss_as_the_trainer_computes_it(tmp_path, how):
    """A subclass overriding ``compute_loss`` (Trainer's documented extension point), a
    ``compute_loss_func`` and label smoothing: the same final weights as plain Trainer's."""
    mixins = {"compute_loss": (Regularised,), "compute_loss_func": (OwnLossFunc,), "label_smoothing": ()}[how]
    extra = {"label_smoothing_factor": 0.1} if how == "label_smoothing" else {}
    model, logs, _ = _train(type("Plain", (*mixins, transformers.Trainer), {}), tmp_path / "hf", **extra)
    eae_model, eae_logs, _ = _train(type("Swept", (*mixins, EAETrainer), {}), tmp_path / "eae", **extra)
    _, default_logs, _ = _train(EAETrainer, tmp_path / "default")
    assert [loss for loss, _ in eae_logs] != [loss for loss, _ in default_logs]  # the loss swept is the subclass's
    for (loss, norm), (eae_loss, eae_norm) in zip(logs, eae_logs):
        assert abs(loss - eae_loss) <= 1e-6 * abs(loss) and abs(norm - eae_norm) <= 1e-6 * abs(norm)
    worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), eae_model.parameters()))
    assert worst <= 1e-6, worst


@pytest.mark.parametrize(
    "eae_log, keys",
    [
        (None, ("norm",)),  # the default
        (("norm", "clip_norm", "clipped"), ("norm", "clip_norm", "clipped")),
        ("all", ("norm", "int8_scale", "clip_norm", "clip_scale", "clipped")),
        ((), ()),
    ],
    ids=["default", "chosen", "all", "none"],
)
def test_eae_trainer_logs_named_boundaries(tmp_path, eae_log, keys):
    """One entry per cut layer, named as ``res.adjoints`` names it (no loss or input costate); the
    default is the costate norm, ``eae_log=`` chooses; the values are read only when Trainer logs."""
    from eae_func import passes as P
    from eae_func.lazy import Lazy

    class Logged(EAETrainer):
        def __init__(self, *a, **k):
            chosen = {} if eae_log is None else {"eae_log": eae_log}
            super().__init__(*a, eae={"passes": ef.compose(P.int8(), P.clip_by_global_norm(1.0))}, **chosen, **k)

    _, _, trainer = _train(Logged, tmp_path)
    want = {f"eae/transformer.h.{i}/{key}" for i in range(3) for key in keys}
    for entry in trainer.state.log_history:
        if "loss" in entry:
            assert {k for k in entry if k.startswith("eae/")} == want
    assert set(trainer.eae_logs) == want
    assert all(isinstance(v, torch.Tensor | Lazy) for v in trainer.eae_logs.values())  # unread until logged
    assert all(trainer.state.log_history[0][f"eae/transformer.h.{i}/norm"] > 0 for i in range(3) if keys)


@pytest.mark.parametrize("eae", [{"capture": "graph"}, {"boundary_dtype": torch.float32}], ids=["graph", "bdtype"])
def test_eae_trainer_with_options_only_a_captured_chain_has_trains_as_trainer_does(tmp_path, eae):
    """Graph capture (``capture="graph"``, and ``boundary_dtype``, which once fell back to it and now runs
    at run time) failed: the ``use_cache=False`` it added to the inputs was a boundary leaf, the Trainer
    itself fingerprinted."""

    class Captured(EAETrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, eae=eae, **k)

    model, logs, _ = _train(transformers.Trainer, tmp_path / "hf")
    eae_model, eae_logs, _ = _train(Captured, tmp_path / "eae")
    for (loss, norm), (eae_loss, eae_norm) in zip(logs, eae_logs):
        assert abs(loss - eae_loss) <= 1e-6 * abs(loss) and abs(norm - eae_norm) <= 1e-6 * abs(norm)
    assert max((a - b).abs().max().item() for a, b in zip(model.parameters(), eae_model.parameters())) <= 1e-6


def test_eae_trainer_refuses_a_log_it_cannot_make(tmp_path):
    from eae_func.integrations.transformers import EAETrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
    with pytest.raises(TypeError, match=r"EAETrainer\(eae_log=...\): expected \"all\" or a sequence of names"):
        EAETrainer(model=model, args=args, eae_log="norm")
    with pytest.raises(ValueError, match="keep_costates=False drops"):
        EAETrainer(model=model, args=args, eae={"keep_costates": False})
    EAETrainer(model=model, args=args, eae={"keep_costates": False}, eae_log=("clip_norm",))


def _seq2seq(kind):
    T = transformers
    if kind == "bart":
        config = T.BartConfig(
            d_model=16,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            vocab_size=64,
            max_position_embeddings=32,
            dropout=0.0,
        )
        return T.BartForConditionalGeneration(config), ["model.encoder.layers.*", "model.decoder.layers.*"]
    config = T.T5Config(
        d_model=16, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=8, vocab_size=64, dropout_rate=0.0
    )
    config.decoder_start_token_id = config.pad_token_id = 0
    return T.T5ForConditionalGeneration(config), ["encoder.block.*", "decoder.block.*"]


@pytest.mark.parametrize("kind", ["bart", "t5"])
def test_eae_trainer_cuts_both_stacks_of_an_encoder_decoder_and_trains_as_trainer_does(tmp_path, kind):
    from eae_func import passes as P

    cut = set()
    models = {}
    for cls in (transformers.Trainer, EAETrainer):
        transformers.set_seed(0)
        model, stacks = _seq2seq(kind)
        assert layers_of(model) == stacks
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / cls.__name__),
            max_steps=2,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            seed=0,
            dataloader_num_workers=0,
        )
        extra = (
            {"eae": {"passes": P.tap(lambda adj: cut.add(adj.stage.rsplit(".", 1)[0]))}} if cls is EAETrainer else {}
        )
        cls(model=model, args=args, train_dataset=Tokens(), **extra).train()
        models[cls] = model
    assert cut == {s[:-2] for s in stacks}  # every call of both stacks was a stage
    worst = max((a - b).abs().max().item() for a, b in zip(*(m.parameters() for m in models.values())))
    assert worst <= 1e-6, worst


def test_layers_of_finds_the_repeated_layers_and_options_trainer_decides_are_refused(tmp_path):
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32))
    assert layers_of(gpt2) == ["transformer.h.*"]
    with pytest.raises(ValueError, match="no nn.ModuleList of repeated layers"):
        layers_of(nn.Linear(2, 2))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match=r"eae=\{'update': ...\} is Trainer's to decide"):
        EAETrainer(model=gpt2, args=args, eae={"update": None})


def test_write_grads_accumulate_adds_into_grad():
    model = nn.Linear(3, 2)
    first = {"weight": torch.ones(2, 3), "bias": torch.ones(2)}
    ef.write_grads(model, first)
    ef.write_grads(model, {"weight": torch.full((2, 3), 2.0), "bias": None}, accumulate=True)
    assert torch.equal(model.weight.grad, torch.full((2, 3), 3.0)) and torch.equal(model.bias.grad, torch.ones(2))
    ef.write_grads(model, first)  # overwrite: the given tensor itself, no copy
    assert model.weight.grad.data_ptr() == first["weight"].data_ptr()
    ef.write_grads(model, first, accumulate=True)  # accumulating onto it makes a new tensor
    assert torch.equal(model.weight.grad, torch.full((2, 3), 2.0))
    assert first["weight"].equal(torch.ones(2, 3))  # the caller's tensor untouched


def test_eae_trainer_holds_what_trainer_with_gradient_checkpointing_holds(tmp_path):
    """Live bytes over a whole ``train()``: EAETrainer on the switch peaks where Trainer with
    ``gradient_checkpointing=True`` does (measured: 48 bytes apart on a 6-layer GPT-2); the sweep it
    ran before held the gradients twice at its end (2.97 MB more there)."""
    from live_bytes import LiveBytes

    peaks = {}
    for label, cls, extra in (
        ("checkpointing", transformers.Trainer, {"gradient_checkpointing": True}),
        ("switch", EAETrainer, {}),
    ):
        with LiveBytes() as live:
            _train(cls, tmp_path / label, **extra)
        peaks[label] = live.peak
    assert peaks["switch"] <= peaks["checkpointing"] + 4096, peaks
