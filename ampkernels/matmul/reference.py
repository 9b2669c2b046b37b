"""Plain-PyTorch reference of :func:`ampkernels.scaled_matmul`, on 16-bit and on FP8 operands: ``scale * (a @ b) +
bias`` with float32 accumulation.

Used by the tests (as the expected result) and by the fallback backend. Each function states the exact math the
kernels implement. :mod:`ampkernels.reference` gathers every family's references in one namespace.
"""

from __future__ import annotations

import torch

# --------------------------------------------------------------------------------------------------------------------
# scaled_matmul
# --------------------------------------------------------------------------------------------------------------------


def scaled_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor | float | None = None,
    *,
    alpha: float = 1.0,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    found_inf: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of ``ampkernels.scaled_matmul`` (and its ``"torch"`` backend): computed in float32 (float64 for
    float64 operands) as ``v = (a @ b) * (alpha * scale) + bias``; with ``accumulate`` ``v = out + v`` (old value read
    in the same precision); the result is ``v`` cast to ``out_dtype`` (default ``out.dtype``, else ``a.dtype``) and
    written to ``out`` when given. ``scale`` broadcasts against the [..., M, N] product (a tensor of one element,
    per row [..., M, 1], per column [N]). ``found_inf`` (float32, 1 element) is set to 1.0 when any element of the
    result as stored is inf or NaN, with no host synchronization; never cleared.
    """
    compute = torch.float64 if a.dtype == torch.float64 else torch.float32
    v = a.to(compute) @ b.to(compute)
    if isinstance(scale, torch.Tensor):
        v = v * (scale.to(compute) * alpha)
    else:
        v = v * (alpha * (1.0 if scale is None else float(scale)))
    if bias is not None:
        v = v + bias.to(compute)
    if accumulate:
        v = out.to(compute) + v
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else a.dtype
    result = v.to(out_dtype)
    if found_inf is not None and result.numel():
        bad = torch.isfinite(result).all().logical_not()
        found_inf.copy_(torch.where(bad, torch.ones_like(found_inf), found_inf))
    if out is not None:
        out.copy_(result)
        return out
    return result


def scaled_matmul_float8(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    scale: torch.Tensor | float | None = None,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    found_inf: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of ``ampkernels.scaled_matmul`` on float8 operands: in float32, ``v = (a.float() @ b.float()) *
    (scale_a * scale_b)`` with ``scale_a`` one element or per row of a ([M, 1]) and ``scale_b`` one element or per
    column of b ([1, N]) (``torch._scaled_mm``'s dequantization factors; None means 1), then ``v = v * scale + bias``
    (``scale`` as in :func:`scaled_matmul`), ``v = out + v`` with ``accumulate``, rounded to ``out_dtype``.
    ``found_inf`` as in :func:`scaled_matmul`; ``amax_out`` (float32, one element) becomes ``max(amax_out, max |result
    as stored|)`` (NaN-propagating, like ``torch.maximum``): the amax the next layer's cast needs."""
    v = a.float() @ b.float()
    if scale_a is not None:
        v = v * scale_a.float().reshape(-1, 1)
    if scale_b is not None:
        v = v * scale_b.float().reshape(1, -1)
    if isinstance(scale, torch.Tensor):
        v = v * scale.float()
    elif scale is not None:
        v = v * float(scale)
    if bias is not None:
        v = v + bias.float()
    if accumulate:
        v = out.float() + v
    result = v.to(out_dtype)
    if found_inf is not None and result.numel():
        bad = torch.isfinite(result).all().logical_not()
        found_inf.copy_(torch.where(bad, torch.ones_like(found_inf), found_inf))
    if amax_out is not None and result.numel():
        amax_out.copy_(torch.maximum(amax_out, result.float().abs().amax().reshape(amax_out.shape)))
    if out is not None:
        out.copy_(result)
        return out
    return result
