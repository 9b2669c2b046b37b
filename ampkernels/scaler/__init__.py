"""The loss scaler: :class:`FusedGradScaler` (``torch.amp.GradScaler``'s API on fused, sync-free kernels) and the
multi-tensor ops it runs, :func:`unscale_reduce_` (unscale + non-finite check + norm, optionally the clip) and
:func:`update_scale_` (the dynamic loss-scale update), with their plain-PyTorch references in
:mod:`ampkernels.scaler.reference` and Triton kernels in :mod:`ampkernels.scaler.triton`. The native kernels are in
``csrc/scaler/``."""

from ampkernels.scaler.functional import UnscaleResult, check_and_norm, unscale_, unscale_reduce_, update_scale_
from ampkernels.scaler.grad_scaler import FusedGradScaler

__all__ = ["FusedGradScaler", "UnscaleResult", "check_and_norm", "unscale_", "unscale_reduce_", "update_scale_"]
