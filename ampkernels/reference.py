"""Plain-PyTorch references for every ampkernels op.

Used by the tests (as the expected result) and by the fallback backend (when neither the native
extension nor Triton can run). Each function states the exact math the kernels implement; see
``dev/design.md`` for the shared metadata format.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ampkernels._constants import QUANT_BLOCK, QUANT_CODES, STATE_Q4, STATE_Q8

#: Smallest normal float32: the default floor of the loss scale (stock halves on to 0 and then skips forever).
FLOAT32_TINY = 2.0**-126


def inv_scale_of(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` rounded exactly as ``torch.amp.GradScaler.unscale_`` does (reciprocal in float64)."""
    return scale.double().reciprocal().float()


def unscale_reduce_(
    tensors: Sequence[torch.Tensor],
    scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    factor: torch.Tensor | None = None,
    write: bool = True,
    norm_type: float | None = None,
    per_tensor: bool = False,
):
    """Reference for the fused multi-tensor pass (no host synchronization).

    For every tensor ``g``: ``v = g * inv_scale (* factor)`` in float32 (float64 for float64 tensors); when
    ``write``, ``g`` is overwritten with ``v`` cast back to its dtype. ``found_inf`` (float32, 1 element) is set to
    1.0 when any *input* element is non-finite, and never cleared. Returns ``(norm, per_tensor_norms)``: the
    ``norm_type`` norm (2 or inf) of all ``v`` (rounded to each tensor's dtype, as ``unscale_`` stores them) together
    (0-d) and of each tensor ([len(tensors)]), float32, or
    ``None`` when not requested. Norms are accumulated in float64 here; the kernels accumulate a 16/32-bit
    tensor's in float32 and a float64 tensor's in float64.
    """
    if norm_type is not None and norm_type != 2.0 and not math.isinf(norm_type):
        raise ValueError(f"norm_type must be 2.0 or inf, got {norm_type}")
    dev = found_inf.device
    inv = inv_scale_of(scale)
    flags, norms = [], []
    for g in tensors:
        math_dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
        v = g.to(math_dtype) * inv.to(g.device, math_dtype)
        if factor is not None:
            v = v * factor.to(g.device, math_dtype)
        if g.numel():
            flags.append(torch.isfinite(g).all().logical_not().to(dev))
        if norm_type is not None:
            vd = v.to(g.dtype).double()  # the norm of the unscaled value as stored in the tensor's dtype
            if norm_type == 2.0:
                norms.append(vd.pow(2).sum().to(dev))
            else:
                norms.append((vd.abs().max() if vd.numel() else vd.new_zeros(())).to(dev))
        if write:
            g.copy_(v.to(g.dtype))
    if flags:
        any_bad = torch.stack(flags).any().reshape(found_inf.shape)
        found_inf.copy_(torch.where(any_bad, torch.ones_like(found_inf), found_inf))
    if norm_type is None:
        return None, None
    stacked = torch.stack(norms) if norms else torch.zeros(0, dtype=torch.float64, device=dev)
    if norm_type == 2.0:
        total, each = stacked.sum().sqrt(), stacked.sqrt()
    else:
        total, each = (stacked.max() if stacked.numel() else stacked.new_zeros(())), stacked
    return total.float(), (each.float() if per_tensor else None)


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(max_norm / (norm + 1e-6), 1)`` in float32, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    return torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    *,
    hysteresis: int = 1,
    hysteresis_tracker: torch.Tensor | None = None,
    min_scale: float = FLOAT32_TINY,
    max_scale: float = math.inf,
    history: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> None:
    """Reference for the loss-scale update; equals ``torch._amp_update_scale_`` with the defaults.

    ``scale`` float32 [1] or [], ``growth_tracker`` int32, ``found_inf`` float32 (non-zero = overflow).
    Hysteresis (Megatron-LM semantics): on overflow the growth tracker resets and ``hysteresis_tracker``
    (int32) decrements; the scale backs off (never below ``min_scale``) once it is <= 0; on growth (never above
    ``max_scale``, and only to a finite value) it is reset to ``hysteresis``. ``counters`` (int64 [2]: updates,
    skipped) and ``history`` (float32 [N], ring buffer of the scale after each update) are optional telemetry.
    Written with tensor ops only: no host synchronization.
    """
    found = found_inf.reshape(()) != 0
    s = scale.reshape(())
    gt = growth_tracker.reshape(())
    ht = hysteresis_tracker.reshape(()) if hysteresis_tracker is not None else torch.ones_like(gt)
    f32 = dict(dtype=torch.float32, device=scale.device)
    backed_off = torch.maximum((s.double() * backoff_factor).float(), torch.tensor(min_scale, **f32))
    ht_after_overflow = ht - 1
    scale_if_found = torch.where(ht_after_overflow <= 0, backed_off, s)
    successful = gt + 1
    grow = successful == growth_interval
    grown = (s.double() * growth_factor).float()
    grown = torch.minimum(grown, torch.tensor(max_scale, **f32))
    scale_if_ok = torch.where(grow & torch.isfinite((s.double() * growth_factor).float()), grown, s)
    new_scale = torch.where(found, scale_if_found, scale_if_ok)
    zero = torch.zeros_like(gt)
    growth_tracker.copy_(torch.where(found | grow, zero, successful).reshape(growth_tracker.shape))
    if hysteresis_tracker is not None:
        reset = torch.full_like(ht, hysteresis)
        new_ht = torch.where(found, ht_after_overflow, torch.where(grow, reset, ht))
        hysteresis_tracker.copy_(new_ht.reshape(hysteresis_tracker.shape))
    scale.copy_(new_scale.reshape(scale.shape))
    if counters is not None:
        n = counters[0].clone()
        counters[0] += 1
        counters[1] += found.to(counters.dtype)
        if history is not None and history.numel():
            history.index_copy_(0, (n % history.numel()).reshape(1), new_scale.reshape(1))


