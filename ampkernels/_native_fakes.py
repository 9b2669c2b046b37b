"""Fake (meta) implementations of every op the native extension registers, so that ``torch.compile`` can trace them
and ``torch.library.opcheck`` can test them.

The schemas are in csrc/ (one ``TORCH_LIBRARY_FRAGMENT`` per op family): ``unscale_reduce_`` and ``update_scale_``
in csrc/scaler/scaler_ops.cpp, ``scaled_matmul_wmma_``, ``scaled_matmul_wgmma_`` and ``scaled_matmul_fp8_wgmma_`` in
csrc/matmul/scaled_matmul_ops.cpp, ``to_float8_native`` in csrc/float8/float8_ops.cpp. Nothing is registered when the
extension is missing.
"""

from __future__ import annotations

import math

import torch

from ampkernels import dispatch
from ampkernels._constants import FLOAT8_DTYPES

# Every op of the native extension: tests/test_native_fakes.py checks this list against the registered schemas.
NATIVE_OPS = (
    "unscale_reduce_",
    "update_scale_",
    "scaled_matmul_wmma_",
    "scaled_matmul_wgmma_",
    "scaled_matmul_fp8_wgmma_",
    "to_float8_native",
)


# The checks below are the C++ ops' own (csrc/*/*_ops.cpp), with their messages' argument names, so that a traced call
# fails as the op would: a fake that accepted what the op refuses gave torch.compile outputs of a shape the op never
# returns (a norm for norm_type=1), or failed with an unrelated error (unpacking a 3-D x). Only what depends on the
# data pointers (overlap, alignment) and the CUDA-only device rule are left to the op.
# NOTE: in Python rather than as C++ Meta kernels calling the ops' own checks: those read sizes as int64, which a
# tensor with symbolic sizes refuses (torch.compile with dynamic shapes). tests/test_native_fakes.py compares the two
# sets of errors case by case, so that one cannot drift from the other unnoticed.

_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INT32_MAX = 2**31 - 1


def _check(cond, arg: str, message) -> None:
    torch._check(cond, lambda: f"ampkernels: argument '{arg}': {message() if callable(message) else message}")


def _check_scalar_float(t, arg: str, device=None) -> None:
    _check(t.dtype == torch.float32, arg, lambda: f"expected a float32 tensor, got {t.dtype}")
    _check(t.numel() == 1, arg, lambda: f"expected a 1-element tensor, got {t.numel()} elements")
    if device is not None:
        _check(t.device == device, arg, lambda: f"expected a tensor on {device}, got one on {t.device}")


def _unscale_reduce_fake(tensors, scale, found_inf, factor, write, norm_type, per_tensor, max_norm):
    dev = found_inf.device
    _check_scalar_float(scale, "scale")
    _check_scalar_float(found_inf, "found_inf")
    _check(scale.device == dev, "scale", lambda: f"expected a tensor on {dev}, got one on {scale.device}")
    if factor is not None:
        _check_scalar_float(factor, "factor", dev)
    for i, t in enumerate(tensors):
        _check(t.layout == torch.strided, "tensors", lambda i=i, t=t: f"element {i} has layout {t.layout}")
        _check(
            t.dtype in _GRAD_DTYPES,
            "tensors",
            lambda i=i, t=t: f"element {i} has dtype {t.dtype}; supported: float32, float16, bfloat16, float64",
        )
        _check(t.device == dev, "tensors", lambda i=i, t=t: f"element {i} is on {t.device} but found_inf is on {dev}")
    _check(
        norm_type in (0.0, 2.0, math.inf),
        "norm_type",
        lambda: f"the fused kernels compute the 2-norm and the inf-norm, got {norm_type}",
    )
    empty = torch.empty(0, dtype=torch.float32, device=dev)
    has_norm = norm_type != 0.0
    norm = torch.empty((), dtype=torch.float32, device=dev) if has_norm else empty
    each = torch.empty(len(tensors), dtype=torch.float32, device=dev) if has_norm and per_tensor else empty
    coef = torch.empty((), dtype=torch.float32, device=dev) if has_norm and max_norm >= 0 else empty
    return norm, each, coef


