"""ampkernels.integrations.accelerate against the real Accelerate.

The same tiny model trained through stock Accelerate and through ``ampkernels.integrations.accelerate`` gives the
same losses and the same loss-scale history: bit for bit when only the scaler changes (FusedGradScaler unscales by
powers of two, as stock), to FusedAdamW's tolerance against torch's AdamW when the optimizer and the clip change
too. Accelerate makes a loss scaler for fp16 only on a GPU, so the CPU tests set up on the CPU what it sets up on
a GPU (``stock_fp16_scaler``); the GPU tests run its own fp16 path and check with ``torch.cuda.set_sync_debug_mode``
that no step synchronizes with the host.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from integrations_common import (
    SCALER_KWARGS,
    batches,
    count_host_reads,
    reset_accelerate_state,
    stock_fp16_scaler,
    tiny_model,
)

import ampkernels


@pytest.mark.parametrize(
    "name, package", [("accelerate", "accelerate"), ("transformers", "transformers"), ("lightning", "lightning")]
)
def test_import_without_the_framework(monkeypatch, name, package):
    """``import ampkernels.integrations`` needs no framework; a submodule names the package it needs."""
    monkeypatch.setitem(sys.modules, package, None)  # makes `import <package>` raise ImportError
    for key in [k for k in sys.modules if k.startswith("ampkernels.integrations")]:
        monkeypatch.delitem(sys.modules, key)
    integrations = importlib.import_module("ampkernels.integrations")
    assert set(integrations.__all__) == {"accelerate", "transformers", "lightning"}
    with pytest.raises(ImportError, match=f"pip install {package}"):
        importlib.import_module(f"ampkernels.integrations.{name}")


accelerate = pytest.importorskip("accelerate")

from accelerate.utils import GradScalerKwargs  # noqa: E402
from tolerances import OPTIMIZER_FP32  # noqa: E402

from ampkernels.integrations import accelerate as ak  # noqa: E402

FP32_TOL = OPTIMIZER_FP32


@pytest.fixture(autouse=True)
def fresh_state():
    reset_accelerate_state()
    yield
    reset_accelerate_state()


@pytest.fixture
def cpu_fp16(monkeypatch):
    stock_fp16_scaler(monkeypatch, **SCALER_KWARGS)


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "fused":
        return ampkernels.FusedAdamW(model.parameters(), lr=1e-2)
    if kind == "torch-fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def train(accelerator, optimizer_kind: str, steps: int = 12, clip: float | None = 1.0, device: str = "cpu", poison=()):
    """Trains the tiny model; returns (losses, scales, skipped) per step, read after each step."""
    model = tiny_model()
    model, optimizer = accelerator.prepare(model, make_optimizer(optimizer_kind, model))
    losses, scales, skipped = [], [], []
    for i, (x, y) in enumerate(batches(steps, device)):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss * (float("inf") if i in poison else 1.0))
        if clip is not None:
            accelerator.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        scales.append(accelerator.scaler.get_scale())
        skipped.append(accelerator.optimizer_step_was_skipped)
    return losses, scales, skipped


def test_accelerator_uses_the_fused_scaler(cpu_fp16):
    stock = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    ours = ak.Accelerator(cpu=True, mixed_precision="fp16")
    assert type(stock.scaler) is torch.amp.GradScaler
    assert type(ours.scaler) is ampkernels.FusedGradScaler
    assert ours.scaler.get_scale() == SCALER_KWARGS["init_scale"]
    assert ours.scaler.get_growth_interval() == SCALER_KWARGS["growth_interval"]
    _, optimizer = ours.prepare(tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1))
    assert optimizer.scaler is ours.scaler


def test_scaler_settings_come_from_grad_scaler_kwargs(cpu_fp16):
    handler = GradScalerKwargs(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    acc = ak.Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[handler])
    s = acc.scaler
    assert isinstance(s, ampkernels.FusedGradScaler)
    assert (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (
        1024.0,
        4.0,
        0.25,
        7,
    )


def test_same_as_stock_bit_for_bit_when_only_the_scaler_changes(cpu_fp16):
    """torch's AdamW, no clip: the runs differ only in the scaler, whose unscale is exact."""
    stock = train(accelerate.Accelerator(cpu=True, mixed_precision="fp16"), "torch", clip=None)
    reset_accelerate_state()
    ours = train(ak.Accelerator(cpu=True, mixed_precision="fp16"), "torch", clip=None)
    assert ours == stock  # losses, scales and skipped steps, exactly
    assert any(stock[2]) and not all(stock[2])  # the run did skip steps, and took others
    assert len(set(stock[1])) > 2  # and the scale moved both ways