# --------------------------------------------------------------------------------------------------------------------
# scaled_matmul
# --------------------------------------------------------------------------------------------------------------------


def scaled_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor | float | None = None,
    *,
    alpha: float = 1.0,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    found_inf: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of ``ampkernels.scaled_matmul`` (and its ``"torch"`` backend): computed in float32 (float64 for
    float64 operands) as ``v = (a @ b) * (alpha * scale) + bias``; with ``accumulate`` ``v = out + v`` (old value read
    in the same precision); the result is ``v`` cast to ``out_dtype`` (default ``out.dtype``, else ``a.dtype``) and
    written to ``out`` when given. ``scale`` broadcasts against the [..., M, N] product (a tensor of one element,
    per row [..., M, 1], per column [N]). ``found_inf`` (float32, 1 element) is set to 1.0 when any element of the
    result as stored is inf or NaN, with no host synchronization; never cleared.
    """
    compute = torch.float64 if a.dtype == torch.float64 else torch.float32
    v = a.to(compute) @ b.to(compute)
    if isinstance(scale, torch.Tensor):
        v = v * (scale.to(compute) * alpha)
    else:
        v = v * (alpha * (1.0 if scale is None else float(scale)))
    if bias is not None:
        v = v + bias.to(compute)
    if accumulate:
        v = out.to(compute) + v
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else a.dtype
    result = v.to(out_dtype)
    if found_inf is not None and result.numel():
        bad = torch.isfinite(result).all().logical_not()
        found_inf.copy_(torch.where(bad, torch.ones_like(found_inf), found_inf))
    if out is not None:
        out.copy_(result)
        return out
    return result


# --------------------------------------------------------------------------------------------------------------------
# Fused optimizer steps (ampkernels.FusedAdam / FusedAdamW / FusedSGD)
# --------------------------------------------------------------------------------------------------------------------
#
# The math of torch.optim.Adam/AdamW/SGD (single-tensor and foreach forms) in float32 whatever the storage dtype,
# with the scaler contract of torch's fused optimizers: gradients are divided by ``grad_scale`` (multiplied by
# fp32(1 / fp64(grad_scale))) and only read; a non-zero ``found_inf`` skips the step entirely (parameters, state and
# step counts unchanged). Written with tensor ops only: no host synchronization, so it also runs on CUDA tensors
# without one. These are the references of the kernels and the last fallback of the optimizers.


def _skip_where(skip: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor) -> None:
    """``old = skip ? old : new`` in place (``new`` rounded to ``old``'s dtype)."""
    new = new.to(old.dtype)
    old.copy_(new if skip is None else torch.where(skip, old, new))


def _scaled_grad(grad: torch.Tensor, grad_scale: torch.Tensor | None, maximize: bool) -> torch.Tensor:
    g = grad.float()
    if grad_scale is not None:
        g = g * inv_scale_of(grad_scale).to(g.device).reshape(())
    return -g if maximize else g


def _lr_float64(lr: float | torch.Tensor, device: torch.device) -> float | torch.Tensor:
    return lr.to(device, torch.float64).reshape(()) if isinstance(lr, torch.Tensor) else float(lr)


def adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    master_params: Sequence[torch.Tensor] = (),
) -> None:
    """One Adam (``decoupled_weight_decay=False``) or AdamW step, in place; torch.optim.Adam/AdamW's math.

    Args:
        params: parameters (float32/float16/bfloat16); with ``master_params`` they receive the rounded master values.
        grads: one gradient per parameter (any float dtype), only read; divided by ``grad_scale`` when given.
        exp_avgs, exp_avg_sqs: first and second moments, one per parameter, parameter-shaped.
        max_exp_avg_sqs: with ``amsgrad``, the running maximum of the second moment; else ignored (may be empty).
        steps: float32 1-element step counts, advanced by one (unless skipped); the bias corrections use the new count.
        lr: learning rate, a float or a 1-element tensor (read on the device).
        beta1, beta2, eps, weight_decay, amsgrad, maximize: as torch.optim.Adam.
        decoupled_weight_decay: ``True`` for AdamW (``p *= 1 - lr * weight_decay``), else L2 added to the gradient.
        grad_scale: optional float32 1-element tensor the gradients are divided by (loss scale / clip coefficient).
        found_inf: optional float32 1-element tensor; non-zero skips the whole step.
        master_params: optional float32 master copies of float16/bfloat16 parameters (the math reads these).

    Per element, in float32, every operation rounded on its own (no fused multiply-add) and ``sqrt`` correctly
    rounded: the exact IEEE result of this formula, whichever vector code torch's own ``lerp``, ``addcmul`` and
    ``sqrt`` use on this machine (torch 2.14 on an AVX-512 CPU fuses the first two and rounds ``sqrt`` within an
    ulp, so torch.optim.Adam agrees with this only to a few float32 ulps)::

        g = grad * inv_scale (negated if maximize);  p = master or param
        p = p * (1 - lr * wd)  if decoupled  else  g = g + wd * p
        m = lerp(m, g, 1 - beta1) = m + w * (g - m) if w < 0.5 else g - (g - m) * (1 - w)   (torch's two forms)
        v = v * beta2 + ((1 - beta2) * g) * g;  vmax = max(vmax, v) if amsgrad
        step += 1;  step_size = lr / (1 - beta1^step);  bc2_sqrt = sqrt(1 - beta2^step)   (float64, rounded once)
        p = p - step_size * (m / (sqrt(vmax or v) / bc2_sqrt + eps))
    """
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        dev = param.device
        skip = (found_inf.to(dev).reshape(()) != 0) if found_inf is not None else None
        holder = master_params[i] if master_params else param
        p, m, v, vmax, new_step = _adam_math(
            holder.float(),
            _scaled_grad(grad.to(dev), grad_scale, maximize),
            exp_avgs[i].float(),
            exp_avg_sqs[i].float(),
            max_exp_avg_sqs[i].float() if amsgrad else None,
            steps[i].to(dev).float(),
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        _skip_where(skip, exp_avgs[i], m)
        _skip_where(skip, exp_avg_sqs[i], v)
        if amsgrad:
            _skip_where(skip, max_exp_avg_sqs[i], vmax)
        if master_params:
            _skip_where(skip, master_params[i], p)
        _skip_where(skip, param, p)
        _skip_where(skip, steps[i], new_step.reshape(steps[i].shape))


def _adam_math(p, g, m0, v0, vmax0, step, *, lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay):
    """The float32 element math of :func:`adam_step` on whole tensors (``g`` already unscaled and signed; ``vmax0``
    None without amsgrad). Returns the new (p, m, v, vmax, step)."""
    dev = p.device
    w = float(torch.tensor(1 - beta1, dtype=torch.float32))  # the weight as the kernels hold it
    lr64 = _lr_float64(lr, dev)
    if weight_decay != 0:
        if decoupled_weight_decay:
            p = p * torch.as_tensor(1 - lr64 * weight_decay, device=dev).float()
        else:
            g = g + weight_decay * p
    m = m0 + w * (g - m0) if w < 0.5 else g - (g - m0) * (1 - w)
    v = v0 * beta2 + ((1 - beta2) * g) * g
    second = vmax = v
    if vmax0 is not None:
        second = vmax = torch.maximum(vmax0, v)
    new_step = step + 1
    step_size = (lr64 / (1 - beta1 ** new_step.double())).float()
    bc2_sqrt = (1 - beta2 ** new_step.double()).sqrt().float()
    # A float32 value's square root in float64, rounded to float32, is the correctly rounded float32 root.
    root = second.double().sqrt().float()
    p = p - step_size * (m / (root / bc2_sqrt + eps))
    return p, m, v, vmax, new_step


def sgd_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    master_params: Sequence[torch.Tensor] = (),
) -> None:
    """One SGD step, in place; torch.optim.SGD's math.

    Args:
        params, grads, grad_scale, found_inf, master_params: as :func:`adam_step`.
        momentum_buffers: with ``momentum != 0``, one buffer per parameter; else ignored (may be empty).
        steps: with ``momentum != 0``, float32 1-element counts of applied steps (0: the buffer is not yet
            initialised, so this step sets it to the gradient, as torch does on its first step); advanced by one.
        lr: a float or a 1-element tensor. momentum, dampening, weight_decay, nesterov, maximize: as torch.optim.SGD.

    Per element, in float32::

        g = grad * inv_scale (negated if maximize);  g = g + wd * p
        buf = g  on the first step, else  buf * momentum + (1 - dampening) * g
        g = g + momentum * buf  if nesterov  else  buf;   p = p - lr * g
    """
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        dev = param.device
        skip = (found_inf.to(dev).reshape(()) != 0) if found_inf is not None else None
        holder = master_params[i] if master_params else param
        p = holder.float()
        g = _scaled_grad(grad.to(dev), grad_scale, maximize)
        if weight_decay != 0:
            g = g + weight_decay * p
        if momentum != 0:
            first = steps[i].to(dev).reshape(()) == 0
            buf = torch.where(first, g, momentum_buffers[i].float() * momentum + (1 - dampening) * g)
            g = g + momentum * buf if nesterov else buf
            _skip_where(skip, momentum_buffers[i], buf)
            _skip_where(skip, steps[i], steps[i].float() + 1)
        lr32 = lr.to(dev, torch.float32).reshape(()) if isinstance(lr, torch.Tensor) else lr
        p = p - lr32 * g
        if master_params:
            _skip_where(skip, master_params[i], p)
        _skip_where(skip, param, p)


