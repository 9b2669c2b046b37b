"""The FP8 casts on inputs at the edge of their contract, on every backend that runs here (native: CUDA tensors;
Triton: CUDA, or the interpreter on CPU; torch: the reference).

The ``device`` argument is parametrized by conftest.py (cpu, and cuda when present).
"""

from __future__ import annotations

import math

import pytest
import torch

from ampkernels import dispatch, reference
from ampkernels._constants import FLOAT8_DTYPES
from ampkernels.float8 import to_float8, to_float8_pair

BACKENDS = ["native", "triton", "torch"]
FLOAT32_MAX = torch.finfo(torch.float32).max


def _skip_unless_runs(backend: str, device: str) -> None:
    reason = dispatch.why_not("to_float8", backend, device)
    if reason is not None:
        pytest.skip(reason)


def _beyond_float32(device, seed: int = 0) -> torch.Tensor:
    """Random float64 values with finite ones beyond float32's range (x.float() makes them inf) in a few places."""
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
    x[0, 1] = 1e39
    x[3, 4] = -1e300
    x[5, 9] = 3.5e38  # just beyond float32's largest, 3.4028e38
    return x.to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("transpose", [False, True])
def test_finite_float64_beyond_float32_saturates(device, backend, dtype, granularity, transpose):
    """Finite float64 values beyond float32's range became NaN codes (x.float() is inf), the amax was taken as not
    finite (scale 1, found_inf set); a finite value never becomes inf or NaN: they cast as if saturated to float32's
    largest value first."""
    _skip_unless_runs(backend, device)
    x = _beyond_float32(device)
    data, scale_inv = to_float8(x, dtype, granularity, transpose=transpose, backend=backend)
    assert not data.float().isnan().any(), "a finite input became NaN"
    saturated = x.clamp(-FLOAT32_MAX, FLOAT32_MAX).float()
    want_data, want_scale_inv = to_float8(saturated, dtype, granularity, transpose=transpose, backend=backend)
    assert torch.equal(_bits(data), _bits(want_data))
    assert torch.equal(scale_inv, want_scale_inv)
    limit = torch.finfo(dtype).max
    big = data.float() if not transpose else data.float().t()
    assert big[0, 1] > 0 and big[3, 4] < 0 and big[5, 9] > 0
    if granularity == "tensor":  # the largest magnitude maps to the format's largest
        assert big.abs().max() == limit


@pytest.mark.parametrize("backend", BACKENDS)
def test_finite_float64_beyond_float32_is_recorded_as_finite(device, backend):
    _skip_unless_runs(backend, device)
    x = _beyond_float32(device, seed=1)
    amax = torch.zeros(1, device=device)
    found = torch.zeros(1, device=device)
    to_float8(x, amax_out=amax, found_inf=found, backend=backend)
    assert float(found) == 0.0, "a finite input set found_inf"
    assert float(amax) == FLOAT32_MAX
    data, data_t, _ = to_float8_pair(x, amax_out=amax, found_inf=found, backend=backend)
    assert not data.float().isnan().any() and torch.equal(_bits(data.t()), _bits(data_t))
    assert float(found) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_float64_still_becomes_nan_and_sets_found_inf(device, backend, bad):
    """Saturating the finite values leaves the rule for inf and NaN as it was: a NaN code and the flag set."""
    _skip_unless_runs(backend, device)
    x = _beyond_float32(device, seed=2)
    x[2, 2] = bad
    found = torch.zeros(1, device=device)
    data, _ = to_float8(x, found_inf=found, backend=backend)
    codes = data.float()
    assert codes[2, 2].isnan()
    assert codes.isnan().sum() == 1
    assert float(found) == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_delayed_scaling_saturates_finite_float64(device, backend):
    _skip_unless_runs(backend, device)
    x = _beyond_float32(device, seed=3)
    data, _ = to_float8(x, scale=torch.ones(1, device=device), backend=backend)
    limit = torch.finfo(torch.float8_e4m3fn).max
    assert data.float()[0, 1] == limit and data.float()[3, 4] == -limit and data.float()[5, 9] == limit
    assert not data.float().isnan().any()


@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("transpose", [False, True])
def test_reference_saturates_finite_float64_beyond_float32(device, dtype, granularity, transpose):
    """reference.to_float8 (the torch backend, and every kernel test's expectation) took float64 through x.float():
    finite values beyond float32's range became NaN codes, their amax inf (not recorded, scale 1) and found_inf
    set. As the public casts: they cast as if saturated to float32's largest value first."""
    x = _beyond_float32(device, seed=4)
    rows = (x.shape[1] if transpose else x.shape[0]) if granularity == "row" else None
    amax = torch.zeros((rows, 1) if rows else (1,), device=device)
    found = torch.zeros(1, device=device)
    data, scale_inv = reference.to_float8(x, dtype, granularity, transpose=transpose, amax_out=amax, found_inf=found)
    assert not data.float().isnan().any(), "a finite input became NaN"
    assert float(found) == 0.0, "a finite input set found_inf"
    saturated = x.clamp(-FLOAT32_MAX, FLOAT32_MAX).float()
    want_data, want_scale_inv = reference.to_float8(saturated, dtype, granularity, transpose=transpose)
    assert torch.equal(_bits(data), _bits(want_data))
    assert torch.equal(scale_inv, want_scale_inv)
    torch.testing.assert_close(amax.reshape(-1), reference.float8_amax(saturated, granularity, transpose).reshape(-1))
    assert float(amax.max()) == FLOAT32_MAX
    limit = torch.finfo(dtype).max
    codes = data.float() if not transpose else data.float().t()
    assert codes[0, 1] > 0 and codes[3, 4] < 0 and codes[5, 9] > 0
    if granularity == "tensor":  # the largest magnitude maps to the format's largest
        assert codes[3, 4] == -limit


def test_reference_amax_and_pair_of_finite_float64_beyond_float32(device):
    x = _beyond_float32(device, seed=5)
    assert float(reference.float8_amax(x)) == FLOAT32_MAX
    rows = reference.float8_amax(x, "row")
    assert torch.isfinite(rows).all() and float(rows[3, 0]) == FLOAT32_MAX
    found = torch.zeros(1, device=device)
    data, data_t, _ = reference.to_float8_pair(x, found_inf=found)
    assert not data.float().isnan().any() and torch.equal(_bits(data.t()), _bits(data_t))
    assert float(found) == 0.0
