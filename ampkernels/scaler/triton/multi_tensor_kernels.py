"""Triton kernels of the multi-tensor AMP ops (see ``dev/design.md``); launched by
``ampkernels.scaler.triton.multi_tensor``.

* ``_unscale_reduce_kernel``: one launch per (dtype, alignment) group, persistent grid over the group's chunks; each
  chunk unscales (optionally in place), checks for non-finite inputs and reduces its norm partial into its own slot of
  a float64 ``partials`` buffer [C, 2] (no atomics, no memset).
* ``_finalize_kernel``: single program; ORs the flags into ``found_inf``, reduces the total norm in a fixed order
  (deterministic) and writes the clip coefficient.
* ``_per_tensor_norm_kernel``: one program per tensor, reduces that tensor's chunk partials (fixed order).
* ``_update_scale_kernel``: single program, the loss-scale update with hysteresis, bounds and telemetry.

The math matches ``ampkernels.reference`` exactly (same roundings). Norms: a chunk of a 16/32-bit tensor accumulates
in float32 (within float32 rounding of the reference's float64), a chunk of a float64 tensor in float64; chunks are
summed in float64, so neither a float64 norm's squares (1e20 -> 1e40, 1e-30 -> 1e-60) nor a large total overflows or
underflows before the final rounding to float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ampkernels._constants import NormKind
from ampkernels._triton_functions import _rounded

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_DBL_MAX = tl.constexpr(1.7976931348623157e308)

# The NORM constexpr's values (ampkernels._constants.NormKind).
_NORM_NONE = tl.constexpr(int(NormKind.NONE))
_NORM_L2 = tl.constexpr(int(NormKind.L2))
_NORM_INF = tl.constexpr(int(NormKind.INF))


@triton.jit
def _nanmax(a, b):
    # Plain tl.maximum / tl.max drop NaN; torch's max (the reference) propagates it.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _nanmax_reduce(x):
    """Max over a 1-D block of values >= 0 or NaN that propagates NaN: tl.max plus a sum that is NaN iff a lane is.

    Built-in reductions rather than tl.reduce with a custom combine, which the interpreter runs element by element.
    """
    return tl.max(x, axis=0) + tl.sum(tl.where(x >= 0.0, 0.0, x), axis=0)


@triton.jit
def _unscale_block(
    x,
    base,
    offs,
    bound,
    inv,
    fac,
    acc,
    bad,
    WRITE: tl.constexpr,
    NORM: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    IS_FP64: tl.constexpr,
    MASKED: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One loaded block ``x`` from ``base + offs`` (int64 offsets; with MASKED only those < ``bound`` are real)."""
    # Non-finite check on the *input* value: |x| <= MAX is an ordered compare, false for NaN and inf. float64 tensors
    # are checked, unscaled and accumulated in float64 (like torch and the reference), everything else in float32.
    # (Folding the flag in right after the load keeps ptxas at fewer registers.)
    if IS_FP64:
        bad = bad | ((tl.abs(x) <= _DBL_MAX) == 0).to(tl.int32)
        v = x * inv.to(tl.float64)
        if HAS_FACTOR:
            v = v * fac.to(tl.float64)
    else:
        xf = x.to(tl.float32)
        bad = bad | ((tl.abs(xf) <= _FLT_MAX) == 0).to(tl.int32)
        v = xf * inv
        if HAS_FACTOR:
            v = v * fac
    stored = _rounded(v, x.dtype, INTERPRET)  # (bf16: integer rounding under the interpreter, whose casts truncate)
    if WRITE:
        if MASKED:
            tl.store(base + offs, stored, mask=offs < bound)
        else:
            tl.store(base + offs, stored)
    if NORM == _NORM_L2:
        vn = stored.to(acc.dtype)  # the norm of the value as stored (rounded to the tensor's dtype)
        acc += vn * vn
    elif NORM == _NORM_INF:
        acc = _nanmax(acc, tl.abs(stored.to(acc.dtype)))
    return acc, bad


