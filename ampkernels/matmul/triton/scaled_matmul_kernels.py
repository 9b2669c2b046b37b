"""Triton kernels of ``ampkernels.scaled_matmul``: ``out (+)= scale * (a @ b) + bias`` with fp32 accumulation
(launch and tuning: ``ampkernels.matmul.triton.scaled_matmul``).

Two persistent kernels share one epilogue:

* ``_scaled_mm_tma_kernel`` (sm_90+): operands read through TMA tensor descriptors (host-side
  ``triton.tools.tensor_descriptor.TensorDescriptor``), each operand row- or column-major (a transposed view is
  read as is: the descriptor is built on the contiguous storage and the loaded tile is transposed in registers,
  which wgmma takes directly from shared memory). The output is stored through a descriptor too when its rows are
  16-byte aligned, optionally in two halves along N (less shared memory for the store, one more pipeline stage).
* ``_scaled_mm_ptr_kernel`` (sm_80, and whatever TMA cannot take: 16-byte alignment of base and strides, K == 0):
  plain pointer loads with any strides.

The epilogue runs while the accumulator is fp32: per-tensor / per-row / per-column scale (``alpha * scale``),
bias, accumulation into the old output (read as fp32), cast, and the non-finite check of the *stored* values:
a tile writes 1.0 to ``found_inf`` only when it holds a non-finite value (all writers write the same value, so
the race is benign; nothing is ever cleared).

FP8 operands (e4m3fn / e5m2) run in the same kernels: FP8 ``tl.dot`` with its partial sums added into the fp32
accumulator every BLOCK_K (``MAX_IMPRECISE``), the dequantization factors ``scale_a`` (per tensor or row) and
``scale_b`` (per tensor or column) applied first in the epilogue (``SCALE_A``/``SCALE_B``, compiled out for 16-bit
operands), and the output's amax recorded last (``CHECK_AMAX``: an integer atomic max on the float bits).

"""

from __future__ import annotations

import triton
import triton.language as tl

from ampkernels._triton_functions import _rounded

_FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row-tiles share each column of B while it is in L2."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile_id // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    within = tile_id % tiles_per_group
    return first_m + within % group_rows, within // group_rows


@triton.jit
def _scaled_values(acc, offs_m, offs_n, M, N, alpha, scale_ptr, scale_mode, bias_ptr, HAS_BIAS: tl.constexpr):
    """fp32 ``acc * (alpha * scale) + bias`` for one tile (rows ``offs_m``, columns ``offs_n``)."""
    if scale_mode == 1:
        tile_factor = alpha * tl.load(scale_ptr)
    elif scale_mode == 0:
        tile_factor = alpha
    else:
        tile_factor = 1.0
    # Vector factors load nothing unless their mode is on (masked loads) and are then exactly 1.0, so each mode
    # rounds once, like the reference's acc * (alpha * scale). The mode folds into the bound (0 when off) so that
    # each mask is one vector comparison: Triton 3.9's interpreter refuses `vector & (scalar == k)` as a mask (the
    # broadcast scalar comes out int32, not int1).
    row_factor = tl.load(scale_ptr + offs_m, mask=offs_m < tl.where(scale_mode == 2, M, 0), other=1.0)
    row_factor = tl.where(scale_mode == 2, row_factor * alpha, row_factor)
    col_factor = tl.load(scale_ptr + offs_n, mask=offs_n < tl.where(scale_mode == 3, N, 0), other=1.0)
    col_factor = tl.where(scale_mode == 3, col_factor * alpha, col_factor)
    v = acc * tile_factor * row_factor[:, None] * col_factor[None, :]
    if HAS_BIAS:
        v += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    return v


