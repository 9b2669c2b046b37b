"""ampkernels.integrations.lightning against the real Lightning Trainer and Fabric.

The same tiny model trained with Lightning's own ``MixedPrecision`` plugin and with ours gives the same losses and
loss-scale history: bit for bit when only the scaler changes, to FusedAdamW's tolerance against torch's AdamW when
the optimizer and the clip change too. Lightning runs ``"16-mixed"`` on the CPU when handed the plugin, so the CPU
tests run the scaler path; the GPU tests run it on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from integrations_common import SCALER_KWARGS, batches

import ampkernels

lightning = pytest.importorskip("lightning")

from lightning.fabric.plugins.precision import MixedPrecision as StockFabricPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision as StockPrecision  # noqa: E402
from tolerances import OPTIMIZER_FP32  # noqa: E402

from ampkernels.float8 import Float8Linear, convert_to_float8  # noqa: E402
from ampkernels.integrations.lightning import FabricMixedPrecision, MixedPrecision  # noqa: E402

FP32_TOL = OPTIMIZER_FP32
STEPS = 12


def net(out_features: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, out_features))


def fp8_net() -> torch.nn.Module:
    """Aligned to 16 (the FP8 layers' rule)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 16))


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "fused":
        return ampkernels.FusedAdamW(params, lr=1e-2)
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


class Module(lightning.LightningModule):
    """Records the loss of every step and, after it, the scale."""

    def __init__(self, model: torch.nn.Module, optimizer: str):
        super().__init__()
        self.net, self.optimizer_kind = model, optimizer
        self.losses, self.scales = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        scaler = self.trainer.precision_plugin.scaler
        self.scales.append(None if scaler is None else scaler.get_scale())

    def configure_optimizers(self):
        return make_optimizer(self.optimizer_kind, self.parameters())


def loader(n: int = STEPS, width: int = 16, out: int = 8):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, width, generator=g), torch.randn(64, out, generator=g)) for _ in range(n)]
    return torch.utils.data.DataLoader(data, batch_size=None)


def fit(plugin, optimizer: str, *, model=None, device: str = "cpu", data=None, ckpt_path=None, **trainer_args):
    module = Module(net() if model is None else model, optimizer)
    options = dict(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = lightning.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, plugins=[plugin], **{**options, **trainer_args}
    )
    trainer.fit(module, loader() if data is None else data, ckpt_path=ckpt_path)
    return module, trainer


def stock_fp16(device: str = "cpu") -> StockPrecision:
    return StockPrecision("16-mixed", device, scaler=torch.amp.GradScaler(device, **SCALER_KWARGS))


def ours_fp16(device: str = "cpu") -> MixedPrecision:
    return MixedPrecision("16-mixed", device, scaler=ampkernels.FusedGradScaler(device, **SCALER_KWARGS))


def skips(scales: list[float]) -> list[bool]:
    return [b < a for a, b in zip([SCALER_KWARGS["init_scale"]] + scales, scales)]


def test_plugin_defaults():
    plugin = MixedPrecision("16-mixed", "cpu")
    assert type(plugin.scaler) is ampkernels.FusedGradScaler and plugin.device == "cpu"
    assert isinstance(plugin, StockPrecision)  # Lightning's checks and checkpoint logic see an AMP plugin
    assert MixedPrecision.__qualname__ == StockPrecision.__qualname__  # the checkpoint key
    assert MixedPrecision("bf16-mixed", "cpu").scaler is None
    assert FabricMixedPrecision("bf16-mixed", "cpu").scaler is None


