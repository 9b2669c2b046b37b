"""The backends of the FP8 casts (``to_float8``: native, Triton, torch) and of the fused producers
(``float8_fused``: Triton, torch), registered with :mod:`ampkernels.dispatch`. The public wrappers in
:mod:`ampkernels.float8.casts` and :mod:`ampkernels.float8.fused` check the arguments, ask dispatch for a backend
once per call and call it (the custom ops carry its name, and look the object up by it)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ampkernels import dispatch
from ampkernels.float8 import reference

CastResult = tuple[torch.Tensor, torch.Tensor]
PairResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: Rows longer than this run on the reference's math on the Triton backend (a Triton program holds a whole row):
#: :attr:`TritonFused.max_row`.
MAX_TRITON_ROW = 16384


# --------------------------------------------------------------------------------------------------------------------
# The FP8 casts
# --------------------------------------------------------------------------------------------------------------------


@runtime_checkable
class CastBackend(dispatch.Backend, Protocol):
    """What each backend of the FP8 casts implements, with these signatures and return values. Arguments arrive
    checked (:mod:`ampkernels.float8.casts`): ``x`` a detached [M, K] tensor (float64 already taken in float32),
    ``scale`` flattened; an empty ``x`` takes the reference on every backend."""

    def to_float8(
        self,
        x: torch.Tensor,
        dtype: torch.dtype,
        granularity: str,
        scale: torch.Tensor | None,
        amax_out: torch.Tensor | None,
        transpose: bool,
        found_inf: torch.Tensor | None,
    ) -> CastResult:
        """:func:`ampkernels.float8.to_float8`: (data [M, K] or [K, M], scale_inv 0-d or [R, 1]); may update
        ``amax_out`` and set ``found_inf``."""
        ...

    def to_float8_pair(
        self,
        x: torch.Tensor,
        dtype: torch.dtype,
        scale: torch.Tensor | None,
        amax_out: torch.Tensor | None,
        found_inf: torch.Tensor | None,
    ) -> PairResult:
        """:func:`ampkernels.float8.to_float8_pair`: (data [M, K], data_t [K, M], scale_inv 0-d)."""
        ...

    def cast_with_produced_amax(
        self, x: torch.Tensor, dtype: torch.dtype, amax_scratch: torch.Tensor, pair: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """The tensorwise current-scaling cast of a plain eager [M, K] ``x`` from the amax its producer recorded in
        ``amax_scratch`` (:func:`ampkernels.float8.casts.cast_with_produced_amax`): ``(data, data_t or None,
        scale_inv)``, or None where the backend does not take a produced amax (the caller casts as usual)."""
        ...


def _reference_to_float8(x, dtype, granularity, scale, amax_out, transpose, found_inf) -> CastResult:
    if amax_out is not None and granularity == "row":
        # A [R] amax_out (accepted like [R, 1]) as the reference's [R, 1] amax: contiguous, so a view written
        # through (reference.to_float8 would broadcast a [R] record against the [R, 1] amax).
        amax_out = amax_out.view(-1, 1)
    return reference.to_float8(
        x, dtype, granularity, scale=scale, amax_out=amax_out, transpose=transpose, found_inf=found_inf
    )


def _reference_to_float8_pair(x, dtype, scale, amax_out, found_inf) -> PairResult:
    return reference.to_float8_pair(x, dtype, scale=scale, amax_out=amax_out, found_inf=found_inf)


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.view(-1)


class NativeCasts(dispatch.NativeBackend):
    """The CUDA casts of the extension (``ampkernels::to_float8_native``, ``csrc/float8/casts.cu``)."""

    def why_not(self, device: torch.device) -> str | None:
        reason = dispatch.native_reason(device)
        if reason is None:
            if device.type != "cuda":
                return "the native FP8 casts run CUDA tensors only (CPU tensors take the reference)"
            if dispatch.native_op("to_float8_native") is None:
                return "ampkernels._C has no to_float8_native op (built before the native casts; rebuild it)"
        return reason

    @staticmethod
    def _cast(x, dtype, per_row, write_data, write_t, scale, amax_out, found_inf, amax_scratch=None) -> PairResult:
        """``ampkernels::to_float8_native``: (data or empty, data_t or empty, scale_inv)."""
        return dispatch.native_op("to_float8_native").default(
            x, dtype, per_row, write_data, write_t, scale, _flat(amax_out), _flat(found_inf), amax_scratch
        )

    def to_float8(self, x, dtype, granularity, scale, amax_out, transpose, found_inf) -> CastResult:
        if x.numel() == 0:
            return _reference_to_float8(x, dtype, granularity, scale, amax_out, transpose, found_inf)
        data, data_t, scale_inv = self._cast(
            x, dtype, granularity == "row", not transpose, transpose, scale, amax_out, found_inf
        )
        return (data_t if transpose else data), scale_inv

    def to_float8_pair(self, x, dtype, scale, amax_out, found_inf) -> PairResult:
        if x.numel() == 0:
            return _reference_to_float8_pair(x, dtype, scale, amax_out, found_inf)
        return self._cast(x, dtype, False, True, True, scale, amax_out, found_inf)

    def cast_with_produced_amax(self, x, dtype, amax_scratch, pair):
        data, data_t, scale_inv = self._cast(x.detach(), dtype, False, True, pair, None, None, None, amax_scratch)
        return data, (data_t if pair else None), scale_inv


class TritonCasts(dispatch.TritonBackend):
    module = "ampkernels.float8.triton.casts"

    def to_float8(self, x, dtype, granularity, scale, amax_out, transpose, found_inf) -> CastResult:
        if x.numel() == 0:
            return _reference_to_float8(x, dtype, granularity, scale, amax_out, transpose, found_inf)
        return self.kernels().to_float8(x, dtype, granularity, scale, _flat(amax_out), transpose, _flat(found_inf))

    def to_float8_pair(self, x, dtype, scale, amax_out, found_inf) -> PairResult:
        if x.numel() == 0:
            return _reference_to_float8_pair(x, dtype, scale, amax_out, found_inf)
        return self.kernels().to_float8_pair(x, dtype, scale, _flat(amax_out), _flat(found_inf))

    def cast_with_produced_amax(self, x, dtype, amax_scratch, pair):
        x = x.detach()
        if pair:
            return self.kernels().to_float8_pair(x, dtype, None, None, None, amax_scratch)
        data, scale_inv = self.kernels().to_float8(x, dtype, "tensor", None, None, False, None, amax_scratch)
        return data, None, scale_inv


class TorchCasts(dispatch.TorchBackend):
    """The reference (:func:`ampkernels.float8.reference.to_float8`)."""

    def to_float8(self, x, dtype, granularity, scale, amax_out, transpose, found_inf) -> CastResult:
        return _reference_to_float8(x, dtype, granularity, scale, amax_out, transpose, found_inf)

    def to_float8_pair(self, x, dtype, scale, amax_out, found_inf) -> PairResult:
        return _reference_to_float8_pair(x, dtype, scale, amax_out, found_inf)

    def cast_with_produced_amax(self, x, dtype, amax_scratch, pair):
        return None  # the reference takes its own amax pass


# --------------------------------------------------------------------------------------------------------------------
# The fused producers
# --------------------------------------------------------------------------------------------------------------------


@runtime_checkable
class FusedBackend(dispatch.Backend, Protocol):
    """What each backend of the fused producers (norm, SiLU-up, RoPE) implements, with these signatures and return
    values. Arguments arrive checked (:mod:`ampkernels.float8.fused`), non-empty and contiguous (except rotary's
    ``x``: any strides, [B, H, T, D]). ``scratch`` is None or the zeroed int32 [3] scratch of a tensorwise cast, to
    fill with the amax of the output."""

    #: Whether the fused wrappers let this backend record its output's amax for the next layer's cast
    #: (:func:`ampkernels.float8.fused.produced_amax`), in plain eager mode.
    records_amax: bool

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, scratch: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, D], weight [D] -> (out [M, D] in the promoted dtype, rstd [M] float32); fills ``scratch`` with out's
        amax."""
        ...

    def rms_norm_backward(
        self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (grad_x like x, grad_weight like weight)."""
        ...

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """gate, up of one shape -> silu(gate) * up in the promoted dtype; fills ``scratch`` with its amax."""
        ...

    def silu_mul_backward(
        self, grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (grad_gate like gate, grad_up like up)."""
        ...

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
        """x [B, H, T, D] rotated by the float32 tables [T, D / 2] (``inverse``: by minus the angles)."""
        ...


def _record_torch(out: torch.Tensor, scratch: torch.Tensor | None) -> None:
    """The reference's record of the finite amax and the non-finite flag (what the kernels' atomics compute)."""
    if scratch is None:
        return
    a = out.detach().float().abs()
    finite = torch.isfinite(a)
    amax = torch.where(finite, a, torch.zeros_like(a)).amax() if a.numel() else a.new_zeros(())
    scratch[0:1].view(torch.float32).copy_(torch.maximum(scratch[0:1].view(torch.float32), amax.reshape(1)))
    scratch[1:2].copy_(torch.where(finite.all(), scratch[1:2], torch.ones_like(scratch[1:2])))


def _rms_norm_torch(x, weight, eps, scratch):
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    out = (xf * rstd[:, None]).to(x.dtype) * weight
    _record_torch(out, scratch)
    return out, rstd


def _rms_norm_backward_torch(grad, x, weight, rstd):
    xf, g = x.float(), grad.float()
    normed = (xf * rstd[:, None]).to(x.dtype).float()
    grad_weight = (g * normed).sum(0).to(weight.dtype)
    gn = g * weight.float()
    dot = (gn * xf).sum(-1, keepdim=True)
    grad_x = rstd[:, None] * gn - (rstd**3 / x.shape[-1])[:, None] * dot * xf
    return grad_x.to(x.dtype), grad_weight


class TritonFused(dispatch.TritonBackend):
    module = "ampkernels.float8.triton.fused"
    records_amax = True
    #: The longest norm row the kernels take (a program holds a row); longer rows run on the reference's math.
    max_row = MAX_TRITON_ROW

    def rms_norm(self, x, weight, eps, scratch=None):
        if x.shape[-1] > self.max_row:
            return _rms_norm_torch(x, weight, eps, scratch)
        return self.kernels().rms_norm(x, weight, eps, torch.promote_types(x.dtype, weight.dtype), scratch)

    def rms_norm_backward(self, grad, x, weight, rstd):
        if x.shape[-1] > self.max_row:
            return _rms_norm_backward_torch(grad, x, weight, rstd)
        return self.kernels().rms_norm_backward(grad, x, weight, rstd)

    def silu_mul(self, gate, up, scratch=None):
        return self.kernels().silu_mul(gate, up, torch.promote_types(gate.dtype, up.dtype), scratch)

    def silu_mul_backward(self, grad, gate, up):
        return self.kernels().silu_mul_backward(grad, gate, up)

    def rotary(self, x, cos, sin, inverse):
        return self.kernels().rotary(x, cos, sin, inverse)


class TorchFused(dispatch.TorchBackend):
    """The reference's math; records no amax (the casts after it take their own amax pass)."""

    records_amax = False

    def rms_norm(self, x, weight, eps, scratch=None):
        return _rms_norm_torch(x, weight, eps, scratch)

    def rms_norm_backward(self, grad, x, weight, rstd):
        return _rms_norm_backward_torch(grad, x, weight, rstd)

    def silu_mul(self, gate, up, scratch=None):
        out = reference.silu_mul(gate, up)
        _record_torch(out, scratch)
        return out

    def silu_mul_backward(self, grad, gate, up):
        g, gf, uf = grad.float(), gate.float(), up.float()
        s = torch.sigmoid(gf)
        grad_up = g * gf * s
        grad_gate = g * uf * s * (1.0 + gf * (1.0 - s))
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype)

    def rotary(self, x, cos, sin, inverse):
        half = x.shape[-1] // 2
        s = -sin if inverse else sin
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        # In x's layout, as the kernels write it and the op's fake says (a transposed q/k stays transposed)
        return torch.empty_like(x).copy_(torch.cat((x1 * cos - x2 * s, x1 * s + x2 * cos), dim=-1))


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
