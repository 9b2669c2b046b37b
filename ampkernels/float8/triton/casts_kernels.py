"""Triton kernels of the FP8 casts (math in ``reference.to_float8``); launched by ``ampkernels.float8.triton.casts``.

* ``_amax_flat_kernel``: a persistent grid-stride pass over a contiguous tensor; each program reduces the finite
  ``max |x|`` of its share and ORs a non-finite flag, then one atomic max each into a zeroed scratch.
* ``_amax_tiles_kernel``: the same over a strided [M, K] matrix in tiles, per tensor or per column (the scales of
  ``"row"`` with ``transpose``: one per row of ``x.T``).
* ``_cast_flat_kernel``: tensorwise cast of a contiguous tensor, walked in the reverse order of ``_amax_flat_kernel``
  (the tail that pass left in L2 is read first).
* ``_cast_rows_kernel``: per row of a strided [M, K] matrix: amax and cast in one program.
* ``_cast_tiles_kernel``: tiles of a strided [M, K] matrix written as [M, K] and/or [K, M] (``tl.trans`` of the
  tile: coalesced reads and writes), per tensor or per column of x.

Current scaling reads the amax from the scratch of an amax pass and computes the scale in the kernel, exactly as
``reference.float8_scale``: ``reciprocal(max(amax, 1e-12)) * fp8_max`` (torch's ``float / tensor`` is a reciprocal
and a product, two roundings; ``div_rn``: IEEE). Delayed scaling (a given scale) records the amax in the same pass:
partials into the scratch, and the last program to finish (an atomic ticket) writes ``amax_out`` and ``found_inf``
(finite-only, as ``reference._record_amax``).

The finite amax and the non-finite flag are kept apart: float atomics do not order NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ampkernels._constants import FLOAT8_AMAX_FLOOR

_AMAX_FLOOR = tl.constexpr(FLOAT8_AMAX_FLOOR)
_INF = tl.constexpr(float("inf"))
# NOTE: no NaN constexpr: Triton compares a kernel's globals by value when it compiles, and NaN != NaN made every
# kernel calling _cast fail on the H200 ("Global variable _NAN has changed"). The NaN is built from its bits.
_NAN_BITS = tl.constexpr(0x7FC00000)


@triton.jit
def _scale_of(amax, bad, FP8_MAX: tl.constexpr):
    """reference.float8_scale: 1.0 for a non-finite amax (``bad``), else reciprocal(max(amax, floor)) * max."""
    scale = tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), tl.maximum(amax, _AMAX_FLOOR)) * FP8_MAX
    return tl.where(bad, 1.0, scale)


@triton.jit
def _inverse(scale):
    return tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _finite_abs(x):
    """(|x| where finite else 0, 1 where x is inf/NaN else 0): the parts of an amax that atomics can combine."""
    a = tl.abs(x)
    finite = a < _INF
    return tl.where(finite, a, 0.0), tl.where(finite, 0, 1)


@triton.jit
def _recorded(prev, amax, bad):
    """``amax_out``'s new value: max(prev, amax) (prev's NaN kept, as torch.maximum), prev when amax is not finite."""
    return tl.where(bad | (amax <= prev) | (prev != prev), prev, amax)


@triton.jit
def _encode(p, E4M3: tl.constexpr, SOFTWARE: tl.constexpr):
    """float32 ``p`` (finite values within ±max, or NaN) as float8 bits (uint8), rounded to nearest even.

    The hardware path is ``cvt.rn.satfinite`` (sm_89+). The interpreter's float8 conversion rounds half up, loses
    the carry into the exponent and turns NaN into a number, so there (``SOFTWARE``) the rounding is integer math:
    normal values round the mantissa with the usual +0x7FF..+lsb; subnormal ones add a power of two whose ulp is the
    format's subnormal step, so that the float32 add rounds (to nearest even) and the difference of the bits is the
    code. NaN becomes 0x7F (positive NaN, what torch writes for the reference's NaN and cvt for every NaN)."""
    if SOFTWARE:
        MANT: tl.constexpr = 3 if E4M3 else 2
        BIAS: tl.constexpr = 7 if E4M3 else 15
        SHIFT: tl.constexpr = 23 - MANT
        MIN_NORMAL_BITS: tl.constexpr = (127 - BIAS + 1) << 23
        MAGIC_BITS: tl.constexpr = (127 - BIAS + SHIFT + 1) << 23
        bits = p.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        normal = ((a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MANT)
        magic = tl.full(p.shape, MAGIC_BITS, tl.uint32).to(tl.float32, bitcast=True)
        subnormal = (a.to(tl.float32, bitcast=True) + magic).to(tl.uint32, bitcast=True) - MAGIC_BITS
        code = tl.where(a < MIN_NORMAL_BITS, subnormal, normal) | sign
        code = tl.where(a > 0x7F800000, 0x7F, code)
        return code.to(tl.uint8)
    elif E4M3:
        return p.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return p.to(tl.float8e5).to(tl.uint8, bitcast=True)


@triton.jit
def _cast(x, scale, FP8_MAX: tl.constexpr, E4M3: tl.constexpr, SOFTWARE: tl.constexpr):
    """reference.to_float8's data: (x * scale) clamped to ±max (NaN stays NaN), NaN for a non-finite x."""
    p = x * scale
    p = tl.where(p > FP8_MAX, FP8_MAX, p)
    p = tl.where(p < -FP8_MAX, -FP8_MAX, p)
    nan = tl.full(p.shape, _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    p = tl.where(tl.abs(x) < _INF, p, nan)
    return _encode(p, E4M3, SOFTWARE)


@triton.jit
def _finish_tensor(
    scratch_amax, scratch_bad, amax_out, found_inf, HAS_AMAX_OUT: tl.constexpr, HAS_FOUND_INF: tl.constexpr
):
    """One program: ``amax_out`` and ``found_inf`` from the (complete) scratch of a tensorwise amax."""
    amax = tl.atomic_max(scratch_amax, 0.0)  # an atomic read: the partials were atomics from other programs
    bad = tl.atomic_max(scratch_bad, 0) != 0
    if HAS_AMAX_OUT:
        tl.store(amax_out, _recorded(tl.load(amax_out), amax, bad))
    if HAS_FOUND_INF:
        if bad:
            tl.store(found_inf, 1.0)


@triton.jit
def _last_program(ticket):
    """Whether this program is the last of the launch to get here (every program's atomics before it are then done:
    the barrier orders this program's threads' atomics before the ticket's acq_rel add)."""
    tl.debug_barrier()
    return tl.atomic_add(ticket, 1, sem="acq_rel") == tl.num_programs(0) - 1


@triton.jit
def _amax_flat_kernel(x_ptr, n, scratch_amax, scratch_bad, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, n, step):
        idx = start + offs
        x = tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
        a, b = _finite_abs(x)
        acc = tl.maximum(acc, a)
        bad = bad | b
    tl.atomic_max(scratch_amax, tl.max(acc, axis=0))
    tl.atomic_max(scratch_bad, tl.max(bad, axis=0))


@triton.jit
def _amax_tiles_kernel(
    x_ptr,
    M,
    K,
    stride_m,
    stride_k,
    scratch_amax,
    scratch_bad,
    PER_COLUMN: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    """One program per (row strip of ROWS_PER_PROGRAM, column block of BK), strips first, on a 1-d grid (a second
    grid dimension stops at 65535 programs); per column the scratch is [K] amax, [K] flags."""
    strips = tl.cdiv(M, ROWS_PER_PROGRAM)
    pid = tl.program_id(0)
    pid_m = (pid % strips).to(tl.int64)
    offs_k = (pid // strips) * BK + tl.arange(0, BK)
    mask_k = offs_k < K
    acc = tl.zeros([BM, BK], tl.float32)
    bad = tl.zeros([BM, BK], tl.int32)
    for m0 in range(pid_m * ROWS_PER_PROGRAM, tl.minimum(M, (pid_m + 1) * ROWS_PER_PROGRAM), BM):
        offs_m = m0 + tl.arange(0, BM)
        mask = (offs_m < M)[:, None] & mask_k[None, :]
        ptrs = x_ptr + offs_m[:, None] * stride_m + offs_k[None, :].to(tl.int64) * stride_k
        a, b = _finite_abs(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32))
        acc = tl.maximum(acc, a)
        bad = bad | b
    col_amax = tl.max(acc, axis=0)
    col_bad = tl.max(bad, axis=0)
    if PER_COLUMN:
        tl.atomic_max(scratch_amax + offs_k, col_amax, mask=mask_k)
        tl.atomic_max(scratch_bad + offs_k, col_bad, mask=mask_k)
    else:
        tl.atomic_max(scratch_amax, tl.max(col_amax, axis=0))
        tl.atomic_max(scratch_bad, tl.max(col_bad, axis=0))


@triton.jit
def _cast_flat_kernel(
    x_ptr,
    out_ptr,
    n,
    scale_ptr,  # delayed: the given scale
    scale_inv_ptr,
    scratch_amax,  # current: the amax pass's result; delayed: where this pass's partials go
    scratch_bad,
    ticket,
    amax_out,
    found_inf,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    SOFTWARE: tl.constexpr,
    CURRENT: tl.constexpr,
    HAS_AMAX_OUT: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if CURRENT:
        amax = tl.load(scratch_amax)
        was_bad = tl.load(scratch_bad) != 0
        scale = _scale_of(amax, was_bad, FP8_MAX)
        if pid == 0:
            tl.store(scale_inv_ptr, _inverse(scale))
            if HAS_AMAX_OUT:
                tl.store(amax_out, _recorded(tl.load(amax_out), amax, was_bad))
            if HAS_FOUND_INF:
                if was_bad:
                    tl.store(found_inf, 1.0)
    else:
        scale = tl.load(scale_ptr)
        if pid == 0:
            tl.store(scale_inv_ptr, _inverse(scale))
    RECORD: tl.constexpr = (not CURRENT) and (HAS_AMAX_OUT or HAS_FOUND_INF)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.int32)
    last_block = (n - 1) // BLOCK
    # NOTE: blocks in the reverse of the amax pass's order: its last blocks are still in L2.
    for i in range(pid, last_block + 1, nprog):
        idx = (last_block - i).to(tl.int64) * BLOCK + offs
        mask = idx < n
        x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + idx, _cast(x, scale, FP8_MAX, E4M3, SOFTWARE), mask=mask)
        if RECORD:
            a, b = _finite_abs(x)
            acc = tl.maximum(acc, a)
            bad = bad | b
    if RECORD:
        tl.atomic_max(scratch_amax, tl.max(acc, axis=0))
        tl.atomic_max(scratch_bad, tl.max(bad, axis=0))
        if _last_program(ticket):
            _finish_tensor(scratch_amax, scratch_bad, amax_out, found_inf, HAS_AMAX_OUT, HAS_FOUND_INF)


@triton.jit
def _cast_rows_kernel(
    x_ptr,
    out_ptr,
    M,
    K,
    stride_m,
    stride_k,
    scale_ptr,  # delayed: [M] given scales
    scale_inv_ptr,
    amax_out,
    found_inf,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    SOFTWARE: tl.constexpr,
    CURRENT: tl.constexpr,
    HAS_AMAX_OUT: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """ROWS rows per program, in blocks of BLOCK_K columns. Current scaling with K > BLOCK_K reads a row twice (the
    second read mostly from L1/L2)."""
    offs_m = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mask_m = offs_m < M
    row_x = x_ptr + offs_m[:, None] * stride_m
    row_out = out_ptr + offs_m[:, None] * K
    if BLOCK_K >= K:  # the row in registers: one read
        offs_k = tl.arange(0, BLOCK_K)
        mask = mask_m[:, None] & (offs_k < K)[None, :]
        x = tl.load(row_x + offs_k[None, :].to(tl.int64) * stride_k, mask=mask, other=0.0).to(tl.float32)
        a, b = _finite_abs(x)
        amax = tl.max(a, axis=1)
        row_bad = tl.max(b, axis=1) != 0
        if CURRENT:
            scale = _scale_of(amax, row_bad, FP8_MAX)
        else:
            scale = tl.load(scale_ptr + offs_m, mask=mask_m, other=1.0)
        tl.store(row_out + offs_k[None, :], _cast(x, scale[:, None], FP8_MAX, E4M3, SOFTWARE), mask=mask)
    else:
        acc = tl.zeros([ROWS, BLOCK_K], tl.float32)
        bad = tl.zeros([ROWS, BLOCK_K], tl.int32)
        if CURRENT:
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask = mask_m[:, None] & (offs_k < K)[None, :]
                x = tl.load(row_x + offs_k[None, :].to(tl.int64) * stride_k, mask=mask, other=0.0).to(tl.float32)
                a, b = _finite_abs(x)
                acc = tl.maximum(acc, a)
                bad = bad | b
            scale = _scale_of(tl.max(acc, axis=1), tl.max(bad, axis=1) != 0, FP8_MAX)
        else:
            scale = tl.load(scale_ptr + offs_m, mask=mask_m, other=1.0)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = mask_m[:, None] & (offs_k < K)[None, :]
            x = tl.load(row_x + offs_k[None, :].to(tl.int64) * stride_k, mask=mask, other=0.0).to(tl.float32)
            tl.store(row_out + offs_k[None, :], _cast(x, scale[:, None], FP8_MAX, E4M3, SOFTWARE), mask=mask)
            if not CURRENT:
                a, b = _finite_abs(x)
                acc = tl.maximum(acc, a)
                bad = bad | b
        amax = tl.max(acc, axis=1)
        row_bad = tl.max(bad, axis=1) != 0
    tl.store(scale_inv_ptr + offs_m, _inverse(scale), mask=mask_m)
    if HAS_AMAX_OUT:
        prev = tl.load(amax_out + offs_m, mask=mask_m, other=0.0)
        tl.store(amax_out + offs_m, _recorded(prev, amax, row_bad), mask=mask_m)
    if HAS_FOUND_INF:
        if tl.max(tl.where(mask_m & row_bad, 1, 0), axis=0) != 0:
            tl.store(found_inf, 1.0)


# (Over 80 lines: one kernel that writes a tile in both layouts from one read; the transposed store's index math
# is most of it.)
@triton.jit
def _cast_tiles_kernel(
    x_ptr,
    out_ptr,  # [M, K] (WRITE_DATA)
    out_t_ptr,  # [K, M] (WRITE_T)
    M,
    K,
    stride_m,
    stride_k,
    scale_ptr,  # delayed: the given scale (one, or [K] per column)
    scale_inv_ptr,
    scratch_amax,  # one, or [K] per column: current: the amax pass's result; delayed: this pass's partials
    scratch_bad,
    ticket,
    amax_out,
    found_inf,
    FP8_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    SOFTWARE: tl.constexpr,
    CURRENT: tl.constexpr,
    PER_COLUMN: tl.constexpr,
    HAS_AMAX_OUT: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    WRITE_DATA: tl.constexpr,
    WRITE_T: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    FINISH_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BK)
    # NOTE: tiles in the reverse of memory order: the amax pass's last reads are still in L2.
    tile = tl.num_programs(0) - 1 - pid
    tile_m = tile // tiles_k
    tile_k = tile % tiles_k
    offs_m = tile_m.to(tl.int64) * BM + tl.arange(0, BM)
    offs_k = tile_k * BK + tl.arange(0, BK)
    mask_m = offs_m < M
    mask_k = offs_k < K
    mask = mask_m[:, None] & mask_k[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_m + offs_k[None, :].to(tl.int64) * stride_k, mask=mask, other=0.0).to(
        tl.float32
    )
    # The scale: one, or per column (per row of the [K, M] output).
    first_row = tile_m == 0  # writes what is per column (or, tile 0, per tensor)
    if PER_COLUMN:
        if CURRENT:
            amax = tl.load(scratch_amax + offs_k, mask=mask_k, other=0.0)
            was_bad = tl.load(scratch_bad + offs_k, mask=mask_k, other=0) != 0
            scale = _scale_of(amax, was_bad, FP8_MAX)
            if first_row:
                if HAS_AMAX_OUT:
                    prev = tl.load(amax_out + offs_k, mask=mask_k, other=0.0)
                    tl.store(amax_out + offs_k, _recorded(prev, amax, was_bad), mask=mask_k)
                if HAS_FOUND_INF:
                    if tl.max(tl.where(mask_k & was_bad, 1, 0), axis=0) != 0:
                        tl.store(found_inf, 1.0)
        else:
            scale = tl.load(scale_ptr + offs_k, mask=mask_k, other=1.0)
        if first_row:
            tl.store(scale_inv_ptr + offs_k, _inverse(scale), mask=mask_k)
        codes = _cast(x, scale[None, :], FP8_MAX, E4M3, SOFTWARE)
        scale_t = scale[:, None]
    else:
        if CURRENT:
            amax = tl.load(scratch_amax)
            was_bad = tl.load(scratch_bad) != 0
            scale = _scale_of(amax, was_bad, FP8_MAX)
            if tile == 0:
                if HAS_AMAX_OUT:
                    tl.store(amax_out, _recorded(tl.load(amax_out), amax, was_bad))
                if HAS_FOUND_INF:
                    if was_bad:
                        tl.store(found_inf, 1.0)
        else:
            scale = tl.load(scale_ptr)
        if tile == 0:
            tl.store(scale_inv_ptr, _inverse(scale))
        codes = _cast(x, scale, FP8_MAX, E4M3, SOFTWARE)
        scale_t = scale
    if WRITE_DATA:
        tl.store(out_ptr + offs_m[:, None] * K + offs_k[None, :], codes, mask=mask)
    if WRITE_T:
        # NOTE: the transposed tile is cast from the transposed input, not transposed as codes: on the H200 (Triton
        # 3.6), tl.trans of the uint8 codes of an fp32 tile that was also stored untransposed wrote a quarter of the
        # elements wrong (dev/float8/linear_probe.py); a float tile's transpose is the path the matmuls use.
        codes_t = _cast(tl.trans(x), scale_t, FP8_MAX, E4M3, SOFTWARE)
        tl.store(
            out_t_ptr + offs_k[:, None].to(tl.int64) * M + offs_m[None, :],
            codes_t,
            mask=mask_k[:, None] & mask_m[None, :],
        )
    if (not CURRENT) and (HAS_AMAX_OUT or HAS_FOUND_INF):
        a, b = _finite_abs(x)
        if PER_COLUMN:
            tl.atomic_max(scratch_amax + offs_k, tl.max(a, axis=0), mask=mask_k)
            tl.atomic_max(scratch_bad + offs_k, tl.max(b, axis=0), mask=mask_k)
        else:
            tl.atomic_max(scratch_amax, tl.max(tl.max(a, axis=0), axis=0))
            tl.atomic_max(scratch_bad, tl.max(tl.max(b, axis=0), axis=0))
        if _last_program(ticket):
            if PER_COLUMN:
                any_bad = tl.full([], 0, tl.int32)
                for k0 in range(0, K, FINISH_BLOCK):
                    cols = k0 + tl.arange(0, FINISH_BLOCK)
                    in_k = cols < K
                    # atomic reads: the partials were atomics from other programs
                    col_amax = tl.atomic_max(scratch_amax + cols, tl.zeros([FINISH_BLOCK], tl.float32), mask=in_k)
                    col_bad = tl.atomic_max(scratch_bad + cols, tl.zeros([FINISH_BLOCK], tl.int32), mask=in_k) != 0
                    if HAS_AMAX_OUT:
                        prev = tl.load(amax_out + cols, mask=in_k, other=0.0)
                        tl.store(amax_out + cols, _recorded(prev, col_amax, col_bad), mask=in_k)
                    any_bad = tl.maximum(any_bad, tl.max(tl.where(in_k & col_bad, 1, 0), axis=0))
                if HAS_FOUND_INF:
                    if any_bad != 0:
                        tl.store(found_inf, 1.0)
            else:
                _finish_tensor(scratch_amax, scratch_bad, amax_out, found_inf, HAS_AMAX_OUT, HAS_FOUND_INF)
