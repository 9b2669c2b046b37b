"""AMSGrad's running maximum of the second moment propagates NaN, as ``torch.optim.AdamW(amsgrad=True)`` does
(``torch.maximum``): on every backend of FusedAdamW, a NaN gradient leaves NaN in the parameter and in all three
moments, and a NaN second moment under a finite first one (from a loaded or edited state) makes the parameter NaN
instead of stepping it by the old maximum. No scaler: nothing skips the step.

The ``device`` argument is parametrized by conftest.py (cpu, and cuda when present).
"""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import OPTIMIZER_FP32

from ampkernels import FusedAdamW, dispatch

BACKENDS = ["native", "triton", "torch"]
SHAPES = [(7, 5), (33,)]
POISONED = (0, (2, 3))  # the tensor and element that meet the NaN
KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# FusedAdamW and torch's AdamW round the same float32 math in a different order (see tests/optim/test_optimizers.py).
FP32_TOL = dict(OPTIMIZER_FP32, equal_nan=True)


def _run(make, device, where, steps=3):
    """Three AdamW steps from fixed parameters and gradients; before step 1 the NaN goes into the gradient or the
    second moment of element POISONED. Returns the optimizer and its parameters."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen).to(device) for s in SHAPES] for _ in range(steps)]
    optimizer = make(params)
    t, index = POISONED
    for step in range(steps):
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()
        if step == 1 and where == "gradient":
            params[t].grad[index] = math.nan
        if step == 1 and where == "second moment":
            with torch.no_grad():
                optimizer.state[params[t]]["exp_avg_sq"][index] = math.nan
        optimizer.step()
    return optimizer, params


@pytest.mark.parametrize("where", ["gradient", "second moment"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_amsgrad_propagates_nan_as_torch_does(device, backend, where):
    reason = dispatch.why_not("adam", backend, device)
    if reason is not None:
        pytest.skip(reason)
    options = dict(lr=1e-3, weight_decay=0.01, amsgrad=True)
    stock, stock_params = _run(lambda ps: torch.optim.AdamW(ps, foreach=False, **options), device, where)
    ours, our_params = _run(lambda ps: FusedAdamW(ps, backend=backend, **options), device, where)
    t, index = POISONED
    assert math.isnan(stock_params[t].detach()[index]) and math.isnan(
        stock.state[stock_params[t]]["max_exp_avg_sq"][index]
    )
    for i, (a, b) in enumerate(zip(our_params, stock_params)):
        torch.testing.assert_close(a.detach(), b.detach(), **FP32_TOL, msg=f"{backend}: parameter {i}")
        for key in KEYS:
            torch.testing.assert_close(
                ours.state[a][key], stock.state[b][key], **FP32_TOL, msg=f"{backend}: {key} of parameter {i}"
            )
    nan = torch.isnan(our_params[t].detach())
    assert nan.sum() == 1 and nan[index]  # the NaN stays in its element
    assert all(torch.isfinite(p).all() for p in our_params[1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_amsgrad_with_bfloat16_moments_propagates_nan(device, backend):
    """The blockwise step (bfloat16 moments) keeps the same rule: the NaN reaches the parameter and the running
    maximum of the poisoned element only (values compared loosely: torch's moments are float32)."""
    reason = dispatch.why_not("adam_blockwise", backend, device)
    if reason is not None:
        pytest.skip(reason)
    options = dict(lr=1e-3, weight_decay=0.01, amsgrad=True)
    for where in ("gradient", "second moment"):
        stock, stock_params = _run(lambda ps: torch.optim.AdamW(ps, foreach=False, **options), device, where)
        ours, our_params = _run(
            lambda ps: FusedAdamW(ps, backend=backend, exp_avg_sq_dtype=torch.bfloat16, **options), device, where
        )
        for a, b in zip(our_params, stock_params):
            assert torch.equal(torch.isnan(a), torch.isnan(b)), (backend, where)
            assert torch.equal(ours.state[a]["max_exp_avg_sq"].isnan(), stock.state[b]["max_exp_avg_sq"].isnan())
            torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-4, equal_nan=True)
