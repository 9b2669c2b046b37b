"""FusedGradScaler's extras: hysteresis (the Megatron-LM rule), scale bounds, device-side telemetry and its plot."""

from __future__ import annotations

import math

import pytest
import torch
from grad_scaler_common import (
    FLOAT32_TINY,
    INF,
    Stock,
    drive,
    misuse_setup,
)

import ampkernels
from ampkernels import FusedGradScaler


def expected_scales(pattern, init, growth_interval, hysteresis=1, factor=2.0, backoff=0.5, lo=FLOAT32_TINY, hi=INF):
    """The contract's update rule, written out in Python (Megatron-LM hysteresis, clamped to [lo, hi])."""
    scale, tracker, hyst, out = init, 0, hysteresis, []
    for c in pattern:
        if c == "o":
            tracker, hyst = 0, hyst - 1
            if hyst <= 0:
                scale = max(scale * backoff, lo)
        else:
            tracker += 1
            if tracker == growth_interval:
                if math.isfinite(scale * factor):
                    scale = min(scale * factor, hi)
                tracker, hyst = 0, hysteresis
        out.append(scale)
    return out


def test_hysteresis_2_backs_off_on_second_overflow_since_growth(device):
    scaler = FusedGradScaler(device, init_scale=1024.0, growth_interval=3, hysteresis=2)
    scales, skipped = drive(scaler, device, "oo...o.oo")
    assert scales == [1024, 512, 512, 512, 1024, 1024, 1024, 512, 256]
    assert skipped == [c == "o" for c in "oo...o.oo"], "an overflow absorbed by hysteresis must still skip the step"


def test_hysteresis_is_not_reset_by_finite_steps_without_growth(device):
    scaler = FusedGradScaler(device, init_scale=1024.0, growth_interval=2, hysteresis=3)
    assert drive(scaler, device, "o.o.o..o")[0] == [1024, 1024, 1024, 1024, 512, 512, 1024, 1024]


def test_hysteresis_random_pattern_follows_megatron_rule(device):
    pattern = "".join("o" if b else "." for b in (torch.rand(40, generator=torch.Generator().manual_seed(0)) < 0.35))
    scaler = FusedGradScaler(device, init_scale=2.0**12, growth_interval=2, hysteresis=2)
    scales, skipped = drive(scaler, device, pattern)
    assert scales == expected_scales(pattern, 2.0**12, 2, hysteresis=2)
    assert skipped == [c == "o" for c in pattern]


def test_max_scale_clamps_growth(device):
    scaler = FusedGradScaler(device, init_scale=1024.0, growth_interval=1, max_scale=3000.0)
    assert drive(scaler, device, "...o..")[0] == [2048, 3000, 3000, 1500, 3000, 3000]


def test_min_scale_clamps_backoff(device):
    scaler = FusedGradScaler(device, init_scale=1024.0, growth_interval=2, min_scale=256.0)
    assert drive(scaler, device, "oooo..")[0] == [512, 256, 256, 256, 256, 512]


def test_scale_never_drops_below_smallest_normal_float32_by_default(device):
    pattern = "oooooo."
    ours = drive(FusedGradScaler(device, init_scale=2.0**-123, growth_interval=1), device, pattern)[0]
    stock = drive(Stock(device, init_scale=2.0**-123, growth_interval=1), device, pattern)[0]
    assert ours == [2.0**-124, 2.0**-125, 2.0**-126, 2.0**-126, 2.0**-126, 2.0**-126, 2.0**-125]
    assert stock[:3] == ours[:3] and stock[3] == 2.0**-127, "stock goes on below 2**-126"


@pytest.mark.parametrize("history_size", [4, 1024])
def test_telemetry_reports_history_and_counters(device, history_size):
    pattern = "..o..o."
    scaler = FusedGradScaler(device, init_scale=1024.0, growth_interval=2, telemetry=True, history_size=history_size)
    scales, _ = drive(scaler, device, pattern)
    t = scaler.telemetry()
    assert set(t) >= {"scale_history", "updates", "skipped_steps", "last_grad_norm"}
    assert isinstance(t["scale_history"], list) and all(isinstance(s, float) for s in t["scale_history"])
    assert t["scale_history"] == scales[-history_size:]
    assert (t["updates"], t["skipped_steps"]) == (7, 2)
    assert isinstance(t["updates"], int) and isinstance(t["skipped_steps"], int)
    assert t["last_grad_norm"] is None, "no norm was measured (clip_grad_norm_ never called)"


def test_telemetry_last_grad_norm_is_the_clip_norm(device):
    scaler, opt = misuse_setup(lambda d, **kw: FusedGradScaler(d, telemetry=True, **kw), device)
    norm = scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    last = scaler.telemetry()["last_grad_norm"]
    assert isinstance(last, float) and last == pytest.approx(norm.item(), rel=1e-6)


def test_plot_scale_history_writes_png(device, tmp_path):
    pytest.importorskip("matplotlib")
    scaler = FusedGradScaler(device, init_scale=1024.0, growth_interval=2, telemetry=True)
    drive(scaler, device, "..o..")
    path = tmp_path / "scale.png"
    ampkernels.plot_scale_history(scaler, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
