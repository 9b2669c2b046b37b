"""ampkernels: fused, sync-free mixed-precision (AMP) kernels for PyTorch.

``import ampkernels`` never fails because an optional piece (the native extension, Triton, matplotlib) is missing;
``python -m ampkernels.info`` says which backend each op uses and why.
"""

from ampkernels import _native_fakes, float8, ops, reference  # noqa: F401  (_native_fakes registers on import)
from ampkernels.cuda_graph import CapturedStep, capture_step
from ampkernels.grad_scaler import FusedGradScaler
from ampkernels.loss import LinearCrossEntropy, linear_cross_entropy
from ampkernels.optimizers import FusedAdam, FusedAdamW, FusedSGD
from ampkernels.scaled_matmul import ScaledLinear, scaled_matmul
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
