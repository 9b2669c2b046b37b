"""The ``torch.library`` ops behind :func:`ampkernels.scaled_matmul`: ``ampkernels::scaled_mm_`` (mutating: writes
``out``, may set ``found_inf``; used when no gradient is needed), ``ampkernels::scaled_mm`` (functional, with
autograd) and ``ampkernels::scaled_mm_fp8_`` (mutating: float8 operands with their dequantization factors, and any
call with ``amax_out``; no autograd: float8 tensors take none). All have fake implementations, so ``torch.compile``
traces them and ``torch.library.opcheck`` passes; autocast is applied before them, in
:func:`ampkernels.matmul.api.scaled_matmul`, like ``aten::mm`` does (float8 operands are left alone).
"""

from __future__ import annotations

import torch

from ampkernels._constants import FLOAT8_DTYPES, SCALE_COL, SCALE_NONE, SCALE_ROW, SCALE_TENSOR
from ampkernels._native_fakes import check, check_scalar_float, native_fake
from ampkernels.matmul.launch import launch, launch_float8


@torch.library.custom_op("ampkernels::scaled_mm_", mutates_args=("out", "found_inf"))
def _scaled_mm_out(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor | None,
    scale_mode: int,
    alpha: float,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    accumulate: bool,
    found_inf: torch.Tensor | None,
    backend: str,
) -> None:
    """In place: ``out (+)= alpha * scale * (a @ b) + bias``; a [M, K], b [K, N], out [M, N] row-major."""
    launch(backend, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)


@_scaled_mm_out.register_fake
def _(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, backend) -> None:
    return None


@torch.library.custom_op("ampkernels::scaled_mm_fp8_", mutates_args=("out", "found_inf", "amax_out"))
def _scaled_mm_fp8_out(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None,
    scale_b: torch.Tensor | None,
    scale: torch.Tensor | None,
    scale_mode: int,
    alpha: float,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    accumulate: bool,
    found_inf: torch.Tensor | None,
    amax_out: torch.Tensor | None,
    backend: str,
) -> None:
    """In place: ``out (+)= alpha * scale * ((a @ b) * scale_a * scale_b) + bias``, then ``amax_out = max(amax_out,
    max |out|)``; a [M, K], b [K, N] float8 (or 16-bit with scale_a, scale_b None), scale_a one element or [M],
    scale_b one element or [N] (float32), out [M, N] row-major."""
    launch_float8(backend, a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out)


@_scaled_mm_fp8_out.register_fake
def _(a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out, backend) -> None:
    return None


@torch.library.custom_op("ampkernels::scaled_mm", mutates_args=())
def _scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor | None,
    scale_mode: int,
    alpha: float,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    check_finite: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Functional form with autograd: returns ``(out [M, N] out_dtype, flag)``; ``flag`` is float32 [1] (1.0 when
    an output element is non-finite) if ``check_finite``, else empty."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    flag = torch.zeros(1 if check_finite else 0, dtype=torch.float32, device=a.device)
    launch(backend, a, b, scale, scale_mode, alpha, bias, out, False, flag if check_finite else None)
    return out, flag


