"""Plain-PyTorch reference of :func:`ampkernels.linear_cross_entropy`.

Used by the tests (as the expected result) and by the fallback backend. Each function states the exact math the
kernels implement. :mod:`ampkernels.reference` gathers every family's references in one namespace.
"""

from __future__ import annotations

import torch


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


def cross_entropy_chunk(
    logits: torch.Tensor,
    target: torch.Tensor,
    token_weight: torch.Tensor | None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference of the per-chunk step of :func:`ampkernels.linear_cross_entropy` (the Triton kernel
    ``_cross_entropy_rows_kernel``): the losses of the rows of ``logits`` [N, V] (any float dtype; the math in float32)
    and, with ``token_weight`` (float32 [N], each row's incoming gradient), the gradient of ``sum(token_weight *
    losses)`` by the logits, float32 [N, V]:

    ``grad = token_weight * (softmax(z) * (1 + 2 z_loss lse) - s / V - (1 - s) * onehot(t))``, zero for ignored rows.

    Loss per row as :func:`linear_cross_entropy`'s. Works on a float32 copy of ``logits`` (in place on it: the
    exponentials become the softmax without a second [N, V] buffer).
    """
    vocab = logits.shape[1]
    logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
    valid = target != ignore_index
    safe_target = torch.where(valid, target, 0)[:, None]
    picked = logits.gather(1, safe_target)[:, 0]
    mean = logits.mean(1) if label_smoothing else None
    row_max = logits.amax(1)
    exp = logits.sub_(row_max[:, None]).exp_()
    sum_exp = exp.sum(1)
    lse = sum_exp.log() + row_max
    loss = (1 - label_smoothing) * (lse - picked) + z_loss * lse * lse
    if label_smoothing:
        loss = loss + label_smoothing * (lse - mean)
    losses = torch.where(valid, loss, 0.0)
    if token_weight is None:
        return losses, None
    grad = exp.div_(sum_exp[:, None])
    if z_loss:
        grad.mul_((1 + 2 * z_loss * lse)[:, None])
    if label_smoothing:
        grad.sub_(label_smoothing / vocab)
    grad.scatter_add_(1, safe_target, valid.float()[:, None] * (label_smoothing - 1))
    grad.mul_(token_weight[:, None]).masked_fill_(~valid[:, None], 0.0)
    return losses, grad
