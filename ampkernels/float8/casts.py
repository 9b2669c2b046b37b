"""The FP8 casts: :func:`to_float8` and :func:`to_float8_pair` (argument checks with errors naming the argument,
the ``torch.library`` ops ``ampkernels::to_float8`` / ``ampkernels::to_float8_pair`` with fake implementations, and
the launch on the backend :mod:`ampkernels.dispatch` picks, a :class:`~ampkernels.float8.backends.CastBackend`).
Semantics: :func:`ampkernels.reference.to_float8`.

Backends: ``"native"`` (the op ``ampkernels::to_float8_native``, CUDA kernels in ``csrc/float8/casts.cu``; the
default on CUDA tensors), ``"triton"`` (``ampkernels/float8/triton/casts.py``) and ``"torch"`` (the reference; the
default on CPU tensors). Empty tensors take the reference on any (nothing for a kernel to do).
"""

from __future__ import annotations

import math

import torch

from ampkernels import dispatch
from ampkernels._constants import FLOAT8_DTYPES
from ampkernels._native_fakes import check, native_fake
from ampkernels._runtime import eager_or_op, plain_eager
from ampkernels.float8 import backends as _backends  # noqa: F401  (registers the ops' backends)
from ampkernels.float8 import reference
from ampkernels.float8.reference import FLOAT8_GRANULARITIES

_OP = "to_float8"
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

__all__ = ["to_float8", "to_float8_pair"]


def _error(fn: str, argument: str, message: str) -> ValueError:
    return ValueError(f"ampkernels.{fn}: argument '{argument}': {message}")


def _shape(t: torch.Tensor) -> str:
    return f"[{', '.join(map(str, t.shape))}]"


