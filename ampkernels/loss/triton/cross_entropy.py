"""Launch code of the per-chunk step of ``ampkernels.linear_cross_entropy`` on the Triton backend (math in
``reference.cross_entropy_chunk``, kernel in ``ampkernels.loss.triton.cross_entropy_kernels``).

Bytes per chunk of N x V logits in their 16-bit dtype: two reads of the logits and, with gradients, one write of
their gradient over them (6 bytes per logit), against the torch backend's float32 copy and five elementwise passes
(about 30 bytes per logit)."""

from __future__ import annotations

import torch

from ampkernels import dispatch
from ampkernels._runtime import on_device_of_first_tensor
from ampkernels.loss.triton.cross_entropy_kernels import _cross_entropy_rows_kernel

# NOTE: 4096 logits per block: 16 per thread at 8 warps, 8 KiB of bf16 loads in flight per program.
BLOCK = 4096


@on_device_of_first_tensor
def cross_entropy_chunk_(
    logits: torch.Tensor,
    target: torch.Tensor,
    token_weight: torch.Tensor | None,
    losses: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
) -> None:
    """logits [N, V] contiguous, target int64 [N], token_weight float32 [N] (any stride, 0 to broadcast) or None,
    losses float32 [N] (written). With ``token_weight`` the logits are overwritten with their gradient."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    grads = token_weight is not None
    _cross_entropy_rows_kernel[(rows,)](
        logits,
        target,
        token_weight if grads else losses,
        losses,
        vocab,
        token_weight.stride(0) if grads else 0,
        ignore_index,
        float(label_smoothing),
        float(z_loss),
        GRADS=grads,
        SMOOTHING=label_smoothing != 0.0,
        Z_LOSS=z_loss != 0.0,
        INT_BF16=dispatch.triton_interpreting(),
        BLOCK=min(BLOCK, max(16, 1 << (vocab - 1).bit_length())),
        num_warps=8,
    )