def test_same_as_stock_with_fused_adamw_and_the_fused_clip(cpu_fp16):
    stock = train(accelerate.Accelerator(cpu=True, mixed_precision="fp16"), "torch")
    reset_accelerate_state()
    ours = train(ak.Accelerator(cpu=True, mixed_precision="fp16"), "fused")
    assert ours[1] == stock[1]  # the scale after every step
    assert ours[2] == stock[2]  # which steps were skipped
    assert any(stock[2]) and not all(stock[2])
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(stock[0]), **FP32_TOL)


def test_the_fused_clip_runs_and_matches_accelerates(cpu_fp16, monkeypatch):
    calls = []
    original = ampkernels.FusedGradScaler.clip_grad_norm_

    def spy(self, optimizer, max_norm, norm_type=2.0):
        calls.append(max_norm)
        return original(self, optimizer, max_norm, norm_type)

    monkeypatch.setattr(ampkernels.FusedGradScaler, "clip_grad_norm_", spy)
    results = {}
    for name, make in (("stock", accelerate.Accelerator), ("ours", ak.Accelerator)):
        reset_accelerate_state()
        acc = make(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=2.0**10)])
        model = tiny_model()
        model, optimizer = acc.prepare(model, make_optimizer("torch", model))  # the clip writes the gradients
        x, y = batches(1)[0]
        acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        norm = acc.clip_grad_norm_(model.parameters(), 0.05)
        results[name] = (norm, [p.grad.clone() for p in model.parameters()])
    assert calls == [0.05]  # ours went through FusedGradScaler.clip_grad_norm_, once
    assert results["stock"][0] > 0.1  # (so the clip did scale the gradients down)
    torch.testing.assert_close(results["ours"][0], results["stock"][0], **FP32_TOL)
    for a, b in zip(results["ours"][1], results["stock"][1]):
        torch.testing.assert_close(a, b, **FP32_TOL)


def test_bf16_clip_is_folded_into_the_fused_step(monkeypatch):
    """No scaler (bf16): the parameters of a FusedAdamW are clipped by its clip_grad_norm_ (one read-only pass, the
    coefficient applied in its step), training as Accelerate's clip with torch's AdamW does."""
    calls = []
    original = ampkernels.FusedAdamW.clip_grad_norm_

    def spy(self, max_norm, norm_type=2.0):
        calls.append(max_norm)
        return original(self, max_norm, norm_type)

    monkeypatch.setattr(ampkernels.FusedAdamW, "clip_grad_norm_", spy)
    results = {}
    for name, make, kind in (("stock", accelerate.Accelerator, "torch"), ("ours", ak.Accelerator, "fused")):
        reset_accelerate_state()
        acc = make(cpu=True, mixed_precision="bf16")
        model = tiny_model()
        model, optimizer = acc.prepare(model, make_optimizer(kind, model))
        losses, norms = [], []
        for x, y in batches(6):
            with acc.autocast():
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            acc.backward(loss)
            norms.append(acc.clip_grad_norm_(model.parameters(), 0.05))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        results[name] = (torch.tensor(losses), torch.stack(norms), [p.detach() for p in model.parameters()])
    assert calls == [0.05] * 6
    assert (results["stock"][1] > 0.05).all()  # (the clip clipped every step)
    for ours, stock in zip(results["ours"][:2], results["stock"][:2]):
        torch.testing.assert_close(ours, stock, **FP32_TOL)
    for a, b in zip(results["ours"][2], results["stock"][2]):
        torch.testing.assert_close(a, b, **FP32_TOL)


