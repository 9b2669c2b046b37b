"""The fakes of the scaler's native ops (schemas in ``csrc/scaler/scaler_ops.cpp``), registered on import:
``ampkernels::unscale_reduce_`` and ``ampkernels::update_scale_``."""

from __future__ import annotations

import torch

from ampkernels._constants import NO_CLIP, NormKind
from ampkernels._native_fakes import check, check_scalar_float, native_fake

_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INT32_MAX = 2**31 - 1


@native_fake("unscale_reduce_")
def _unscale_reduce_fake(tensors, scale, found_inf, factor, write, norm_kind, per_tensor, max_norm):
    dev = found_inf.device
    check_scalar_float(scale, "scale")
    check_scalar_float(found_inf, "found_inf")
    check(scale.device == dev, "scale", lambda: f"expected a tensor on {dev}, got one on {scale.device}")
    if factor is not None:
        check_scalar_float(factor, "factor", dev)
    for i, t in enumerate(tensors):
        check(t.layout == torch.strided, "tensors", lambda i=i, t=t: f"element {i} has layout {t.layout}")
        check(
            t.dtype in _GRAD_DTYPES,
            "tensors",
            lambda i=i, t=t: f"element {i} has dtype {t.dtype}; supported: float32, float16, bfloat16, float64",
        )
        check(t.device == dev, "tensors", lambda i=i, t=t: f"element {i} is on {t.device} but found_inf is on {dev}")
    check(
        norm_kind in tuple(NormKind),
        "norm_kind",
        lambda: f"expected a NormKind: 0 (none), 1 (2-norm) or 2 (inf-norm), got {norm_kind}",
    )
    check(
        max_norm >= 0 or max_norm == NO_CLIP,
        "max_norm",
        lambda: f"expected >= 0, or {NO_CLIP:g} (no clip coefficient), got {max_norm:g}",
    )
    empty = torch.empty(0, dtype=torch.float32, device=dev)
    has_norm = norm_kind != NormKind.NONE
    norm = torch.empty((), dtype=torch.float32, device=dev) if has_norm else empty
    each = torch.empty(len(tensors), dtype=torch.float32, device=dev) if has_norm and per_tensor else empty
    coef = torch.empty((), dtype=torch.float32, device=dev) if has_norm and max_norm != NO_CLIP else empty
    return norm, each, coef


def _check_int32_scalar(t, arg: str, device) -> None:
    check(t.dtype == torch.int32 and t.numel() == 1, arg, "expected a 1-element int32 tensor")
    check(t.device == device, arg, lambda: f"expected a tensor on {device}, got one on {t.device}")


@native_fake("update_scale_")
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
    check_scalar_float(scale, "scale")
    check_scalar_float(found_inf, "found_inf")
    _check_int32_scalar(growth_tracker, "growth_tracker", scale.device)
    _check_int32_scalar(hysteresis_tracker, "hysteresis_tracker", scale.device)
    check(found_inf.device == scale.device, "found_inf", lambda: f"expected a tensor on {scale.device}")
    check(1 <= growth_interval <= _INT32_MAX, "growth_interval", f"must be in [1, 2**31), got {growth_interval}")
    check(1 <= hysteresis <= _INT32_MAX, "hysteresis", f"must be in [1, 2**31), got {hysteresis}")
    if counters is not None:
        check(
            counters.dtype == torch.int64 and counters.numel() == 2 and counters.is_contiguous(),
            "counters",
            "expected a contiguous int64 tensor of 2 elements",
        )
        check(counters.device == scale.device, "counters", lambda: f"expected a tensor on {scale.device}")
    if history is not None:
        check(counters is not None, "history", "needs 'counters' to know where to write")
        check(
            history.dtype == torch.float32 and history.is_contiguous(),
            "history",
            "expected a contiguous float32 tensor",
        )
        check(history.device == scale.device, "history", lambda: f"expected a tensor on {scale.device}")
    return None
