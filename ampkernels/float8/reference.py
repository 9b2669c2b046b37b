"""Plain-PyTorch references of the FP8 casts with per-tensor or per-row scales (:mod:`ampkernels.float8`) and of
the fused producers of FP8 inputs (RMSNorm, SiLU·up, rotary embedding).

Used by the tests (as the expected result) and by the fallback backend. Each function states the exact math the
kernels implement. :mod:`ampkernels.reference` gathers every family's references in one namespace.
"""

from __future__ import annotations

import math

import torch

from ampkernels._constants import FLOAT8_AMAX_FLOOR

# --------------------------------------------------------------------------------------------------------------------
# FP8: casts with per-tensor or per-row scales (ampkernels.float8)
# --------------------------------------------------------------------------------------------------------------------

FLOAT8_GRANULARITIES = ("tensor", "row")


def float8_max(dtype: torch.dtype) -> float:
    """Largest finite value of a float8 dtype: 448 (e4m3fn), 57344 (e5m2)."""
    return float(torch.finfo(dtype).max)


def float8_scale(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The float32 scale that maps ``amax`` onto the largest finite value of ``dtype``, with ``margin`` powers of two
    of headroom (TransformerEngine's ``margin``): ``float8_max(dtype) / max(amax, FLOAT8_AMAX_FLOOR) / 2**margin``,
    computed as ``reciprocal(max(amax, FLOAT8_AMAX_FLOOR)) * float8_max(dtype)`` with each step rounded to float32
    (what torchao's ``float8_max / amax`` computes: torch evaluates a number divided by a tensor that way). A
    non-finite ``amax`` (an inf or NaN in the tensor) gives 1.0: the scale always stays finite and positive, and the
    non-finite values themselves reach the product (see :func:`to_float8`)."""
    amax = amax.float()
    scale = torch.reciprocal(torch.clamp(amax, min=FLOAT8_AMAX_FLOOR)) * float8_max(dtype)
    if margin:
        scale = scale * (2.0**-margin)
    return torch.where(torch.isfinite(amax), scale, torch.ones_like(scale))


_FLOAT32_MAX = torch.finfo(torch.float32).max


def saturate_to_float32(x: torch.Tensor) -> torch.Tensor:
    """``x.float()``, except that finite float64 values beyond float32's range saturate to its largest (``x.float()``
    makes them inf, which would cast to NaN and count as non-finite); inf and NaN stay as they are. The casts compute
    in float32: every backend takes a float64 input this way."""
    if x.dtype != torch.float64:
        return x.float()
    return torch.where(x.isinf(), x, x.clamp(-_FLOAT32_MAX, _FLOAT32_MAX)).float()


def _rows_view(x: torch.Tensor, transpose: bool) -> torch.Tensor:
    """``x`` as the [R, C] matrix a cast writes: [..., K] flattened to [M, K], or its transpose [K, M]."""
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
    return x2.t() if transpose else x2


def float8_amax(x: torch.Tensor, granularity: str = "tensor", transpose: bool = False) -> torch.Tensor:
    """``max |x|`` in float32 (of :func:`saturate_to_float32`'s ``x``; NaN if ``x`` holds a NaN): 0-d for
    ``"tensor"``, [R, 1] per row of the matrix the cast writes (rows of ``x.reshape(-1, K)``, or of its transpose
    with ``transpose``) for ``"row"``."""
    xf = saturate_to_float32(_rows_view(x, transpose)).abs()
    if granularity == "tensor":
        return xf.amax() if xf.numel() else xf.new_zeros(())
    return xf.amax(dim=1, keepdim=True) if xf.shape[1] else xf.new_zeros((xf.shape[0], 1))


def _record_amax(amax_out: torch.Tensor | None, amax: torch.Tensor, found_inf: torch.Tensor | None) -> None:
    finite = torch.isfinite(amax)
    if amax_out is not None:
        # A non-finite amax is not recorded: the step it comes from is skipped, and a delayed-scaling history must not
        # carry it into the scales of the next steps.
        amax_out.copy_(torch.where(finite, torch.maximum(amax_out, amax.reshape(amax_out.shape)), amax_out))
    if found_inf is not None:
        bad = finite.all().logical_not()
        found_inf.copy_(torch.where(bad, torch.ones_like(found_inf), found_inf))


def to_float8(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "tensor",
    *,
    scale: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    transpose: bool = False,
    found_inf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``ampkernels.float8.to_float8``: ``x`` (any float dtype, [..., K], viewed as the [M, K] matrix
    ``x.reshape(-1, K)``; its transpose [K, M] with ``transpose``) cast to ``dtype`` with a float32 scale.

    * The scale: ``scale`` when given (delayed scaling: float32, one element for ``"tensor"``, [R, 1] for ``"row"``),
      else :func:`float8_scale` of :func:`float8_amax` (current scaling; per row of the written matrix for
      ``"row"``).
    * ``data = (x.float() * scale)`` (for float64, :func:`saturate_to_float32` in place of ``x.float()``) clamped
      to ``±float8_max(dtype)`` (saturating: a finite value never becomes inf or NaN) and rounded to ``dtype`` by
      torch's conversion (round to nearest even); a non-finite element of ``x`` becomes NaN in either format, so it
      reaches the product and the scaler's check instead of being saturated away. ``data`` is contiguous: [M, K],
      or [K, M] with ``transpose``.
    * Returns ``(data, scale_inv)`` with ``scale_inv = 1 / scale`` (float32; 0-d for ``"tensor"``, [R, 1] for
      ``"row"``), the dequantization factor ``torch._scaled_mm`` takes: ``x ≈ data.float() * scale_inv``.
    * ``amax_out`` (float32, the amax's shape): becomes ``max(amax_out, amax of x)`` when that amax is finite, and is
      left alone otherwise (the delayed-scaling record of this pass). ``found_inf`` (float32, one element): set to
      1.0 when the amax is not finite (``x`` holds an inf or NaN); never cleared.
    """
    xf = saturate_to_float32(_rows_view(x, transpose))
    amax = float8_amax(x, granularity, transpose)
    s = float8_scale(amax, dtype) if scale is None else scale.float().reshape(amax.shape)
    limit = float8_max(dtype)
    y = (xf * s).clamp(-limit, limit)
    y = torch.where(torch.isfinite(xf), y, torch.full_like(y, math.nan))
    data = y.to(dtype).contiguous()
    _record_amax(amax_out, amax, found_inf)
    return data, torch.reciprocal(s)


def to_float8_pair(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    scale: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of ``ampkernels.float8.to_float8_pair``: one tensorwise cast written in both layouts, ``(data [M,
    K], data_t [K, M], scale_inv)``, each contiguous and equal to :func:`to_float8`'s with ``transpose`` False /
    True (the forward reads one layout, the backward the other)."""
    data, scale_inv = to_float8(x, dtype, "tensor", scale=scale, amax_out=amax_out, found_inf=found_inf)
    return data, data.t().contiguous(), scale_inv


# --------------------------------------------------------------------------------------------------------------------
# Fused producers of FP8 inputs: RMSNorm and SiLU·up (ampkernels.float8.rms_norm / silu_mul)
# --------------------------------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Reference of ``ampkernels.float8.rms_norm``, Llama's RMSNorm over the last dimension: normalized in float32,
    cast back to ``x``'s dtype, then multiplied by ``weight`` ([D]) with torch's type promotion (a bfloat16 ``x`` and a
    float32 ``weight`` give float32)::

        (x.float() * rsqrt(mean(x.float() ** 2, -1) + eps)).to(x.dtype) * weight
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Reference of ``ampkernels.float8.silu_mul``, SwiGLU's gate: ``silu(gate) * up`` computed in float32 and
    rounded once to the promoted dtype of ``gate`` and ``up``."""
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(out_dtype)


def rotary_tables(positions: int, half: int, base: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (cos, sin) [positions, half] of the angles ``t * base ** (-i / half)`` (computed as Llama's port
    does: the inverse frequencies, then the outer product with the positions, in float32)."""
    inv_freq = base ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = torch.arange(positions, device=device, dtype=torch.float32)[:, None] * inv_freq
    return angles.cos(), angles.sin()


def rotary_embedding(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Reference of ``ampkernels.float8.rotary_embedding``: rotary position embedding of ``x`` ([..., T, D], D even)
    in the half-split layout: the pairs ``(x[..., i], x[..., i + D/2])`` at position t (dimension -2) rotated by
    :func:`rotary_tables`' angle, in float32 (the tables unrounded), rounded once to ``x``'s dtype."""
    half = x.shape[-1] // 2
    cos, sin = rotary_tables(x.shape[-2], half, base, x.device)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)
