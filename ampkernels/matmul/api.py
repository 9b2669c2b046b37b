"""The public scaled_matmul API: :func:`scaled_matmul` (checks every argument, errors name it; applies autocast like
``aten::mm``; normalizes the scale to one of four modes; flattens ``a``'s batch dimensions; picks a backend through
:mod:`ampkernels.dispatch`) and :class:`ScaledLinear`, a drop-in ``torch.nn.Linear`` running on it.

Backends: ``"triton"`` (``ampkernels/matmul/triton/scaled_matmul.py``), ``"wgmma"`` (the native op
``ampkernels::scaled_matmul_wgmma_``: Hopper only, in a build for sm_90a), ``"wmma"`` (the native op
``ampkernels::scaled_matmul_wmma_``, sm_75 and newer), ``"torch"`` (:func:`ampkernels.reference.scaled_matmul`, also
the only backend for float32/float64 operands) and, the default on Hopper, ``"auto"``: Triton or wgmma per problem
(:func:`ampkernels.matmul.launch.auto_backend`).

Float8 operands (:func:`_scaled_matmul_float8`) have their own checks, backends (``"auto"``, ``"triton"``,
``"wgmma"``: the native op ``ampkernels::scaled_matmul_fp8_wgmma_``, ``"cublas"``: ``torch._scaled_mm``,
``"torch"``: :func:`ampkernels.reference.scaled_matmul_float8`; op ``"scaled_matmul_float8"`` of
:mod:`ampkernels.dispatch`) and per-signature cache (:class:`_Float8Call`).
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from ampkernels import dispatch
from ampkernels._constants import FLOAT8_DTYPES, SCALE_COL, SCALE_NONE, SCALE_ROW, SCALE_TENSOR
from ampkernels._modules import buffers_keep_dtype
from ampkernels._runtime import capturing, eager_or_op, plain_eager
from ampkernels.matmul import launch as matmul_dispatch
from ampkernels.matmul import library as _library  # noqa: F401  (registers the torch.library ops)
from ampkernels.matmul.launch import launch_float8

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

__all__ = ["ScaledLinear", "clear_caches", "scaled_matmul", "select_backend"]


def select_backend(device: torch.device, backend: str | None = None) -> str:
    """``dispatch.select("scaled_matmul", device, backend)``: the backend a call on ``device`` runs."""
    return dispatch.select("scaled_matmul", device, backend)


# --------------------------------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------------------------------


def _error(argument: str, message: str) -> ValueError:
    return ValueError(f"ampkernels.scaled_matmul: argument '{argument}': {message}")


def _shape(t: torch.Tensor) -> str:
    return f"[{', '.join(map(str, t.shape))}]"


def _normalize_scale(scale, a: torch.Tensor, out_shape: tuple[int, ...], compute: torch.dtype):
    """(alpha, scale tensor or None, mode) for ``scale * (a @ b)`` broadcasting rules; see :func:`scaled_matmul`."""
    if scale is None:
        return 1.0, None, SCALE_NONE
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        return float(scale), None, SCALE_NONE
    if not isinstance(scale, torch.Tensor):
        raise TypeError(
            f"ampkernels.scaled_matmul: argument 'scale': expected a float or a tensor, got {type(scale).__name__}"
        )
    if not scale.is_floating_point():
        raise _error("scale", f"expected a floating-point tensor, got {scale.dtype}")
    if scale.device != a.device:
        if scale.device.type == "cpu" and scale.ndim == 0:
            scale = scale.to(a.device, non_blocking=True)  # like a CPU 0-d tensor in `scale * (a @ b)`
        else:
            raise _error("scale", f"expected a tensor on {a.device} (like a), got one on {scale.device}")
    scale = scale.to(compute)
    M, N = math.prod(out_shape[:-1]), out_shape[-1]
    rows_shape = (*out_shape[:-1], 1)
    if scale.ndim > len(out_shape):
        raise _error("scale", f"shape {_shape(scale)} has more dimensions than the output {list(out_shape)}")
    if scale.numel() == 1:
        return 1.0, scale.reshape(()), SCALE_TENSOR
    if tuple(scale.shape) == rows_shape:  # (contiguous: the kernels read scale_ptr + row)
        return 1.0, scale.reshape(M).contiguous(), SCALE_ROW
    if scale.shape[-1] == N and all(size == 1 for size in scale.shape[:-1]):
        return 1.0, scale.reshape(N).contiguous(), SCALE_COL
    hint = ""
    if scale.ndim == 1 and scale.shape[0] == M:
        hint = f"; a 1-D scale broadcasts along the columns (length N={N}): pass shape {list(rows_shape)} per row"
    raise _error(
        "scale",
        f"shape {_shape(scale)} is not one of: a single element, per row {list(rows_shape)}, per column [{N}] "
        f"(output {list(out_shape)}){hint}",
    )


def _check_found_inf(found_inf, device):
    if found_inf is None:
        return
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"ampkernels.scaled_matmul: argument 'found_inf': expected a tensor, got {type(found_inf)}")
    if found_inf.dtype != torch.float32 or found_inf.numel() != 1:
        raise _error("found_inf", f"expected a 1-element float32 tensor, got {found_inf.dtype} {_shape(found_inf)}")
    if found_inf.device != device:
        raise _error("found_inf", f"expected a tensor on {device}, got one on {found_inf.device}")


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 1)
    return start, start + (extent + 1) * t.element_size()


def _overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    (x0, x1), (y0, y1) = _byte_range(x), _byte_range(y)
    return x0 < y1 and y0 < x1 and x.device == y.device


def _check_amax_out(amax_out, device):
    if amax_out is None:
        return
    if not isinstance(amax_out, torch.Tensor):
        raise TypeError(f"ampkernels.scaled_matmul: argument 'amax_out': expected a tensor, got {type(amax_out)}")
    if amax_out.dtype != torch.float32 or amax_out.numel() != 1:
        raise _error("amax_out", f"expected a 1-element float32 tensor, got {amax_out.dtype} {_shape(amax_out)}")
    if amax_out.device != device:
        raise _error("amax_out", f"expected a tensor on {device}, got one on {amax_out.device}")


def _check_operands(a, b) -> None:
    """Shapes and devices of a [..., M, K] and b [K, N] (dtypes are checked per path)."""
    if a.ndim < 2:
        raise _error("a", f"expected a tensor of at least 2 dimensions [..., M, K], got {_shape(a)}")
    if b.ndim != 2:
        raise _error("b", f"expected a 2-D tensor [K, N], got {_shape(b)}")
    if a.shape[-1] != b.shape[0]:
        raise _error("b", f"inner dimensions differ: a is {_shape(a)} (K={a.shape[-1]}), b is {_shape(b)}")
    if b.device != a.device:
        raise _error("b", f"expected a tensor on {a.device} (like a), got one on {b.device}")


def _check_bias(bias, N: int, device, compute, operand_dtype):
    """``bias`` [N] contiguous, converted to ``compute`` unless it is already that or ``operand_dtype``."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"ampkernels.scaled_matmul: argument 'bias': expected a tensor, got {type(bias)}")
    if bias.shape != (N,):
        raise _error("bias", f"expected shape [{N}], got {_shape(bias)}")
    if not bias.is_floating_point():
        raise _error("bias", f"expected a floating-point tensor, got {bias.dtype}")
    if bias.device != device:
        raise _error("bias", f"expected a tensor on {device} (like a), got one on {bias.device}")
    if bias.dtype not in (compute, operand_dtype):
        bias = bias.to(compute)
    return bias.contiguous()


