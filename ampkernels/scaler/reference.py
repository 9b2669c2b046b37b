"""Plain-PyTorch references of the scaler ops (:mod:`ampkernels.scaler`): unscale + non-finite check + norm, and
the loss-scale update.

Used by the tests (as the expected result) and by the fallback backend. Each function states the exact math the
kernels implement. :mod:`ampkernels.reference` gathers every family's references in one namespace.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ampkernels._constants import NormKind, norm_kind

#: Smallest normal float32: the default floor of the loss scale (stock halves on to 0 and then skips forever).
FLOAT32_TINY = 2.0**-126


def inv_scale_of(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` rounded exactly as ``torch.amp.GradScaler.unscale_`` does (reciprocal in float64)."""
    return scale.double().reciprocal().float()


def unscale_reduce_(
    tensors: Sequence[torch.Tensor],
    scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    factor: torch.Tensor | None = None,
    write: bool = True,
    norm_type: float | None = None,
    per_tensor: bool = False,
):
    """Reference for the fused multi-tensor pass (no host synchronization).

    For every tensor ``g``: ``v = g * inv_scale (* factor)`` in float32 (float64 for float64 tensors); when
    ``write``, ``g`` is overwritten with ``v`` cast back to its dtype. ``found_inf`` (float32, 1 element) is set to
    1.0 when any *input* element is non-finite, and never cleared. Returns ``(norm, per_tensor_norms)``: the
    ``norm_type`` norm (2 or inf) of all ``v`` (rounded to each tensor's dtype, as ``unscale_`` stores them) together
    (0-d) and of each tensor ([len(tensors)]), float32, or
    ``None`` when not requested. Norms are accumulated in float64 here; the kernels accumulate a 16/32-bit
    tensor's in float32 and a float64 tensor's in float64.
    """
    kind = norm_kind(norm_type)
    dev = found_inf.device
    inv = inv_scale_of(scale)
    flags, norms = [], []
    for g in tensors:
        math_dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
        v = g.to(math_dtype) * inv.to(g.device, math_dtype)
        if factor is not None:
            v = v * factor.to(g.device, math_dtype)
        if g.numel():
            flags.append(torch.isfinite(g).all().logical_not().to(dev))
        if kind is not NormKind.NONE:
            vd = v.to(g.dtype).double()  # the norm of the unscaled value as stored in the tensor's dtype
            if kind is NormKind.L2:
                norms.append(vd.pow(2).sum().to(dev))
            else:
                norms.append((vd.abs().max() if vd.numel() else vd.new_zeros(())).to(dev))
        if write:
            g.copy_(v.to(g.dtype))
    if flags:
        any_bad = torch.stack(flags).any().reshape(found_inf.shape)
        found_inf.copy_(torch.where(any_bad, torch.ones_like(found_inf), found_inf))
    if kind is NormKind.NONE:
        return None, None
    stacked = torch.stack(norms) if norms else torch.zeros(0, dtype=torch.float64, device=dev)
    if kind is NormKind.L2:
        total, each = stacked.sum().sqrt(), stacked.sqrt()
    else:
        total, each = (stacked.max() if stacked.numel() else stacked.new_zeros(())), stacked
    return total.float(), (each.float() if per_tensor else None)


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(max_norm / (norm + 1e-6), 1)`` in float32, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    return torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    *,
    hysteresis: int = 1,
    hysteresis_tracker: torch.Tensor | None = None,
    min_scale: float = FLOAT32_TINY,
    max_scale: float = math.inf,
    history: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> None:
    """Reference for the loss-scale update; equals ``torch._amp_update_scale_`` with the defaults.

    ``scale`` float32 [1] or [], ``growth_tracker`` int32, ``found_inf`` float32 (non-zero = overflow).
    Hysteresis (Megatron-LM semantics): on overflow the growth tracker resets and ``hysteresis_tracker``
    (int32) decrements; the scale backs off (never below ``min_scale``) once it is <= 0; on growth (never above
    ``max_scale``, and only to a finite value) it is reset to ``hysteresis``. ``counters`` (int64 [2]: updates,
    skipped) and ``history`` (float32 [N], ring buffer of the scale after each update) are optional telemetry.
    Written with tensor ops only: no host synchronization.
    """
    found = found_inf.reshape(()) != 0
    s = scale.reshape(())
    gt = growth_tracker.reshape(())
    ht = hysteresis_tracker.reshape(()) if hysteresis_tracker is not None else torch.ones_like(gt)
    f32 = dict(dtype=torch.float32, device=scale.device)
    backed_off = torch.maximum((s.double() * backoff_factor).float(), torch.tensor(min_scale, **f32))
    ht_after_overflow = ht - 1
    scale_if_found = torch.where(ht_after_overflow <= 0, backed_off, s)
    successful = gt + 1
    grow = successful == growth_interval
    grown = (s.double() * growth_factor).float()
    grown = torch.minimum(grown, torch.tensor(max_scale, **f32))
    scale_if_ok = torch.where(grow & torch.isfinite((s.double() * growth_factor).float()), grown, s)
    new_scale = torch.where(found, scale_if_found, scale_if_ok)
    zero = torch.zeros_like(gt)
    growth_tracker.copy_(torch.where(found | grow, zero, successful).reshape(growth_tracker.shape))
    if hysteresis_tracker is not None:
        reset = torch.full_like(ht, hysteresis)
        new_ht = torch.where(found, ht_after_overflow, torch.where(grow, reset, ht))
        hysteresis_tracker.copy_(new_ht.reshape(hysteresis_tracker.shape))
    scale.copy_(new_scale.reshape(scale.shape))
    if counters is not None:
        n = counters[0].clone()
        counters[0] += 1
        counters[1] += found.to(counters.dtype)
        if history is not None and history.numel():
            history.index_copy_(0, (n % history.numel()).reshape(1), new_scale.reshape(1))