def test_plugin_checks_its_arguments():
    with pytest.raises(ValueError, match="'precision'"):
        MixedPrecision("16-true", "cpu")
    with pytest.raises(TypeError, match="'scaler'"):
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="'scaler'"):
        FabricMixedPrecision("bf16-mixed", "cpu", scaler=ampkernels.FusedGradScaler("cpu"))
    with pytest.raises(ValueError, match="recipe"):
        MixedPrecision("bf16-mixed", "cpu", float8="no-such-recipe")
    with pytest.raises(ValueError, match="'float8_options'"):
        MixedPrecision("bf16-mixed", "cpu", float8_options={"min_features": 0})
    with pytest.raises(TypeError, match="'fuse'"):
        MixedPrecision("bf16-mixed", "cpu", fuse="yes")


def test_same_as_stock_bit_for_bit_when_only_the_scaler_changes():
    stock, _ = fit(stock_fp16(), "torch")
    ours, _ = fit(ours_fp16(), "torch")
    assert (ours.losses, ours.scales) == (stock.losses, stock.scales)
    assert any(skips(stock.scales)) and not all(skips(stock.scales)) and len(set(stock.scales)) > 2
    for a, b in zip(ours.parameters(), stock.parameters()):
        assert torch.equal(a, b)


def test_same_as_stock_with_fused_adamw_and_the_fused_clip(monkeypatch):
    calls = []
    original = ampkernels.FusedGradScaler.clip_grad_norm_

    def spy(self, optimizer, max_norm, norm_type=2.0):
        calls.append(max_norm)
        return original(self, optimizer, max_norm, norm_type)

    monkeypatch.setattr(ampkernels.FusedGradScaler, "clip_grad_norm_", spy)
    stock, _ = fit(stock_fp16(), "torch", gradient_clip_val=1.0)
    ours, _ = fit(ours_fp16(), "fused", gradient_clip_val=1.0)
    assert calls == [1.0] * STEPS
    assert ours.scales == stock.scales
    assert any(skips(stock.scales)) and not all(skips(stock.scales))
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(stock.losses), **FP32_TOL)
    for a, b in zip(ours.parameters(), stock.parameters()):
        torch.testing.assert_close(a, b, **FP32_TOL)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clip_matches_stock_with_torch_adamw(algorithm):
    """With an optimizer stock Lightning unscales before the clip: ours clips the same gradients."""
    kw = dict(gradient_clip_val=0.05, gradient_clip_algorithm=algorithm)
    stock, _ = fit(stock_fp16(), "torch", **kw)
    ours, _ = fit(ours_fp16(), "torch", **kw)
    assert ours.scales == stock.scales
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(stock.losses), **FP32_TOL)


def test_clip_by_value_with_fused_adamw():
    """Stock Lightning refuses to clip an optimizer that takes the scale; ours unscales it first."""
    kw = dict(gradient_clip_val=0.05, gradient_clip_algorithm="value")
    stock, _ = fit(stock_fp16(), "torch", **kw)
    ours, _ = fit(ours_fp16(), "fused", **kw)
    assert ours.scales == stock.scales
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(stock.losses), **FP32_TOL)


def test_bf16_mixed_clips_fused_adamw_in_its_step(monkeypatch):
    """bf16 (no scaler): FusedAdamW.clip_grad_norm_, the clip folded into the step, trains as torch's clip does."""
    calls = []
    original = ampkernels.FusedAdamW.clip_grad_norm_

    def spy(self, max_norm, norm_type=2.0):
        calls.append(max_norm)
        return original(self, max_norm, norm_type)

    monkeypatch.setattr(ampkernels.FusedAdamW, "clip_grad_norm_", spy)
    stock, _ = fit(StockPrecision("bf16-mixed", "cpu"), "torch", gradient_clip_val=0.05)
    ours, _ = fit(MixedPrecision("bf16-mixed", "cpu"), "fused", gradient_clip_val=0.05)
    assert calls == [0.05] * STEPS
    assert ours.scales == stock.scales == [None] * STEPS
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(stock.losses), **FP32_TOL)


