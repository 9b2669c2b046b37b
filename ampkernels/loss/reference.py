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
