"""The backends of ``scaled_matmul`` on 16-bit operands (``scaled_matmul``: auto, triton, wgmma, wmma, torch; cublas
named only to say why it does not apply) and on float8 operands (``scaled_matmul_float8``: auto, triton, wgmma,
cublas, torch), registered with :mod:`ampkernels.dispatch`. Each implements its op's Protocol
(:class:`MatmulBackend`, :class:`Float8MatmulBackend`): the launch on normalized 2-D arguments and what the callers
ask of it, so that :mod:`ampkernels.matmul.api` and :mod:`ampkernels.matmul.launch` hold a backend and call it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from ampkernels import dispatch
from ampkernels._constants import SCALE_COL, SCALE_NONE, SCALE_ROW, SCALE_TENSOR
from ampkernels._runtime import capturing
from ampkernels.matmul import reference

_TRITON = "ampkernels.matmul.triton.scaled_matmul"
#: The backends "auto" chooses between, per problem.
AUTO_CANDIDATES = ("triton", "wgmma")
FLOAT8_AUTO_CANDIDATES = ("triton", "wgmma", "cublas")
#: Float8 "auto" without timing (``tuning.TUNE`` False, small problems, inside a capture): the first of these that
#: takes the problem. cuBLAS is the measured baseline; the native kernel next; Triton last.
FLOAT8_UNTIMED_ORDER = ("cublas", "wgmma", "triton")


@runtime_checkable
class MatmulBackend(dispatch.Backend, Protocol):
    """What each backend of scaled_matmul (16-bit operands) implements, with these signatures and return values."""

    #: Whether it runs float32/float64 operands (in their precision): only the reference, asked for by name.
    wide_operands: bool

    def launch(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> None:
        """``out (+)= alpha * scale * (a @ b) + bias`` on normalized 2-D arguments (see the op schema), any of M,
        N, K zero included."""
        ...

    def launch_amax(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out) -> None:
        """:meth:`launch`, then ``amax_out = max(amax_out, max |out as stored|)`` (the Triton epilogue records it,
        the other backends after their launch in torch ops)."""
        ...

    def resolve(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> MatmulBackend:
        """The backend that runs this problem (M, N, K > 0): itself; "auto": its choice for the problem."""
        ...

    def direct_launcher(self, a, b, scale, scale_mode, bias, out, accumulate, found_inf) -> Callable | None:
        """A launcher of its own for problems with these arguments' metadata (M, N, K > 0), called as ``launcher(a,
        b, scale, alpha, bias, out, found_inf)`` instead of :meth:`launch` by the cached calls; None: they call
        :meth:`launch`."""
        ...


@runtime_checkable
class Float8MatmulBackend(dispatch.Backend, Protocol):
    """What each backend of scaled_matmul_float8 implements, with these signatures and return values."""

    #: Whether "auto" offers it only where no other candidate takes the problem.
    last_resort: bool

    def launch_float8(
        self, a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
    ) -> None:
        """``out (+)= alpha * scale * ((a @ b) * scale_a * scale_b) + bias``, then found_inf and ``amax_out =
        max(amax_out, max |out|)``, on normalized 2-D float8 arguments (see the ``ampkernels::scaled_mm_fp8_``
        schema), any of M, N, K zero included."""
        ...

    def takes(self, a, b, out) -> bool:
        """Whether "auto" may run this problem (normalized 2-D arguments) on it."""
        ...

    def refuses(self, K: int, N: int, device: torch.device) -> str | None:
        """Why it cannot run a problem of this K and N when asked for by name (the error of argument 'backend'),
        None when it can."""
        ...


# --------------------------------------------------------------------------------------------------------------------
# Shared pieces: the rules, the reference, the operand layouts
# --------------------------------------------------------------------------------------------------------------------


def _float8_capable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return f"float8 Tensor Cores need compute capability 8.9 or newer, this GPU is {capability[0]}.{capability[1]}"
    return None


def cublas_refuses(K: int, N: int, device: torch.device) -> str | None:
    """Why ``torch._scaled_mm`` cannot take this problem on ``device`` (None when it can): cuBLAS's FP8 GEMM wants K
    and N multiples of 16 (torch's CPU kernel takes any shape)."""
    if device.type == "cuda" and (K % 16 or N % 16):
        return f"torch._scaled_mm (cuBLAS) needs K and N multiples of 16, got K={K}, N={N}"
    return None


# NOTE: "fast accumulation" keeps the whole K loop in the tensor cores' reduced-precision FP8 accumulator (the FP8
# wgmma kernel always; cuBLAS with use_fast_accum=True). Its error stays within the accuracy rule (at most 2x
# torch._scaled_mm's default) for bf16 outputs up to K = 8192, where the output's rounding dominates, and not for fp16
# or fp32 outputs (dev/float8/NOTES.md). It runs faster in cuBLAS (dev/matmul/wgmma/NOTES.md), so it is used where it
# stays within the rule: "auto" offers the wgmma kernel only there, and the cublas backend asks cuBLAS for it only
# there; backend="wgmma" runs anywhere.
FAST_ACCUMULATION_MAX_K = 8192


def fast_accumulation_ok(K: int, out_dtype: torch.dtype) -> bool:
    """Whether fast FP8 accumulation stays within 2x torch._scaled_mm's default error for this K and output dtype."""
    return out_dtype == torch.bfloat16 and K <= FAST_ACCUMULATION_MAX_K


def wgmma_float8_takes(a: torch.Tensor) -> bool:
    """The native FP8 kernel's operand rule: K a positive multiple of 16 (TMA copies rows of 16-byte multiples)."""
    return a.shape[1] > 0 and a.shape[1] % 16 == 0


def _reference(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> None:
    """The 16-bit reference on normalized arguments (a per-row scale as a column)."""
    ref_scale = scale
    if scale_mode == SCALE_ROW:
        ref_scale = scale[:, None]
    reference.scaled_matmul(
        a, b, ref_scale, alpha=alpha, bias=bias, out=out, accumulate=accumulate, found_inf=found_inf
    )


def _reference_scale(scale, scale_mode, alpha):
    """The normalized scale as the references take it (a per-row scale as a column)."""
    if scale_mode == SCALE_ROW:
        return scale[:, None]
    if scale_mode in (SCALE_TENSOR, SCALE_COL):
        return scale
    return None if alpha == 1.0 else alpha


def _reference_float8(a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out):
    """The float8 reference on normalized arguments."""
    reference.scaled_matmul_float8(
        a, b, scale_a, scale_b, _reference_scale(scale, scale_mode, alpha), bias=bias, out_dtype=out.dtype,
        out=out, accumulate=accumulate, found_inf=found_inf, amax_out=amax_out,
    )  # fmt: skip


def _record_stored(out: torch.Tensor, found_inf: torch.Tensor | None, amax_out: torch.Tensor | None) -> None:
    """found_inf and amax_out of ``out`` as stored, in torch ops (the backends whose epilogue lacks them); the same
    ops as :func:`ampkernels.reference.scaled_matmul_float8`."""
    if out.numel() == 0:
        return
    if found_inf is not None:
        bad = torch.isfinite(out).all().logical_not()
        found_inf.copy_(torch.where(bad, torch.ones_like(found_inf), found_inf))
    if amax_out is not None:
        amax_out.copy_(torch.maximum(amax_out, out.float().abs().amax().reshape(amax_out.shape)))


def _row_major(t: torch.Tensor) -> bool:
    rows, cols = t.shape
    return t.stride(1) == 1 and (t.stride(0) >= cols or rows == 1) and not t.data_ptr() % 16


def _k_major(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a row-major, b column-major (both "K-major"), 16-byte aligned, copied where they are not: the layout FP8
    wgmma reads from shared memory and the only one cuBLAS's FP8 GEMM takes. The hot GEMMs of a float8 Linear come
    in it (b = w8.t()); the others pay one copy of an operand."""
    if not _row_major(a):
        a = a.clone(memory_format=torch.contiguous_format)
    if not _row_major(b.t()):
        b = b.t().clone(memory_format=torch.contiguous_format).t()
    return a, b


_UNIT: dict[torch.device, torch.Tensor] = {}


def _unit(device: torch.device) -> torch.Tensor:
    """A cached float32 1.0 on ``device`` (torch._scaled_mm's scale when none is given)."""
    one = _UNIT.get(device)
    if one is None:
        one = torch.ones((), dtype=torch.float32, device=device)
        # NOTE: not kept when made inside a CUDA graph capture: the fill only runs at replay, and an eager call
        # before that would read unwritten memory.
        if not capturing():
            _UNIT[device] = one
    return one


def _cublas_float8(a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate) -> None:
    """``torch._scaled_mm`` (a row-major, b column-major, copied so if needed). It writes ``out`` itself when the
    call is only ``(a @ b) * scale_a * scale_b (+ bias)`` in a form cuBLAS takes (per-row/column factors need a
    bfloat16 output; a bias of the output's 16-bit dtype); otherwise it returns the fp32 product and the epilogue
    follows in torch ops, as the reference computes it."""
    M, N = a.shape[0], b.shape[1]
    a, b = _k_major(a, b)
    vector = any(f is not None and f.numel() > 1 for f in (scale_a, scale_b))
    direct = (
        scale_mode == SCALE_NONE
        and alpha == 1.0
        and not accumulate
        and (out.dtype == torch.bfloat16 or not vector)
        and (bias is None or (bias.dtype == out.dtype and out.dtype != torch.float32))
    )
    one = _unit(out.device)
    fast = fast_accumulation_ok(a.shape[1], out.dtype)
    if accumulate and out.dtype == torch.float32 and scale_mode == SCALE_NONE and alpha == 1.0 and bias is None:
        if not vector:
            # out += (a @ b) * scale_a * scale_b: cuBLAS scales the float32 product in its epilogue, one add follows
            # (4 bytes per output element written, 12 read and written by the add; the generic path below makes
            # three more float32 passes: 1 GB each for a [128k, 2048] weight gradient)
            sa = one if scale_a is None else scale_a.reshape(())
            sb = one if scale_b is None else scale_b.reshape(())
            out.add_(torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32, use_fast_accum=fast))
            return
    if direct:
        sa = one if scale_a is None else scale_a
        sb = one if scale_b is None else scale_b
        if vector:  # cuBLAS's rowwise mode takes both factors as vectors: [M, 1] and [1, N]
            sa = sa.reshape(-1, 1).expand(M, 1).contiguous() if sa.numel() == 1 else sa.reshape(M, 1)
            sb = sb.reshape(1, -1).expand(1, N).contiguous() if sb.numel() == 1 else sb.reshape(1, N)
        else:
            sa, sb = sa.reshape(()), sb.reshape(())
        torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out.dtype, out=out, use_fast_accum=fast)
        return
    v = torch._scaled_mm(a, b, one, one, out_dtype=torch.float32, use_fast_accum=fast)
    if scale_a is not None:
        v = v * scale_a.reshape(-1, 1)
    if scale_b is not None:
        v = v * scale_b.reshape(1, -1)
    ref_scale = _reference_scale(scale, scale_mode, alpha)
    if ref_scale is not None:
        v = v * ref_scale
    if bias is not None:
        v = v + bias.float()
    if accumulate:
        v = out.float() + v
    out.copy_(v)


# --------------------------------------------------------------------------------------------------------------------
# scaled_matmul (16-bit operands)
# --------------------------------------------------------------------------------------------------------------------


class _Auto(dispatch.AutoBackend):
    def __init__(self, op: str, candidates: tuple[str, ...]):
        self.op, self.candidates = op, candidates

    def why_not(self, device: torch.device) -> str | None:
        if dispatch.auto_candidates(device, self.op):
            return None
        if len(self.candidates) == 2:
            return f"'auto' chooses between {' and '.join(self.candidates)} per problem, and neither runs here"
        return f"'auto' chooses between {', '.join(self.candidates)} per problem, and none runs here"


class _Kernel:
    """What the 16-bit kernels share: no float32/float64 operands, their own choice, and the launches. ``launch`` and
    ``launch_amax`` take every problem: an empty one does nothing, K == 0 runs the reference (``out (+)= bias``: not
    worth a kernel's edge case), the others go to the backend's ``_launch`` / ``_launch_amax``."""

    wide_operands = False

    def launch(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> None:
        if a.shape[0] == 0 or b.shape[1] == 0:
            return
        if a.shape[1] == 0:
            return _reference(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)
        self._launch(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)

    def launch_amax(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out) -> None:
        if a.shape[0] == 0 or b.shape[1] == 0:
            return
        if a.shape[1] == 0:
            _reference(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)
            return _record_stored(out, None, amax_out)
        self._launch_amax(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out)

    def _launch(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> None:
        raise NotImplementedError

    def _launch_amax(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out) -> None:
        self._launch(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)
        _record_stored(out, None, amax_out)

    def resolve(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> MatmulBackend:
        return self

    def direct_launcher(self, a, b, scale, scale_mode, bias, out, accumulate, found_inf) -> Callable | None:
        return None


class Auto(_Kernel, _Auto):
    """Triton or wgmma per problem (:func:`ampkernels.matmul.launch.auto_backend`)."""

    def _launch(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> None:
        self.resolve(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)._launch(
            a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf
        )

    def _launch_amax(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out) -> None:
        self.resolve(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)._launch_amax(
            a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
        )

    def resolve(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> MatmulBackend:
        name = _launch.auto_backend(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)
        return SCALED_MATMUL.backend(name)


class TritonMatmul(_Kernel, dispatch.TritonBackend):
    module = _TRITON

    def _launch(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> None:
        self.kernels().scaled_mm_(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)

    def _launch_amax(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out) -> None:
        self.kernels().scaled_mm_(
            a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out=amax_out
        )  # fmt: skip

    def direct_launcher(self, a, b, scale, scale_mode, bias, out, accumulate, found_inf) -> Callable | None:
        # the kernel launcher itself (it reads the scale through its pointer: no reshaped view either)
        return self.kernels().launcher_for(a, b, scale, scale_mode, bias, out, accumulate, found_inf)


class _NativeMatmul(_Kernel):
    """A native kernel: the op ``torch.ops.ampkernels.<op>``."""

    op: str

    def _launch(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> None:
        # The native ops take row- or column-major operands only.
        a = a if a.is_contiguous() or a.t().is_contiguous() else a.contiguous()
        b = b if b.is_contiguous() or b.t().is_contiguous() else b.contiguous()
        dispatch.native_op(self.op)(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)


class Wmma(_NativeMatmul):
    name = "wmma"
    op = "scaled_matmul_wmma_"

    def why_not(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "the WMMA kernel runs on CUDA tensors only"
        if dispatch.native_op("scaled_matmul_wmma_") is None:
            return dispatch.native_reason(device) or (
                "ampkernels._C has no scaled_matmul_wmma_ op (built without its CUDA kernel); "
                "rebuild with `pip install --no-build-isolation -e .` and CUDA_HOME set"
            )
        return None


def _wgmma_reason(device: torch.device) -> str | None:
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


class Wgmma(_NativeMatmul):
    name = "wgmma"
    op = "scaled_matmul_wgmma_"

    def why_not(self, device: torch.device) -> str | None:
        return _wgmma_reason(device)


class CublasRefuses16Bit(_Kernel):
    """``cublas`` asked for with 16-bit operands: it exists to say why not (:func:`dispatch.choose` raises with
    :meth:`why_not` before anything would launch it)."""

    name = "cublas"

    def why_not(self, device: torch.device) -> str | None:
        others = "/".join(b.name for b in SCALED_MATMUL.backends if b is not self)
        return f"'cublas' (torch._scaled_mm) runs float8 operands only; float16/bfloat16 operands run on {others}"

    def _launch(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> None:
        raise AssertionError(self.why_not(out.device))


class TorchMatmul(_Kernel, dispatch.TorchBackend):
    #: The reference computes float32/float64 operands in their precision.
    wide_operands = True

    def _launch(self, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> None:
        _reference(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)


# --------------------------------------------------------------------------------------------------------------------
# scaled_matmul_float8
# --------------------------------------------------------------------------------------------------------------------


class _Float8:
    """What the float8 backends share: offered by "auto" for any problem, any shape taken by name (by default), and
    the launch: an empty problem does nothing, K == 0 runs the reference (``out (+)= bias``: not worth a kernel's
    edge case), the others go to the backend's ``_launch_float8``."""

    last_resort = False

    def launch_float8(
        self, a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
    ) -> None:
        if a.shape[0] == 0 or b.shape[1] == 0:
            return
        args = (a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out)
        if a.shape[1] == 0:
            return _reference_float8(*args)
        self._launch_float8(*args)

    def _launch_float8(
        self, a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
    ) -> None:
        raise NotImplementedError

    def takes(self, a, b, out) -> bool:
        return True

    def refuses(self, K: int, N: int, device: torch.device) -> str | None:
        return None


class AutoFloat8(_Float8, _Auto):
    """The fastest of Triton, wgmma and cuBLAS per problem (:func:`ampkernels.matmul.launch.float8_auto_backend`)."""

    def _launch_float8(self, *args) -> None:
        SCALED_MATMUL_FLOAT8.backend(_launch.float8_auto_backend(*args))._launch_float8(*args)

    def takes(self, a, b, out) -> bool:
        return False  # not a candidate of its own


class TritonFloat8Matmul(_Float8, dispatch.TritonBackend):
    module = _TRITON
    # NOTE: Triton's FP8 GEMM measured the slowest backend on all six training shapes, and timing it compiles its
    # configs, most of a Float8Linear model's first step (dev/float8/NOTES.md). "auto" runs it where neither native
    # backend takes the problem.
    last_resort = True

    def why_not(self, device: torch.device) -> str | None:
        return super().why_not(device) or _float8_capable(device)

    def _launch_float8(
        self, a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
    ) -> None:
        a, b = _k_major(a, b)
        self.kernels().scaled_mm_(
            a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf,
            scale_a=scale_a, scale_b=scale_b, amax_out=amax_out,
        )  # fmt: skip


class WgmmaFloat8(_Float8):
    name = "wgmma"

    def why_not(self, device: torch.device) -> str | None:
        reason = _wgmma_reason(device)
        if reason is None and dispatch.native_op("scaled_matmul_fp8_wgmma_") is None:
            reason = "ampkernels._C has no scaled_matmul_fp8_wgmma_ op (built without the fp8 wgmma kernel)"
        return reason

    def _launch_float8(
        self, a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
    ) -> None:
        a, b = _k_major(a, b)
        dispatch.native_op("scaled_matmul_fp8_wgmma_")(
            a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
        )

    def takes(self, a, b, out) -> bool:
        # always fast accumulation: offered only where it stays within the accuracy rule
        return fast_accumulation_ok(a.shape[1], out.dtype) and wgmma_float8_takes(a)

    def refuses(self, K: int, N: int, device: torch.device) -> str | None:
        if K % 16:
            return f"'wgmma': the FP8 kernel needs K multiples of 16, got K={K}; 'triton' or 'auto' takes any shape"
        return None


class CublasFloat8(_Float8):
    name = "cublas"

    def why_not(self, device: torch.device) -> str | None:
        if not hasattr(torch, "_scaled_mm"):
            return f"this torch ({torch.__version__}) has no torch._scaled_mm"
        if device.type not in ("cpu", "cuda"):
            return f"torch._scaled_mm runs CUDA (and CPU) tensors, not {device.type}"
        return _float8_capable(device)

    def _launch_float8(
        self, a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
    ) -> None:
        _cublas_float8(a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate)
        _record_stored(out, found_inf, amax_out)

    def takes(self, a, b, out) -> bool:
        return cublas_refuses(a.shape[1], b.shape[1], out.device) is None

    def refuses(self, K: int, N: int, device: torch.device) -> str | None:
        reason = cublas_refuses(K, N, device)
        if reason is not None:
            return f"'cublas': {reason}; backend 'triton' or 'auto' takes any shape"
        return None


class TorchFloat8Matmul(_Float8, dispatch.TorchBackend):
    def _launch_float8(
        self, a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
    ) -> None:
        _reference_float8(a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out)


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
            AutoFloat8("scaled_matmul_float8", FLOAT8_AUTO_CANDIDATES),
            TritonFloat8Matmul(),
            WgmmaFloat8(),
            CublasFloat8(),
            TorchFloat8Matmul(),
        ),
        _order("scaled_matmul_float8", ("triton", "wgmma", "cublas", "torch")),
        Float8MatmulBackend,
        native=("wgmma",),
        auto=FLOAT8_AUTO_CANDIDATES,
    )
)

# NOTE: "auto" asks the per-problem choice of the launch module, which imports this one (to register the ops) and
# re-exports its rules: imported last, so that either module may be imported first.
from ampkernels.matmul import launch as _launch  # noqa: E402