# ---- low-precision optimizer state (FusedAdam's exp_avg_dtype / exp_avg_sq_dtype / stochastic_rounding) ----
#
# Quantized moments are block floating point, as the OCP MX formats: each block of QUANT_BLOCK consecutive elements
# along the last dimension shares one power-of-two scale, stored as its biased float32 exponent in a uint8 (as E8M0),
# and each element is a tiny float code of its value divided by that scale. The scale puts the block's largest
# magnitude in the code's top binade [1, 2), so the largest element keeps the code's full relative precision and
# every other one its dynamic range below. All of it is integer arithmetic on float32 bit patterns and products with
# powers of two: every backend computes the same codes from the same float32 values.
#
#   first moment (signed):   8 bits = sign + E4M3 (range 2^-17 .. 1.875, 3.1-6.2% relative step)
#                            4 bits = sign + E2M1 (0, 0.125, 0.25, 0.375, 0.5, 0.75, 1, 1.5: FP4 as in MXFP4)
#   second moment (>= 0):    8 bits = E5M3 (range 2^-33 .. 1.875)
#                            4 bits = E4M0 (powers of two 2^-14 .. 1)
# Codes are rounded to nearest (ties away from zero); zero has one code (no sign). The second moment is never
# rounded to zero: a value below the smallest non-zero code is stored as that code (it only ever overstates the
# denominator, which shortens that element's step; a zero would turn the step into m / eps, the "zero-point
# problem" of 4-bit Adam, Li et al. 2023).
# A block of zeros decodes to zeros. Codes of 4 bits are packed two per byte along the last dimension (element 2j
# in the low nibble of byte j); a row of odd length ends in a zero high nibble.

