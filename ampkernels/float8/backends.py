"""The backends of the FP8 casts (``to_float8``: native, Triton, torch) and of the fused producers
(``float8_fused``: Triton, torch), registered with :mod:`ampkernels.dispatch`."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ampkernels import dispatch


@runtime_checkable
class CastBackend(dispatch.Backend, Protocol):
    """What each backend of the FP8 casts implements, with these signatures and return values."""


@runtime_checkable
class FusedBackend(dispatch.Backend, Protocol):
    """What each backend of the fused producers (norm, SiLU-up, RoPE) implements, with these signatures and return
    values."""


class NativeCasts(dispatch.NativeBackend):
    def why_not(self, device: torch.device) -> str | None:
        reason = dispatch.native_reason(device)
        if reason is None:
            if device.type != "cuda":
                return "the native FP8 casts run CUDA tensors only (CPU tensors take the reference)"
            if dispatch.native_op("to_float8_native") is None:
                return "ampkernels._C has no to_float8_native op (built before the native casts; rebuild it)"
        return reason


class TritonCasts(dispatch.TritonBackend):
    module = "ampkernels.float8.triton.casts"


class TorchCasts(dispatch.TorchBackend):
    pass


class TritonFused(dispatch.TritonBackend):
    module = "ampkernels.float8.triton.fused"


class TorchFused(dispatch.TorchBackend):
    pass


_VARIABLE = "AMPKERNELS_FLOAT8_BACKEND"
TO_FLOAT8 = dispatch.register(
    dispatch.Op(
        "to_float8",
        "to_float8 (FP8 casts: to_float8, to_float8_pair)",
        _VARIABLE,
        (NativeCasts(), TritonCasts(), TorchCasts()),
        dispatch.kernels_on_cuda(("native", "triton", "torch")),
        CastBackend,
        native_optional=True,
    )
)
FLOAT8_FUSED = dispatch.register(
    dispatch.Op(
        "float8_fused",
        "float8_fused (fused rms_norm, silu_mul, rotary_embedding)",
        _VARIABLE,
        (TritonFused(), TorchFused()),
        dispatch.kernels_on_cuda(("triton", "torch")),
        FusedBackend,
        native=(),
    )
)
