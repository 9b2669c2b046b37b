"""Launch code of the Triton FP8 casts (``ampkernels.float8.to_float8`` / ``to_float8_pair``; math in
``reference.to_float8``, kernels in ``ampkernels.float8.triton.casts_kernels``).

Passes per call (each reads x once; the amax pass only reads):

| call | passes |
|---|---|
| tensorwise, current scaling | amax, cast (the cast walks memory backwards: the amax pass's tail is still in L2) |
| tensorwise, delayed (``scale`` given) | cast, recording the amax |
| rowwise (``"row"``) | one: a row's amax and its cast in one program |
| ``transpose`` / pair, current | amax, tiled cast writing [K, M] (and [M, K] for the pair) |
| ``transpose`` / pair, delayed | tiled cast, recording the amax |
| ``"row"`` + ``transpose``, current | column amax, tiled cast (the scales are per column of x) |

Arguments arrive checked and normalized (:mod:`ampkernels.float8.casts`): x is [M, K] with any strides and at least
one element; ``scale`` float32 contiguous (one element, or [R]); ``amax_out`` float32 contiguous of the amax's size;
``found_inf`` float32 of one element. No host sync: the scales never leave the device.
"""

from __future__ import annotations

import torch
import triton

from ampkernels import dispatch
from ampkernels._runtime import num_sms, on_device_of_first_tensor
from ampkernels.float8.reference import float8_max
from ampkernels.float8.triton.casts_kernels import (
    _amax_flat_kernel,
    _amax_tiles_kernel,
    _cast_flat_kernel,
    _cast_rows_kernel,
    _cast_tiles_kernel,
)

#: None: the hardware's ``cvt.rn.satfinite`` on Hopper and newer, the integer rounding of ``_encode`` elsewhere:
#: under the interpreter (whose float8 conversion is wrong) and before sm_90 (no FP8 cvt before sm_89; Triton's
#: fp32 -> e4m3 on sm_89 has gone through fp16, a double rounding: triton-lang/triton#11753). True forces the
#: integer rounding (the GPU tests check it against the hardware).
SOFTWARE_ROUNDING: bool | None = None

# NOTE: a flat pass moves BLOCK elements per program and iteration (16 per thread at 8 warps: 32-byte bf16 loads,
# 16-byte FP8 stores); a few programs per SM keep enough loads in flight (REFERENCE.md: 4-8 per SM, BLOCK 1024-4096
# reach 87-105% of copy for a read-only reduction).
FLAT_BLOCK = 4096
FLAT_WARPS = 8
PROGRAMS_PER_SM = 4
# Tiles of the transposing casts and of the strided amax pass.
TILE_M = 64
TILE_K = 64
TILE_WARPS = 4
AMAX_TILE_M = 32
AMAX_TILE_K = 128
AMAX_ROWS_PER_PROGRAM = 512
# A rowwise program holds about this many elements ([ROWS, BLOCK_K]); longer rows are walked in blocks.
ROW_ELEMENTS = 4096
FINISH_BLOCK = 1024


