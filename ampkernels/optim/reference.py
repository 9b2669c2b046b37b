"""Plain-PyTorch references of the fused optimizer steps (:mod:`ampkernels.optim`) and of their blockwise
low-precision state.

Used by the tests (as the expected result) and by the fallback backend. Each function states the exact math the
kernels implement. :mod:`ampkernels.reference` gathers every family's references in one namespace.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ampkernels._constants import QUANT_BLOCK, QUANT_CODES, STATE_Q4, STATE_Q8
from ampkernels.optim.hyperparameters import AdamHyperparameters, SgdHyperparameters
from ampkernels.scaler.reference import inv_scale_of

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
    hyper: AdamHyperparameters,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    master_params: Sequence[torch.Tensor] = (),
) -> None:
    """One Adam (``decoupled_weight_decay=False``) or AdamW step, in place; torch.optim.Adam/AdamW's math.

    Args:
        params: parameters (float32/float16/bfloat16); with ``master_params`` they receive the rounded master values.
        grads: one gradient per parameter (any float dtype), only read; divided by ``grad_scale`` when given.
        exp_avgs, exp_avg_sqs: first and second moments, one per parameter, parameter-shaped.
        max_exp_avg_sqs: with ``hyper.amsgrad``, the running maximum of the second moment; else ignored (may be
            empty).
        steps: float32 1-element step counts, advanced by one (unless skipped); the bias corrections use the new count.
        lr: learning rate, a float or a 1-element tensor (read on the device).
        hyper: beta1, beta2, eps, weight_decay, amsgrad, maximize as torch.optim.Adam; decoupled_weight_decay
            ``True`` for AdamW (``p *= 1 - lr * weight_decay``), else L2 added to the gradient. Stochastic rounding
            is :func:`adam_step_blockwise`'s: ignored here.
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
            _scaled_grad(grad.to(dev), grad_scale, hyper.maximize),
            exp_avgs[i].float(),
            exp_avg_sqs[i].float(),
            max_exp_avg_sqs[i].float() if hyper.amsgrad else None,
            steps[i].to(dev).float(),
            lr=lr,
            hyper=hyper,
        )
        _skip_where(skip, exp_avgs[i], m)
        _skip_where(skip, exp_avg_sqs[i], v)
        if hyper.amsgrad:
            _skip_where(skip, max_exp_avg_sqs[i], vmax)
        if master_params:
            _skip_where(skip, master_params[i], p)
        _skip_where(skip, param, p)
        _skip_where(skip, steps[i], new_step.reshape(steps[i].shape))


def _adam_math(p, g, m0, v0, vmax0, step, *, lr, hyper: AdamHyperparameters):
    """The float32 element math of :func:`adam_step` on whole tensors (``g`` already unscaled and signed; ``vmax0``
    None without amsgrad). Returns the new (p, m, v, vmax, step)."""
    beta1, beta2, eps, weight_decay = hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay
    dev = p.device
    w = float(torch.tensor(1 - beta1, dtype=torch.float32))  # the weight as the kernels hold it
    lr64 = _lr_float64(lr, dev)
    if weight_decay != 0:
        if hyper.decoupled_weight_decay:
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
    hyper: SgdHyperparameters,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    master_params: Sequence[torch.Tensor] = (),
) -> None:
    """One SGD step, in place; torch.optim.SGD's math.

    Args:
        params, grads, grad_scale, found_inf, master_params: as :func:`adam_step`.
        momentum_buffers: with ``hyper.momentum != 0``, one buffer per parameter; else ignored (may be empty).
        steps: with ``hyper.momentum != 0``, float32 1-element counts of applied steps (0: the buffer is not yet
            initialised, so this step sets it to the gradient, as torch does on its first step); advanced by one.
        lr: a float or a 1-element tensor.
        hyper: momentum, dampening, weight_decay, nesterov, maximize as torch.optim.SGD.

    Per element, in float32::

        g = grad * inv_scale (negated if maximize);  g = g + wd * p
        buf = g  on the first step, else  buf * momentum + (1 - dampening) * g
        g = g + momentum * buf  if nesterov  else  buf;   p = p - lr * g
    """
    momentum, dampening, weight_decay, nesterov = hyper.momentum, hyper.dampening, hyper.weight_decay, hyper.nesterov
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        dev = param.device
        skip = (found_inf.to(dev).reshape(()) != 0) if found_inf is not None else None
        holder = master_params[i] if master_params else param
        p = holder.float()
        g = _scaled_grad(grad.to(dev), grad_scale, hyper.maximize)
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
    hyper: AdamHyperparameters,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    master_params: Sequence[torch.Tensor] = (),
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
        hyper: as :func:`adam_step`; with ``hyper.stochastic_rounding`` each updated bfloat16 parameter is rounded
            up or down at random (unbiased), from the stream of :func:`rounding_bits` keyed by (``hyper.seed``,
            ``salts[i]``, new step) at global flat index ``offsets[i] + i_local`` (``offsets``: where a shard starts
            in its full tensor; default 0).
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
            _scaled_grad(grad.to(dev), grad_scale, hyper.maximize),
            _load_moment(exp_avgs[i], exp_avg_scales[i], fmt_m, False, shape),
            _load_moment(exp_avg_sqs[i], exp_avg_sq_scales[i], fmt_v, True, shape),
            max_exp_avg_sqs[i].float() if hyper.amsgrad else None,
            steps[i].to(dev).float(),
            lr=lr,
            hyper=hyper,
        )
        _store_moment(skip, exp_avgs[i], exp_avg_scales[i], fmt_m, False, m)
        _store_moment(skip, exp_avg_sqs[i], exp_avg_sq_scales[i], fmt_v, True, v)
        if hyper.amsgrad:
            _skip_where(skip, max_exp_avg_sqs[i], vmax)
        if master_params:
            _skip_where(skip, master_params[i], p)
        if hyper.stochastic_rounding and param.dtype == torch.bfloat16:
            key = rounding_key(hyper.seed, salts[i] if salts else i, new_step)
            start = offsets[i] if offsets else 0
            index = torch.arange(start, start + p.numel(), dtype=torch.int64, device=dev)
            p = stochastic_round_to_bf16(p.flatten(), rounding_bits(key, index)).reshape(shape)
        _skip_where(skip, param, p)
        _skip_where(skip, steps[i], new_step.reshape(steps[i].shape))
