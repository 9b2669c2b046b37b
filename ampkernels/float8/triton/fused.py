"""Launch code of the fused kernels of ``ampkernels.float8.fused`` (``rms_norm``, ``silu_mul``, ``rotary_embedding``;
math in ``reference.rms_norm`` / ``silu_mul`` / ``rotary_embedding``, kernels in
``ampkernels.float8.triton.fused_kernels``).

Bytes per call (the floor ``benchmarks/float8_fused.py`` measures against):

| call | reads | writes |
|---|---|---|
| rms_norm | x, w | out, rstd (4 B per row) |
| rms_norm backward | grad, x, w, rstd | grad_x, one float32 row of the weight gradient per program |
| silu_mul | gate, up | out |
| silu_mul backward | grad, gate, up | grad_gate, grad_up |
| rotary (forward or backward) | x (and the [T, D/2] float32 tables, from L2) | out |

Arguments arrive checked (:mod:`ampkernels.float8.fused`) with at least one element: contiguous, except rotary's x
(any strides, viewed as [B, H, T, D]); norm rows of at most
``ampkernels.float8.backends.MAX_TRITON_ROW`` elements (a program holds a row). ``scratch`` is None or the zeroed int32
[3] buffer of a tensorwise cast's scratch (``float8_casts._Scratch``).
"""

from __future__ import annotations

import torch
import triton

from ampkernels import dispatch
from ampkernels._runtime import num_sms, on_device_of_first_tensor
from ampkernels.float8.triton.casts import _cdiv, _Scratch
from ampkernels.float8.triton.fused_kernels import (
    _rms_norm_backward_kernel,
    _rms_norm_kernel,
    _rotary_kernel,
    _silu_mul_backward_kernel,
    _silu_mul_kernel,
)

# NOTE: a program holds about ROW_ELEMENTS elements ([ROWS, BLOCK_D]): 16 per thread at 8 warps, the flat casts'
# load width, which keeps enough loads in flight (float8_casts.FLAT_BLOCK).
ROW_ELEMENTS = 4096
FLAT_BLOCK = 2048
BACKWARD_PROGRAMS_PER_SM = 4


def _row_tiles(D: int) -> tuple[int, int, int]:
    block_d = triton.next_power_of_2(D)
    rows = max(1, ROW_ELEMENTS // block_d)
    return rows, block_d, 4 if rows * block_d <= 2048 else 8


def _scratch_args(scratch, dummy):
    if scratch is None:
        return dummy, dummy
    scratch = _Scratch.of(scratch)
    return scratch.amax, scratch.bad


@on_device_of_first_tensor
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype, scratch):
    """x [M, D], weight [D] -> (out [M, D] in ``out_dtype``, rstd [M] float32)."""
    M, D = x.shape
    out = torch.empty((M, D), dtype=out_dtype, device=x.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    rows, block_d, warps = _row_tiles(D)
    _rms_norm_kernel[(_cdiv(M, rows),)](
        x,
        weight,
        out,
        rstd,
        *_scratch_args(scratch, rstd),
        M,
        D,
        eps,
        HAS_AMAX=scratch is not None,
        INT_BF16=dispatch.triton_interpreting(),
        ROWS=rows,
        BLOCK_D=block_d,
        num_warps=warps,
    )
    return out, rstd


@on_device_of_first_tensor
def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    """-> (grad_x like x, grad_weight in weight's dtype)."""
    M, D = x.shape
    rows, block_d, warps = _row_tiles(D)
    blocks = _cdiv(M, rows)
    if x.device.type == "cuda":
        programs = min(blocks, num_sms(x.device) * BACKWARD_PROGRAMS_PER_SM)
    else:
        programs = min(blocks, 4)  # the interpreter runs programs one after another
    grad_x = torch.empty_like(x)
    partial = torch.empty((programs, D), dtype=torch.float32, device=x.device)
    _rms_norm_backward_kernel[(programs,)](
        grad,
        x,
        weight,
        rstd,
        grad_x,
        partial,
        M,
        D,
        INT_BF16=dispatch.triton_interpreting(),
        ROWS=rows,
        BLOCK_D=block_d,
        num_warps=warps,
    )
    return grad_x, partial.sum(0).to(weight.dtype)


@on_device_of_first_tensor
def silu_mul(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype, scratch) -> torch.Tensor:
    out = torch.empty(gate.shape, dtype=out_dtype, device=gate.device)
    n = gate.numel()
    _silu_mul_kernel[(_cdiv(n, FLAT_BLOCK),)](
        gate,
        up,
        out,
        *_scratch_args(scratch, out),
        n,
        HAS_AMAX=scratch is not None,
        INT_BF16=dispatch.triton_interpreting(),
        BLOCK=FLAT_BLOCK,
        num_warps=8,
    )
    return out


@on_device_of_first_tensor
def silu_mul_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    _silu_mul_backward_kernel[(_cdiv(n, FLAT_BLOCK),)](
        grad, gate, up, grad_gate, grad_up, n, INT_BF16=dispatch.triton_interpreting(), BLOCK=FLAT_BLOCK, num_warps=8
    )
    return grad_gate, grad_up


@on_device_of_first_tensor
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x [B, H, T, D] (any strides) rotated by the float32 tables cos / sin [T, D / 2] -> a tensor of x's shape,
    dtype and memory layout (``inverse``: by minus the angles)."""
    B, H, T, D = x.shape
    out = torch.empty_like(x)  # (x's strides, when x is dense: the layout attention reads)
    half = D // 2
    block_half = triton.next_power_of_2(half)
    rows_per_program = max(1, ROW_ELEMENTS // (2 * block_half))
    rows = B * H * T
    _rotary_kernel[(_cdiv(rows, rows_per_program),)](
        x,
        out,
        cos,
        sin,
        rows,
        H,
        T,
        *x.stride(),
        *out.stride(),
        INVERSE=inverse,
        INT_BF16=dispatch.triton_interpreting(),
        ROWS=rows_per_program,
        HALF=half,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
    return out