def _cdiv(a: int, b: int) -> int:
    # NOTE: not triton.cdiv, which is a JIT function in recent Triton: calling it from Python costs ~7 us each.
    return -(-a // b)


def _software(device: torch.device) -> bool:
    if SOFTWARE_ROUNDING is not None:
        return SOFTWARE_ROUNDING
    return dispatch.triton_interpreting() or torch.cuda.get_device_capability(device) < (9, 0)


def _flat_programs(n: int, block: int, device: torch.device) -> int:
    blocks = _cdiv(n, block)
    if device.type != "cuda":
        return max(1, min(blocks, 4))  # the interpreter runs programs one after another
    return max(1, min(blocks, num_sms(device) * PROGRAMS_PER_SM))


def _flat_block(device: torch.device) -> int:
    return FLAT_BLOCK if device.type == "cuda" else 1024


def _format(dtype: torch.dtype) -> dict:
    return {"FP8_MAX": float8_max(dtype), "E4M3": dtype == torch.float8_e4m3fn}


class _Scratch:
    """Zeroed int32 scratch (one fill): the finite amax (as float32 bits), the non-finite flags and a ticket; one
    entry each, or ``columns`` amax and flag entries."""

    def __init__(self, device: torch.device, columns: int = 1, buffer: torch.Tensor | None = None) -> None:
        if buffer is None:
            buffer = torch.zeros(2 * columns + 1, dtype=torch.int32, device=device)
        self.amax = buffer[:columns].view(torch.float32)
        self.bad = buffer[columns : 2 * columns]
        self.ticket = buffer[2 * columns :]

    @classmethod
    def of(cls, buffer: torch.Tensor) -> _Scratch:
        """The tensorwise scratch over an int32 [3] ``buffer`` (one a producer kernel of
        ``ampkernels.float8.triton.fused`` filled with the amax of what it wrote)."""
        return cls(buffer.device, 1, buffer)


def _amax_tensor(x: torch.Tensor, scratch: _Scratch) -> None:
    """Tensorwise amax pass into ``scratch``."""
    if x.is_contiguous():
        block = _flat_block(x.device)
        grid = (_flat_programs(x.numel(), block, x.device),)
        _amax_flat_kernel[grid](x, x.numel(), scratch.amax, scratch.bad, BLOCK=block, num_warps=FLAT_WARPS)
    else:
        _amax_tiles(x, scratch, per_column=False)


def _amax_tiles(x: torch.Tensor, scratch: _Scratch, per_column: bool) -> None:
    M, K = x.shape
    grid = (_cdiv(M, AMAX_ROWS_PER_PROGRAM) * _cdiv(K, AMAX_TILE_K),)
    _amax_tiles_kernel[grid](
        x,
        M,
        K,
        x.stride(0),
        x.stride(1),
        scratch.amax,
        scratch.bad,
        PER_COLUMN=per_column,
        ROWS_PER_PROGRAM=AMAX_ROWS_PER_PROGRAM,
        BM=AMAX_TILE_M,
        BK=AMAX_TILE_K,
        num_warps=TILE_WARPS,
    )


def _flags(amax_out, found_inf) -> dict:
    return {"HAS_AMAX_OUT": amax_out is not None, "HAS_FOUND_INF": found_inf is not None}


def _cast_tiles(x, out, out_t, scale, scale_inv, scratch, amax_out, found_inf, dtype, per_column) -> None:
    M, K = x.shape
    dummy = scale_inv
    grid = (_cdiv(M, TILE_M) * _cdiv(K, TILE_K),)
    _cast_tiles_kernel[grid](
        x,
        dummy if out is None else out.view(torch.uint8),
        dummy if out_t is None else out_t.view(torch.uint8),
        M,
        K,
        x.stride(0),
        x.stride(1),
        dummy if scale is None else scale,
        scale_inv,
        scratch.amax,
        scratch.bad,
        scratch.ticket,
        dummy if amax_out is None else amax_out,
        dummy if found_inf is None else found_inf,
        **_format(dtype),
        SOFTWARE=_software(x.device),
        CURRENT=scale is None,
        PER_COLUMN=per_column,
        **_flags(amax_out, found_inf),
        WRITE_DATA=out is not None,
        WRITE_T=out_t is not None,
        BM=TILE_M,
        BK=TILE_K,
        FINISH_BLOCK=FINISH_BLOCK,
        num_warps=TILE_WARPS,
    )


def _cast_flat(x, out, scale, scale_inv, scratch, amax_out, found_inf, dtype) -> None:
    n = x.numel()
    block = _flat_block(x.device)
    dummy = scale_inv
    grid = (_flat_programs(n, block, x.device),)
    _cast_flat_kernel[grid](
        x,
        out.view(torch.uint8),
        n,
        dummy if scale is None else scale,
        scale_inv,
        scratch.amax,
        scratch.bad,
        scratch.ticket,
        dummy if amax_out is None else amax_out,
        dummy if found_inf is None else found_inf,
        **_format(dtype),
        SOFTWARE=_software(x.device),
        CURRENT=scale is None,
        **_flags(amax_out, found_inf),
        BLOCK=block,
        num_warps=FLAT_WARPS,
    )


def _cast_rows(x, out, scale, scale_inv, amax_out, found_inf, dtype) -> None:
    M, K = x.shape
    block_k = min(triton.next_power_of_2(K), ROW_ELEMENTS)
    rows = max(1, min(ROW_ELEMENTS // block_k, triton.next_power_of_2(M)))
    dummy = scale_inv
    _cast_rows_kernel[(_cdiv(M, rows),)](
        x,
        out.view(torch.uint8),
        M,
        K,
        x.stride(0),
        x.stride(1),
        dummy if scale is None else scale,
        scale_inv,
        dummy if amax_out is None else amax_out,
        dummy if found_inf is None else found_inf,
        **_format(dtype),
        SOFTWARE=_software(x.device),
        CURRENT=scale is None,
        **_flags(amax_out, found_inf),
        ROWS=rows,
        BLOCK_K=block_k,
        num_warps=4 if rows * block_k <= 2048 else 8,
    )


@on_device_of_first_tensor
def to_float8(x, dtype, granularity, scale, amax_out, transpose, found_inf, amax_scratch=None):
    """``reference.to_float8`` on a checked [M, K] ``x`` (see the module docstring): ``(data, scale_inv)``.
    ``amax_scratch``: tensorwise current scaling from the int32 [3] scratch x's producer filled with its amax (no amax
    pass)."""
    M, K = x.shape
    device = x.device
    data = torch.empty((K, M) if transpose else (M, K), dtype=dtype, device=device)
    if granularity == "row":
        scale_inv = torch.empty((K if transpose else M, 1), dtype=torch.float32, device=device)
        if not transpose:
            _cast_rows(x, data, scale, scale_inv, amax_out, found_inf, dtype)
            return data, scale_inv
        scratch = _Scratch(device, columns=K)
        if scale is None:
            _amax_tiles(x, scratch, per_column=True)
        _cast_tiles(x, None, data, scale, scale_inv, scratch, amax_out, found_inf, dtype, per_column=True)
        return data, scale_inv
    scale_inv = torch.empty((), dtype=torch.float32, device=device)
    scratch = _Scratch(device) if amax_scratch is None else _Scratch.of(amax_scratch)
    if scale is None and amax_scratch is None:
        _amax_tensor(x, scratch)
    if transpose:
        _cast_tiles(x, None, data, scale, scale_inv, scratch, amax_out, found_inf, dtype, per_column=False)
    elif x.is_contiguous():
        _cast_flat(x, data, scale, scale_inv, scratch, amax_out, found_inf, dtype)
    else:
        _cast_tiles(x, data, None, scale, scale_inv, scratch, amax_out, found_inf, dtype, per_column=False)
    return data, scale_inv


@on_device_of_first_tensor
def to_float8_pair(x, dtype, scale, amax_out, found_inf, amax_scratch=None):
    """``reference.to_float8_pair`` on a checked [M, K] ``x``: ``(data [M, K], data_t [K, M], scale_inv)`` from one
    read of x (plus the amax pass for current scaling, unless ``amax_scratch`` holds it: see :func:`to_float8`)."""
    M, K = x.shape
    data = torch.empty((M, K), dtype=dtype, device=x.device)
    data_t = torch.empty((K, M), dtype=dtype, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    scratch = _Scratch(x.device) if amax_scratch is None else _Scratch.of(amax_scratch)
    if scale is None and amax_scratch is None:
        _amax_tensor(x, scratch)
    if x.element_size() >= 4:
        # NOTE (H200, Triton 3.6): for fp32 inputs the one-pass pair wrote a quarter of the transposed codes wrong
        # whenever its rows allowed vectorized stores (48 x 96, 256 x 64, 8192 x 2048 weights; 333 x 129 came out
        # right), while the single-layout kernels were bit-exact on the same shapes. Until that is understood
        # (dev/float8/NOTES.md), fp32 inputs (weights) take two passes: one read more of the weight per step.
        _cast_tiles(x, data, None, scale, scale_inv, scratch, amax_out, found_inf, dtype, per_column=False)
        _cast_tiles(x, None, data_t, scale, scale_inv, scratch, None, None, dtype, per_column=False)
    else:
        _cast_tiles(x, data, data_t, scale, scale_inv, scratch, amax_out, found_inf, dtype, per_column=False)
    return data, data_t, scale_inv