def _check_out(out, expected_shape, out_dtype, device, others):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"ampkernels.scaled_matmul: argument 'out': expected a tensor, got {type(out).__name__}")
    if tuple(out.shape) != expected_shape:
        raise _error("out", f"expected shape {list(expected_shape)}, got {_shape(out)}")
    if out.dtype != out_dtype:
        raise _error("out", f"expected dtype {out_dtype} (out_dtype), got {out.dtype}")
    if out.device != device:
        raise _error("out", f"expected a tensor on {device}, got one on {out.device}")
    # NOTE: the memory checks read data pointers, which fake tensors lack: torch.compile would break the graph on
    # them (fullgraph=True: fail). A contiguous tensor has no internal overlap, and what out= aliases in a traced
    # graph is for functionalization to see.
    tracing = torch.compiler.is_compiling()
    if not tracing and torch._debug_has_internal_overlap(out) != 0:
        raise _error("out", "has internally overlapping memory (e.g. an expanded tensor)")
    if not out.is_contiguous():
        raise _error("out", f"must be contiguous (row-major), got strides {out.stride()}")
    if tracing:
        return
    for name, other in others.items():
        if isinstance(other, torch.Tensor) and _overlaps(out, other):
            raise _error("out", f"overlaps argument '{name}' in memory")


