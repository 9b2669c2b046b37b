"""Triton kernels of the fused optimizer steps (math in ``reference.adam_step`` / ``reference.sgd_step`` and
``csrc/optimizer.h``); launched by ``ampkernels.optim.triton.optimizers.StepTable``.

* ``_prologue_kernel``: one lane per tensor; advances the float32 step counts and writes the per-tensor constants
  (Adam: step size and sqrt of the second bias correction, in float64; SGD: whether this is the first step).
* ``_adam_kernel`` / ``_sgd_kernel``: persistent grid over the chunks of every parameter of the launch.

Both return at once when ``found_inf`` is non-zero. Float64 scalars travel as int64 bit patterns (Triton passes
Python floats as float32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ampkernels._constants import CHUNK
from ampkernels._triton_functions import _f64, _lerp, _rounded, _skipped

_CHUNK = tl.constexpr(CHUNK)

# Rows of the address array (same order as csrc/optimizer.h OptimizerList); tl.constexpr because Triton 3.6
# kernels may read only constexpr globals.
_GRAD, _EXP_AVG, _EXP_AVG_SQ, _MAX_EXP_AVG_SQ, _MASTER, _STEP = (tl.constexpr(row) for row in range(6))


@triton.jit(do_not_specialize=["num_tensors", "lr_bits", "log2_beta1_bits", "log2_beta2_bits"])
def _prologue_kernel(
    lists,
    num_tensors,
    scalars,
    found_inf,
    lr_ptr,
    lr_bits,
    log2_beta1_bits,
    log2_beta2_bits,
    IS_ADAM: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    LR_FROM_PTR: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    if _skipped(found_inf, HAS_FOUND):
        return
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = t < num_tensors
    step_ptr = tl.load(lists + _STEP * num_tensors + t, mask=mask, other=0).to(tl.pointer_type(tl.float32))
    mask = mask & (tl.load(lists + _STEP * num_tensors + t, mask=mask, other=0) != 0)
    step = tl.load(step_ptr, mask=mask, other=0.0)
    if IS_ADAM:
        step = step + 1.0
        tl.store(step_ptr, step, mask=mask)
        if LR_FROM_PTR:
            lr = tl.load(lr_ptr).to(tl.float64)
        else:
            lr = _f64(lr_bits)
        s = step.to(tl.float64)
        # beta^step as exp2(step * log2(beta)) in float64: within a few float64 ulps of pow, far below float32.
        bc1 = 1.0 - tl.exp2(s * _f64(log2_beta1_bits))
        bc2 = 1.0 - tl.exp2(s * _f64(log2_beta2_bits))
        tl.store(scalars + 2 * t, (lr / bc1).to(tl.float32), mask=mask)
        tl.store(scalars + 2 * t + 1, tl.sqrt(bc2).to(tl.float32), mask=mask)
    else:
        tl.store(scalars + 2 * t, tl.where(step == 0.0, 1.0, 0.0), mask=mask)
        tl.store(step_ptr, step + 1.0, mask=mask)


@triton.jit
def _chunk(addrs, numels, chunk_tensor, chunk_start, c):
    t = tl.load(chunk_tensor + c)
    start = tl.multiple_of(tl.load(chunk_start + c), 16)
    size = tl.minimum(tl.load(numels + t) - start, _CHUNK)
    return t, start, size


@triton.jit
def _ptr(lists, row, num_tensors, t, start, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    p = tl.load(lists + row * num_tensors + t).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p + start


# (Over 80 lines: one kernel, so the whole AdamW update of an element stays in registers; its arguments, one a
# line, are a third of it.)
@triton.jit(do_not_specialize=["num_tensors", "num_chunks", "lr_bits", "wd", "wd_bits", "beta2", "omb1", "omb2", "eps"])
def _adam_kernel(
    addrs,
    numels,
    chunk_tensor,
    chunk_start,
    lists,
    num_tensors,
    num_chunks,
    scalars,
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
    S_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_WD: tl.constexpr,
    DECOUPLED: tl.constexpr,
    WEIGHT_SMALL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    LR_FROM_PTR: tl.constexpr,
    ALIGNED: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    if _skipped(found_inf, HAS_FOUND):
        return
    inv = 1.0
    if HAS_SCALE:
        inv = (1.0 / tl.load(grad_scale).to(tl.float64)).to(tl.float32)  # as GradScaler.unscale_ rounds it
    if LR_FROM_PTR:
        lr = tl.load(lr_ptr).to(tl.float64)
    else:
        lr = _f64(lr_bits)
    decay = (1.0 - lr * _f64(wd_bits)).to(tl.float32)  # float64, as the native kernels
    lanes = tl.arange(0, BLOCK_E)
    for c in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
        t, start, size = _chunk(addrs, numels, chunk_tensor, chunk_start, c)
        p_ptr = tl.load(addrs + t).to(tl.pointer_type(P_DTYPE))
        if ALIGNED:
            p_ptr = tl.multiple_of(p_ptr, 16)
        p_ptr += start
        g_ptr = _ptr(lists, _GRAD, num_tensors, t, start, G_DTYPE, ALIGNED)
        m_ptr = _ptr(lists, _EXP_AVG, num_tensors, t, start, S_DTYPE, ALIGNED)
        v_ptr = _ptr(lists, _EXP_AVG_SQ, num_tensors, t, start, S_DTYPE, ALIGNED)
        step_size = tl.load(scalars + 2 * t)
        bc2_sqrt = tl.load(scalars + 2 * t + 1)
        for off in range(0, size, BLOCK_E):
            idx = off + lanes
            mask = idx < size
            g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32) * inv
            if MAXIMIZE:
                g = -g
            if HAS_MASTER:
                w_ptr = _ptr(lists, _MASTER, num_tensors, t, start, tl.float32, ALIGNED)
                p = tl.load(w_ptr + idx, mask=mask, other=0.0)
            else:
                p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            if HAS_WD:
                if DECOUPLED:
                    p = p * decay
                else:
                    g = g + wd * p
            m = _lerp(tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32), g, omb1, WEIGHT_SMALL)
            v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32) * beta2 + omb2 * g * g
            second = v
            if AMSGRAD:
                x_ptr = _ptr(lists, _MAX_EXP_AVG_SQ, num_tensors, t, start, S_DTYPE, ALIGNED)
                vmax = tl.maximum(
                    tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32), v, propagate_nan=tl.PropagateNan.ALL
                )
                tl.store(x_ptr + idx, _rounded(vmax, S_DTYPE, INTERPRET), mask=mask)
                second = vmax
            denom = tl.div_rn(tl.sqrt_rn(second), bc2_sqrt) + eps
            p = p - step_size * tl.div_rn(m, denom)
            tl.store(m_ptr + idx, _rounded(m, S_DTYPE, INTERPRET), mask=mask)
            tl.store(v_ptr + idx, _rounded(v, S_DTYPE, INTERPRET), mask=mask)
            if HAS_MASTER:
                tl.store(w_ptr + idx, p, mask=mask)
            tl.store(p_ptr + idx, _rounded(p, P_DTYPE, INTERPRET), mask=mask)


@triton.jit(do_not_specialize=["num_tensors", "num_chunks", "lr_bits", "wd", "momentum", "omd"])
def _sgd_kernel(
    addrs,
    numels,
    chunk_tensor,
    chunk_start,
    lists,
    num_tensors,
    num_chunks,
    scalars,
    grad_scale,
    found_inf,
    lr_ptr,
    lr_bits,
    wd,
    momentum,
    omd,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_WD: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    LR_FROM_PTR: tl.constexpr,
    ALIGNED: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    if _skipped(found_inf, HAS_FOUND):
        return
    inv = 1.0
    if HAS_SCALE:
        inv = (1.0 / tl.load(grad_scale).to(tl.float64)).to(tl.float32)
    if LR_FROM_PTR:
        lr = tl.load(lr_ptr)
    else:
        lr = _f64(lr_bits).to(tl.float32)
    lanes = tl.arange(0, BLOCK_E)
    for c in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
        t, start, size = _chunk(addrs, numels, chunk_tensor, chunk_start, c)
        p_ptr = tl.load(addrs + t).to(tl.pointer_type(P_DTYPE))
        if ALIGNED:
            p_ptr = tl.multiple_of(p_ptr, 16)
        p_ptr += start
        g_ptr = _ptr(lists, _GRAD, num_tensors, t, start, G_DTYPE, ALIGNED)
        first = False
        if HAS_MOMENTUM:
            first = tl.load(scalars + 2 * t) != 0.0
        for off in range(0, size, BLOCK_E):
            idx = off + lanes
            mask = idx < size
            g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32) * inv
            if MAXIMIZE:
                g = -g
            if HAS_MASTER:
                w_ptr = _ptr(lists, _MASTER, num_tensors, t, start, tl.float32, ALIGNED)
                p = tl.load(w_ptr + idx, mask=mask, other=0.0)
            else:
                p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            if HAS_WD:
                g = g + wd * p
            if HAS_MOMENTUM:
                b_ptr = _ptr(lists, _EXP_AVG, num_tensors, t, start, S_DTYPE, ALIGNED)
                buf = tl.load(b_ptr + idx, mask=mask, other=0.0).to(tl.float32)
                buf = tl.where(first, g, buf * momentum + omd * g)
                tl.store(b_ptr + idx, _rounded(buf, S_DTYPE, INTERPRET), mask=mask)
                if NESTEROV:
                    g = g + momentum * buf
                else:
                    g = buf
            p = p - lr * g
            if HAS_MASTER:
                tl.store(w_ptr + idx, p, mask=mask)
            tl.store(p_ptr + idx, _rounded(p, P_DTYPE, INTERPRET), mask=mask)


# --------------------------------------------------------------------------------------------------------------------
# Host side
