"""ampkernels: fused, sync-free mixed-precision (AMP) kernels for PyTorch.

One package per kernel family, as ``csrc/``: :mod:`ampkernels.scaler` (the loss scaler), :mod:`ampkernels.optim`
(fused optimizers), :mod:`ampkernels.matmul` (``scaled_matmul``), :mod:`ampkernels.float8` (FP8 training) and
:mod:`ampkernels.loss` (fused linear + cross-entropy); :mod:`ampkernels.dispatch` chooses their backends.
``import ampkernels`` never fails because an optional piece (the native extension, Triton, matplotlib) is missing;
``python -m ampkernels.info`` says which backend each op uses and why.
"""

# (the families in the order dispatch and ``python -m ampkernels.info`` list their ops)
from ampkernels import scaler, optim, matmul, float8, loss  # noqa: I001, F401
from ampkernels import _native_fakes, ops, reference  # noqa: F401  (_native_fakes registers on import)
from ampkernels.cuda_graph import CapturedStep, capture_step
from ampkernels.loss import LinearCrossEntropy, linear_cross_entropy
from ampkernels.optim import FusedAdam, FusedAdamW, FusedSGD
from ampkernels.scaled_matmul import ScaledLinear, scaled_matmul
from ampkernels.scaler import FusedGradScaler
from ampkernels.telemetry import plot_scale_history

__version__ = "0.1.0"
__all__ = [
    "CapturedStep",
    "FusedAdam",
    "FusedAdamW",
    "FusedGradScaler",
    "FusedSGD",
    "LinearCrossEntropy",
    "ScaledLinear",
    "ops",
    "plot_scale_history",
    "reference",
    "scaled_matmul",
    "__version__",
    "capture_step",
    "float8",
    "linear_cross_entropy",
]
