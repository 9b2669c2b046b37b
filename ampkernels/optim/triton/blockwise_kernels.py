"""Triton kernels of the Adam step with low-precision moments (math in ``reference.adam_step_blockwise``); launched
by ``ampkernels.optim.triton.blockwise.BlockwiseStepTable``.

* ``_blockwise_prologue_kernel``: one lane per tensor; advances the float32 step counts and writes the per-tensor
  constants: step size and sqrt of the second bias correction (float64, rounded once) and the stochastic-rounding
  key of ``reference.rounding_key`` (uint32 arithmetic).
* ``_blockwise_adam_kernel``: a grid-stride loop over work items (``ITEM_BLOCKS`` consecutive 128-element blocks of
  one tensor, in row-major order across its rows; the launch code picks the grid), each walked in [NB, 128] tiles:
  one tile row per block, so a block's absmax is a ``tl.max`` over axis 1 and its new exponent and codes come out of
  the same registers. A tile may span several rows (short rows waste only the padding of their last block). One
  launch per format group: formats, dtypes and FULL (whole blocks, aligned: vector accesses) are constexpr.

Both return at once when ``found_inf`` is non-zero: nothing is written. The codes are the reference's integer math
(``_block_exponent``, ``_encode``, ``_decode``, ``_mix32``) on the same float32 bit patterns, bit for bit (NaN: see
``_INF_BITS``); the float math is the reference's operation for operation (on a GPU the division by the bias
correction by ``_div_rn_by``, whose quotients are div.rn's).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ampkernels._constants import QUANT_BLOCK, STATE_Q4, STATE_Q8
from ampkernels._triton_functions import _bf16, _f64, _lerp, _rounded, _skipped

_QB = tl.constexpr(QUANT_BLOCK)
_HALF_QB = tl.constexpr(QUANT_BLOCK // 2)
_Q8 = tl.constexpr(STATE_Q8)
_Q4 = tl.constexpr(STATE_Q4)
# float32 bits of +inf: a block's absmax bits are clamped to it, so that a NaN block saturates (exponent 253) as
# the reference's does for x86's NaN (0x7FC00000); for NaN bits above 0x7FF7FFFF (CUDA's canonical 0x7FFFFFFF)
# the reference's int32 rounding add wraps instead (exponent 1, codes 0). Codes saturate for every NaN here.
_INF_BITS = tl.constexpr(0x7F800000)

# Rows of the per-tensor metadata (int64 [_META_ROWS, num_tensors]; built in blockwise.py).
(
    _PARAM,
    _EXP_AVG,
    _EXP_AVG_SCALE,
    _EXP_AVG_SQ,
    _EXP_AVG_SQ_SCALE,
    _MAX_EXP_AVG_SQ,
    _MASTER,
    _STEP,
    _COLS,
    _NBLK,
    _BLOCKS,
    _OFFSET,
    _SALT,
) = (tl.constexpr(row) for row in range(13))
META_ROWS = 13


@triton.jit
def _mix32(x):
    # reference._mix32 (lowbias32) on uint32: the products wrap modulo 2^32 as the reference masks them.
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["num_tensors", "lr_bits", "log2_beta1_bits", "log2_beta2_bits", "seed_lo", "seed_hi"])
def _blockwise_prologue_kernel(
    meta,
    num_tensors,
    scalars,
    keys,
    found_inf,
    lr_ptr,
    lr_bits,
    log2_beta1_bits,
    log2_beta2_bits,
    seed_lo,
    seed_hi,
    HAS_FOUND: tl.constexpr,
    LR_FROM_PTR: tl.constexpr,
    SR: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    if _skipped(found_inf, HAS_FOUND):
        return
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = t < num_tensors
    step_ptr = tl.load(meta + _STEP * num_tensors + t, mask=mask, other=0).to(tl.pointer_type(tl.float32))
    step = tl.load(step_ptr, mask=mask, other=0.0) + 1.0
    tl.store(step_ptr, step, mask=mask)
    if LR_FROM_PTR:
        lr = tl.load(lr_ptr).to(tl.float64)
    else:
        lr = _f64(lr_bits)
    s = step.to(tl.float64)
    # As optimizers_kernels._prologue_kernel: beta^step as exp2(step * log2(beta)) in float64.
    bc1 = 1.0 - tl.exp2(s * _f64(log2_beta1_bits))
    bc2 = 1.0 - tl.exp2(s * _f64(log2_beta2_bits))
    tl.store(scalars + 2 * t, (lr / bc1).to(tl.float32), mask=mask)
    tl.store(scalars + 2 * t + 1, tl.sqrt(bc2).to(tl.float32), mask=mask)
    if SR:
        # reference.rounding_key(seed, salt, step): the seed halves and the salt as uint32, the step truncated.
        k = _mix32(seed_lo.to(tl.uint32, bitcast=True))
        k = _mix32(k ^ seed_hi.to(tl.uint32, bitcast=True))
        salt = tl.load(meta + _SALT * num_tensors + t, mask=mask, other=0).to(tl.uint32)
        k = _mix32(k ^ salt)
        key = _mix32(k + step.to(tl.int64).to(tl.uint32))
        tl.store(keys + t, key.to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def _pow2(biased):
    # 2 ** (biased - 127) from its float32 bit pattern; biased int32 in [1, 254].
    return (biased << 23).to(tl.float32, bitcast=True)


@triton.jit
def _decode(codes, EB: tl.constexpr, MB: tl.constexpr, SIGNED: tl.constexpr):
    """reference._decode of codes (int32, sign bit above the magnitude when SIGNED) as float32 times 2^(top - 127):
    the magnitude bits placed as a float32's top exponent and mantissa bits (codes below 2^MB land as float32
    subnormals: the uniform grid), the sign bit as the float's. The caller's product with 2^(127 - top) is exact."""
    magnitude_bits: tl.constexpr = EB + MB
    bits = (codes & ((1 << magnitude_bits) - 1)) << (23 - MB)
    if SIGNED:
        bits = bits | ((codes >> magnitude_bits) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _encode(y, EB: tl.constexpr, MB: tl.constexpr, NO_GRID: tl.constexpr, INTERPRET: tl.constexpr):
    """reference._encode: magnitudes y (float32 >= 0, below 2 unless non-finite) -> codes (int32), nearest, ties
    away from zero. The normal range from y's bits: (bits + half a step - the exponent offset) >> (23 - MB), one
    add for the reference's two (no int32 overflow for any bits <= 0x7FFFFFFF: NaN and inf saturate).

    NO_GRID: the caller raises every code below 1 to 1 (the second moment) and MB is 0, so the grid below the
    smallest normal value (codes 0 and 1) only ever gives 1: left out (values there come out of the normal formula
    at 1 or below, the caller's 1 all the same)."""
    top: tl.constexpr = (1 << EB) - 1
    bias: tl.constexpr = (1 << (22 - MB)) - ((127 - top) << 23)
    normal = tl.minimum((y.to(tl.int32, bitcast=True) + bias) >> (23 - MB), (1 << (EB + MB)) - 1)
    if NO_GRID:
        return normal
    small = y < 2.0 ** (1 - top)
    # The grid below the smallest normal value: floor(y * 2^k + 0.5), kept on the grid's lanes only (a NaN compares
    # false and takes the normal path).
    if INTERPRET:
        # y clamped: numpy's int32 conversion of the other lanes would overflow.
        sub = tl.floor(tl.minimum(y, 2.0 ** (1 - top)) * (2.0 ** (top - 1 + MB)) + 0.5).to(tl.int32)
    else:
        # One FMA for the product and the add: y * 2^k is exact, so the FMA rounds once as the reference's add.
        # The other lanes' cvt.rmi saturates (PTX), and they are not kept.
        sub = tl.floor(tl.fma(y, 2.0 ** (top - 1 + MB), 0.5)).to(tl.int32)
    return tl.where(small, sub, normal)


@triton.jit
def _div_rn_by(a, c, c_rcp):
    """div.rn(a, c) for a = sqrt_rn(v) (0, +inf, NaN or >= 2^-75) and a per-tensor divisor c in (0, 1] (the bias
    correction's square root) with c_rcp = 1 / c rounded to nearest: two Markstein corrections of a * c_rcp, 5
    operations per element against div.rn's 11 (reciprocal, Newton step, range check, branch). The first brings the
    quotient within an ulp of a / c, which makes the second's FMA residual exact and its sum the rounded quotient
    (Markstein's theorem); for such a and c no step underflows or overflows. a = inf would make the residual NaN.
    tests/optim/test_triton_blockwise.py checks it bit for bit against IEEE division on the GPU."""
    q = a * c_rcp
    q = tl.fma(tl.fma(-q, c, a), c_rcp, q)
    q = tl.fma(tl.fma(-q, c, a), c_rcp, q)
    return tl.where(a == float("inf"), a, q)


@triton.jit
def _unpack4(packed, NB: tl.constexpr):
    # [NB, 64] bytes -> [NB, 128] nibbles: element 2j in the low nibble of byte j.
    return tl.reshape(tl.join(packed & 0xF, packed >> 4), [NB, _QB])


@triton.jit
def _load_moment(
    x_ptr,
    s_ptr,
    at,
    FMT: tl.constexpr,
    EB: tl.constexpr,
    MB: tl.constexpr,
    SIGNED: tl.constexpr,
    NB: tl.constexpr,
):
    """The moment of one tile as float32 [NB, 128]: param-shaped storage, or codes times their block's scale.
    ``at``: the tile's (flat offsets, mask, Q4 byte offsets, their mask, blocks, block mask)."""
    flat, mask, code_off, code_mask, blk, bmask = at
    if FMT != _Q8 and FMT != _Q4:
        values = tl.load(x_ptr + flat, mask=mask, other=0.0).to(tl.float32)
    else:
        if FMT == _Q8:
            codes = tl.load(x_ptr + flat, mask=mask, other=0).to(tl.int32)
        else:
            codes = _unpack4(tl.load(x_ptr + code_off, mask=code_mask, other=0).to(tl.int32), NB)
        top: tl.constexpr = (1 << EB) - 1
        exponent = tl.load(s_ptr + blk, mask=bmask, other=0).to(tl.int32)
        scale = tl.where(exponent == 0, 0.0, _pow2(tl.maximum(exponent, 1)))  # 0: a fresh, all-zero block
        # Two products: the first exact (a code value), the second the reference's own rounding.
        values = (_decode(codes, EB, MB, SIGNED) * (2.0 ** (127 - top))) * scale[:, None]
    return values


@triton.jit
def _store_moment(
    x,
    x_ptr,
    s_ptr,
    at,
    FMT: tl.constexpr,
    EB: tl.constexpr,
    MB: tl.constexpr,
    SIGNED: tl.constexpr,
    NB: tl.constexpr,
    DTYPE: tl.constexpr,
    FULL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Stores the new moment ``x`` (float32 [NB, 128]): rounded to the storage dtype, or as codes + exponents."""
    flat, mask, code_off, code_mask, blk, bmask = at
    if FMT != _Q8 and FMT != _Q4:
        tl.store(x_ptr + flat, _rounded(x, DTYPE, INTERPRET), mask=mask)
    else:
        # reference.quantize_blockwise, per tile row: the block's absmax on the magnitudes' bit patterns (they order
        # like the values, NaN above inf: clamped to inf's, as the reference's positive NaN rounds; lanes past the
        # row's end count as zeros, as the reference's padding).
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        if not FULL:
            bits = tl.where(mask, bits, 0)
        absmax = tl.minimum(tl.max(bits, axis=1), _INF_BITS)
        exponent = tl.minimum(tl.maximum(((absmax + (1 << (22 - MB))) >> 23) & 0xFF, 1), 253)
        y = bits.to(tl.float32, bitcast=True) * _pow2(254 - exponent)[:, None]  # exact: times 2 ** (127 - exponent)
        codes = _encode(y, EB, MB, not SIGNED and MB == 0, INTERPRET)
        if SIGNED:
            codes = codes | (((x < 0.0) & (codes > 0)).to(tl.int32) << (EB + MB))  # no sign on a zero code
        else:
            codes = tl.maximum(codes, 1)  # the second moment is never zero (reference.py's header says why)
        if FMT == _Q4 and not FULL:
            codes = tl.where(mask, codes, 0)  # a row of odd length ends in a zero high nibble
        if FMT == _Q8:
            tl.store(x_ptr + flat, codes.to(tl.uint8), mask=mask)
        else:
            low, high = tl.split(tl.reshape(codes, [NB, _HALF_QB, 2]))
            tl.store(x_ptr + code_off, (low | (high << 4)).to(tl.uint8), mask=code_mask)
        tl.store(s_ptr + blk, exponent.to(tl.uint8), mask=bmask)


@triton.jit
def _meta_ptr(meta, row, num_tensors, t, DTYPE: tl.constexpr, ALIGN: tl.constexpr):
    """Row ``row`` of the metadata for tensor ``t`` as a pointer, promised ALIGN-byte aligned (0: nothing)."""
    p = tl.load(meta + row * num_tensors + t).to(tl.pointer_type(DTYPE))
    if ALIGN:
        p = tl.multiple_of(p, ALIGN)
    return p


# (Over 80 lines: one kernel, so that each block's moments are dequantized, updated, re-quantized and the parameter
# stepped without a round trip to memory; the 8/4-bit formats' branches are constexpr, compiled away.)
@triton.jit(
    do_not_specialize=[
        "num_tensors",
        "num_items",
        "lr_bits",
        "wd",
        "wd_bits",
        "beta2",
        "omb1",
        "omb2",
        "eps",
    ]
)
def _blockwise_adam_kernel(
    meta,
    grads,
    items,
    num_tensors,
    num_items,
    scalars,
    keys,
    grad_scale,
    found_inf,
    lr_ptr,
    lr_bits,
    wd,
    wd_bits,
    beta2,
    omb1,
    omb2,
    eps,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    M_DTYPE: tl.constexpr,
    V_DTYPE: tl.constexpr,
    X_DTYPE: tl.constexpr,
    FMT_M: tl.constexpr,
    FMT_V: tl.constexpr,
    M_EB: tl.constexpr,
    M_MB: tl.constexpr,
    V_EB: tl.constexpr,
    V_MB: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_WD: tl.constexpr,
    DECOUPLED: tl.constexpr,
    WEIGHT_SMALL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    LR_FROM_PTR: tl.constexpr,
    SR: tl.constexpr,
    FULL: tl.constexpr,
    G_ALIGNED: tl.constexpr,
    INTERPRET: tl.constexpr,
    NB: tl.constexpr,
    ITEM_BLOCKS: tl.constexpr,
    STAGES: tl.constexpr = 1,
):
    """One Adam step over the work items ``items`` (int64 [num_items, 2]: tensor, first block) of tensors that all
    have the moment formats FMT_M / FMT_V. FULL: every row is whole blocks and every parameter/state address is
    16-byte aligned (unmasked columns, vector accesses); G_ALIGNED: so are the gradients."""
    if _skipped(found_inf, HAS_FOUND):
        return
    QUANT: tl.constexpr = FMT_M == _Q8 or FMT_M == _Q4 or FMT_V == _Q8 or FMT_V == _Q4
    # The alignment promised for each tensor (FULL: all are 16-byte aligned; G_ALIGNED: the gradients too). With a
    # quantized moment, only what four elements take (float32 16 bytes, bfloat16 8, 8-bit codes 4, 4-bit codes 2):
    # every tensor then loads and stores in one layout, [1, 4] per thread, and a block's absmax is one warp's REDUX.
    # Promised 16, the narrower ones load as wider vectors, the tile takes their layout, and a store of another
    # tensor first converts it through shared memory (H200 SASS of 8-bit moments with float32 parameters: 2 STS.128
    # + 2 LDS.128 + a barrier per tile). Without one, 16 bytes: no reduction, and wider vectors issue fewer loads.
    M_BITS: tl.constexpr = 8 if FMT_M == _Q8 else (4 if FMT_M == _Q4 else M_DTYPE.primitive_bitwidth)
    V_BITS: tl.constexpr = 8 if FMT_V == _Q8 else (4 if FMT_V == _Q4 else V_DTYPE.primitive_bitwidth)
    P_ALIGN: tl.constexpr = (P_DTYPE.primitive_bitwidth // 2 if QUANT else 16) if FULL else 0
    G_ALIGN: tl.constexpr = (G_DTYPE.primitive_bitwidth // 2 if QUANT else 16) if G_ALIGNED else 0
    M_ALIGN: tl.constexpr = (M_BITS // 2 if QUANT else 16) if FULL else 0
    V_ALIGN: tl.constexpr = (V_BITS // 2 if QUANT else 16) if FULL else 0
    X_ALIGN: tl.constexpr = (X_DTYPE.primitive_bitwidth // 2 if QUANT else 16) if FULL else 0
    inv = 1.0
    if HAS_SCALE:
        inv = (1.0 / tl.load(grad_scale).to(tl.float64)).to(tl.float32)  # as GradScaler.unscale_ rounds it
    if LR_FROM_PTR:
        lr = tl.load(lr_ptr).to(tl.float64)
    else:
        lr = _f64(lr_bits)
    decay = (1.0 - lr * _f64(wd_bits)).to(tl.float32)  # float64, as the native kernels
    lanes = tl.arange(0, _QB)
    half_lanes = tl.arange(0, _HALF_QB)
    for c in range(tl.program_id(0), num_items, tl.num_programs(0)):
        t = tl.load(items + 2 * c).to(tl.int32)
        b0 = tl.load(items + 2 * c + 1).to(tl.int32)
        cols = tl.load(meta + _COLS * num_tensors + t)  # int64 (numel for an unquantized tensor)
        nblk = tl.load(meta + _NBLK * num_tensors + t).to(tl.int32)
        if FULL:
            cols = tl.multiple_of(cols, _QB)
        bend = tl.minimum(b0 + ITEM_BLOCKS, tl.load(meta + _BLOCKS * num_tensors + t).to(tl.int32))
        p_ptr = _meta_ptr(meta, _PARAM, num_tensors, t, P_DTYPE, P_ALIGN)
        g_ptr = tl.load(grads + t).to(tl.pointer_type(G_DTYPE))
        if G_ALIGN:
            g_ptr = tl.multiple_of(g_ptr, G_ALIGN)
        m_ptr = _meta_ptr(meta, _EXP_AVG, num_tensors, t, M_DTYPE, M_ALIGN)
        ms_ptr = _meta_ptr(meta, _EXP_AVG_SCALE, num_tensors, t, tl.uint8, 0)
        v_ptr = _meta_ptr(meta, _EXP_AVG_SQ, num_tensors, t, V_DTYPE, V_ALIGN)
        vs_ptr = _meta_ptr(meta, _EXP_AVG_SQ_SCALE, num_tensors, t, tl.uint8, 0)
        step_size = tl.load(scalars + 2 * t)
        bc2_sqrt = tl.load(scalars + 2 * t + 1)
        # 1 / c in float64, then float32: the same as rounding once (a float32 c's reciprocal is never that close
        # to a float32 tie).
        bc2_rcp = (1.0 / bc2_sqrt.to(tl.float64)).to(tl.float32)
        if SR:
            key = tl.load(keys + t).to(tl.uint32, bitcast=True)
            offset = tl.load(meta + _OFFSET * num_tensors + t)
        for tb in tl.range(b0, bend, NB, num_stages=STAGES):
            blk = tb + tl.arange(0, NB)
            bmask = blk < bend
            if QUANT and FULL:
                # Rows of whole blocks: block b starts at element b * 128 and code byte b * 64 (no row index).
                block_start = tl.multiple_of(blk.to(tl.int64) * _QB, _QB)
                code_off = tl.multiple_of(blk.to(tl.int64) * _HALF_QB, _HALF_QB)[:, None] + half_lanes[None, :]
                code_mask = tl.broadcast_to(bmask[:, None], [NB, _HALF_QB])
            elif QUANT:
                row = blk // nblk
                jb = blk - row * nblk
                block_start = row.to(tl.int64) * cols + jb * _QB
                col = jb[:, None] * _QB + lanes[None, :]
                # Q4 codes: byte j of a row holds elements 2j, 2j + 1; a block's 128 elements fill 64 bytes.
                code_col = jb[:, None] * _HALF_QB + half_lanes[None, :]
                code_cols = (cols + 1) // 2
                code_mask = bmask[:, None] & (code_col < code_cols)
                code_off = (row.to(tl.int64) * code_cols)[:, None] + code_col
            else:
                # One row (cols = numel): the tile is NB * 128 consecutive elements.
                block_start = blk.to(tl.int64) * _QB
                col = block_start[:, None] + lanes[None, :]
                code_off = col
                code_mask = bmask[:, None]
            flat = block_start[:, None] + lanes[None, :]
            if FULL:
                mask = tl.broadcast_to(bmask[:, None], [NB, _QB])  # constant along a block: vector accesses
            else:
                mask = bmask[:, None] & (col < cols)
            at = (flat, mask, code_off, code_mask, blk, bmask)
            g = tl.load(g_ptr + flat, mask=mask, other=0.0).to(tl.float32) * inv
            if MAXIMIZE:
                g = -g
            if HAS_MASTER:
                w_ptr = _meta_ptr(meta, _MASTER, num_tensors, t, tl.float32, 16 if FULL else 0)  # float32: 4 elements
                p = tl.load(w_ptr + flat, mask=mask, other=0.0)
            else:
                p = tl.load(p_ptr + flat, mask=mask, other=0.0).to(tl.float32)
            if HAS_WD:
                if DECOUPLED:
                    p = p * decay
                else:
                    g = g + wd * p
            m = _load_moment(m_ptr, ms_ptr, at, FMT_M, M_EB, M_MB, True, NB)
            v = _load_moment(v_ptr, vs_ptr, at, FMT_V, V_EB, V_MB, False, NB)
            m = _lerp(m, g, omb1, WEIGHT_SMALL)
            v = v * beta2 + omb2 * g * g
            second = v
            if AMSGRAD:
                x_ptr = _meta_ptr(meta, _MAX_EXP_AVG_SQ, num_tensors, t, X_DTYPE, X_ALIGN)
                vmax = tl.maximum(
                    tl.load(x_ptr + flat, mask=mask, other=0.0).to(tl.float32), v, propagate_nan=tl.PropagateNan.ALL
                )
                tl.store(x_ptr + flat, _rounded(vmax, X_DTYPE, INTERPRET), mask=mask)
                second = vmax
            if INTERPRET:
                denom = tl.div_rn(tl.sqrt_rn(second), bc2_sqrt) + eps
            else:
                denom = _div_rn_by(tl.sqrt_rn(second), bc2_sqrt, bc2_rcp) + eps
            p = p - step_size * tl.div_rn(m, denom)
            _store_moment(
                m,
                m_ptr,
                ms_ptr,
                at,
                FMT_M,
                M_EB,
                M_MB,
                True,
                NB,
                M_DTYPE,
                FULL,
                INTERPRET,
            )
            _store_moment(
                v,
                v_ptr,
                vs_ptr,
                at,
                FMT_V,
                V_EB,
                V_MB,
                False,
                NB,
                V_DTYPE,
                FULL,
                INTERPRET,
            )
            if HAS_MASTER:
                tl.store(w_ptr + flat, p, mask=mask)
            if SR:
                # reference.rounding_bits at global flat index offset + flat, then stochastic_round_to_bf16. The
                # index's high word hashed per block: the block's, or the next one past a 2^32 crossing inside it.
                base = offset + block_start
                low = base.to(tl.uint32)
                high = (base >> 32).to(tl.uint32)
                ulanes = lanes[None, :].to(tl.uint32)
                room = tl.full([], 0xFFFFFFFF, tl.uint32) - low  # lanes past it wrap the low word
                hi = tl.where(ulanes > room[:, None], _mix32(high + 1)[:, None], _mix32(high)[:, None])
                random16 = _mix32(((key + low)[:, None] + ulanes) ^ hi) >> 16
                tl.store(p_ptr + flat, _bf16(p, random16), mask=mask)
            else:
                tl.store(p_ptr + flat, _rounded(p, P_DTYPE, INTERPRET), mask=mask)