@triton.jit
def _dequantized(acc, offs_m, offs_n, M, N, scale_a_ptr, scale_b_ptr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr):
    """``acc * scale_a * scale_b`` in that order (the reference's two roundings): each factor one element (mode 1),
    per row of a / per column of b (mode 2), or absent (0, compiled out: the 16-bit kernels)."""
    if SCALE_A == 1:
        acc = acc * tl.load(scale_a_ptr)
    elif SCALE_A == 2:
        acc = acc * tl.load(scale_a_ptr + offs_m, mask=offs_m < M, other=1.0)[:, None]
    if SCALE_B == 1:
        acc = acc * tl.load(scale_b_ptr)
    elif SCALE_B == 2:
        acc = acc * tl.load(scale_b_ptr + offs_n, mask=offs_n < N, other=1.0)[None, :]
    return acc


@triton.jit
def _record_amax(stored, offs_m, offs_n, M, N, amax_bits_ptr):
    """``amax = max(amax, max |stored|)`` by an integer atomic max on the float32 bits (``amax_bits_ptr``: the
    float32 amax viewed as int32). The bits of non-negative floats order like their values, and a NaN's (sign
    cleared by the abs: 0x7fc00000 and up) sort above inf's (0x7f800000), so a NaN wins, as with ``torch.maximum``.
    A negative old value (int32 below zero) loses to any magnitude, as it should; only a NaN with its sign bit set
    in ``amax_out`` beforehand would be overwritten."""
    bits = tl.abs(stored.to(tl.float32)).to(tl.int32, bitcast=True)
    bits = tl.where((offs_m[:, None] < M) & (offs_n[None, :] < N), bits, 0)
    tl.atomic_max(amax_bits_ptr, tl.max(bits))