# (Over 80 lines: most of it is the docstring, the op's contract.)
def scaled_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float | torch.Tensor | None = None,
    *,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    found_inf: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``scale * (a @ b) + bias`` with fp32 accumulation and the scale, bias and checks in the kernel's epilogue.

    Args:
        a: [..., M, K] float16 or bfloat16, any strides (batch dimensions are flattened into M rows); or float8
            (see below).
        b: [K, N], same dtype as ``a``, any strides (``w.t()`` of a Linear weight is read as is).
        scale: a Python float (host constant), or a float tensor on a's device (float32 after conversion; a 0-d
            CPU tensor is copied over): one element (no host sync), per row: shape ``a.shape[:-1] + (1,)`` (e.g.
            (M, 1)), or per column: (N,) / (1, N). These are exactly the shapes for which ``scale * (a @ b)``
            broadcasts without growing the output; anything else (e.g. a 1-D tensor of length M ≠ N, which would
            broadcast along columns) raises. ``None`` means 1.
        bias: [N], any float dtype (added in fp32).
        out_dtype: float16, bfloat16 or float32; default ``out.dtype`` if ``out`` is given, else ``a.dtype``.
        out: [..., M, N] contiguous tensor to write (must not overlap the inputs).
        accumulate: add into ``out`` (required) instead of overwriting it: ``out += scale * (a @ b) + bias``,
            computed in fp32 from the old value (gradient accumulation into fp32 buffers).
        found_inf: float32, 1 element: set to 1.0 when any output element as stored is inf/NaN (also from
            overflow in the cast to fp16); never cleared. Computed in the epilogue, no extra pass, no host sync.
        amax_out: float32, 1 element: becomes ``max(amax_out, max |out as stored|)``, NaN-propagating (a NaN in
            the output makes it NaN); in the Triton epilogue an atomic max, other backends add a torch pass. The
            amax the next layer's float8 cast needs. Not with autograd.
        scale_a, scale_b: float8 operands only (see below).
        backend: "auto", "triton", "wgmma", "wmma" or "torch" (the reference); float8: "auto", "triton", "wgmma",
            "cublas" or "torch"; default: the op's choice in :mod:`ampkernels.dispatch` (``python -m
            ampkernels.info`` shows it).

    Float8 operands (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, not both e5m2, which cuBLAS refuses too):
    ``out = ((a.float() @ b.float()) * scale_a * scale_b * scale + bias).to(out_dtype)``
    (:func:`ampkernels.reference.scaled_matmul_float8`), with ``scale_a`` (float32: one element, or per row of a:
    ``[M, 1]`` / ``a.shape[:-1] + (1,)``) and ``scale_b`` (float32: one element, or per column of b: ``[1, N]`` /
    ``[N]``) the dequantization factors of ``torch._scaled_mm`` (None means 1); ``out_dtype`` defaults to
    ``out.dtype``, else bfloat16. Fast with a row-major and b column-major (b = ``w8.t()`` of a [N, K] weight);
    other layouts are copied to that one first. Float8 tensors take no part in autograd: an argument that requires
    grad raises (``ampkernels.float8.Float8Linear`` has its own autograd). Autocast leaves float8 operands alone.

    Returns ``out`` (or a new [..., M, N] tensor). Is equivalent to
    ``(scale * (a.float() @ b.float()) + bias).to(out_dtype)`` (with ``out += ...`` for ``accumulate``).

    Under autocast (``torch.autocast``) ``a`` and ``b`` are cast to the autocast dtype like ``aten::mm`` does
    (float64 operands are left alone); the scale, bias, flag and an explicit ``out``/``out_dtype`` are left alone.
    float32/float64 operands run only on ``backend="torch"`` (the reference, computing in their precision),
    otherwise they raise.

    Autograd (not with ``out``/``accumulate``): grads of a, b through the same kernels (the scale applied to both),
    bias grad = Σ rows of grad_out, and the gradient of a scale tensor that requires grad (one extra matmul).
    """
    key = None
    if type(a) is torch.Tensor and type(b) is torch.Tensor and not torch.compiler.is_compiling():
        if a.dtype in FLOAT8_DTYPES:
            key = _float8_key(a, b, scale, scale_a, scale_b, bias, out_dtype, out, accumulate, found_inf, amax_out)
            key = (key, backend)
            entry = _FLOAT8_CALLS.get(key)
            if entry is not None:
                result = entry.run(a, b, scale, scale_a, scale_b, bias, out, found_inf, amax_out)
                if result is not None:
                    return result
            return _scaled_matmul_float8(
                a, b, scale, scale_a, scale_b, bias, out_dtype, out, accumulate, found_inf, amax_out, backend, key
            )
        if scale_a is None and scale_b is None and amax_out is None:
            key = _call_key(a, b, scale, bias, out_dtype, out, accumulate, found_inf, backend)
            entry = _CALLS.get(key)
            if entry is not None:
                result = entry.run(a, b, scale, bias, out, found_inf)
                if result is not None:
                    return result
    result = _scaled_matmul_checked(
        a, b, scale, bias, out_dtype, out, accumulate, found_inf, backend, key, scale_a, scale_b, amax_out
    )
    return result


# (Over 80 lines: every argument check of scaled_matmul in one place, in the order the errors must come, before
# anything is allocated or launched.)
def _scaled_matmul_checked(
    a, b, scale, bias, out_dtype, out, accumulate, found_inf, backend, key, scale_a=None, scale_b=None, amax_out=None
):
    """Every check, then the launch; caches a :class:`_Call` under ``key`` when the call qualifies."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        bad = "a" if not isinstance(a, torch.Tensor) else "b"
        raise TypeError(f"ampkernels.scaled_matmul: argument '{bad}': expected a tensor")
    if a.dtype in FLOAT8_DTYPES:
        return _scaled_matmul_float8(
            a, b, scale, scale_a, scale_b, bias, out_dtype, out, accumulate, found_inf, amax_out, backend, None
        )
    for name, factor in (("scale_a", scale_a), ("scale_b", scale_b)):
        if factor is not None:
            raise _error(name, f"dequantization factors go with float8 operands; a is {a.dtype} (use 'scale')")
    if torch.is_autocast_enabled(a.device.type):
        # like aten::mm: each operand eligible for autocast (floating point, not float64) is cast
        cast = torch.get_autocast_dtype(a.device.type)
        a, b = (t.to(cast) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (a, b))
    _check_operands(a, b)
    if b.dtype != a.dtype:
        raise _error("b", f"expected dtype {a.dtype} (like a), got {b.dtype}")

    chosen = dispatch.choose("scaled_matmul", a.device, backend)
    # float32/float64 operands are accepted only when the reference is asked for by name: by default they are
    # most likely a missing autocast, and silently running an fp32 matmul would hide that.
    wide_ok = chosen.wide_operands and dispatch.requested("scaled_matmul", backend)[0] is not None
    allowed = KERNEL_DTYPES + ((torch.float32, torch.float64) if wide_ok else ())
    if a.dtype not in allowed:
        hint = "" if wide_ok else "; cast, use torch.autocast, or pass backend='torch' for float32/float64"
        raise _error("a", f"expected float16 or bfloat16, got {a.dtype}{hint}")
    compute = torch.float64 if a.dtype == torch.float64 else torch.float32

    if out_dtype is None:
        out_dtype = out.dtype if isinstance(out, torch.Tensor) else a.dtype
    out_allowed = OUT_DTYPES + ((torch.float64,) if wide_ok else ())
    if out_dtype not in out_allowed:
        raise _error("out_dtype", f"expected one of float16, bfloat16, float32, got {out_dtype}")
    out_shape = (*a.shape[:-1], b.shape[1])
    M, K, N = math.prod(a.shape[:-1]), b.shape[0], b.shape[1]

    alpha, scale_t, mode = _normalize_scale(scale, a, out_shape, compute)
    caller_bias = bias
    bias = _check_bias(bias, N, a.device, compute, a.dtype)
    _check_found_inf(found_inf, a.device)
    _check_amax_out(amax_out, a.device)
    if accumulate and out is None:
        raise _error("accumulate", "accumulate=True adds into `out`, which is missing")
    if out is not None:
        others = {"a": a, "b": b, "scale": scale_t, "bias": bias, "found_inf": found_inf, "amax_out": amax_out}
        _check_out(out, out_shape, out_dtype, a.device, others)
        if out.requires_grad and torch.is_grad_enabled():
            # Writing into it would drop its gradient history without a trace (torch's out= ops refuse too).
            raise _error("out", "requires grad: out=/accumulate= do not support autograd; call without out=")

    a2 = a if a.ndim == 2 else a.reshape(M, K)
    tensors = (a, b, scale_t, bias)
    needs_grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
    if needs_grad:
        if out is not None:
            raise _error("out", "out=/accumulate= do not support autograd (an input requires grad)")
        if amax_out is not None:
            raise _error("amax_out", "is not supported with autograd (an input requires grad); call without it")
        result, flag = torch.ops.ampkernels.scaled_mm(
            a2, b, scale_t, mode, alpha, bias, out_dtype, found_inf is not None, chosen.name
        )
        if found_inf is not None:
            torch.maximum(found_inf.reshape(1), flag, out=found_inf.view(1))
        return result.view(out_shape)
    if amax_out is not None:  # the op with the amax epilogue (no cached signature: not a hot path for 16 bits)
        if out is None:
            out = torch.empty(out_shape, dtype=out_dtype, device=a.device)
        _launch_float8_op(
            chosen.name, a2, b, None, None, scale_t, mode, alpha, bias, out, accumulate, found_inf, amax_out
        )
        return out
    result = torch.empty(out_shape, dtype=out_dtype, device=a.device) if out is None else out
    out2 = result.view(M, N)
    autocasting = torch.is_autocast_enabled(a.device.type)
    if key is not None and not autocasting and plain_eager(a2, b, scale_t, bias, out, found_inf):
        # the caller's bias: later calls of the signature hand it to the kernel as they get it (when it passes
        # make's rule, it is the checked bias itself)
        entry = _Call.make(
            a, a2, b, scale, scale_t, mode, alpha, caller_bias, out_dtype, out, out2, accumulate, found_inf, chosen,
            out_shape,
        )  # fmt: skip
        if entry is not None:
            if len(_CALLS) >= _MAX_CACHED:
                _CALLS.clear()
            _CALLS[key] = entry
    # NOTE: the custom-op dispatcher costs as much host time per call as a 1024^3 matmul takes on the GPU
    # (dev/matmul/NOTES.md): plain eager tensors launch directly (eager_or_op).
    args = (a2, b, scale_t, mode, alpha, bias, out2, accumulate, found_inf)
    eager_or_op(chosen.launch, torch.ops.ampkernels.scaled_mm_, args, chosen.name, (out2, found_inf))
    return result