def _check_tensor(fn: str, name: str, t, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ampkernels.{fn}: argument '{name}': expected a tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise _error(fn, name, f"expected a float32 tensor, got {t.dtype}")
    if t.device != device:
        raise _error(fn, name, f"expected a tensor on {device} (like x), got one on {t.device}")


def _check_per_row(fn: str, name: str, t: torch.Tensor, rows: int | None, granularity: str) -> None:
    """One element (``rows`` None: tensorwise), else [rows, 1] or [rows]."""
    if rows is None:
        if t.numel() != 1:
            raise _error(fn, name, f"expected one element for granularity 'tensor', got shape {_shape(t)}")
    elif tuple(t.shape) not in ((rows, 1), (rows,)):
        raise _error(
            fn,
            name,
            f"expected shape [{rows}, 1] (one per row of the written matrix, granularity 'row'), got {_shape(t)}",
        )


def _check_not_differentiable(fn: str, name: str, t: torch.Tensor) -> None:
    # Written in place by the cast, which autograd does not see (the reference's in-place record refused a leaf
    # that requires grad with an error naming no argument; the kernels wrote it anyway).
    if t.requires_grad:
        raise _error(fn, name, "must not require grad (the cast writes it in place, outside autograd)")


def _checked(fn, x, dtype, granularity, scale, amax_out, transpose, found_inf, backend):
    """The checked call as the op takes it: (x as [M, K] detached, scale flattened to float32 contiguous, the
    backend chosen)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"ampkernels.{fn}: argument 'x': expected a tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise _error(fn, "x", f"expected float32, bfloat16, float16 or float64, got {x.dtype}")
    if x.ndim < 1:
        raise _error(fn, "x", "expected a tensor of at least 1 dimension [..., K], got a 0-d tensor")
    if transpose and x.ndim < 2:
        raise _error(fn, "x", f"transpose needs at least 2 dimensions [..., M, K], got {_shape(x)}")
    if dtype not in FLOAT8_DTYPES:
        raise _error(fn, "dtype", f"expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if granularity not in FLOAT8_GRANULARITIES:
        raise _error(
            fn, "granularity", f"expected one of {', '.join(map(repr, FLOAT8_GRANULARITIES))}, got {granularity!r}"
        )
    if not isinstance(transpose, bool):
        raise TypeError(f"ampkernels.{fn}: argument 'transpose': expected a bool, got {type(transpose).__name__}")
    K = x.shape[-1]
    M = math.prod(x.shape[:-1])
    rows = (K if transpose else M) if granularity == "row" else None
    if scale is not None:
        _check_tensor(fn, "scale", scale, x.device)
        _check_per_row(fn, "scale", scale, rows, granularity)
        scale = scale.reshape(-1).contiguous()
    if amax_out is not None:
        _check_tensor(fn, "amax_out", amax_out, x.device)
        _check_per_row(fn, "amax_out", amax_out, rows, granularity)
        if not amax_out.is_contiguous():
            raise _error(fn, "amax_out", f"must be contiguous (written in place), got strides {amax_out.stride()}")
        _check_not_differentiable(fn, "amax_out", amax_out)
    if found_inf is not None:
        _check_tensor(fn, "found_inf", found_inf, x.device)
        if found_inf.numel() != 1:
            raise _error(fn, "found_inf", f"expected one element, got shape {_shape(found_inf)}")
        _check_not_differentiable(fn, "found_inf", found_inf)
    chosen = dispatch.choose(_OP, x.device, dispatch.check_backend(_OP, backend))
    x2 = x.detach()  # a cast is not differentiable (Float8Linear defines the gradients)
    if x2.dtype == torch.float64:  # before any backend: each then sees the same float32 tensor
        x2 = reference.saturate_to_float32(x2)
    x2 = x2 if x2.ndim == 2 else x2.reshape(M, K)
    return x2, scale, chosen


# --------------------------------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("ampkernels::to_float8", mutates_args=("amax_out", "found_inf"))
def _to_float8_op(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    scale: torch.Tensor | None,
    amax_out: torch.Tensor | None,
    transpose: bool,
    found_inf: torch.Tensor | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (data [M, K] or [K, M], scale_inv: 0-d or [R, 1]); may update amax_out and set found_inf."""
    return dispatch.backend(_OP, backend).to_float8(x, dtype, granularity, scale, amax_out, transpose, found_inf)


@_to_float8_op.register_fake
def _(x, dtype, granularity, scale, amax_out, transpose, found_inf, backend):
    M, K = x.shape
    data = x.new_empty((K, M) if transpose else (M, K), dtype=dtype)
    scale_shape = ((K if transpose else M), 1) if granularity == "row" else ()
    return data, x.new_empty(scale_shape, dtype=torch.float32)


@torch.library.custom_op("ampkernels::to_float8_pair", mutates_args=("amax_out", "found_inf"))
def _to_float8_pair_op(
    x: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor | None,
    amax_out: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (data [M, K], data_t [K, M], scale_inv 0-d); may update amax_out and set found_inf."""
    return dispatch.backend(_OP, backend).to_float8_pair(x, dtype, scale, amax_out, found_inf)


@_to_float8_pair_op.register_fake
def _(x, dtype, scale, amax_out, found_inf, backend):
    M, K = x.shape
    return x.new_empty((M, K), dtype=dtype), x.new_empty((K, M), dtype=dtype), x.new_empty((), dtype=torch.float32)


def _check_vector(t, arg: str, x, count, contiguous: bool) -> None:
    if t is None:
        return
    check(t.dtype == torch.float32, arg, lambda: f"expected a float32 tensor, got {t.dtype}")
    check(t.device == x.device, arg, lambda: f"expected a tensor on {x.device}, got one on {t.device}")
    check(t.numel() == count, arg, lambda: f"expected {count} elements, got {t.numel()}")
    check(not contiguous or t.is_contiguous(), arg, lambda: f"must be contiguous, got strides {t.stride()}")


@native_fake("to_float8_native")
def _to_float8_native_fake(x, dtype, per_row, write_data, write_t, scale, amax_out, found_inf, amax_scratch):
    check(
        x.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64),
        "x",
        lambda: f"expected float32, bfloat16, float16 or float64, got {x.dtype}",
    )
    check(x.dim() == 2, "x", lambda: f"expected a 2-D tensor [M, K], got {x.dim()} dimensions")
    check(x.numel() > 0, "x", lambda: f"expected at least one element, got shape {list(x.shape)}")
    check(dtype in FLOAT8_DTYPES, "dtype", lambda: f"expected float8_e4m3fn or float8_e5m2, got {dtype}")
    check(write_data or write_t, "write_data", "nothing to write: write_data and write_t are both false")
    check(not (per_row and write_data and write_t), "per_row", "the pair (both layouts) is tensorwise only")
    M, K = x.shape
    count = (K if write_t else M) if per_row else 1
    _check_vector(scale, "scale", x, count, True)
    _check_vector(amax_out, "amax_out", x, count, True)
    _check_vector(found_inf, "found_inf", x, 1, False)
    if amax_scratch is not None:
        check(not per_row and scale is None, "amax_scratch", "only for tensorwise current scaling")
        check(
            amax_scratch.dtype == torch.int32 and amax_scratch.numel() == 3 and amax_scratch.is_contiguous(),
            "amax_scratch",
            "expected a contiguous int32 tensor of 3 elements",
        )
        check(amax_scratch.device == x.device, "amax_scratch", lambda: f"expected a tensor on {x.device}")
    data = x.new_empty((M, K) if write_data else (0,), dtype=dtype)
    data_t = x.new_empty((K, M) if write_t else (0,), dtype=dtype)
    scale_inv = x.new_empty(((K if write_t else M), 1) if per_row else (), dtype=torch.float32)
    return data, data_t, scale_inv


# --------------------------------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------------------------------


def to_float8(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "tensor",
    *,
    scale: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    transpose: bool = False,
    found_inf: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` cast to float8 with a float32 scale, ``x ≈ data.float() * scale_inv``, without a host sync.

    Args:
        x: [..., K] float32, bfloat16, float16 (or float64: taken in float32, finite values beyond its range
            saturated to its largest), any strides; the batch dimensions are flattened: the cast writes the [M, K]
            matrix ``x.reshape(-1, K)``, or its transpose [K, M] with ``transpose``.
        dtype: ``torch.float8_e4m3fn`` (forward operands) or ``torch.float8_e5m2`` (gradients).
        granularity: ``"tensor"`` (one scale) or ``"row"`` (one per row of the written matrix: per row of x, or per
            column of x with ``transpose``).
        scale: delayed scaling: the float32 scale to use, on x's device (one element, or [R, 1] per row). ``None``:
            current scaling, ``float8_max(dtype) / max(amax, 1e-12)`` computed on the device from this tensor's amax
            (1.0 where the amax is not finite).
        amax_out: float32 on x's device, the amax's shape (one element, or [R, 1]): becomes ``max(amax_out, amax)``
            when the amax is finite, left alone otherwise (the record delayed scaling keeps). Contiguous.
        transpose: write ``x.T`` ([K, M] contiguous: the layout the backward's GEMMs read).
        found_inf: float32, one element: set to 1.0 when x holds an inf or NaN; never cleared (the flag the fused
            optimizers skip a step on).
        backend: ``"native"`` (CUDA C++), ``"triton"`` or ``"torch"`` (the reference); default:
            :mod:`ampkernels.dispatch`'s choice (native on CUDA tensors).

    Returns ``(data, scale_inv)``: data contiguous in ``dtype``; scale_inv = 1 / scale, float32, 0-d or [R, 1] (the
    dequantization factor ``torch._scaled_mm`` takes). Is equivalent, bit for bit, to ``amax = x.abs().amax();
    scale = 448 / amax; data = (x.float() * scale).clamp(-448, 448).to(dtype)`` with the NaN, floor and non-finite
    rules of :func:`ampkernels.reference.to_float8`.
    """
    fn = "to_float8"
    x2, scale, chosen = _checked(fn, x, dtype, granularity, scale, amax_out, transpose, found_inf, backend)
    args = (x2, dtype, granularity, scale, amax_out, transpose, found_inf)
    return eager_or_op(chosen.to_float8, torch.ops.ampkernels.to_float8, args, chosen.name, (amax_out, found_inf))


def cast_with_produced_amax(
    x: torch.Tensor, dtype: torch.dtype, amax_scratch: torch.Tensor, pair: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """Tensorwise current-scaling cast of a [M, K] ``x`` whose producer (:mod:`ampkernels.float8.fused`) recorded
    its amax in ``amax_scratch``: ``(data, data_t or None, scale_inv)`` equal, bit for bit, to :func:`to_float8_pair`
    (``pair``) or :func:`to_float8`, without their amax pass. None where that does not apply (the reference backend,
    a traced call): the caller casts as usual."""
    chosen = dispatch.choose(_OP, x.device)
    if not plain_eager(x):
        return None
    return chosen.cast_with_produced_amax(x, dtype, amax_scratch, pair)


def to_float8_pair(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    scale: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tensorwise cast of ``x`` ([..., M, K], at least 2-D) written in both layouts from one read: ``(data [M,
    K], data_t [K, M], scale_inv)``, equal to :func:`to_float8` with ``transpose`` False and True (the forward GEMM
    reads one, the backward the other). Arguments as :func:`to_float8` (tensorwise)."""
    fn = "to_float8_pair"
    if isinstance(x, torch.Tensor) and x.ndim < 2:
        raise _error(fn, "x", f"expected at least 2 dimensions [..., M, K], got {_shape(x)}")
    x2, scale, chosen = _checked(fn, x, dtype, "tensor", scale, amax_out, False, found_inf, backend)
    args = (x2, dtype, scale, amax_out, found_inf)
    op = torch.ops.ampkernels.to_float8_pair
    return eager_or_op(chosen.to_float8_pair, op, args, chosen.name, (amax_out, found_inf))
