"""Triton kernel of the per-chunk step of ``ampkernels.linear_cross_entropy`` (math:
``reference.cross_entropy_chunk``; launch: ``ampkernels.loss.triton.cross_entropy``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ampkernels._triton_functions import _rounded


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr,
    target_ptr,
    weight_ptr,
    loss_ptr,
    V,
    weight_stride,
    ignore_index,
    label_smoothing,
    z_loss,
    GRADS: tl.constexpr,
    SMOOTHING: tl.constexpr,
    Z_LOSS: tl.constexpr,
    INT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row of logits [N, V] per program: its loss into ``loss_ptr[row]`` (float32) and, with GRADS, the gradient
    of ``weight[row] * loss`` by the logits written over them, in the logits' dtype.

    Two reads of the row and one write: the first read keeps a running maximum and sum of exponentials (rescaled when
    the maximum grows, once per block), the second forms the softmax from the log-sum-exp."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * V
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    cols = tl.arange(0, BLOCK)

    running_max = -float("inf")
    sum_exp = 0.0
    sum_logits = 0.0
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        x = tl.load(row_ptr + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # (-inf - -inf is NaN: while every logit so far is -inf, the sum stays 0 and nothing is rescaled)
        rescale = tl.where(running_max == new_max, 1.0, tl.exp(running_max - new_max))
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        sum_exp = sum_exp * rescale + tl.sum(tl.exp(x - shift), axis=0)
        running_max = new_max
        if SMOOTHING:
            sum_logits += tl.sum(tl.where(mask, x, 0.0), axis=0)
    lse = running_max + tl.log(sum_exp)

    # (a target outside [0, V) that no host check stopped: NaN, never a read outside the row)
    in_range = (target >= 0) & (target < V)
    picked = tl.load(row_ptr + tl.where(valid & in_range, target, 0)).to(tl.float32)
    picked = tl.where(in_range | ~valid, picked, float("nan"))
    loss = (1.0 - label_smoothing) * (lse - picked)
    if SMOOTHING:
        loss += label_smoothing * (lse - sum_logits / V)
    if Z_LOSS:
        loss += z_loss * lse * lse
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))

    if GRADS:
        weight = tl.load(weight_ptr + row * weight_stride)
        weight = tl.where(in_range | ~valid, weight, float("nan"))  # (an out-of-range target: a NaN row)
        softmax_factor = weight
        if Z_LOSS:
            softmax_factor = weight * (1.0 + 2.0 * z_loss * lse)
        for start in range(0, V, BLOCK):
            mask = start + cols < V
            x = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) * softmax_factor
            if SMOOTHING:
                grad -= weight * (label_smoothing / V)
            grad = tl.where(start + cols == target, grad - weight * (1.0 - label_smoothing), grad)
            grad = tl.where(valid, grad, 0.0)
            tl.store(row_ptr + start + cols, _rounded(grad, logits_ptr.dtype.element_ty, INT_BF16), mask=mask)