# --------------------------------------------------------------------------------------------------------------------
# Per-signature cache of the checked call
# --------------------------------------------------------------------------------------------------------------------

# NOTE: the checks, backend choice and scale normalization cost more host time per call than a 768-wide transformer
# matmul takes on the GPU (dev/matmul/NOTES.md, "Host path per call"). Their outcome depends only on what _call_key
# collects, so a call whose key was checked once skips straight to the launch; only what depends on the data
# pointers (overlap of `out` with the inputs) and the global modes (grad, autocast, tracing) is checked per call. The
# AMPKERNELS_*BACKEND variables and the switches of ampkernels.matmul.tuning are read when a signature is first
# seen: call clear_caches() after changing them.
_CALLS: dict[tuple, _Call] = {}
_MAX_CACHED = 4096


def clear_caches() -> None:
    """Forgets the cached call signatures, "auto" choices and Triton launchers, and hands the native kernels'
    switches to the extension: call it after changing the ``AMPKERNELS_*BACKEND`` variables or a switch of
    :mod:`ampkernels.matmul.tuning` (or ``TMA_DESCRIPTORS`` / ``DIRECT_LAUNCH`` of the Triton matmul)."""
    _CALLS.clear()
    _FLOAT8_CALLS.clear()
    matmul_dispatch.clear_caches()