def test_float8_in_convert_module():
    """The plugin converts the Linear layers before configure_optimizers; the run equals one converted by hand."""
    data = loader(width=64, out=16)
    ours, _ = fit(
        MixedPrecision("bf16-mixed", "cpu", float8="tensorwise", float8_options={"min_features": 0}),
        "fused",
        model=fp8_net(),
        data=data,
    )
    assert [type(m) for m in ours.net if isinstance(m, torch.nn.Linear)] == [Float8Linear, Float8Linear]
    by_hand, _ = fit(
        StockPrecision("bf16-mixed", "cpu"), "fused", model=convert_to_float8(fp8_net(), min_features=0), data=data
    )
    plain, _ = fit(StockPrecision("bf16-mixed", "cpu"), "fused", model=fp8_net(), data=data)
    assert ours.losses == by_hand.losses
    assert ours.losses != plain.losses  # (FP8 changes the numbers: the conversion did take effect)


def test_fuse_in_convert_module():
    """``fuse=True`` runs fuse_modules(loss=True) in the hook: a Hugging Face Llama inside the LightningModule gets the
    fused norms, MLPs, RoPE and loss, then the FP8 layers; the hook's result trains as the model fused by hand."""
    transformers = pytest.importorskip("transformers")
    from ampkernels.float8 import fuse_modules

    def llama() -> torch.nn.Module:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4
        )
        return transformers.LlamaForCausalLM(config)

    plugin = MixedPrecision("bf16-mixed", "cpu", float8="tensorwise", float8_options={"min_features": 0}, fuse=True)
    ours = plugin.convert_module(torch.nn.ModuleDict({"net": llama()}))["net"]
    by_hand = llama()
    report = fuse_modules(by_hand, loss=True)
    convert_to_float8(by_hand, min_features=0)
    assert sorted(name for name, _ in report.swapped) == [
        "(the model)",
        "model.layers.0.input_layernorm",
        "model.layers.0.mlp",
        "model.layers.0.post_attention_layernorm",
        "model.layers.0.self_attn",
        "model.norm",
    ]
    assert [type(m).__qualname__ for m in ours.modules()] == [type(m).__qualname__ for m in by_hand.modules()]
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours_out, hand_out = ours(input_ids=ids, labels=ids), by_hand(input_ids=ids, labels=ids)
    assert ours_out.logits is None and torch.equal(ours_out.loss, hand_out.loss)


def test_checkpoint_moves_between_stock_and_ours(tmp_path):
    """Lightning files the scaler's state under the plugin's class name, "MixedPrecision", for both plugins; a run
    resumed from the checkpoint of the other plugin continues as the uninterrupted run."""
    full, _ = fit(ours_fp16(), "torch", max_epochs=2)
    for first, second in ((stock_fp16, ours_fp16), (ours_fp16, stock_fp16)):
        half, trainer = fit(first(), "torch", max_epochs=1)
        path = tmp_path / f"{first.__name__}.ckpt"
        trainer.save_checkpoint(path)
        state = torch.load(path, weights_only=False)["MixedPrecision"]
        assert state["scale"] == half.scales[-1] == full.scales[STEPS - 1]
        resumed, trainer = fit(second(), "torch", max_epochs=2, ckpt_path=str(path))
        assert resumed.losses == full.losses[STEPS:]
        assert resumed.scales == full.scales[STEPS:]


# ---- Fabric ----


