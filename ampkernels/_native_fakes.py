"""Fake (meta) implementations of every op the native extension registers, so that ``torch.compile`` can trace them
and ``torch.library.opcheck`` can test them.

The schemas are in csrc/ (one ``TORCH_LIBRARY_FRAGMENT`` per op family): ``unscale_reduce_`` and ``update_scale_``
in csrc/scaler/scaler_ops.cpp, ``scaled_matmul_wmma_``, ``scaled_matmul_wgmma_`` and ``scaled_matmul_fp8_wgmma_`` in
csrc/matmul/scaled_matmul_ops.cpp, ``to_float8_native`` in csrc/float8/float8_ops.cpp. Nothing is registered when the
extension is missing.
"""

from __future__ import annotations

import torch

from ampkernels import dispatch

# Every op of the native extension: tests/test_native_fakes.py checks this list against the registered schemas.
NATIVE_OPS = (
    "unscale_reduce_",
    "update_scale_",
    "scaled_matmul_wmma_",
    "scaled_matmul_wgmma_",
    "scaled_matmul_fp8_wgmma_",
    "to_float8_native",
)


def _unscale_reduce_fake(tensors, scale, found_inf, factor, write, norm_type, per_tensor, max_norm):
    dev = found_inf.device
    empty = torch.empty(0, dtype=torch.float32, device=dev)
    has_norm = norm_type != 0.0
    norm = torch.empty((), dtype=torch.float32, device=dev) if has_norm else empty
    each = torch.empty(len(tensors), dtype=torch.float32, device=dev) if has_norm and per_tensor else empty
    coef = torch.empty((), dtype=torch.float32, device=dev) if has_norm and max_norm >= 0 else empty
    return norm, each, coef


def _update_scale_fake(
    scale,
    growth_tracker,
    hysteresis_tracker,
    found_inf,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
    min_scale,
    max_scale,
    counters,
    history,
):
    return None


def _scaled_matmul_fake(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf):
    return None  # writes `out` (and found_inf) in place


def _scaled_matmul_fp8_fake(
    a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
):
    return None  # writes `out` (and found_inf, amax_out) in place


def _to_float8_native_fake(x, dtype, per_row, write_data, write_t, scale, amax_out, found_inf, amax_scratch):
    M, K = x.shape
    data = x.new_empty((M, K) if write_data else (0,), dtype=dtype)
    data_t = x.new_empty((K, M) if write_t else (0,), dtype=dtype)
    scale_inv = x.new_empty(((K if write_t else M), 1) if per_row else (), dtype=torch.float32)
    return data, data_t, scale_inv


_FAKES = {
    "unscale_reduce_": _unscale_reduce_fake,
    "update_scale_": _update_scale_fake,
    "scaled_matmul_wmma_": _scaled_matmul_fake,
    "scaled_matmul_wgmma_": _scaled_matmul_fake,
    "scaled_matmul_fp8_wgmma_": _scaled_matmul_fp8_fake,
    "to_float8_native": _to_float8_native_fake,
}


def register() -> None:
    """Registers the fakes once, when the native extension is importable."""
    if dispatch.native() is None or not hasattr(torch.library, "register_fake"):
        return
    for name in NATIVE_OPS:
        if hasattr(torch.ops.ampkernels, name):
            torch.library.register_fake(f"ampkernels::{name}")(_FAKES[name])


register()
