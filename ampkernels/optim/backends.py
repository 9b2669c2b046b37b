"""The fused optimizers' backends (native, Triton, torch) of ``adam``, ``sgd`` and ``adam_blockwise``, registered
with :mod:`ampkernels.dispatch`."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ampkernels import dispatch


@runtime_checkable
class OptimizerBackend(dispatch.Backend, Protocol):
    """What each backend of the optimizers' steps implements, with these signatures and return values."""


class NativeOptimizer(dispatch.NativeBackend):
    pass


class TritonOptimizer(dispatch.TritonBackend):
    def __init__(self, module: str):
        self.module = module


class TorchOptimizer(dispatch.TorchBackend):
    pass


def _blockwise_order(device: torch.device) -> tuple[str, ...]:
    # NOTE: on CUDA tensors Triton's blockwise step is the faster (dev/optimizers/NOTES.md).
    return ("triton", "native", "torch") if device.type == "cuda" else ("native", "torch")


_VARIABLE = "AMPKERNELS_OPTIMIZER_BACKEND"
_STEPS = "ampkernels.optim.triton.optimizers"
ADAM = dispatch.register(
    dispatch.Op(
        "adam",
        "adam (FusedAdam, FusedAdamW)",
        _VARIABLE,
        (NativeOptimizer(), TritonOptimizer(_STEPS), TorchOptimizer()),
        dispatch.native_first,
        OptimizerBackend,
    )
)
SGD = dispatch.register(
    dispatch.Op(
        "sgd",
        "sgd (FusedSGD)",
        _VARIABLE,
        (NativeOptimizer(), TritonOptimizer(_STEPS), TorchOptimizer()),
        dispatch.native_first,
        OptimizerBackend,
    )
)
ADAM_BLOCKWISE = dispatch.register(
    dispatch.Op(
        "adam_blockwise",
        "adam_blockwise (FusedAdam with low-precision moments or stochastic rounding)",
        _VARIABLE,
        (NativeOptimizer(), TritonOptimizer("ampkernels.optim.triton.blockwise"), TorchOptimizer()),
        _blockwise_order,
        OptimizerBackend,
    )
)