def _check_int32_scalar(t, arg: str, device) -> None:
    _check(t.dtype == torch.int32 and t.numel() == 1, arg, "expected a 1-element int32 tensor")
    _check(t.device == device, arg, lambda: f"expected a tensor on {device}, got one on {t.device}")


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
    _check_scalar_float(scale, "scale")
    _check_scalar_float(found_inf, "found_inf")
    _check_int32_scalar(growth_tracker, "growth_tracker", scale.device)
    _check_int32_scalar(hysteresis_tracker, "hysteresis_tracker", scale.device)
    _check(found_inf.device == scale.device, "found_inf", lambda: f"expected a tensor on {scale.device}")
    _check(1 <= growth_interval <= _INT32_MAX, "growth_interval", f"must be in [1, 2**31), got {growth_interval}")
    _check(1 <= hysteresis <= _INT32_MAX, "hysteresis", f"must be in [1, 2**31), got {hysteresis}")
    if counters is not None:
        _check(
            counters.dtype == torch.int64 and counters.numel() == 2 and counters.is_contiguous(),
            "counters",
            "expected a contiguous int64 tensor of 2 elements",
        )
        _check(counters.device == scale.device, "counters", lambda: f"expected a tensor on {scale.device}")
    if history is not None:
        _check(counters is not None, "history", "needs 'counters' to know where to write")
        _check(
            history.dtype == torch.float32 and history.is_contiguous(),
            "history",
            "expected a contiguous float32 tensor",
        )
        _check(history.device == scale.device, "history", lambda: f"expected a tensor on {scale.device}")
    return None


def _check_matmul_epilogue(M, N, scale, scale_mode, bias, bias_dtypes, out, found_inf) -> None:
    _check(0 <= scale_mode <= 3, "scale_mode", lambda: f"expected 0, 1, 2 or 3, got {scale_mode}")
    if scale_mode == 0:
        _check(scale is None, "scale", "expected None with scale_mode 0")
    else:
        _check(scale is not None, "scale", f"expected a tensor with scale_mode {scale_mode}, got None")
        _check(scale.dtype == torch.float32, "scale", lambda: f"expected float32, got {scale.dtype}")
        if scale_mode == 1:
            _check(scale.numel() == 1, "scale", lambda: f"expected 1 element with scale_mode 1, got {scale.numel()}")
        else:
            want = M if scale_mode == 2 else N
            _check(
                scale.dim() == 1 and scale.shape[0] == want,
                "scale",
                lambda: f"expected a 1-D tensor of {want} elements, got shape {list(scale.shape)}",
            )
    if bias is not None:
        _check(
            bias.dim() == 1 and bias.shape[0] == N,
            "bias",
            lambda: f"expected a 1-D tensor of {N} elements, got shape {list(bias.shape)}",
        )
        _check(bias.dtype in bias_dtypes, "bias", lambda: f"expected one of {bias_dtypes}, got {bias.dtype}")
    _check(
        out.dim() == 2 and out.shape[0] == M and out.shape[1] == N,
        "out",
        lambda: f"expected shape [{M}, {N}], got {list(out.shape)}",
    )
    _check(
        out.dtype in (torch.float32, torch.float16, torch.bfloat16),
        "out",
        lambda: f"expected float32, float16 or bfloat16, got {out.dtype}",
    )
    if found_inf is not None:
        _check_scalar_float(found_inf, "found_inf")


def _scaled_matmul_fake(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf):
    _check(a.dim() == 2, "a", lambda: f"expected a 2-D tensor, got {a.dim()} dimensions")
    _check(b.dim() == 2, "b", lambda: f"expected a 2-D tensor, got {b.dim()} dimensions")
    _check(a.dtype in (torch.float16, torch.bfloat16), "a", lambda: f"expected float16 or bfloat16, got {a.dtype}")
    _check(b.dtype == a.dtype, "b", lambda: f"expected the dtype of 'a' ({a.dtype}), got {b.dtype}")
    _check(b.shape[0] == a.shape[1], "b", lambda: f"expected {a.shape[1]} rows, got {b.shape[0]}")
    _check_matmul_epilogue(a.shape[0], b.shape[1], scale, scale_mode, bias, (torch.float32, a.dtype), out, found_inf)
    return None  # writes `out` (and found_inf) in place


