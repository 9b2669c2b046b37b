"""Triton kernels of the fused producers of FP8 inputs (math in ``reference.rms_norm`` / ``reference.silu_mul``);
launched by ``ampkernels.float8.triton.fused``.

* ``_rms_norm_kernel``: rows of [M, D] normalized in float32 and scaled by the weight, one read and one write; also
  the per-row ``rstd`` the backward reads.
* ``_rms_norm_backward_kernel``: the input gradient of its rows and the program's partial weight gradient (summed
  over the programs by the launcher).
* ``_silu_mul_kernel`` / ``_silu_mul_backward_kernel``: ``silu(gate) * up`` in float32 and its two gradients.

Every rounding to bfloat16 goes through ``optimizers_kernels._rounded``: the hardware's cvt.rn on a GPU, integer
rounding to nearest even under the interpreter (``INT_BF16``), whose own casts truncate.

A forward kernel may also reduce the finite ``max |out|`` of what it stores and a non-finite flag into the zeroed
scratch of a tensorwise FP8 cast (``float8_casts._Scratch``): the next layer's current-scaling cast then reads its
scale from there and skips its amax pass (``float8_casts_kernels``' protocol: float atomics for the finite amax, an
int flag for inf/NaN, which float atomics do not order).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ampkernels._triton_functions import _rounded
from ampkernels.float8.triton.casts_kernels import _finite_abs


@triton.jit
def _record_amax(out, mask, scratch_amax, scratch_bad):
    a, b = _finite_abs(out.to(tl.float32))
    a = tl.where(mask, a, 0.0)
    b = tl.where(mask, b, 0)
    tl.atomic_max(scratch_amax, tl.max(tl.max(a, axis=1), axis=0))
    tl.atomic_max(scratch_bad, tl.max(tl.max(b, axis=1), axis=0))


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rstd_ptr,
    scratch_amax,
    scratch_bad,
    M,
    D,
    eps,
    HAS_AMAX: tl.constexpr,
    INT_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``out = (x * rstd).to(x.dtype) * w`` per row, ``rstd = rsqrt(mean(x**2) + eps)`` in float32."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < M) & (cols[None, :] < D)
    offs = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=1) / D + eps)
    normed = _rounded(xf * rstd[:, None], x_ptr.dtype.element_ty, INT_BF16).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    out = _rounded(normed * w[None, :], out_ptr.dtype.element_ty, INT_BF16)
    tl.store(out_ptr + offs, out, mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < M)
    if HAS_AMAX:
        _record_amax(out, mask, scratch_amax, scratch_bad)


@triton.jit
def _rms_norm_backward_kernel(
    grad_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    grad_x_ptr,
    grad_w_partial_ptr,
    M,
    D,
    INT_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rows ``pid, pid + programs, ...`` (blocks of ROWS): ``grad_x = rstd * gn - rstd**3 / D * x * sum(gn * x)``
    with ``gn = grad * w``, and this program's ``sum over its rows of grad * (x * rstd).to(x.dtype)`` (the weight
    gradient's partial, float32 [programs, D])."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for block in range(pid, tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows = (block * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        mask = (rows[:, None] < M) & col_mask[None, :]
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
        normed = _rounded(xf * rstd[:, None], x_ptr.dtype.element_ty, INT_BF16).to(tl.float32)
        acc += tl.sum(g * normed, axis=0)
        gn = g * w[None, :]
        dot = tl.sum(gn * xf, axis=1)
        grad_x = rstd[:, None] * gn - (rstd * rstd * rstd * dot / D)[:, None] * xf
        tl.store(grad_x_ptr + offs, _rounded(grad_x, grad_x_ptr.dtype.element_ty, INT_BF16), mask=mask)
    tl.store(grad_w_partial_ptr + pid.to(tl.int64) * D + cols, acc, mask=col_mask)


@triton.jit
def _silu_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    scratch_amax,
    scratch_bad,
    n,
    HAS_AMAX: tl.constexpr,
    INT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``out = silu(gate) * up`` in float32, rounded once to out's dtype (one read of each input, one write)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = _rounded(g / (1.0 + tl.exp(-g)) * u, out_ptr.dtype.element_ty, INT_BF16)
    tl.store(out_ptr + offs, out, mask=mask)
    if HAS_AMAX:
        _record_amax(out[None, :], mask[None, :], scratch_amax, scratch_bad)


@triton.jit
def _silu_mul_backward_kernel(
    grad_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr, n, INT_BF16: tl.constexpr, BLOCK: tl.constexpr
):
    """``grad_up = grad * silu(gate)``, ``grad_gate = grad * up * s * (1 + gate * (1 - s))`` with ``s =
    sigmoid(gate)``, in float32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(grad_up_ptr + offs, _rounded(grad * g * s, grad_up_ptr.dtype.element_ty, INT_BF16), mask=mask)
    grad_gate = grad * u * s * (1.0 + g * (1.0 - s))
    tl.store(grad_gate_ptr + offs, _rounded(grad_gate, grad_gate_ptr.dtype.element_ty, INT_BF16), mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    rows,
    H,
    T,
    x_sb,
    x_sh,
    x_st,
    x_sd,
    o_sb,
    o_sh,
    o_st,
    o_sd,
    INVERSE: tl.constexpr,
    INT_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rows (b, h, t) of x [B, H, T, 2 * HALF] (any strides): the pairs (x1, x2) = (x[..., i], x[..., i + HALF]) rotated
    by the angle of position t, ``(x1 cos - x2 sin, x1 sin + x2 cos)`` from the float32 tables [T, HALF], in float32,
    rounded once; ``INVERSE`` rotates by minus the angle (the backward: the transpose of a rotation)."""
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    t = r % T
    bh = r // T
    h = bh % H
    b = bh // H
    # int64: the element offsets i * x_sd pass 2**31 when D is not x's innermost dimension of a large tensor.
    i = tl.arange(0, BLOCK_HALF).to(tl.int64)
    mask = (r < rows)[:, None] & (i < HALF)[None, :]
    x_row = b * x_sb + h * x_sh + t * x_st
    o_row = b * o_sb + h * o_sh + t * o_st
    x1 = tl.load(x_ptr + x_row[:, None] + i[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_row[:, None] + (i[None, :] + HALF) * x_sd, mask=mask, other=0.0).to(tl.float32)
    table = t[:, None] * HALF + i[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
    if INVERSE:
        sin = -sin
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + o_row[:, None] + i[None, :] * o_sd, _rounded(x1 * cos - x2 * sin, dtype, INT_BF16), mask=mask)
    out2 = _rounded(x1 * sin + x2 * cos, dtype, INT_BF16)
    tl.store(out_ptr + o_row[:, None] + (i[None, :] + HALF) * o_sd, out2, mask=mask)
