"""The largest finite value of each dtype is finite: every backend's non-finite check (``unscale_reduce_``) leaves
``found_inf`` at 0 on a tensor that holds exactly ±max (float32's FLT_MAX, float16's 65504, bfloat16's and
float64's largest values) and sets it on the next value up (inf); so does FusedGradScaler end to end, as
``torch.amp.GradScaler`` does (the step is taken, the scale grows).

The ``device`` argument is parametrized by conftest.py (cpu, and cuda when present).
"""

from __future__ import annotations

import math

import pytest
import torch

import ampkernels
from ampkernels import dispatch, ops

BACKENDS = ["native", "triton", "torch"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# Past the native chunk (16384 elements), so that the values sit in different chunks and at a chunk's last element.
SIZES = [5, 16385, 3]


def _skip_unless_runs(backend: str, device: str) -> None:
    reason = dispatch.why_not("unscale_reduce_", backend, device)
    if reason is not None:
        pytest.skip(reason)


def _with_extremes(dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    """Random tensors holding +max at the first element, -max at a chunk's last element and at the very last."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen).to(dtype).to(device) for n in SIZES]
    largest = torch.finfo(dtype).max
    tensors[0][0] = largest
    tensors[1][16383] = -largest
    tensors[2][-1] = -largest
    return tensors


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's norm of FLT_MAX: inf
@pytest.mark.parametrize("write", [True, False], ids=["unscale", "read-only"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_largest_finite_value_is_finite(device, backend, dtype, write):
    _skip_unless_runs(backend, device)
    tensors = _with_extremes(dtype, device)
    largest = torch.finfo(dtype).max
    assert all(torch.isfinite(t).all() for t in tensors) and tensors[0][0].item() == largest
    found = torch.zeros(1, device=device)
    scale = torch.full((1,), 2.0, device=device)  # unscaled by 0.5: every value stays finite
    ops.unscale_reduce_(tensors, scale, found, write=write, norm_type=2.0, backend=backend)
    assert found.item() == 0.0, f"{backend}: ±{largest} ({dtype}) counted as non-finite"
    if write:
        assert tensors[0][0].item() == largest / 2 and tensors[2][-1].item() == -largest / 2
    # The next value up is inf: flagged, wherever it is.
    for t, index, value in ((0, 0, math.inf), (1, 16383, -math.inf), (2, -1, -math.inf)):
        poisoned = _with_extremes(dtype, device)
        poisoned[t][index] = value
        assert torch.nextafter(torch.tensor(largest, dtype=dtype), torch.tensor(math.inf, dtype=dtype)).isinf()
        found = torch.zeros(1, device=device)
        ops.unscale_reduce_(poisoned, scale, found, write=write, backend=backend)
        assert found.item() == 1.0, (backend, t, index)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_grad_scaler_takes_the_step_on_the_largest_finite_gradient(device, backend):
    """Gradients holding ±FLT_MAX after backward: FusedGradScaler finds no overflow, the optimizer steps and the
    scale grows, exactly as with torch.amp.GradScaler; with an inf instead, both skip the step and back off."""
    _skip_unless_runs(backend, device)
    flt_max = torch.finfo(torch.float32).max
    results = {}
    for poison in (flt_max, math.inf):
        for kind in ("stock", "fused"):
            torch.manual_seed(0)
            model = torch.nn.Linear(6, 4).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)
            if kind == "stock":
                scaler = torch.amp.GradScaler(device, init_scale=2.0**16, growth_interval=1)
            else:
                scaler = ampkernels.FusedGradScaler(device, init_scale=2.0**16, growth_interval=1, backend=backend)
            before = [p.detach().clone() for p in model.parameters()]
            scaler.scale(model(torch.randn(3, 6, device=device)).square().mean()).backward()
            model.weight.grad[1, 2] = poison
            model.bias.grad[3] = -flt_max
            scaler.step(optimizer)
            scaler.update()
            stepped = not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            results[poison, kind] = (stepped, scaler.get_scale(), [p.detach().clone() for p in model.parameters()])
    for poison, stepped, scale in ((flt_max, True, 2.0**17), (math.inf, False, 2.0**15)):
        assert results[poison, "stock"][:2] == (stepped, scale), ("stock", poison, results[poison, "stock"][:2])
        assert results[poison, "fused"][:2] == (stepped, scale), (backend, poison, results[poison, "fused"][:2])
        for ours, stock in zip(results[poison, "fused"][2], results[poison, "stock"][2]):
            torch.testing.assert_close(ours, stock, rtol=1e-6, atol=0)