@triton.jit
def _flag_non_finite(stored, offs_m, offs_n, M, N, found_inf_ptr):
    """found_inf = 1.0 when an in-bounds stored value is inf or NaN (|x| <= MAX is false for both)."""
    finite = tl.abs(stored.to(tl.float32)) <= _FLT_MAX
    bad = (~finite) & (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if tl.max(bad.to(tl.int32)) > 0:
        tl.store(found_inf_ptr, 1.0)


@triton.jit
def _epilogue_tma(
    acc,
    off_m,
    off_n,
    M,
    N,
    alpha,
    scale_ptr,
    scale_mode,
    bias_ptr,
    out_desc,
    out_ptr,
    stride_om,
    found_inf_ptr,
    scale_a_ptr,
    scale_b_ptr,
    amax_ptr,
    HAS_BIAS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    CHECK_FINITE: tl.constexpr,
    SCALE_A: tl.constexpr,
    SCALE_B: tl.constexpr,
    CHECK_AMAX: tl.constexpr,
    OUT_TMA: tl.constexpr,
    SUB_M: tl.constexpr,
    SUB_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    offs_m = off_m + tl.arange(0, SUB_M)
    offs_n = off_n + tl.arange(0, SUB_N)
    acc = _dequantized(acc, offs_m, offs_n, M, N, scale_a_ptr, scale_b_ptr, SCALE_A, SCALE_B)
    v = _scaled_values(acc, offs_m, offs_n, M, N, alpha, scale_ptr, scale_mode, bias_ptr, HAS_BIAS)
    if OUT_TMA:
        if ACCUMULATE:
            v += out_desc.load([off_m, off_n]).to(tl.float32)
        stored = _rounded(v, out_desc.dtype, INTERPRET)
        out_desc.store([off_m, off_n], stored)
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        if ACCUMULATE:
            v += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        stored = _rounded(v, out_ptr.dtype.element_ty, INTERPRET)
        tl.store(ptrs, stored, mask=mask)
    if CHECK_FINITE:
        _flag_non_finite(stored, offs_m, offs_n, M, N, found_inf_ptr)
    if CHECK_AMAX:
        _record_amax(stored, offs_m, offs_n, M, N, amax_ptr)


@triton.jit
def _tile_product(
    a_desc, b_desc, off_m, off_n, k_begin, k_end,
    A_COL_MAJOR: tl.constexpr, B_COL_MAJOR: tl.constexpr, UPCAST: tl.constexpr, MAX_IMPRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """fp32 sum over k-tiles [k_begin, k_end) of one output tile's products, through TMA descriptors."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_begin, k_end):
        off_k = ki * BLOCK_K
        if A_COL_MAJOR:
            a = a_desc.load([off_k, off_m]).T
        else:
            a = a_desc.load([off_m, off_k])
        if B_COL_MAJOR:
            b = b_desc.load([off_n, off_k]).T
        else:
            b = b_desc.load([off_k, off_n])
        if UPCAST:  # the interpreter's bf16 dot is wrong; fp32 products of 16-bit and FP8 inputs are exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=MAX_IMPRECISE)
    return acc


@triton.jit
def _halves_along_n(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The left and right [BLOCK_M, BLOCK_N // 2] halves of a tile (stored, or finished, one at a time)."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _store_halves(
    acc_left, acc_right, off_m, off_n, M, N, alpha, scale_ptr, scale_mode, bias_ptr, out_desc, out_ptr, stride_om,
    found_inf_ptr, scale_a_ptr, scale_b_ptr, amax_ptr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
    CHECK_FINITE: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, CHECK_AMAX: tl.constexpr,
    OUT_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The epilogue of a finished tile given as its two halves along N."""
    _epilogue_tma(
        acc_left, off_m, off_n, M, N, alpha, scale_ptr, scale_mode, bias_ptr, out_desc, out_ptr, stride_om,
        found_inf_ptr, scale_a_ptr, scale_b_ptr, amax_ptr, HAS_BIAS, ACCUMULATE, CHECK_FINITE,
        SCALE_A, SCALE_B, CHECK_AMAX, OUT_TMA, BLOCK_M, BLOCK_N // 2, INTERPRET,
    )  # fmt: skip
    _epilogue_tma(
        acc_right, off_m, off_n + BLOCK_N // 2, M, N, alpha, scale_ptr, scale_mode, bias_ptr, out_desc, out_ptr,
        stride_om, found_inf_ptr, scale_a_ptr, scale_b_ptr, amax_ptr, HAS_BIAS, ACCUMULATE, CHECK_FINITE,
        SCALE_A, SCALE_B, CHECK_AMAX, OUT_TMA, BLOCK_M, BLOCK_N // 2, INTERPRET,
    )  # fmt: skip


@triton.jit
def _store_tile(
    acc, off_m, off_n, M, N, alpha, scale_ptr, scale_mode, bias_ptr, out_desc, out_ptr, stride_om, found_inf_ptr,
    scale_a_ptr, scale_b_ptr, amax_ptr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, CHECK_FINITE: tl.constexpr,
    SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, CHECK_AMAX: tl.constexpr, OUT_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The epilogue of one finished tile, in one piece or in two halves along N."""
    if EPILOGUE_SPLIT == 2:
        acc_left, acc_right = _halves_along_n(acc, BLOCK_M, BLOCK_N)
        _store_halves(
            acc_left, acc_right, off_m, off_n, M, N, alpha, scale_ptr, scale_mode, bias_ptr, out_desc, out_ptr,
            stride_om, found_inf_ptr, scale_a_ptr, scale_b_ptr, amax_ptr, HAS_BIAS, ACCUMULATE, CHECK_FINITE,
            SCALE_A, SCALE_B, CHECK_AMAX, OUT_TMA, BLOCK_M, BLOCK_N, INTERPRET,
        )  # fmt: skip
    else:
        _epilogue_tma(
            acc, off_m, off_n, M, N, alpha, scale_ptr, scale_mode, bias_ptr, out_desc, out_ptr, stride_om,
            found_inf_ptr, scale_a_ptr, scale_b_ptr, amax_ptr, HAS_BIAS, ACCUMULATE, CHECK_FINITE,
            SCALE_A, SCALE_B, CHECK_AMAX, OUT_TMA, BLOCK_M, BLOCK_N, INTERPRET,
        )  # fmt: skip


@triton.jit
def _program_of_iteration(x, per, extra):
    """The program whose stream-K range holds iteration ``x``: the first ``extra`` programs take ``per + 1``
    iterations, the others ``per``."""
    big = extra * (per + 1)
    return tl.where(x < big, x // (per + 1), extra + (x - big) // tl.maximum(per, 1))


@triton.jit
def _add_partials(acc, partials_ptr, flags_ptr, first, member, column, offsets, TILE: tl.constexpr,
                  COLUMNS: tl.constexpr):  # fmt: skip
    """``acc`` plus the partial sums of the column's members ``first .. member - 1`` (programs ``q * COLUMNS +
    column``, in that order: the same bits on every run), each read once its program has raised its flag.
    ``offsets``: this part of a [BLOCK_M, BLOCK_N] tile."""
    for q in range(first, member):
        program = q * COLUMNS + column
        while tl.atomic_cas(flags_ptr + program, 1, 1, sem="acquire") != 1:
            pass
        acc += tl.load(partials_ptr + program * TILE + offsets, cache_modifier=".cg")  # < 2^31: [programs, tile]
    return acc


# (Over 80 lines: one persistent kernel, its tile loop, stream-K tail and fused epilogue (scale, bias, accumulate,
# non-finite flag, amax) together, as a GEMM epilogue must be to cost no extra pass over the output.)
@triton.jit
def _scaled_mm_tma_kernel(
    a_desc,
    b_desc,
    out_desc,
    out_ptr,
    scale_ptr,
    bias_ptr,
    found_inf_ptr,
    scale_a_ptr,
    scale_b_ptr,
    amax_ptr,
    partials_ptr,
    flags_ptr,
    alpha,
    M,
    N,
    K,
    scale_mode,
    stream_k_tiles,
    stride_a,
    stride_b,
    stride_om,
    A_COL_MAJOR: tl.constexpr,
    B_COL_MAJOR: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    CHECK_FINITE: tl.constexpr,
    SCALE_A: tl.constexpr,
    SCALE_B: tl.constexpr,
    CHECK_AMAX: tl.constexpr,
    OUT_TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    DEVICE_DESC: tl.constexpr,
    STREAM_K: tl.constexpr,
    STREAM_K_COLUMNS: tl.constexpr,
):
    """Persistent TMA matmul. Descriptors: a [M, K] (A_COL_MAJOR: [K, M] storage), b [K, N] (B_COL_MAJOR: [N, K]
    storage), out [M, N] with block [BLOCK_M, BLOCK_N // EPILOGUE_SPLIT]. OOB tiles read as zeros (K tail too).

    DEVICE_DESC: ``a_desc``/``b_desc`` are the operands' pointers (``out_desc`` is unused) and the descriptors are
    built here from them and ``stride_a``/``stride_b``/``stride_om`` (leading strides of the storage), in the
    global scratch that ``triton.set_allocator`` provides; otherwise all three are host ``TensorDescriptor``s.

    INTERPRET: run by the Triton interpreter: products in fp32 (its bf16 dot is wrong) and 16-bit outputs rounded
    by ``_rounded`` (its bf16 casts truncate); on a GPU it is False and changes nothing.

    STREAM_K: the k-iterations of the first ``stream_k_tiles`` tiles are cut into NUM_PROGRAMS equal ranges, one
    per program, then the other tiles go round-robin whole (a tile count that is not a multiple of the SM count
    otherwise leaves SMs idle in the last wave: 3072x768 has 72 tiles of 128x256 for 132 SMs). The program that
    reaches a tile's last k-iteration finishes it: it waits for the earlier programs' fp32 partial tiles
    (``partials_ptr`` [NUM_PROGRAMS, BLOCK_M, BLOCK_N], ``flags_ptr`` [NUM_PROGRAMS] int32 zeros), adds them in
    program order (the same sum on every run) and runs the epilogue. A program publishes its partial before it
    waits for any, and waits only for lower-numbered programs (run first under the interpreter, resident first on
    the GPU), so the waits cannot form a cycle.

    STREAM_K_COLUMNS > 1 (every tile shared, NUM_PROGRAMS a multiple of the tile columns): each column of tiles is
    its own stream-K problem, served by programs ``column, column + COLUMNS, ...``; programs p and p + 1 then read
    the same A rows at the same k-steps (L2 hits) instead of at unrelated ones. NOTE (H200, bf16 3072x768x8192,
    dev/n768_probe.py --proxy): stream-K over the tiles in one sequence 0.0736-0.0740 ms with or without its waits,
    column by column 0.0707; the same k-steps as 132 whole tiles 0.0554-0.0561."""
    if DEVICE_DESC:
        if A_COL_MAJOR:
            a_desc = tl.make_tensor_descriptor(a_desc, [K, M], [stride_a, 1], [BLOCK_K, BLOCK_M])
        else:
            a_desc = tl.make_tensor_descriptor(a_desc, [M, K], [stride_a, 1], [BLOCK_M, BLOCK_K])
        if B_COL_MAJOR:
            b_desc = tl.make_tensor_descriptor(b_desc, [N, K], [stride_b, 1], [BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(b_desc, [K, N], [stride_b, 1], [BLOCK_K, BLOCK_N])
        if OUT_TMA:
            out_desc = tl.make_tensor_descriptor(out_ptr, [M, N], [stride_om, 1], [BLOCK_M, BLOCK_N // EPILOGUE_SPLIT])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    first_whole_tile = 0
    if STREAM_K:
        pid = tl.program_id(0)
        column = pid % STREAM_K_COLUMNS
        member = pid // STREAM_K_COLUMNS  # this program's place among its column's programs
        total = (stream_k_tiles // STREAM_K_COLUMNS) * k_tiles
        per = total // (NUM_PROGRAMS // STREAM_K_COLUMNS)
        extra = total % (NUM_PROGRAMS // STREAM_K_COLUMNS)
        start = member * per + tl.minimum(member, extra)
        end = start + per + (member < extra).to(tl.int32)
        # Segments (one per tile the range touches) in reverse: first the start of a tile that a later program
        # finishes (its partial published at once), last the end of a tile that earlier programs started, whose
        # partials they published first. In k order, each program waited for the whole range of the one before.
        last_tile = (end - 1) // k_tiles
        num_segments = tl.where(end > start, last_tile - start // k_tiles + 1, 0)
        tile_offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        for segment in range(num_segments):
            tile_id = last_tile - segment  # within the column when STREAM_K_COLUMNS > 1
            tile_begin = tile_id * k_tiles
            lo = tl.maximum(start, tile_begin)
            hi = tl.minimum(end, tile_begin + k_tiles)
            if STREAM_K_COLUMNS > 1:
                pid_m, pid_n = tile_id, column
            else:
                pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = _tile_product(
                a_desc, b_desc, off_m, off_n, lo - tile_begin, hi - tile_begin,
                A_COL_MAJOR, B_COL_MAJOR, INTERPRET, MAX_IMPRECISE, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            if hi == tile_begin + k_tiles:
                first = _program_of_iteration(tile_begin, per, extra)  # == member when it holds it all
                if EPILOGUE_SPLIT == 2:  # half a tile at a time: a whole fp32 partial beside acc would spill
                    acc_left, acc_right = _halves_along_n(acc, BLOCK_M, BLOCK_N)
                    half_offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N // 2)[None, :]
                    acc_left = _add_partials(
                        acc_left, partials_ptr, flags_ptr, first, member, column, half_offsets, BLOCK_M * BLOCK_N,
                        STREAM_K_COLUMNS,
                    )  # fmt: skip
                    acc_right = _add_partials(
                        acc_right, partials_ptr + BLOCK_N // 2, flags_ptr, first, member, column, half_offsets,
                        BLOCK_M * BLOCK_N, STREAM_K_COLUMNS,
                    )  # fmt: skip
                    _store_halves(
                        acc_left, acc_right, off_m, off_n, M, N, alpha, scale_ptr, scale_mode, bias_ptr,
                        out_desc, out_ptr, stride_om, found_inf_ptr, scale_a_ptr, scale_b_ptr, amax_ptr, HAS_BIAS,
                        ACCUMULATE, CHECK_FINITE, SCALE_A, SCALE_B, CHECK_AMAX, OUT_TMA, BLOCK_M, BLOCK_N, INTERPRET,
                    )  # fmt: skip
                else:
                    acc = _add_partials(
                        acc, partials_ptr, flags_ptr, first, member, column, tile_offsets, BLOCK_M * BLOCK_N,
                        STREAM_K_COLUMNS,
                    )  # fmt: skip
                    _store_tile(
                        acc, off_m, off_n, M, N, alpha, scale_ptr, scale_mode, bias_ptr, out_desc, out_ptr,
                        stride_om, found_inf_ptr, scale_a_ptr, scale_b_ptr, amax_ptr, HAS_BIAS, ACCUMULATE,
                        CHECK_FINITE, SCALE_A, SCALE_B, CHECK_AMAX, OUT_TMA, BLOCK_M, BLOCK_N, 1, INTERPRET,
                    )  # fmt: skip
            else:  # the range ends inside this tile: hand the partial sum to the program that finishes it
                mine = partials_ptr + pid * (BLOCK_M * BLOCK_N) + tile_offsets
                tl.store(mine, acc, cache_modifier=".cg")
                tl.debug_barrier()  # every thread's part is written before the flag is raised
                tl.atomic_xchg(flags_ptr + pid, 1, sem="release")
        first_whole_tile = stream_k_tiles
    for tile_id in tl.range(first_whole_tile + tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = _tile_product(
            a_desc, b_desc, off_m, off_n, 0, k_tiles, A_COL_MAJOR, B_COL_MAJOR, INTERPRET, MAX_IMPRECISE,
            BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        _store_tile(
            acc, off_m, off_n, M, N, alpha, scale_ptr, scale_mode, bias_ptr, out_desc, out_ptr, stride_om,
            found_inf_ptr, scale_a_ptr, scale_b_ptr, amax_ptr, HAS_BIAS, ACCUMULATE, CHECK_FINITE,
            SCALE_A, SCALE_B, CHECK_AMAX, OUT_TMA, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT, INTERPRET,
        )  # fmt: skip


@triton.jit
def _scaled_mm_ptr_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    scale_ptr,
    bias_ptr,
    found_inf_ptr,
    scale_a_ptr,
    scale_b_ptr,
    amax_ptr,
    alpha,
    M,
    N,
    K,
    scale_mode,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    CHECK_FINITE: tl.constexpr,
    SCALE_A: tl.constexpr,
    SCALE_B: tl.constexpr,
    CHECK_AMAX: tl.constexpr,
    INTERPRET: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Persistent pointer-based matmul for any strides (a [M, K], b [K, N]); out is row-major [M, N]."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    offs_k = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows/columns past the edge re-read row/column 0 (always valid) instead of masking every load.
        rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
        cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k_left = K - ki * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if INTERPRET:  # (as _tile_product's UPCAST)
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=MAX_IMPRECISE)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        acc = _dequantized(acc, offs_m, offs_n, M, N, scale_a_ptr, scale_b_ptr, SCALE_A, SCALE_B)
        v = _scaled_values(acc, offs_m, offs_n, M, N, alpha, scale_ptr, scale_mode, bias_ptr, HAS_BIAS)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        if ACCUMULATE:
            v += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        stored = _rounded(v, out_ptr.dtype.element_ty, INTERPRET)
        tl.store(out_ptrs, stored, mask=mask)
        if CHECK_FINITE:
            _flag_non_finite(stored, offs_m, offs_n, M, N, found_inf_ptr)
        if CHECK_AMAX:
            _record_amax(stored, offs_m, offs_n, M, N, amax_ptr)
