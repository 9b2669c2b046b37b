"""The backends of ``scaled_matmul`` on 16-bit operands (``scaled_matmul``: auto, triton, wgmma, wmma, torch; cublas
named only to say why it does not apply) and on float8 operands (``scaled_matmul_float8``: auto, triton, wgmma,
cublas, torch), registered with :mod:`ampkernels.dispatch`."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ampkernels import dispatch

_TRITON = "ampkernels.matmul.triton.scaled_matmul"
#: The backends "auto" chooses between, per problem.
AUTO_CANDIDATES = ("triton", "wgmma")
FLOAT8_AUTO_CANDIDATES = ("triton", "wgmma", "cublas")


@runtime_checkable
class MatmulBackend(dispatch.Backend, Protocol):
    """What each backend of scaled_matmul implements, with these signatures and return values."""


def _float8_capable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return f"float8 Tensor Cores need compute capability 8.9 or newer, this GPU is {capability[0]}.{capability[1]}"
    return None


class Auto(dispatch.AutoBackend):
    def __init__(self, op: str, candidates: tuple[str, ...]):
        self.op, self.candidates = op, candidates

    def why_not(self, device: torch.device) -> str | None:
        if dispatch.auto_candidates(device, self.op):
            return None
        if len(self.candidates) == 2:
            return f"'auto' chooses between {' and '.join(self.candidates)} per problem, and neither runs here"
        return f"'auto' chooses between {', '.join(self.candidates)} per problem, and none runs here"


class TritonMatmul(dispatch.TritonBackend):
    module = _TRITON


class TritonFloat8Matmul(dispatch.TritonBackend):
    module = _TRITON

    def why_not(self, device: torch.device) -> str | None:
        return super().why_not(device) or _float8_capable(device)


class Wmma:
    name = "wmma"

    def why_not(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "the WMMA kernel runs on CUDA tensors only"
        if dispatch.native_op("scaled_matmul_wmma_") is None:
            return dispatch.native_reason(device) or (
                "ampkernels._C has no scaled_matmul_wmma_ op (built without its CUDA kernel); "
                "rebuild with `pip install --no-build-isolation -e .` and CUDA_HOME set"
            )
        return None


class Wgmma:
    name = "wgmma"

    def why_not(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "the wgmma kernel runs on CUDA tensors only"
        if dispatch.native_op("scaled_matmul_wgmma_") is None:
            return dispatch.native_reason(device) or "ampkernels._C has no scaled_matmul_wgmma_ op"
        mod = dispatch.native()
        if not getattr(mod, "wgmma_built", False):
            arch_list = getattr(mod, "cuda_arch_list", "")
            return f"ampkernels._C was built for {arch_list!r}, without 9.0a (TORCH_CUDA_ARCH_LIST), which wgmma needs"
        capability = torch.cuda.get_device_capability(device)
        if capability != (9, 0):
            return f"wgmma needs a compute capability 9.0 GPU (H100, H200), this one is {capability[0]}.{capability[1]}"
        return None


class WgmmaFloat8(Wgmma):
    def why_not(self, device: torch.device) -> str | None:
        reason = super().why_not(device)
        if reason is None and dispatch.native_op("scaled_matmul_fp8_wgmma_") is None:
            reason = "ampkernels._C has no scaled_matmul_fp8_wgmma_ op (built without the fp8 wgmma kernel)"
        return reason


class CublasRefuses16Bit:
    """``cublas`` asked for with 16-bit operands: it exists to say why not."""

    name = "cublas"

    def why_not(self, device: torch.device) -> str | None:
        others = "/".join(b.name for b in SCALED_MATMUL.backends if b is not self)
        return f"'cublas' (torch._scaled_mm) runs float8 operands only; float16/bfloat16 operands run on {others}"


class CublasFloat8:
    name = "cublas"

    def why_not(self, device: torch.device) -> str | None:
        if not hasattr(torch, "_scaled_mm"):
            return f"this torch ({torch.__version__}) has no torch._scaled_mm"
        if device.type not in ("cpu", "cuda"):
            return f"torch._scaled_mm runs CUDA (and CPU) tensors, not {device.type}"
        return _float8_capable(device)


class TorchMatmul(dispatch.TorchBackend):
    pass


def _order(op: str, kernels: tuple[str, ...]):
    def order(device: torch.device) -> tuple[str, ...]:
        if device.type != "cuda":
            return ("torch",)
        if len(dispatch.auto_candidates(device, op)) > 1:
            return ("auto",)
        return kernels

    return order


SCALED_MATMUL = dispatch.register(
    dispatch.Op(
        "scaled_matmul",
        "scaled_matmul (and ScaledLinear)",
        "AMPKERNELS_SCALED_MATMUL_BACKEND",
        (Auto("scaled_matmul", AUTO_CANDIDATES), TritonMatmul(), Wgmma(), Wmma(), CublasRefuses16Bit(), TorchMatmul()),
        _order("scaled_matmul", ("triton", "wgmma", "wmma", "torch")),
        MatmulBackend,
        native=("wgmma", "wmma"),
        auto=AUTO_CANDIDATES,
    )
)
SCALED_MATMUL_FLOAT8 = dispatch.register(
    dispatch.Op(
        "scaled_matmul_float8",
        "scaled_matmul_float8 (scaled_matmul on float8 operands)",
        "AMPKERNELS_SCALED_MATMUL_FLOAT8_BACKEND",
        (
            Auto("scaled_matmul_float8", FLOAT8_AUTO_CANDIDATES),
            TritonFloat8Matmul(),
            WgmmaFloat8(),
            CublasFloat8(),
            TorchMatmul(),
        ),
        _order("scaled_matmul_float8", ("triton", "wgmma", "cublas", "torch")),
        MatmulBackend,
        native=("wgmma",),
        auto=FLOAT8_AUTO_CANDIDATES,
    )
)