_MASK32 = 0xFFFFFFFF


def quant_code(fmt: int, second_moment: bool) -> tuple[int, int, bool]:
    """(exponent bits, mantissa bits, signed) of the code of moment format ``fmt`` (``_constants.STATE_Q8/Q4``)."""
    exp_bits, man_bits = QUANT_CODES[(fmt, second_moment)]
    return exp_bits, man_bits, not second_moment


def quant_layout(shape: Sequence[int], fmt: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(codes shape, scales shape) of a quantized moment of a tensor of ``shape`` (dim >= 1)."""
    *rows, cols = shape
    code_cols = (cols + 1) // 2 if fmt == STATE_Q4 else cols
    return (*rows, code_cols), (*rows, -(-cols // QUANT_BLOCK))


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2 ** (exponent - 127) as float32 from its bit pattern; ``exponent`` int32 in [1, 254]."""
    return (exponent.to(torch.int32) << 23).view(torch.float32)


def _block_exponent(absmax: torch.Tensor, man_bits: int) -> torch.Tensor:
    """The biased exponent (int32 in [1, 253]) that puts ``absmax``, rounded to ``man_bits``, in [1, 2)."""
    # int64: the rounding add must not wrap (a NaN's bits plus the half-step saturate at 253, as inf's do).
    bits = absmax.contiguous().view(torch.int32).to(torch.int64)
    return ((bits + (1 << (22 - man_bits))) >> 23).clamp(1, 253).to(torch.int32)


def _encode(y: torch.Tensor, exp_bits: int, man_bits: int) -> torch.Tensor:
    """Codes (int32) of magnitudes ``y`` (float32 >= 0, below 2 unless non-finite), rounded to nearest."""
    top = 2**exp_bits - 1  # the exponent field of the binade [1, 2)
    bits = y.contiguous().view(torch.int32).to(torch.int64)  # no wrap for NaN bit patterns
    normal = ((bits + (1 << (22 - man_bits))) >> (23 - man_bits)) - ((127 - top) << man_bits)
    # Below the smallest normal value the codes are a uniform grid (exact scaling by a power of two, then + 0.5).
    sub = torch.floor(y * 2.0 ** (top - 1 + man_bits) + 0.5).to(torch.int32)
    codes = torch.where(y < 2.0 ** (1 - top), sub, normal)
    return codes.clamp(0, 2 ** (exp_bits + man_bits) - 1).to(torch.int32)  # a NaN or inf saturates


def _decode(codes: torch.Tensor, exp_bits: int, man_bits: int) -> torch.Tensor:
    top = 2**exp_bits - 1
    sub = codes.float() * 2.0 ** (1 - top - man_bits)
    normal = ((codes + ((127 - top) << man_bits)) << (23 - man_bits)).view(torch.float32)
    return torch.where(codes < 2**man_bits, sub, normal)


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` (float32, [..., cols]) as [rows, blocks, QUANT_BLOCK], zero-padded, and its last dimension."""
    cols = x.shape[-1]
    rows = x.reshape(-1, cols)
    pad = -cols % QUANT_BLOCK
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.reshape(rows.shape[0], -1, QUANT_BLOCK), cols


def quantize_blockwise(x: torch.Tensor, fmt: int, second_moment: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32, dim >= 1, blocks along the last dimension) -> (uint8 codes, uint8 block exponents) in the
    layout of :func:`quant_layout`. ``dequantize_blockwise`` of the result is ``x`` rounded to the code."""
    exp_bits, man_bits, signed = quant_code(fmt, second_moment)
    blocks, cols = _blocks(x.float())
    absmax = blocks.abs().amax(dim=-1, keepdim=True)
    exponent = _block_exponent(absmax, man_bits)
    y = blocks.abs() * _pow2(254 - exponent)  # exact: a product with 2 ** (127 - exponent)
    codes = _encode(y, exp_bits, man_bits)
    if signed:
        # The sign of a value rounded to zero is dropped (one code for zero).
        codes = codes | (((blocks < 0) & (codes > 0)).to(torch.int32) << (exp_bits + man_bits))
    else:
        codes = codes.clamp_min(1)  # never zero (the header above says why)
    codes = codes.reshape(codes.shape[0], -1)[:, :cols]
    if fmt == STATE_Q4:
        if cols % 2:
            codes = torch.nn.functional.pad(codes, (0, 1))
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    codes_shape, scales_shape = quant_layout(x.shape, fmt)
    return codes.to(torch.uint8).reshape(codes_shape), exponent.to(torch.uint8).reshape(scales_shape)


def dequantize_blockwise(
    codes: torch.Tensor, scales: torch.Tensor, fmt: int, second_moment: bool, shape: Sequence[int]
) -> torch.Tensor:
    """The float32 tensor of ``shape`` that ``codes`` and ``scales`` (from :func:`quantize_blockwise`) stand for;
    a zero block exponent (freshly zeroed state) decodes to zeros."""
    exp_bits, man_bits, signed = quant_code(fmt, second_moment)
    cols = shape[-1]
    c = codes.reshape(-1, codes.shape[-1]).to(torch.int32)
    if fmt == STATE_Q4:
        c = torch.stack((c & 0xF, c >> 4), dim=-1).reshape(c.shape[0], -1)[:, :cols]
    magnitude_bits = exp_bits + man_bits
    values = _decode(c & (2**magnitude_bits - 1), exp_bits, man_bits)
    if signed:
        values = torch.where((c >> magnitude_bits) != 0, -values, values)
    pad = -cols % QUANT_BLOCK
    values = torch.nn.functional.pad(values, (0, pad)).reshape(values.shape[0], -1, QUANT_BLOCK)
    exponent = scales.reshape(values.shape[0], -1, 1).to(torch.int32)
    scale = torch.where(exponent == 0, 0.0, _pow2(exponent.clamp_min(1)))
    return (values * scale).reshape(values.shape[0], -1)[:, :cols].reshape(shape)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 integer hash on uint32 values held in int64 (a bijection of [0, 2^32))."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def rounding_key(seed: int, salt: int, step: torch.Tensor) -> torch.Tensor:
    """The per-(seed, tensor, step) key of the stochastic-rounding stream, int64 holding a uint32; ``step`` is the
    float32 step count the step advances to (a tensor, read on its device)."""
    dev = step.device
    k = _mix32(torch.tensor(seed & _MASK32, dtype=torch.int64, device=dev))
    k = _mix32(k ^ ((seed >> 32) & _MASK32))
    k = _mix32(k ^ (salt & _MASK32))
    return _mix32((k + step.to(torch.int64).reshape(())) & _MASK32)


def rounding_bits(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """16 random bits (int64 in [0, 2^16)) for the elements at global flat ``index`` (int64) of a tensor: a
    counter-based stream, the same whatever kernel, launch or shard computes it."""
    hi = _mix32((index >> 32) & _MASK32)
    return _mix32(((key + (index & _MASK32)) & _MASK32) ^ hi) >> 16


def stochastic_round_to_bf16(x: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16 up or down with probability proportional to its distance from each:
    the 16 random bits are added to the 16 bits bfloat16 drops, then truncated. Exact for representable values;
    NaN stays NaN."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    rounded = ((bits + random16) & 0xFFFF0000) & _MASK32
    rounded = torch.where(rounded >= 2**31, rounded - 2**32, rounded).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded).to(torch.bfloat16)


def _load_moment(x, scales, fmt, second_moment, shape):
    if fmt in (STATE_Q8, STATE_Q4):
        return dequantize_blockwise(x, scales, fmt, second_moment, shape)
    return x.float()


def _store_moment(skip, x, scales, fmt, second_moment, new):
    if fmt in (STATE_Q8, STATE_Q4):
        codes, exponents = quantize_blockwise(new, fmt, second_moment)
        _skip_where(skip, x, codes)
        _skip_where(skip, scales, exponents)
    else:
        _skip_where(skip, x, new)


def adam_step_blockwise(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_scales: Sequence[torch.Tensor | None],
    exp_avg_sqs: Sequence[torch.Tensor],
    exp_avg_sq_scales: Sequence[torch.Tensor | None],
    max_exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    formats: Sequence[tuple[int, int]],
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    master_params: Sequence[torch.Tensor] = (),
    stochastic_rounding: bool = False,
    seed: int = 0,
    salts: Sequence[int] = (),
    offsets: Sequence[int] = (),
) -> None:
    """:func:`adam_step` with the moments stored in other formats and optional stochastic rounding of bfloat16
    parameters (FusedAdam's ``exp_avg_dtype``, ``exp_avg_sq_dtype`` and ``stochastic_rounding``).

    Args:
        exp_avgs, exp_avg_sqs: per parameter, a float32 or bfloat16 tensor shaped like it, or uint8 codes.
        exp_avg_scales, exp_avg_sq_scales: per parameter, the uint8 block exponents of a quantized moment, else None.
        max_exp_avg_sqs: with amsgrad (float32 or bfloat16 second moments only), in the second moment's format.
        formats: per parameter, (first, second) moment format: ``_constants.STATE_F32/BF16/Q8/Q4``.
        stochastic_rounding: round each updated bfloat16 parameter up or down at random (unbiased), from the stream
            of :func:`rounding_bits` keyed by (``seed``, ``salts[i]``, new step) at global flat index
            ``offsets[i] + i_local`` (``offsets``: where a shard starts in its full tensor; default 0).
        Everything else: as :func:`adam_step`.

    Per parameter: decode the moments to float32, run :func:`adam_step`'s math, encode them again
    (:func:`quantize_blockwise`, bfloat16 rounded to nearest), round the parameter; with ``found_inf`` non-zero
    nothing changes, codes and block exponents included.
    """
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        dev = param.device
        skip = (found_inf.to(dev).reshape(()) != 0) if found_inf is not None else None
        fmt_m, fmt_v = formats[i]
        holder = master_params[i] if master_params else param
        shape = param.shape
        p, m, v, vmax, new_step = _adam_math(
            holder.float(),
            _scaled_grad(grad.to(dev), grad_scale, maximize),
            _load_moment(exp_avgs[i], exp_avg_scales[i], fmt_m, False, shape),
            _load_moment(exp_avg_sqs[i], exp_avg_sq_scales[i], fmt_v, True, shape),
            max_exp_avg_sqs[i].float() if amsgrad else None,
            steps[i].to(dev).float(),
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        _store_moment(skip, exp_avgs[i], exp_avg_scales[i], fmt_m, False, m)
        _store_moment(skip, exp_avg_sqs[i], exp_avg_sq_scales[i], fmt_v, True, v)
        if amsgrad:
            _skip_where(skip, max_exp_avg_sqs[i], vmax)
        if master_params:
            _skip_where(skip, master_params[i], p)
        if stochastic_rounding and param.dtype == torch.bfloat16:
            key = rounding_key(seed, salts[i] if salts else i, new_step)
            start = offsets[i] if offsets else 0
            index = torch.arange(start, start + p.numel(), dtype=torch.int64, device=dev)
            p = stochastic_round_to_bf16(p.flatten(), rounding_bits(key, index)).reshape(shape)
        _skip_where(skip, param, p)
        _skip_where(skip, steps[i], new_step.reshape(steps[i].shape))


# --------------------------------------------------------------------------------------------------------------------
# FP8: casts with per-tensor or per-row scales (ampkernels.float8)
# --------------------------------------------------------------------------------------------------------------------

#: Floor of the amax a scale is computed from (torchao's): an all-zero tensor gets a large finite scale, not inf.
FLOAT8_AMAX_FLOOR = 1e-12
FLOAT8_GRANULARITIES = ("tensor", "row")


def float8_max(dtype: torch.dtype) -> float:
    """Largest finite value of a float8 dtype: 448 (e4m3fn), 57344 (e5m2)."""
    return float(torch.finfo(dtype).max)


def float8_scale(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The float32 scale that maps ``amax`` onto the largest finite value of ``dtype``, with ``margin`` powers of two
    of headroom (TransformerEngine's ``margin``): ``float8_max(dtype) / max(amax, FLOAT8_AMAX_FLOOR) / 2**margin``,
    computed as ``reciprocal(max(amax, FLOAT8_AMAX_FLOOR)) * float8_max(dtype)`` with each step rounded to float32
    (what torchao's ``float8_max / amax`` computes: torch evaluates a number divided by a tensor that way). A
    non-finite ``amax`` (an inf or NaN in the tensor) gives 1.0: the scale always stays finite and positive, and the
    non-finite values themselves reach the product (see :func:`to_float8`)."""
    amax = amax.float()
    scale = torch.reciprocal(torch.clamp(amax, min=FLOAT8_AMAX_FLOOR)) * float8_max(dtype)
    if margin:
        scale = scale * (2.0**-margin)
    return torch.where(torch.isfinite(amax), scale, torch.ones_like(scale))


def _rows_view(x: torch.Tensor, transpose: bool) -> torch.Tensor:
    """``x`` as the [R, C] matrix a cast writes: [..., K] flattened to [M, K], or its transpose [K, M]."""
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
    return x2.t() if transpose else x2


def float8_amax(x: torch.Tensor, granularity: str = "tensor", transpose: bool = False) -> torch.Tensor:
    """``max |x|`` in float32 (NaN if ``x`` holds a NaN): 0-d for ``"tensor"``, [R, 1] per row of the matrix the
    cast writes (rows of ``x.reshape(-1, K)``, or of its transpose with ``transpose``) for ``"row"``."""
    xf = _rows_view(x, transpose).float().abs()
    if granularity == "tensor":
        return xf.amax() if xf.numel() else xf.new_zeros(())
    return xf.amax(dim=1, keepdim=True) if xf.shape[1] else xf.new_zeros((xf.shape[0], 1))


def _record_amax(amax_out: torch.Tensor | None, amax: torch.Tensor, found_inf: torch.Tensor | None) -> None:
    finite = torch.isfinite(amax)
    if amax_out is not None:
        # A non-finite amax is not recorded: the step it comes from is skipped, and a delayed-scaling history must not
        # carry it into the scales of the next steps.
        amax_out.copy_(torch.where(finite, torch.maximum(amax_out, amax.reshape(amax_out.shape)), amax_out))
    if found_inf is not None:
        bad = finite.all().logical_not()
        found_inf.copy_(torch.where(bad, torch.ones_like(found_inf), found_inf))


def to_float8(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "tensor",
    *,
    scale: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    transpose: bool = False,
    found_inf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``ampkernels.float8.to_float8``: ``x`` (any float dtype, [..., K], viewed as the [M, K] matrix
    ``x.reshape(-1, K)``; its transpose [K, M] with ``transpose``) cast to ``dtype`` with a float32 scale.

    * The scale: ``scale`` when given (delayed scaling: float32, one element for ``"tensor"``, [R, 1] for ``"row"``),
      else :func:`float8_scale` of :func:`float8_amax` (current scaling; per row of the written matrix for
      ``"row"``).
    * ``data = (x.float() * scale)`` clamped to ``±float8_max(dtype)`` (saturating: a finite value never becomes
      inf or NaN) and rounded to ``dtype`` by torch's conversion (round to nearest even); a non-finite element of
      ``x`` becomes NaN in either format, so it reaches the product and the scaler's check instead of being
      saturated away. ``data`` is contiguous: [M, K], or [K, M] with ``transpose``.
    * Returns ``(data, scale_inv)`` with ``scale_inv = 1 / scale`` (float32; 0-d for ``"tensor"``, [R, 1] for
      ``"row"``), the dequantization factor ``torch._scaled_mm`` takes: ``x ≈ data.float() * scale_inv``.
    * ``amax_out`` (float32, the amax's shape): becomes ``max(amax_out, amax of x)`` when that amax is finite, and is
      left alone otherwise (the delayed-scaling record of this pass). ``found_inf`` (float32, one element): set to
      1.0 when the amax is not finite (``x`` holds an inf or NaN); never cleared.
    """
    xf = _rows_view(x, transpose).float()
    amax = float8_amax(x, granularity, transpose)
    s = float8_scale(amax, dtype) if scale is None else scale.float().reshape(amax.shape)
    limit = float8_max(dtype)
    y = (xf * s).clamp(-limit, limit)
    y = torch.where(torch.isfinite(xf), y, torch.full_like(y, math.nan))
    data = y.to(dtype).contiguous()
    _record_amax(amax_out, amax, found_inf)
    return data, torch.reciprocal(s)


def to_float8_pair(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    scale: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of ``ampkernels.float8.to_float8_pair``: one tensorwise cast written in both layouts, ``(data [M,
    K], data_t [K, M], scale_inv)``, each contiguous and equal to :func:`to_float8`'s with ``transpose`` False /
    True (the forward reads one layout, the backward the other)."""
    data, scale_inv = to_float8(x, dtype, "tensor", scale=scale, amax_out=amax_out, found_inf=found_inf)
    return data, data.t().contiguous(), scale_inv


def scaled_matmul_float8(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    scale: torch.Tensor | float | None = None,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    found_inf: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of ``ampkernels.scaled_matmul`` on float8 operands: in float32, ``v = (a.float() @ b.float()) *
    (scale_a * scale_b)`` with ``scale_a`` one element or per row of a ([M, 1]) and ``scale_b`` one element or per
    column of b ([1, N]) (``torch._scaled_mm``'s dequantization factors; None means 1), then ``v = v * scale + bias``
    (``scale`` as in :func:`scaled_matmul`), ``v = out + v`` with ``accumulate``, rounded to ``out_dtype``.
    ``found_inf`` as in :func:`scaled_matmul`; ``amax_out`` (float32, one element) becomes ``max(amax_out, max |result
    as stored|)`` (NaN-propagating, like ``torch.maximum``): the amax the next layer's cast needs."""
    v = a.float() @ b.float()
    if scale_a is not None:
        v = v * scale_a.float().reshape(-1, 1)
    if scale_b is not None:
        v = v * scale_b.float().reshape(1, -1)
    if isinstance(scale, torch.Tensor):
        v = v * scale.float()
    elif scale is not None:
        v = v * float(scale)
    if bias is not None:
        v = v + bias.float()
    if accumulate:
        v = out.float() + v
    result = v.to(out_dtype)
    if found_inf is not None and result.numel():
        bad = torch.isfinite(result).all().logical_not()
        found_inf.copy_(torch.where(bad, torch.ones_like(found_inf), found_inf))
    if amax_out is not None and result.numel():
        amax_out.copy_(torch.maximum(amax_out, result.float().abs().amax().reshape(amax_out.shape)))
    if out is not None:
        out.copy_(result)
        return out
    return result


# --------------------------------------------------------------------------------------------------------------------
# Fused producers of FP8 inputs: RMSNorm and SiLU·up (ampkernels.float8.rms_norm / silu_mul)
# --------------------------------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Reference of ``ampkernels.float8.rms_norm``, Llama's RMSNorm over the last dimension: normalized in float32,
    cast back to ``x``'s dtype, then multiplied by ``weight`` ([D]) with torch's type promotion (a bfloat16 ``x`` and a
    float32 ``weight`` give float32)::

        (x.float() * rsqrt(mean(x.float() ** 2, -1) + eps)).to(x.dtype) * weight
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Reference of ``ampkernels.float8.silu_mul``, SwiGLU's gate: ``silu(gate) * up`` computed in float32 and
    rounded once to the promoted dtype of ``gate`` and ``up``."""
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(out_dtype)


def rotary_tables(positions: int, half: int, base: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (cos, sin) [positions, half] of the angles ``t * base ** (-i / half)`` (computed as Llama's port
    does: the inverse frequencies, then the outer product with the positions, in float32)."""
    inv_freq = base ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = torch.arange(positions, device=device, dtype=torch.float32)[:, None] * inv_freq
    return angles.cos(), angles.sin()


def rotary_embedding(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Reference of ``ampkernels.float8.rotary_embedding``: rotary position embedding of ``x`` ([..., T, D], D even)
    in the half-split layout: the pairs ``(x[..., i], x[..., i + D/2])`` at position t (dimension -2) rotated by
    :func:`rotary_tables`' angle, in float32 (the tables unrounded), rounded once to ``x``'s dtype."""
    half = x.shape[-1] // 2
    cos, sin = rotary_tables(x.shape[-2], half, base, x.device)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Reference of ``ampkernels.loss.linear_cross_entropy``: ``F.cross_entropy`` of the logits
    ``hidden @ weight.T + bias`` computed in float32 (float64 for float64 inputs), plus ``z_loss * lse**2`` per token
    (the log-sum-exp of its logits; PaLM's auxiliary loss).

    Per token ``i`` with target ``t`` over ``V`` classes: ``(1 - s) * (lse - z_t) + s * (lse - mean(z)) + z_loss *
    lse**2`` with ``s = label_smoothing``; tokens whose target is ``ignore_index`` contribute 0 and are not counted.
    ``reduction``: ``"mean"`` (over the counted tokens: NaN when there are none, as torch), ``"sum"`` or ``"none"``
    (one float per token of ``hidden``'s leading dimensions).
    """
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.reshape(-1, hidden.shape[-1]).to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        logits = logits + bias.to(dtype)
    target = target.reshape(-1)
    valid = target != ignore_index
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, torch.where(valid, target, 0)[:, None])[:, 0]
    loss = (1 - label_smoothing) * (lse - picked) + label_smoothing * (lse - logits.mean(-1)) + z_loss * lse**2
    loss = torch.where(valid, loss, torch.zeros((), dtype=dtype, device=loss.device))
    if reduction == "none":
        return loss.reshape(hidden.shape[:-1])
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()