def _tensor_key(t):
    if t is None:
        return None
    if type(t) is not torch.Tensor:
        return type(t)  # floats (and anything else: a key the slow path never caches)
    return (t.dtype, t.device, t.shape, t.stride())


def _call_key(a, b, scale, bias, out_dtype, out, accumulate, found_inf, backend) -> tuple:
    # 16-byte alignment of every pointer: it decides TMA eligibility and Triton specializes pointers on it.
    aligned = (
        not a.data_ptr() & 15,
        not b.data_ptr() & 15,
        type(scale) is not torch.Tensor or not scale.data_ptr() & 15,
        bias is None or type(bias) is not torch.Tensor or not bias.data_ptr() & 15,
        type(out) is not torch.Tensor or not out.data_ptr() & 15,
        type(found_inf) is not torch.Tensor or not found_inf.data_ptr() & 15,
    )
    return (
        a.dtype,
        a.device,
        a.shape,
        a.stride(),
        b.dtype,
        b.device,
        b.shape,
        b.stride(),
        _tensor_key(scale),
        _tensor_key(bias),
        out_dtype,
        _tensor_key(out),
        accumulate,
        _tensor_key(found_inf),
        backend,
        aligned,
    )


def _extent(t) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    start, end = _byte_range(t)
    return end - start


class _Call:
    """A checked call signature: what :func:`scaled_matmul` derives from its arguments' metadata, kept so that the
    next call with the same metadata only launches. Made only for plain eager 16-bit calls without autograd or
    autocast, with a Python number / None scale or a float32 scale tensor on a's device that the kernels read as
    is (no conversion copy), and a contiguous bias of float32 or a's dtype (``bias`` as the caller passed it: the
    cached call reads it as is, with no conversion or copy)."""

    __slots__ = (
        "backend",
        "M",
        "K",
        "N",
        "out_shape",
        "out_dtype",
        "mode",
        "scale_shape",
        "accumulate",
        "extents",
        "launcher",
    )

    @classmethod
    def make(
        cls, a, a2, b, scale, scale_t, mode, alpha, bias, out_dtype, out, out2, accumulate, found_inf, backend,
        out_shape,
    ):  # fmt: skip
        """``out``: as the caller passed it (None or a tensor); ``a2``, ``out2``: the 2-D views the launch takes;
        ``backend``: the chosen one (:class:`~ampkernels.matmul.backends.MatmulBackend`), "auto" resolved here."""
        if a.dtype not in KERNEL_DTYPES or type(scale) not in (float, int, type(None), torch.Tensor):
            return None
        if isinstance(scale, torch.Tensor) and not (
            scale.dtype == torch.float32 and scale.device == a.device and scale_t.data_ptr() == scale.data_ptr()
        ):
            return None  # converted or copied per call
        if bias is not None and (bias.dtype not in (torch.float32, a.dtype) or not bias.is_contiguous()):
            return None
        if capturing():
            return None  # what a capture settles is provisional ("auto" and Triton configs are timed outside)
        call = cls()
        call.M, call.K, call.N = math.prod(a.shape[:-1]), b.shape[0], b.shape[1]
        call.out_shape, call.out_dtype, call.mode, call.accumulate = out_shape, out_dtype, mode, bool(accumulate)
        call.scale_shape = None if scale_t is None else tuple(scale_t.shape)
        # byte extents of out and of the tensors it must not overlap (a, b, scale, bias, found_inf)
        call.extents = (_extent(out), tuple(_extent(t) for t in (a, b, scale, bias, found_inf)))
        call.launcher = None
        if call.M > 0 and call.N > 0 and call.K > 0:
            backend = backend.resolve(a2, b, scale_t, mode, alpha, bias, out2, accumulate, found_inf)
            call.launcher = backend.direct_launcher(a2, b, scale_t, mode, bias, out2, accumulate, found_inf)
        call.backend = backend
        return call

    def run(self, a, b, scale, bias, out, found_inf):
        """Launches; None when the call needs the checked path (autograd, autocast, tracing, an overlap error)."""
        scale_is_tensor = type(scale) is torch.Tensor
        if torch.is_grad_enabled() and (
            a.requires_grad
            or b.requires_grad
            or (out is not None and out.requires_grad)
            or (bias is not None and bias.requires_grad)
            or (scale_is_tensor and scale.requires_grad)
        ):
            return None
        if torch.is_autocast_enabled(a.device.type) or not plain_eager():
            return None
        launcher = self.launcher
        if scale_is_tensor:
            alpha, scale_t = 1.0, (scale if launcher is not None else scale.view(self.scale_shape))
        else:
            alpha, scale_t = (1.0 if scale is None else float(scale)), None
        M, K, N = self.M, self.K, self.N
        a2 = a if a.ndim == 2 else a.reshape(M, K)
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=a.device)
        else:
            out_extent, extents = self.extents
            out_start = out.data_ptr()
            for other, extent in zip((a, b, scale, bias, found_inf), extents):
                if extent and out_extent:
                    start = other.data_ptr()
                    if start < out_start + out_extent and out_start < start + extent:
                        return None  # the checked path raises the error naming the argument
            torch.autograd.graph.increment_version(out)
        out2 = out if out.ndim == 2 else out.view(M, N)
        if launcher is not None:
            launcher(a2, b, scale_t, alpha, bias, out2, found_inf)
        else:
            self.backend.launch(a2, b, scale_t, self.mode, alpha, bias, out2, self.accumulate, found_inf)
        if found_inf is not None:
            torch.autograd.graph.increment_version(found_inf)
        return out