@triton.jit(do_not_specialize=["c_begin", "c_end"])
def _unscale_reduce_kernel(
    addrs,
    numels,
    chunk_tensor,
    chunk_start,
    partials,
    scale,
    factor,
    c_begin,
    c_end,
    DTYPE: tl.constexpr,
    IS_FP64: tl.constexpr,
    ALIGNED: tl.constexpr,
    WRITE: tl.constexpr,
    NORM: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Chunks ``c_begin .. c_end-1`` (one dtype group); writes ``partials[c] = (flag, acc)``.

    Loop iterations cover ``2 * HALF`` elements.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # Exactly torch's scale.double().reciprocal().float(); an fp64 division is correctly rounded on GPU.
    inv = (1.0 / tl.load(scale).to(tl.float64)).to(tl.float32)
    fac = 1.0
    if HAS_FACTOR:
        fac = tl.load(factor)
    lanes = tl.arange(0, HALF)
    for c in range(c_begin + pid, c_end, nprog):
        t = tl.load(chunk_tensor + c)
        # chunk_start is a multiple of CHUNK_SIZE by construction: the hint keeps 16-byte vector accesses possible.
        start = tl.multiple_of(tl.load(chunk_start + c), CHUNK_SIZE)
        n = tl.load(numels + t)
        ptr = tl.load(addrs + t).to(tl.pointer_type(DTYPE))
        # NOTE: a pointer made from an integer has unknown alignment, so Triton would emit scalar loads/stores.
        # The host puts tensors whose data_ptr is a multiple of 16 bytes in their own group (ALIGNED=True) and only
        # there asserts it with tl.multiple_of; with the CHUNK_SIZE hint on `start` and unmasked full blocks below
        # this gives 16-byte accesses (checked by compiling for sm_90 with Triton 3.8: ld/st.global.v4.b32, v2.b64
        # for float64; the unaligned variant compiles to scalar b16/b32 accesses). Unaligned groups stay correct.
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        base = ptr + start
        m = tl.minimum(n - start, CHUNK_SIZE)  # elements of this chunk (int64)
        full = (m // (2 * HALF)) * (2 * HALF)
        acc = tl.zeros([HALF], dtype=tl.float64 if IS_FP64 else tl.float32)
        bad = tl.zeros([HALF], dtype=tl.int32)
        # Full blocks unmasked (a mask against an arbitrary numel would also defeat vectorisation), each as two
        # halves loaded before either is used: more bytes in flight per thread for few registers (NOTE at BLOCK).
        for off in range(0, full, 2 * HALF):
            oa = off + lanes
            ob = off + HALF + lanes
            xa = tl.load(base + oa)
            xb = tl.load(base + ob)
            acc, bad = _unscale_block(
                xa, base, oa, m, inv, fac, acc, bad, WRITE, NORM, HAS_FACTOR, IS_FP64, False, INTERPRET
            )
            acc, bad = _unscale_block(
                xb, base, ob, m, inv, fac, acc, bad, WRITE, NORM, HAS_FACTOR, IS_FP64, False, INTERPRET
            )
        for off in range(full, m, HALF):  # the tail: at most two masked halves
            oa = off + lanes
            xa = tl.load(base + oa, mask=oa < m, other=0.0)
            acc, bad = _unscale_block(
                xa, base, oa, m, inv, fac, acc, bad, WRITE, NORM, HAS_FACTOR, IS_FP64, True, INTERPRET
            )
        tl.store(partials + 2 * c, tl.max(bad, axis=0).to(tl.float64))
        if NORM == _NORM_L2:
            tl.store(partials + 2 * c + 1, tl.sum(acc, axis=0).to(tl.float64))
        elif NORM == _NORM_INF:
            tl.store(partials + 2 * c + 1, _nanmax_reduce(acc).to(tl.float64))


@triton.jit(do_not_specialize=["n_chunks"])
def _finalize_kernel(
    partials,
    n_chunks,
    found_inf,
    norm_out,
    coef_out,
    max_norm,
    NORM: tl.constexpr,
    HAS_COEF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Single program: flags -> found_inf, total norm -> norm_out, clip coefficient -> coef_out (fixed order)."""
    lanes = tl.arange(0, BLOCK)
    bad = tl.zeros([BLOCK], dtype=tl.float64)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for c0 in range(0, n_chunks, BLOCK):
        idx = c0 + lanes
        mask = idx < n_chunks
        bad = tl.maximum(bad, tl.load(partials + 2 * idx, mask=mask, other=0.0))
        if NORM == _NORM_L2:
            acc += tl.load(partials + 2 * idx + 1, mask=mask, other=0.0)
        elif NORM == _NORM_INF:
            acc = _nanmax(acc, tl.load(partials + 2 * idx + 1, mask=mask, other=0.0))
    # Only ever set, never cleared (like torch): a store of 1.0 under a mask, no read-modify-write.
    tl.store(found_inf, 1.0, mask=tl.max(bad, axis=0) > 0.0)
    if NORM != _NORM_NONE:
        if NORM == _NORM_L2:
            # sqrt in float64 then one rounding: the correctly rounded float32 sqrt (53 >= 2 * 24 + 2 bits).
            norm = tl.sqrt(tl.sum(acc, axis=0)).to(tl.float32)
        else:
            norm = _nanmax_reduce(acc).to(tl.float32)
        tl.store(norm_out, norm)
        if HAS_COEF:
            # torch: clamp(max_norm / (norm + 1e-6), max=1); python / tensor is reciprocal() * max_norm in float32.
            # The float64 reciprocal rounded once to float32 is the correctly rounded float32 reciprocal.
            recip = (1.0 / (norm + 1e-6).to(tl.float64)).to(tl.float32)
            coef = recip * max_norm
            coef = tl.where(coef > 1.0, 1.0, coef)  # NaN stays NaN, like torch.clamp
            tl.store(coef_out, coef)


@triton.jit
def _per_tensor_norm_kernel(partials, first_chunk, out_index, per_out, NORM: tl.constexpr, BLOCK: tl.constexpr):
    """Program t: ``per_out[out_index[t]]`` = norm over partials[first_chunk[t] : first_chunk[t+1]] (fixed order)."""
    t = tl.program_id(0)
    c_lo = tl.load(first_chunk + t)
    c_hi = tl.load(first_chunk + t + 1)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for c0 in range(c_lo, c_hi, BLOCK):
        idx = c0 + lanes
        vals = tl.load(partials + 2 * idx + 1, mask=idx < c_hi, other=0.0)
        if NORM == _NORM_L2:
            acc += vals
        else:
            acc = _nanmax(acc, vals)
    if NORM == _NORM_L2:
        res = tl.sqrt(tl.sum(acc, axis=0)).to(tl.float32)
    else:
        res = _nanmax_reduce(acc).to(tl.float32)
    tl.store(per_out + tl.load(out_index + t), res)


@triton.jit(do_not_specialize=["growth_bits", "backoff_bits", "growth_interval", "hysteresis", "history_len"])
def _update_scale_kernel(
    scale,
    growth_tracker,
    found_inf,
    hysteresis_tracker,
    counters,
    history,
    growth_bits,
    backoff_bits,
    growth_interval,
    hysteresis,
    min_scale,
    max_scale,
    history_len,
    HAS_HYST: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
    HAS_HISTORY: tl.constexpr,
):
    """dev/design.md, kernel 3. ``*_bits`` are the float64 bit patterns of the factors (Triton float args are fp32)."""
    growth = growth_bits.to(tl.int64).to(tl.float64, bitcast=True)
    backoff = backoff_bits.to(tl.int64).to(tl.float64, bitcast=True)
    s = tl.load(scale)
    found = tl.load(found_inf) != 0.0  # NaN counts as found, like the reference
    gt = tl.load(growth_tracker)

    # Products in float64, one rounding to float32 (torch's _amp_update_scale_). Bounds compared in float32: with
    # monotone rounding, max(a, fp32(b)) == fp32(max(a, b)) for a float32 a, so this equals the reference.
    backed = (s.to(tl.float64) * backoff).to(tl.float32)
    backed = tl.where(backed < min_scale, min_scale, backed)
    grown = (s.to(tl.float64) * growth).to(tl.float32)
    grown_ok = tl.abs(grown) <= _FLT_MAX
    grown = tl.where(max_scale < grown, max_scale, grown)

    successful = gt + 1
    grow = successful == growth_interval
    if HAS_HYST:
        ht = tl.load(hysteresis_tracker)
        new_s = tl.where(found, tl.where(ht - 1 <= 0, backed, s), tl.where(grow & grown_ok, grown, s))
        tl.store(hysteresis_tracker, tl.where(found, ht - 1, tl.where(grow, hysteresis, ht)))
    else:
        new_s = tl.where(found, backed, tl.where(grow & grown_ok, grown, s))
    tl.store(scale, new_s)
    tl.store(growth_tracker, tl.where(found, 0, tl.where(grow, 0, successful)))
    if HAS_COUNTERS:
        n = tl.load(counters)
        tl.store(counters, n + 1)
        tl.store(counters + 1, tl.load(counters + 1) + found.to(tl.int64))
        if HAS_HISTORY:
            tl.store(history + n % history_len, new_s)