@_scaled_mm.register_fake
def _(a, b, scale, scale_mode, alpha, bias, out_dtype, check_finite, backend):
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)
    return out, a.new_empty((1 if check_finite else 0,), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    a, b, scale, scale_mode, alpha, bias, out_dtype, check_finite, backend = inputs
    ctx.save_for_backward(a, b, scale)
    ctx.scale_mode, ctx.alpha, ctx.backend = scale_mode, alpha, backend
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.mark_non_differentiable(output[1])


def _mm(a, b, scale, scale_mode, alpha, out_dtype, backend):
    return torch.ops.ampkernels.scaled_mm(a, b, scale, scale_mode, alpha, None, out_dtype, False, backend)[0]


def _backward(ctx, grad_out, _grad_flag):
    """out = s ⊙ (a @ b) + bias with s = alpha·scale (scalar, per row or per column):

    grad_a = s ⊙ (g @ bᵀ) and grad_b = aᵀ @ (s ⊙ g), through the same kernels: a scalar or the scale along the
    output's own axis goes in the epilogue; the other axis is the contraction, so g is scaled first (fp32, then
    rounded to a's dtype). An fp32 ``g`` (out_dtype float32) is rounded to a's dtype for the 16-bit kernels.
    grad_bias = Σ_rows g (fp32). grad_scale = alpha · Σ g ⊙ (a @ b) over the broadcast axes (one more matmul, only
    when the scale requires grad)."""
    a, b, scale = ctx.saved_tensors
    mode, alpha, backend = ctx.scale_mode, ctx.alpha, ctx.backend
    g = grad_out.to(a.dtype)
    grad_a = grad_b = grad_scale = grad_bias = None
    need_a, need_b, need_scale, _, _, need_bias = ctx.needs_input_grad[:6]
    compute = torch.promote_types(a.dtype, torch.float32)
    if need_a:
        if mode == SCALE_COL:  # s runs along N, the contraction of g @ bᵀ
            g_cols = (g.to(compute) * (scale * alpha)[None, :]).to(a.dtype)
            grad_a = _mm(g_cols, b.t(), None, SCALE_NONE, 1.0, a.dtype, backend)
        else:
            grad_a = _mm(g, b.t(), scale, mode, alpha, a.dtype, backend)
    if need_b:
        if mode == SCALE_ROW:  # s runs along M, the contraction of aᵀ @ g
            g_rows = (g.to(compute) * (scale * alpha)[:, None]).to(a.dtype)
            grad_b = _mm(a.t(), g_rows, None, SCALE_NONE, 1.0, b.dtype, backend)
        else:
            grad_b = _mm(a.t(), g, scale, mode, alpha, b.dtype, backend)
    if need_bias:
        grad_bias = grad_out.to(compute).sum(0).to(ctx.bias_dtype)
    if need_scale:
        product = _mm(a, b, None, SCALE_NONE, 1.0, compute, backend)
        weighted = grad_out.to(compute) * product * alpha
        if mode == SCALE_TENSOR:
            grad_scale = weighted.sum().reshape(scale.shape)
        elif mode == SCALE_ROW:
            grad_scale = weighted.sum(1)
        else:
            grad_scale = weighted.sum(0)
        grad_scale = grad_scale.to(scale.dtype)
    return grad_a, grad_b, grad_scale, None, None, grad_bias, None, None, None


_scaled_mm.register_autograd(_backward, setup_context=_setup_context)


# ---- fakes of the native matmul ops (schemas in csrc/matmul/scaled_matmul_ops.cpp) ----


def _check_matmul_epilogue(M, N, scale, scale_mode, bias, bias_dtypes, out, found_inf) -> None:
    check(0 <= scale_mode <= 3, "scale_mode", lambda: f"expected 0, 1, 2 or 3, got {scale_mode}")
    if scale_mode == 0:
        check(scale is None, "scale", "expected None with scale_mode 0")
    else:
        check(scale is not None, "scale", f"expected a tensor with scale_mode {scale_mode}, got None")
        check(scale.dtype == torch.float32, "scale", lambda: f"expected float32, got {scale.dtype}")
        if scale_mode == 1:
            check(scale.numel() == 1, "scale", lambda: f"expected 1 element with scale_mode 1, got {scale.numel()}")
        else:
            want = M if scale_mode == 2 else N
            check(
                scale.dim() == 1 and scale.shape[0] == want,
                "scale",
                lambda: f"expected a 1-D tensor of {want} elements, got shape {list(scale.shape)}",
            )
    if bias is not None:
        check(
            bias.dim() == 1 and bias.shape[0] == N,
            "bias",
            lambda: f"expected a 1-D tensor of {N} elements, got shape {list(bias.shape)}",
        )
        check(bias.dtype in bias_dtypes, "bias", lambda: f"expected one of {bias_dtypes}, got {bias.dtype}")
    check(
        out.dim() == 2 and out.shape[0] == M and out.shape[1] == N,
        "out",
        lambda: f"expected shape [{M}, {N}], got {list(out.shape)}",
    )
    check(
        out.dtype in (torch.float32, torch.float16, torch.bfloat16),
        "out",
        lambda: f"expected float32, float16 or bfloat16, got {out.dtype}",
    )
    if found_inf is not None:
        check_scalar_float(found_inf, "found_inf")


@native_fake("scaled_matmul_wmma_", "scaled_matmul_wgmma_")
def _scaled_matmul_fake(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf):
    check(a.dim() == 2, "a", lambda: f"expected a 2-D tensor, got {a.dim()} dimensions")
    check(b.dim() == 2, "b", lambda: f"expected a 2-D tensor, got {b.dim()} dimensions")
    check(a.dtype in (torch.float16, torch.bfloat16), "a", lambda: f"expected float16 or bfloat16, got {a.dtype}")
    check(b.dtype == a.dtype, "b", lambda: f"expected the dtype of 'a' ({a.dtype}), got {b.dtype}")
    check(b.shape[0] == a.shape[1], "b", lambda: f"expected {a.shape[1]} rows, got {b.shape[0]}")
    _check_matmul_epilogue(a.shape[0], b.shape[1], scale, scale_mode, bias, (torch.float32, a.dtype), out, found_inf)
    return None  # writes `out` (and found_inf) in place


@native_fake("scaled_matmul_fp8_wgmma_")
def _scaled_matmul_fp8_fake(
    a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
):
    check(a.dim() == 2, "a", lambda: f"expected a 2-D tensor, got {a.dim()} dimensions")
    check(b.dim() == 2, "b", lambda: f"expected a 2-D tensor, got {b.dim()} dimensions")
    check(a.dtype in FLOAT8_DTYPES, "a", lambda: f"expected float8_e4m3fn or float8_e5m2, got {a.dtype}")
    check(b.dtype in FLOAT8_DTYPES, "b", lambda: f"expected float8_e4m3fn or float8_e5m2, got {b.dtype}")
    check(
        not (a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2),
        "b",
        "float8_e5m2 x float8_e5m2 is not supported (as in torch._scaled_mm): make one operand float8_e4m3fn",
    )
    M, K, N = a.shape[0], a.shape[1], b.shape[1]
    check(b.shape[0] == K, "b", lambda: f"expected {K} rows, got {b.shape[0]}")
    check(K > 0 and K % 16 == 0, "a", lambda: f"K = a.size(1) must be a positive multiple of 16, got {K}")
    _check_matmul_epilogue(M, N, scale, scale_mode, bias, (torch.float32, out.dtype), out, found_inf)
    for arg, t, per in (("scale_a", scale_a, M), ("scale_b", scale_b, N)):
        if t is not None:
            check(t.dtype == torch.float32, arg, lambda t=t: f"expected float32, got {t.dtype}")
            check(t.numel() in (1, per), arg, lambda t=t, per=per: f"expected 1 or {per} elements, got {t.numel()}")
    if amax_out is not None:
        check_scalar_float(amax_out, "amax_out")
    return None  # writes `out` (and found_inf, amax_out) in place