# --------------------------------------------------------------------------------------------------------------------
# Float8 operands
# --------------------------------------------------------------------------------------------------------------------


def _check_factor(argument: str, factor, a: torch.Tensor, length: int, shapes: tuple[tuple[int, ...], ...]):
    """A dequantization factor (scale_a / scale_b): float32 on a's device, one element (returned as is: the kernels
    read its first element) or one of ``shapes`` (returned as a contiguous [length] vector)."""
    if factor is None:
        return None
    if not isinstance(factor, torch.Tensor):
        raise TypeError(
            f"ampkernels.scaled_matmul: argument '{argument}': expected a tensor, got {type(factor).__name__}"
        )
    if factor.dtype != torch.float32:
        raise _error(argument, f"expected a float32 tensor (as torch._scaled_mm takes), got {factor.dtype}")
    if factor.device != a.device:
        raise _error(argument, f"expected a tensor on {a.device} (like a), got one on {factor.device}")
    if factor.numel() == 1:
        return factor
    if tuple(factor.shape) in shapes:
        return factor.reshape(length).contiguous()
    allowed = " or ".join(str(list(shape)) for shape in dict.fromkeys(shapes))
    raise _error(argument, f"shape {_shape(factor)} is not a single element or {allowed}")


def _launch_float8_op(name, a2, b, scale_a, scale_b, scale_t, mode, alpha, bias, out, accumulate, found_inf, amax_out):
    """:func:`launch_float8` directly for plain eager tensors (bumping the version counters the op would), else
    through ``ampkernels::scaled_mm_fp8_`` (tracing, compile, modes, subclasses)."""
    M, N = a2.shape[0], b.shape[1]
    out2 = out.view(M, N)
    if torch.is_autocast_enabled(a2.device.type):  # the torch ops of the reference and of the cuBLAS epilogue
        with torch.autocast(a2.device.type, enabled=False):
            return _launch_float8_op(
                name, a2, b, scale_a, scale_b, scale_t, mode, alpha, bias, out, accumulate, found_inf, amax_out
            )
    args = (a2, b, scale_a, scale_b, scale_t, mode, alpha, bias, out2, accumulate, found_inf, amax_out)
    launch = functools.partial(launch_float8, name)
    eager_or_op(launch, torch.ops.ampkernels.scaled_mm_fp8_, args, name, (out2, found_inf, amax_out))