def _scaled_matmul_fp8_fake(
    a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
):
    _check(a.dim() == 2, "a", lambda: f"expected a 2-D tensor, got {a.dim()} dimensions")
    _check(b.dim() == 2, "b", lambda: f"expected a 2-D tensor, got {b.dim()} dimensions")
    _check(a.dtype in FLOAT8_DTYPES, "a", lambda: f"expected float8_e4m3fn or float8_e5m2, got {a.dtype}")
    _check(b.dtype in FLOAT8_DTYPES, "b", lambda: f"expected float8_e4m3fn or float8_e5m2, got {b.dtype}")
    _check(
        not (a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2),
        "b",
        "float8_e5m2 x float8_e5m2 is not supported (as in torch._scaled_mm): make one operand float8_e4m3fn",
    )
    M, K, N = a.shape[0], a.shape[1], b.shape[1]
    _check(b.shape[0] == K, "b", lambda: f"expected {K} rows, got {b.shape[0]}")
    _check(K > 0 and K % 16 == 0, "a", lambda: f"K = a.size(1) must be a positive multiple of 16, got {K}")
    _check_matmul_epilogue(M, N, scale, scale_mode, bias, (torch.float32, out.dtype), out, found_inf)
    for arg, t, per in (("scale_a", scale_a, M), ("scale_b", scale_b, N)):
        if t is not None:
            _check(t.dtype == torch.float32, arg, lambda t=t: f"expected float32, got {t.dtype}")
            _check(t.numel() in (1, per), arg, lambda t=t, per=per: f"expected 1 or {per} elements, got {t.numel()}")
    if amax_out is not None:
        _check_scalar_float(amax_out, "amax_out")
    return None  # writes `out` (and found_inf, amax_out) in place


def _check_vector(t, arg: str, x, count, contiguous: bool) -> None:
    if t is None:
        return
    _check(t.dtype == torch.float32, arg, lambda: f"expected a float32 tensor, got {t.dtype}")
    _check(t.device == x.device, arg, lambda: f"expected a tensor on {x.device}, got one on {t.device}")
    _check(t.numel() == count, arg, lambda: f"expected {count} elements, got {t.numel()}")
    _check(not contiguous or t.is_contiguous(), arg, lambda: f"must be contiguous, got strides {t.stride()}")


def _to_float8_native_fake(x, dtype, per_row, write_data, write_t, scale, amax_out, found_inf, amax_scratch):
    _check(
        x.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64),
        "x",
        lambda: f"expected float32, bfloat16, float16 or float64, got {x.dtype}",
    )
    _check(x.dim() == 2, "x", lambda: f"expected a 2-D tensor [M, K], got {x.dim()} dimensions")
    _check(x.numel() > 0, "x", lambda: f"expected at least one element, got shape {list(x.shape)}")
    _check(dtype in FLOAT8_DTYPES, "dtype", lambda: f"expected float8_e4m3fn or float8_e5m2, got {dtype}")
    _check(write_data or write_t, "write_data", "nothing to write: write_data and write_t are both false")
    _check(not (per_row and write_data and write_t), "per_row", "the pair (both layouts) is tensorwise only")
    M, K = x.shape
    count = (K if write_t else M) if per_row else 1
    _check_vector(scale, "scale", x, count, True)
    _check_vector(amax_out, "amax_out", x, count, True)
    _check_vector(found_inf, "found_inf", x, 1, False)
    if amax_scratch is not None:
        _check(not per_row and scale is None, "amax_scratch", "only for tensorwise current scaling")
        _check(
            amax_scratch.dtype == torch.int32 and amax_scratch.numel() == 3 and amax_scratch.is_contiguous(),
            "amax_scratch",
            "expected a contiguous int32 tensor of 3 elements",
        )
        _check(amax_scratch.device == x.device, "amax_scratch", lambda: f"expected a tensor on {x.device}")
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