def test_other_parameter_sets_take_accelerates_clip(cpu_fp16, monkeypatch):
    acc = ak.Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=2.0**10)])
    model = tiny_model()
    model, optimizer = acc.prepare(model, make_optimizer("fused", model))
    monkeypatch.setattr(ampkernels.FusedGradScaler, "clip_grad_norm_", lambda *a, **k: pytest.fail("fused clip"))
    x, y = batches(1)[0]
    acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
    first = list(model[0].parameters())
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in first])) / 2.0**10
    norm = acc.clip_grad_norm_(first, 1e9)  # a subset of the optimizer's parameters
    torch.testing.assert_close(norm, expected, **FP32_TOL)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()  # after Accelerate's unscale_, the step takes the unscaled gradients
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_no_host_read_per_step_and_the_skip_flag_is_read_when_asked(cpu_fp16):
    """On the CPU, count the host reads of tensor values (each one a sync on a GPU) in steady-state steps."""
    for kind, make in (("stock", accelerate.Accelerator), ("ours", ak.Accelerator)):
        reset_accelerate_state()
        acc = make(cpu=True, mixed_precision="fp16")
        model = tiny_model()
        model, optimizer = acc.prepare(model, make_optimizer("torch" if kind == "stock" else "fused", model))
        data = batches(8)
        for i, (x, y) in enumerate(data):
            if i == 3:
                reads = count_host_reads()
                counts = reads.__enter__()
            acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
            acc.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        steady = sum(counts.values())
        first = acc.optimizer_step_was_skipped
        after_first = sum(counts.values())
        second = acc.optimizer_step_was_skipped
        after_second = sum(counts.values())
        reads.__exit__(None, None, None)
        if kind == "stock":
            assert steady >= 5, dict(counts)  # the stock step reads found_inf on the host (the counter sees it)
        else:
            assert steady == 0, dict(counts)  # 5 steps, no host read
            assert after_first == 1 and counts["item"] == 1  # the flag, read when asked
            assert after_second == 1  # and kept
        assert first is False and second is False


@pytest.mark.parametrize("kind", ["fused", "torch-fused", "torch"])
def test_step_was_skipped_answers(cpu_fp16, kind):
    """A poisoned step is reported skipped, for optimizers that skip on the device (stock Accelerate reports those
    as taken: it infers a skip from whether step() was called) and for those the scaler skips on the host."""
    _, clean_scales, clean = train(ak.Accelerator(cpu=True, mixed_precision="fp16"), kind, steps=10)
    reset_accelerate_state()
    _, scales, skipped = train(ak.Accelerator(cpu=True, mixed_precision="fp16"), kind, steps=10, poison=(6,))
    assert skipped[:6] == clean[:6] and scales[:6] == clean_scales[:6]
    assert clean[6] is False and skipped[6] is True
    assert scales[6] == scales[5] / 2
    assert clean[0] is True  # the configured 2**20 overflows on the first step: skips are reported in both runs


def test_accumulation_steps_keep_the_last_answer(cpu_fp16):
    acc = ak.Accelerator(cpu=True, mixed_precision="fp16", gradient_accumulation_steps=2)
    model = tiny_model()
    model, optimizer = acc.prepare(model, make_optimizer("fused", model))
    previous_scale, previous_answer, skips = acc.scaler.get_scale(), False, 0
    for x, y in batches(12):
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
            optimizer.step()
            optimizer.zero_grad()
        answer, scale = acc.optimizer_step_was_skipped, acc.scaler.get_scale()
        if acc.sync_gradients:
            assert answer == (scale < previous_scale)
            skips += answer
        else:
            assert answer == previous_answer and scale == previous_scale
        previous_scale, previous_answer = scale, answer
    assert skips >= 1