def _scaled_matmul_float8(
    a, b, scale, scale_a, scale_b, bias, out_dtype, out, accumulate, found_inf, amax_out, backend, key
):
    """Every check of a call with float8 operands, then the launch; caches a :class:`_Float8Call` under ``key``."""
    if not isinstance(b, torch.Tensor):
        raise TypeError("ampkernels.scaled_matmul: argument 'b': expected a tensor")
    _check_operands(a, b)
    if b.dtype not in FLOAT8_DTYPES:
        raise _error("b", f"expected a float8 tensor (a is {a.dtype}), got {b.dtype}")
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise _error("b", "float8_e5m2 x float8_e5m2 is not supported (cuBLAS refuses it too): one of a, b e4m3fn")
    chosen = dispatch.choose("scaled_matmul_float8", a.device, backend)
    if out_dtype is None:
        out_dtype = out.dtype if isinstance(out, torch.Tensor) else torch.bfloat16
    if out_dtype not in OUT_DTYPES:
        raise _error("out_dtype", f"expected one of float16, bfloat16, float32, got {out_dtype}")
    out_shape = (*a.shape[:-1], b.shape[1])
    M, K, N = math.prod(a.shape[:-1]), b.shape[0], b.shape[1]
    reason = chosen.refuses(K, N, a.device)
    if reason is not None:
        raise _error("backend", reason)
    rows = (*a.shape[:-1], 1)
    caller_factors = {"scale_a": scale_a, "scale_b": scale_b}  # for the overlap check: before any copy
    scale_a = _check_factor("scale_a", scale_a, a, M, ((M, 1), rows))
    scale_b = _check_factor("scale_b", scale_b, a, N, ((1, N), (N,)))
    alpha, scale_t, mode = _normalize_scale(scale, a, out_shape, torch.float32)
    caller_bias = bias
    bias = _check_bias(bias, N, a.device, torch.float32, out_dtype)
    _check_found_inf(found_inf, a.device)
    _check_amax_out(amax_out, a.device)
    if accumulate and out is None:
        raise _error("accumulate", "accumulate=True adds into `out`, which is missing")
    if torch.is_grad_enabled():
        named = {"a": a, "b": b, "scale": scale, "scale_a": scale_a, "scale_b": scale_b, "bias": bias, "out": out}
        for argument, t in named.items():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise _error(
                    argument,
                    "requires grad: a float8 scaled_matmul takes no part in autograd (ampkernels.float8.Float8Linear "
                    "has its own backward); pass detached tensors or call under torch.no_grad()",
                )
    if out is not None:
        others = {
            "a": a, "b": b, "scale": scale_t, **caller_factors, "bias": bias, "found_inf": found_inf,
            "amax_out": amax_out,
        }  # fmt: skip
        _check_out(out, out_shape, out_dtype, a.device, others)
    a2 = a if a.ndim == 2 else a.reshape(M, K)
    if key is not None and plain_eager(a2, b, scale_t, scale_a, scale_b, bias, out, found_inf, amax_out):
        entry = _Float8Call.make(
            scale, scale_t, mode, scale_a, scale_b, caller_bias, out_dtype, out, accumulate, chosen, out_shape
        )
        if entry is not None:
            if len(_FLOAT8_CALLS) >= _MAX_CACHED:
                _FLOAT8_CALLS.clear()
            _FLOAT8_CALLS[key] = entry
    if out is None:
        out = torch.empty(out_shape, dtype=out_dtype, device=a.device)
    _launch_float8_op(
        chosen.name, a2, b, scale_a, scale_b, scale_t, mode, alpha, bias, out, accumulate, found_inf, amax_out
    )
    return out


# NOTE: the float8 checks cost as much host time as the 16-bit ones (see the note at _CALLS); a float8 Linear calls
# three GEMMs a step per layer. The same scheme: a call whose metadata was checked once only launches.
_FLOAT8_CALLS: dict[tuple, _Float8Call] = {}


def _float8_key(a, b, scale, scale_a, scale_b, bias, out_dtype, out, accumulate, found_inf, amax_out) -> tuple:
    tensors = (a, b, scale, scale_a, scale_b, bias, out, found_inf, amax_out)
    return (
        tuple(_tensor_key(t) for t in tensors),
        tuple(type(t) is not torch.Tensor or not t.data_ptr() & 15 for t in tensors),
        out_dtype,
        accumulate,
    )


