"""The Triton device functions that kernels of more than one family share: float64 scalars from their int64 bits,
the skip test on ``found_inf``, torch's lerp, and bfloat16 rounding by integer arithmetic (exact on the interpreter,
which truncates its float32 -> bfloat16 casts). Imported by the families' ``triton/*_kernels.py`` only: importing it
needs Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _f64(bits):
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def _skipped(found_inf, HAS_FOUND: tl.constexpr):
    if HAS_FOUND:
        return tl.load(found_inf) != 0.0
    return False


@triton.jit
def _lerp(start, end, weight, WEIGHT_SMALL: tl.constexpr):
    # torch.lerp's two formulas (weight < 0.5 or not).
    if WEIGHT_SMALL:
        return start + weight * (end - start)
    return end - (end - start) * (1.0 - weight)


@triton.jit
def _bf16(x, random16):
    """float32 ``x`` as bfloat16 from its bit pattern: rounded to nearest even (``random16`` None) or stochastically
    (``reference.stochastic_round_to_bf16``: the random bits added to the 16 dropped, then truncated). A NaN stays a
    (quiet) NaN. Nearest even is cvt.rn.bf16.f32's result bit for bit; it serves the interpreter, which truncates
    its float32 -> bfloat16 casts."""
    bits = x.to(tl.uint32, bitcast=True)
    if random16 is None:
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    else:
        rounded = (bits + random16) >> 16
    rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _rounded(x, DTYPE: tl.constexpr, INT_BF16: tl.constexpr):
    # INT_BF16 (the interpreter): bfloat16 by integer rounding; on a GPU the cast (cvt.rn, the same bits).
    if DTYPE == tl.bfloat16 and INT_BF16:
        return _bf16(x, None)
    return x.to(DTYPE)
