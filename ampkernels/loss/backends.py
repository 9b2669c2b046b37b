"""The backends of the fused loss's per-chunk step (Triton, torch), registered with :mod:`ampkernels.dispatch`."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ampkernels import dispatch


@runtime_checkable
class LossBackend(dispatch.Backend, Protocol):
    """What each backend of ``linear_cross_entropy``'s per-chunk step implements, with these signatures and return
    values."""


class TritonLoss(dispatch.TritonBackend):
    module = "ampkernels.loss.triton.cross_entropy"


class TorchLoss(dispatch.TorchBackend):
    pass


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