class _Float8Call:
    """A checked float8 call signature (see :class:`_Call`): made for plain eager calls whose scale is None, a
    Python number or a float32 tensor on a's device, and whose bias needs no conversion; the tensors of a call
    with the same metadata are only reshaped, checked for overlap with ``out``, and launched."""

    __slots__ = ("backend", "out_shape", "out_dtype", "mode", "scale_shape", "accumulate", "extents", "vectors")

    @classmethod
    def make(cls, scale, scale_t, mode, scale_a, scale_b, bias, out_dtype, out, accumulate, backend, out_shape):
        """``bias``: as the caller passed it (every float dtype is read as is: only its layout matters); ``backend``:
        the chosen one (:class:`~ampkernels.matmul.backends.Float8MatmulBackend`)."""
        if type(scale) not in (float, int, type(None), torch.Tensor):
            return None
        if isinstance(scale, torch.Tensor) and not (
            scale.dtype == torch.float32 and scale_t.data_ptr() == scale.data_ptr()
        ):
            return None  # converted or copied per call
        if bias is not None and not bias.is_contiguous():
            return None
        if capturing():
            return None  # what a capture settles is provisional
        call = cls()
        call.backend, call.out_shape, call.out_dtype = backend, out_shape, out_dtype
        call.mode, call.accumulate = mode, bool(accumulate)
        call.scale_shape = None if scale_t is None else tuple(scale_t.shape)
        call.vectors = (scale_a is not None and scale_a.numel() > 1, scale_b is not None and scale_b.numel() > 1)
        call.extents = None if out is None else _extent(out)
        return call

    def run(self, a, b, scale, scale_a, scale_b, bias, out, found_inf, amax_out):
        """Launches; None when the call needs the checked path (grad, tracing, an overlap error)."""
        if torch.is_grad_enabled() and any(
            type(t) is torch.Tensor and t.requires_grad for t in (a, b, scale, scale_a, scale_b, bias, out)
        ):
            return None
        if torch.is_autocast_enabled(a.device.type) or not plain_eager():
            return None
        out_shape = self.out_shape
        M, N = math.prod(out_shape[:-1]), out_shape[-1]
        K = b.shape[0]
        if out is None:
            out = torch.empty(out_shape, dtype=self.out_dtype, device=a.device)
        else:
            out_start, out_end = out.data_ptr(), out.data_ptr() + self.extents
            for other in (a, b, scale, scale_a, scale_b, bias, found_inf, amax_out):
                if type(other) is torch.Tensor and other.numel():
                    start, end = _byte_range(other)
                    if start < out_end and out_start < end:
                        return None  # the checked path raises the error naming the argument
        if type(scale) is torch.Tensor:
            alpha, scale_t = 1.0, scale.view(self.scale_shape)
        else:
            alpha, scale_t = (1.0 if scale is None else float(scale)), None
        if self.vectors[0]:
            scale_a = scale_a.reshape(M).contiguous()
        if self.vectors[1]:
            scale_b = scale_b.reshape(N).contiguous()
        a2 = a if a.ndim == 2 else a.reshape(M, K)
        self.backend.launch_float8(
            a2, b, scale_a, scale_b, scale_t, self.mode, alpha, bias, out.view(M, N), self.accumulate, found_inf,
            amax_out,
        )  # fmt: skip
        for mutated in (out, found_inf, amax_out):
            if mutated is not None:
                torch.autograd.graph.increment_version(mutated)
        return out


# --------------------------------------------------------------------------------------------------------------------
# Module
# --------------------------------------------------------------------------------------------------------------------


class ScaledLinear(torch.nn.Linear):
    """Drop-in ``torch.nn.Linear`` (same constructor, initialization and state_dict keys) on
    :func:`scaled_matmul`: ``y = output_scale * (x @ weight.T) + bias``, the scale and bias in the kernel's
    epilogue.

    Args (beyond ``nn.Linear``'s): output_scale: ``None`` (1), a float, or a tensor (one element, or per output
        feature [out_features]); a tensor is kept as a non-persistent buffer, so state_dict keys stay ``weight`` and
        ``bias``, and keeps its dtype when the module's dtype changes. backend: as :func:`scaled_matmul`.
    float16/bfloat16 inputs (or autocast) run on the kernels; float32 without autocast and float64 (which autocast
    leaves alone) run on the reference (``backend="torch"``), so the module works wherever ``nn.Linear`` does,
    unbatched [in_features] inputs included. Under autocast the bias stays fp32 (``nn.Linear`` would round it to
    the autocast dtype first).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        output_scale: float | torch.Tensor | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        # checked here: a float32 input runs on "torch" whatever was asked, so a typo would otherwise go unseen
        self.backend = dispatch.check_backend("scaled_matmul", backend)
        if isinstance(output_scale, torch.Tensor):
            self.register_buffer("output_scale", output_scale.detach().clone(), persistent=False)
        else:
            self.output_scale = output_scale

    def _apply(self, fn, recurse=True):
        # A tensor output_scale keeps its dtype through model.half() / .to(torch.bfloat16): the kernels apply it in
        # float32, and a float16 copy would round it (per-feature scales below 6e-8 to zero).
        with buffers_keep_dtype(self, ("output_scale",)):
            return super()._apply(fn, recurse)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.ndim == 1:  # an unbatched [in_features] input, as nn.Linear takes it
            return self.forward(input[None])[0]
        backend = self.backend
        autocasting = torch.is_autocast_enabled(input.device.type)
        # float64 is never autocast (as for nn.Linear): it runs on the reference, like float32 without autocast
        if input.dtype == torch.float64 or (not autocasting and input.dtype == torch.float32):
            backend = "torch"
        return scaled_matmul(input, self.weight.t(), self.output_scale, bias=self.bias, backend=backend)

    def extra_repr(self) -> str:
        if self.output_scale is None:
            return super().extra_repr()
        shown = "tensor" if isinstance(self.output_scale, torch.Tensor) else self.output_scale
        return f"{super().extra_repr()}, output_scale={shown}"