def fabric_run(plugin, optimizer: str, clip: str | None, device: str = "cpu", model=None, data=None):
    fabric = lightning.Fabric(accelerator="gpu" if device == "cuda" else "cpu", devices=1, plugins=[plugin])
    model = net() if model is None else model
    model, opt = fabric.setup(model, make_optimizer(optimizer, model.parameters()))
    losses, scales = [], []
    for x, y in batches(STEPS) if data is None else data:
        x, y = fabric.to_device((x, y))
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        if clip == "fabric":
            fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
        elif clip == "fused":
            plugin.clip_grad_norm_(opt, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        scales.append(None if plugin.scaler is None else plugin.scaler.get_scale())
    return losses, scales, model


def stock_fabric_fp16(device: str = "cpu"):
    return StockFabricPrecision("16-mixed", device, scaler=torch.amp.GradScaler(device, **SCALER_KWARGS))


def ours_fabric_fp16(device: str = "cpu"):
    return FabricMixedPrecision("16-mixed", device, scaler=ampkernels.FusedGradScaler(device, **SCALER_KWARGS))


def test_fabric_same_as_stock_bit_for_bit_when_only_the_scaler_changes():
    stock = fabric_run(stock_fabric_fp16(), "torch", None)
    ours = fabric_run(ours_fabric_fp16(), "torch", None)
    assert ours[:2] == stock[:2]
    assert any(skips(stock[1])) and not all(skips(stock[1]))


@pytest.mark.parametrize("clip", ["fused", "fabric"])
def test_fabric_fused_adamw_and_clip(clip):
    """The fused clip, and fabric.clip_gradients (which stock Fabric refuses for an optimizer taking the scale)."""
    stock = fabric_run(stock_fabric_fp16(), "torch", "fabric")
    ours = fabric_run(ours_fabric_fp16(), "fused", clip)
    assert ours[1] == stock[1]
    assert any(skips(stock[1])) and not all(skips(stock[1]))
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(stock[0]), **FP32_TOL)


def test_fabric_float8_in_convert_module():
    data = [(x, y) for x, y in loader(width=64, out=16)]
    plugin = FabricMixedPrecision("bf16-mixed", "cpu", float8="tensorwise", float8_options={"min_features": 0})
    losses, _, model = fabric_run(plugin, "fused", None, model=fp8_net(), data=data)
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 2
    stock = StockFabricPrecision("bf16-mixed", "cpu")
    by_hand, _, _ = fabric_run(stock, "fused", None, model=convert_to_float8(fp8_net(), min_features=0), data=data)
    plain, _, _ = fabric_run(StockFabricPrecision("bf16-mixed", "cpu"), "fused", None, model=fp8_net(), data=data)
    assert losses == by_hand
    assert losses != plain  # (FP8 changes the numbers: the conversion did take effect)


# ---- GPU ----


@pytest.mark.gpu
def test_gpu_trainer_same_as_stock():
    stock, _ = fit(stock_fp16("cuda"), "torch", device="cuda")
    ours, _ = fit(ours_fp16("cuda"), "torch", device="cuda")
    assert (ours.losses, ours.scales) == (stock.losses, stock.scales)
    stock, _ = fit(stock_fp16("cuda"), "torch", device="cuda", gradient_clip_val=1.0)
    ours, _ = fit(ours_fp16("cuda"), "fused", device="cuda", gradient_clip_val=1.0)
    assert ours.scales == stock.scales
    assert any(skips(stock.scales)) and not all(skips(stock.scales))
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(stock.losses), **FP32_TOL)


@pytest.mark.gpu
def test_gpu_fabric_same_as_stock():
    stock = fabric_run(stock_fabric_fp16("cuda"), "torch", "fabric", device="cuda")
    ours = fabric_run(ours_fabric_fp16("cuda"), "fused", "fused", device="cuda")
    assert ours[1] == stock[1]
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(stock[0]), **FP32_TOL)


@pytest.mark.gpu
def test_gpu_float8_in_convert_module():
    data = loader(width=64, out=16)
    ours, _ = fit(
        MixedPrecision("bf16-mixed", "cuda", float8="tensorwise", float8_options={"min_features": 0}),
        "fused",
        model=fp8_net(),
        data=data,
        device="cuda",
    )
    assert sum(isinstance(m, Float8Linear) for m in ours.modules()) == 2
    by_hand, _ = fit(
        StockPrecision("bf16-mixed", "cuda"),
        "fused",
        model=convert_to_float8(fp8_net(), min_features=0),
        data=data,
        device="cuda",
    )
    assert ours.losses == by_hand.losses