def test_checkpoint_round_trip(cpu_fp16, tmp_path):
    acc = ak.Accelerator(cpu=True, mixed_precision="fp16")
    _, scales, _ = train(acc, "fused", steps=5)
    acc.save_state(str(tmp_path))
    state = acc.scaler.state_dict()
    reset_accelerate_state()
    other = ak.Accelerator(cpu=True, mixed_precision="fp16")
    model = tiny_model(seed=5)
    other.prepare(model, make_optimizer("fused", model))
    other.load_state(str(tmp_path))
    assert other.scaler.state_dict() == state
    assert other.scaler.get_scale() == scales[-1]


def test_patch_checks_its_arguments(cpu_fp16):
    with pytest.raises(TypeError, match="'accelerator'"):
        ak.patch(object())
    acc = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    with pytest.raises(TypeError, match="'scaler'"):
        ak.patch(acc, scaler=torch.amp.GradScaler("cpu"))
    reset_accelerate_state()
    bf16 = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    with pytest.raises(ValueError, match="no loss scaler"):
        ak.patch(bf16, scaler=ampkernels.FusedGradScaler("cpu"))
    assert ak.patch(bf16) is bf16 and bf16.scaler is None  # bf16: nothing to replace, nothing breaks


def test_patch_moves_optimizers_prepared_before(cpu_fp16):
    acc = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    model = tiny_model()
    model, optimizer = acc.prepare(model, make_optimizer("fused", model))
    ak.patch(acc)
    assert optimizer.scaler is acc.scaler and isinstance(acc.scaler, ampkernels.FusedGradScaler)
    assert ak.patch(acc) is acc  # twice: nothing more happens


def test_given_scaler_is_used(cpu_fp16):
    scaler = ampkernels.FusedGradScaler("cpu", init_scale=8.0, telemetry=True)
    acc = ak.Accelerator(cpu=True, mixed_precision="fp16", scaler=scaler)
    assert acc.scaler is scaler
    train(acc, "fused", steps=3)
    assert scaler.telemetry()["updates"] == 3


# ---- GPU: Accelerate's own fp16 path ----


def gpu_accelerator(make):
    reset_accelerate_state()
    return make(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(**SCALER_KWARGS)])


@pytest.mark.gpu
def test_gpu_same_as_stock():
    stock = train(gpu_accelerator(accelerate.Accelerator), "torch", clip=None, device="cuda")
    ours = train(gpu_accelerator(ak.Accelerator), "torch", clip=None, device="cuda")
    assert ours == stock
    stock = train(gpu_accelerator(accelerate.Accelerator), "torch", device="cuda")
    ours = train(gpu_accelerator(ak.Accelerator), "fused", device="cuda")
    assert ours[1:] == stock[1:]
    assert any(stock[2]) and not all(stock[2])
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(stock[0]), **FP32_TOL)


def gpu_steps(acc, kind: str, warmup: int = 3, steps: int = 5):
    model = tiny_model().cuda()
    model, optimizer = acc.prepare(model, make_optimizer(kind, model))
    data = batches(warmup + steps, "cuda")

    def step(x, y):
        acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    for x, y in data[:warmup]:
        step(x, y)
    torch.cuda.synchronize()
    return step, data[warmup:]


@pytest.mark.gpu
def test_gpu_no_host_sync_per_step():
    acc = gpu_accelerator(ak.Accelerator)
    step, data = gpu_steps(acc, "fused")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in data:
            step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert acc.optimizer_step_was_skipped in (True, False)  # read when asked


@pytest.mark.gpu
def test_gpu_stock_step_syncs():
    """The check above can fail: stock Accelerate with torch's (foreach) AdamW syncs in every step."""
    step, data = gpu_steps(gpu_accelerator(accelerate.Accelerator), "torch")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            step(*data[0])
    finally:
        torch.cuda.set_sync_debug_mode(0)
