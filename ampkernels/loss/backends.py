"""The backends of the fused loss's per-chunk step (Triton, torch), registered with :mod:`ampkernels.dispatch`.
:func:`ampkernels.linear_cross_entropy` checks the arguments and asks dispatch for a backend; its custom ops carry the
backend's name and call the object it names for each chunk."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ampkernels import dispatch
from ampkernels.loss import reference


@runtime_checkable
class LossBackend(dispatch.Backend, Protocol):
    """What each backend of ``linear_cross_entropy``'s per-chunk step implements, with these signatures and return
    values."""

    def logit_bytes(self, logits_dtype: torch.dtype) -> int:
        """Bytes per logit the step works on (which sizes the chunks: ``cross_entropy.chunk_tokens``)."""
        ...

    def losses_and_grad_logits(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        token_weight: torch.Tensor | None,
        losses: torch.Tensor,
        options: tuple[int, float, float],
    ) -> torch.Tensor | None:
        """One chunk's losses into ``losses`` and, with ``token_weight``, the gradient of the logits (None without
        it). ``options``: (ignore_index, label_smoothing, z_loss)."""
        ...


class TritonLoss(dispatch.TritonBackend):
    """One kernel per chunk on the GEMM's 16-bit logits, their gradient written over them."""

    module = "ampkernels.loss.triton.cross_entropy"

    def logit_bytes(self, logits_dtype):
        return logits_dtype.itemsize

    def losses_and_grad_logits(self, logits, target, token_weight, losses, options):
        ignore_index, label_smoothing, z_loss = options
        self.kernels().cross_entropy_chunk_(logits, target, token_weight, losses, ignore_index, label_smoothing, z_loss)
        return logits if token_weight is not None else None


class TorchLoss(dispatch.TorchBackend):
    """``reference.cross_entropy_chunk`` on a float32 copy of the logits; the gradient in float32."""

    def logit_bytes(self, logits_dtype):
        return 4

    def losses_and_grad_logits(self, logits, target, token_weight, losses, options):
        ignore_index, label_smoothing, z_loss = options
        chunk_losses, grad = reference.cross_entropy_chunk(
            logits, target, token_weight, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss
        )
        losses.copy_(chunk_losses)
        return grad


LINEAR_CROSS_ENTROPY = dispatch.register(
    dispatch.Op(
        "linear_cross_entropy",
        "linear_cross_entropy (and LinearCrossEntropy)",
        "AMPKERNELS_LOSS_BACKEND",
        (TritonLoss(), TorchLoss()),
        dispatch.kernels_on_cuda(("triton", "torch")),
        LossBackend,
        native=(),
    )
)
