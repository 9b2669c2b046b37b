"""ampkernels.integrations.transformers against the real Hugging Face Trainer.

A small regression model trained by stock ``transformers.Trainer`` and by ``ampkernels.integrations.transformers``
gives the same losses, loss-scale history, skipped steps and learning rates; Trainer's checkpoints carry the
FusedAdamW state (every state format) and the scaler's, and a resumed run continues bit for bit. Trainer runs on
Accelerate, which makes a loss scaler for fp16 only on a GPU: the CPU tests set up on the CPU what it sets up on a
GPU (``stock_fp16_scaler``); the GPU tests run its own fp16 path.
"""

from __future__ import annotations

import pytest
import torch
from integrations_common import SCALER_KWARGS, reset_accelerate_state, stock_fp16_scaler

import ampkernels

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tolerances import OPTIMIZER_FP32  # noqa: E402

from ampkernels.integrations import transformers as ak  # noqa: E402

FP32_TOL = OPTIMIZER_FP32
STEPS, SAVE_AT, BATCH = 12, 6, 16


class Regressor(torch.nn.Module):
    """Big enough that the low-bit state formats apply (they leave tensors under 4096 elements in float32)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out.float(), labels), "logits": out}


def dataset(n: int = STEPS * BATCH):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(64, generator=g), "labels": torch.randn(8, generator=g)} for _ in range(n)]


class Record(transformers.TrainerCallback):
    """Per optimizer step: the scale, whether the step was skipped, the learning rate it used."""

    def __init__(self):
        self.trainer = None
        self.scales, self.skipped, self.lrs = [], [], []

    def on_step_end(self, args, state, control, **kwargs):
        acc = self.trainer.accelerator
        self.scales.append(acc.scaler.get_scale() if acc.scaler is not None else None)
        self.skipped.append(acc.optimizer_step_was_skipped)
        self.lrs.append(self.trainer.optimizer.param_groups[0]["lr"])


class Losses:
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append(loss.item())
        return loss


class StockTrainer(Losses, transformers.Trainer):
    pass


class OurTrainer(Losses, ak.Trainer):
    pass


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    reset_accelerate_state()
    stock_fp16_scaler(monkeypatch, **SCALER_KWARGS)
    yield
    reset_accelerate_state()


def run(cls, tmp_path, name, *, resume=None, device="cpu", trainer_kwargs=None, **args):
    reset_accelerate_state()
    defaults = dict(
        output_dir=str(tmp_path / name),
        use_cpu=device == "cpu",
        fp16=True,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-2,
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    record = Record()
    trainer = cls(
        model=Regressor(),
        args=transformers.TrainingArguments(**{**defaults, **args}),
        train_dataset=dataset(),
        callbacks=[record],
        **(trainer_kwargs or {}),
    )
    trainer.losses = []
    record.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer, record


def test_trainer_runs_on_fused_adamw_and_the_fused_scaler(tmp_path):
    trainer, record = run(OurTrainer, tmp_path, "ours", max_steps=2)
    assert type(trainer.optimizer.optimizer) is ampkernels.FusedAdamW
    assert type(trainer.accelerator.scaler) is ampkernels.FusedGradScaler
    groups = trainer.optimizer.param_groups
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.01]  # Trainer's groups: no decay on biases
    assert all(g["betas"] == (0.9, 0.999) and g["eps"] == 1e-8 for g in groups)


def test_same_as_stock_with_fused_adamw_and_the_fused_clip(tmp_path, monkeypatch):
    calls = []
    original = ampkernels.FusedGradScaler.clip_grad_norm_

    def spy(self, optimizer, max_norm, norm_type=2.0):
        calls.append(max_norm)
        return original(self, optimizer, max_norm, norm_type)

    monkeypatch.setattr(ampkernels.FusedGradScaler, "clip_grad_norm_", spy)
    # Stock on torch's AdamW without fused=True: with fused=True stock Accelerate reports a skipped step as taken
    # (ours does not), and the LR schedule of the two runs would part at the first skip.
    stock, stock_record = run(StockTrainer, tmp_path, "stock", optim="adamw_torch")
    ours, record = run(OurTrainer, tmp_path, "ours")
    assert calls == [1.0] * STEPS  # max_grad_norm went to the fused clip at every step
    assert record.scales == stock_record.scales
    assert record.skipped == stock_record.skipped
    assert any(record.skipped) and not all(record.skipped)
    assert record.lrs == stock_record.lrs  # the schedule holds on the same (skipped) steps
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(stock.losses), **FP32_TOL)
    for a, b in zip(ours.model.parameters(), stock.model.parameters()):
        torch.testing.assert_close(a, b, **FP32_TOL)


def test_same_as_stock_bit_for_bit_when_only_the_scaler_changes(tmp_path):
    """SGD (kept by the integration) without clipping: Trainer still asks for the norm (clip to inf), which the
    fused scaler unscales exactly."""
    stock, stock_record = run(StockTrainer, tmp_path, "stock", optim="sgd", max_grad_norm=0.0)
    ours, record = run(OurTrainer, tmp_path, "ours", optim="sgd", max_grad_norm=0.0)
    assert type(ours.optimizer.optimizer) is torch.optim.SGD
    assert type(ours.accelerator.scaler) is ampkernels.FusedGradScaler
    assert ours.losses == stock.losses
    assert (record.scales, record.skipped, record.lrs) == (stock_record.scales, stock_record.skipped, stock_record.lrs)
    assert any(record.skipped)
    for a, b in zip(ours.model.parameters(), stock.model.parameters()):
        assert torch.equal(a, b)


STATE_FORMATS = {
    "fp32": {},
    "bf16": {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"},
    "8bit": {"exp_avg_dtype": "8bit", "exp_avg_sq_dtype": "8bit"},
    "4bit": {"exp_avg_dtype": "4bit", "exp_avg_sq_dtype": "4bit"},
}


@pytest.mark.parametrize("state_format", list(STATE_FORMATS))
def test_checkpoint_resume_continues_bit_for_bit(tmp_path, state_format):
    kwargs = {"adamw_kwargs": STATE_FORMATS[state_format]}
    full, full_record = run(OurTrainer, tmp_path, "full", trainer_kwargs=kwargs)
    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE_AT}"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    states = list(saved["state"].values())
    if state_format in (
        "8bit",
        "4bit",
    ):  # saved as codes, under their own keys: the 128 x 64 weight (the rest is small)
        coded = [s for s in states if "exp_avg_codes" in s]
        assert len(coded) == 1 and all(s["exp_avg_bits"] == int(state_format[0]) for s in coded)
        assert all(s["exp_avg"].numel() < 4096 for s in states if "exp_avg_codes" not in s)
    else:
        dtype = torch.bfloat16 if state_format == "bf16" else torch.float32
        assert all(s["exp_avg"].dtype == dtype for s in states if s["exp_avg"].ndim == 2)
    assert torch.load(checkpoint / "scaler.pt", weights_only=True)["scale"] == full_record.scales[SAVE_AT - 1]

    resumed, record = run(OurTrainer, tmp_path, "resumed", resume=str(checkpoint), trainer_kwargs=kwargs)
    assert resumed.losses == full.losses[SAVE_AT:]
    assert record.scales == full_record.scales[SAVE_AT:]
    assert record.skipped == full_record.skipped[SAVE_AT:]
    assert resumed.accelerator.scaler.state_dict() == full.accelerator.scaler.state_dict()
    for a, b in zip(resumed.model.parameters(), full.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(resumed.optimizer.state.values(), full.optimizer.state.values()):
        assert a.keys() == b.keys()
        for key in a:
            same = torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
            assert same, key


def test_adamw_kwargs_need_an_adamw_optim(tmp_path):
    with pytest.raises(ValueError, match="adamw_kwargs"):
        run(OurTrainer, tmp_path, "x", optim="sgd", trainer_kwargs={"adamw_kwargs": {"exp_avg_dtype": "8bit"}})
    with pytest.raises(TypeError, match="adamw_kwargs"):
        run(OurTrainer, tmp_path, "x", trainer_kwargs={"adamw_kwargs": "8bit"})


def test_optimizer_passed_in_is_kept(tmp_path):
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reset_accelerate_state()
    trainer = ak.Trainer(
        model=model,
        args=transformers.TrainingArguments(str(tmp_path), use_cpu=True, fp16=True, max_steps=2, report_to=[]),
        train_dataset=dataset(64),
        optimizers=(opt, None),
    )
    trainer.train()
    assert trainer.optimizer.optimizer is opt
    assert type(trainer.accelerator.scaler) is ampkernels.FusedGradScaler


# ---- GPU: Accelerate's own fp16 path ----


@pytest.mark.gpu
def test_gpu_same_as_stock(tmp_path):
    stock, stock_record = run(StockTrainer, tmp_path, "stock", device="cuda", optim="adamw_torch")
    ours, record = run(OurTrainer, tmp_path, "ours", device="cuda")
    assert type(ours.accelerator.scaler) is ampkernels.FusedGradScaler
    assert (record.scales, record.skipped, record.lrs) == (stock_record.scales, stock_record.skipped, stock_record.lrs)
    assert any(record.skipped) and not all(record.skipped)
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(stock.losses), **FP32_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("state_format", ["fp32", "8bit"])
def test_gpu_checkpoint_resume(tmp_path, state_format):
    kwargs = {"adamw_kwargs": STATE_FORMATS[state_format]}
    full, full_record = run(OurTrainer, tmp_path, "full", device="cuda", trainer_kwargs=kwargs)
    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE_AT}"
    resumed, record = run(OurTrainer, tmp_path, "resumed", device="cuda", resume=str(checkpoint), trainer_kwargs=kwargs)
    assert resumed.losses == full.losses[SAVE_AT:]
    assert record.scales == full_record.scales[SAVE_AT:]
    for a, b in zip(resumed.model.parameters(), full.model.parameters()):
        assert torch.equal(a, b)
