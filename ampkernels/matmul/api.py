"""The public scaled_matmul API: :func:`scaled_matmul` (checks every argument, errors name it; applies autocast like
``aten::mm``; normalizes the scale to one of four modes; flattens ``a``'s batch dimensions; picks a backend through
:mod:`ampkernels.dispatch`) and :class:`ScaledLinear`, a drop-in ``torch.nn.Linear`` running on it.

Backends: ``"triton"`` (``ampkernels/triton/scaled_matmul.py``), ``"wgmma"`` (the native op
``ampkernels::scaled_matmul_wgmma_``: Hopper only, in a build for sm_90a), ``"wmma"`` (the native op
``ampkernels::scaled_matmul_wmma_``, sm_75 and newer), ``"torch"`` (:func:`ampkernels.reference.scaled_matmul`, also
the only backend for float32/float64 operands) and, the default on Hopper, ``"auto"``: Triton or wgmma per problem
(:func:`ampkernels.matmul.dispatch.auto_backend`).
"""

from __future__ import annotations

import math
import numbers

import torch

from ampkernels import dispatch
from ampkernels._constants import SCALE_COL, SCALE_NONE, SCALE_ROW, SCALE_TENSOR
from ampkernels.matmul import dispatch as matmul_dispatch
from ampkernels.matmul import ops as _ops  # noqa: F401  (registers the torch.library ops)
from ampkernels.matmul.dispatch import auto_backend, launch
from ampkernels.triton import capturing

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


def _check_out(out, expected_shape, out_dtype, device, others):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"ampkernels.scaled_matmul: argument 'out': expected a tensor, got {type(out).__name__}")
    if tuple(out.shape) != expected_shape:
        raise _error("out", f"expected shape {list(expected_shape)}, got {_shape(out)}")
    if out.dtype != out_dtype:
        raise _error("out", f"expected dtype {out_dtype} (out_dtype), got {out.dtype}")
    if out.device != device:
        raise _error("out", f"expected a tensor on {device}, got one on {out.device}")
    if torch._debug_has_internal_overlap(out) != 0:
        raise _error("out", "has internally overlapping memory (e.g. an expanded tensor)")
    if not out.is_contiguous():
        raise _error("out", f"must be contiguous (row-major), got strides {out.stride()}")
    for name, other in others.items():
        if isinstance(other, torch.Tensor) and _overlaps(out, other):
            raise _error("out", f"overlaps argument '{name}' in memory")


def scaled_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float | torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    found_inf: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``scale * (a @ b) + bias`` with fp32 accumulation and the scale, bias and checks in the kernel's epilogue.

    Args:
        a: [..., M, K] float16 or bfloat16, any strides (batch dimensions are flattened into M rows).
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
        backend: "auto", "triton", "wgmma", "wmma" or "torch" (the reference); default: the op's choice in
            :mod:`ampkernels.dispatch` (``python -m ampkernels.info`` shows it).

    Returns ``out`` (or a new [..., M, N] tensor). Is equivalent to
    ``(scale * (a.float() @ b.float()) + bias).to(out_dtype)`` (with ``out += ...`` for ``accumulate``).

    Under autocast (``torch.autocast``) ``a`` and ``b`` are cast to the autocast dtype like ``aten::mm`` does;
    the scale, bias, flag and an explicit ``out``/``out_dtype`` are left alone. float32/float64 operands run only on
    ``backend="torch"`` (the reference, computing in their precision), otherwise they raise.

    Autograd (not with ``out``/``accumulate``): grads of a, b through the same kernels (the scale applied to both),
    bias grad = Σ rows of grad_out, and the gradient of a scale tensor that requires grad (one extra matmul).
    """
    key = None
    if type(a) is torch.Tensor and type(b) is torch.Tensor and not torch.compiler.is_compiling():
        key = _call_key(a, b, scale, bias, out_dtype, out, accumulate, found_inf, backend)
        entry = _CALLS.get(key)
        if entry is not None:
            result = entry.run(a, b, scale, bias, out, found_inf)
            if result is not None:
                return result
    result = _scaled_matmul_checked(a, b, scale, bias, out_dtype, out, accumulate, found_inf, backend, key)
    return result


def _scaled_matmul_checked(a, b, scale, bias, out_dtype, out, accumulate, found_inf, backend, key):
    """Every check, then the launch; caches a :class:`_Call` under ``key`` when the call qualifies."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        bad = "a" if not isinstance(a, torch.Tensor) else "b"
        raise TypeError(f"ampkernels.scaled_matmul: argument '{bad}': expected a tensor")
    if torch.is_autocast_enabled(a.device.type) and a.is_floating_point() and b.is_floating_point():
        cast = torch.get_autocast_dtype(a.device.type)
        a, b = a.to(cast), b.to(cast)
    if a.ndim < 2:
        raise _error("a", f"expected a tensor of at least 2 dimensions [..., M, K], got {_shape(a)}")
    if b.ndim != 2:
        raise _error("b", f"expected a 2-D tensor [K, N], got {_shape(b)}")
    if a.shape[-1] != b.shape[0]:
        raise _error("b", f"inner dimensions differ: a is {_shape(a)} (K={a.shape[-1]}), b is {_shape(b)}")
    if b.device != a.device:
        raise _error("b", f"expected a tensor on {a.device} (like a), got one on {b.device}")
    if b.dtype != a.dtype:
        raise _error("b", f"expected dtype {a.dtype} (like a), got {b.dtype}")

    name = select_backend(a.device, backend)
    # float32/float64 operands are accepted only when the reference is asked for by name: by default they are
    # most likely a missing autocast, and silently running an fp32 matmul would hide that.
    wide_ok = dispatch.requested("scaled_matmul", backend)[0] == "torch"
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
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"ampkernels.scaled_matmul: argument 'bias': expected a tensor, got {type(bias)}")
        if bias.shape != (N,):
            raise _error("bias", f"expected shape [{N}], got {_shape(bias)}")
        if not bias.is_floating_point():
            raise _error("bias", f"expected a floating-point tensor, got {bias.dtype}")
        if bias.device != a.device:
            raise _error("bias", f"expected a tensor on {a.device} (like a), got one on {bias.device}")
        if bias.dtype not in (compute, a.dtype):
            bias = bias.to(compute)
        bias = bias.contiguous()
    _check_found_inf(found_inf, a.device)
    if accumulate and out is None:
        raise _error("accumulate", "accumulate=True adds into `out`, which is missing")
    if out is not None:
        others = {"a": a, "b": b, "scale": scale_t, "bias": bias, "found_inf": found_inf}
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
        result, flag = torch.ops.ampkernels.scaled_mm(
            a2, b, scale_t, mode, alpha, bias, out_dtype, found_inf is not None, name
        )
        if found_inf is not None:
            torch.maximum(found_inf.reshape(1), flag, out=found_inf.view(1))
        return result.view(out_shape)
    autocasting = torch.is_autocast_enabled(a.device.type)
    if key is not None and not autocasting and _plain_eager(a2, b, scale_t, bias, out, found_inf):
        entry = _Call.make(
            a, b, scale, scale_t, mode, alpha, bias, out_dtype, out, accumulate, found_inf, name, out_shape
        )
        if entry is not None:
            if len(_CALLS) >= _MAX_CACHED:
                _CALLS.clear()
            _CALLS[key] = entry
    if out is None:
        out = torch.empty(out_shape, dtype=out_dtype, device=a.device)
    out2 = out.view(M, N)
    if _plain_eager(a2, b, scale_t, bias, out2, found_inf):
        # NOTE: the custom-op dispatcher costs ~15-30 us of host time per call, as much as a 1024^3 matmul on an
        # H200; plain eager tensors need none of what it does (tracing, fake tensors), so launch directly and bump
        # the version counters the op's ADInplaceOrView kernel would have.
        launch(name, a2, b, scale_t, mode, alpha, bias, out2, accumulate, found_inf)
        torch.autograd.graph.increment_version(out)
        if found_inf is not None:
            torch.autograd.graph.increment_version(found_inf)
        return out
    torch.ops.ampkernels.scaled_mm_(a2, b, scale_t, mode, alpha, bias, out2, accumulate, found_inf, name)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Per-signature cache of the checked call
# --------------------------------------------------------------------------------------------------------------------

# NOTE: the checks, backend choice and scale normalization cost ~45 us of Python per call on a 2-core CPU host
# (~3x that on the H200's host), more than a 768-wide transformer matmul takes on the GPU. Their outcome
# depends only on what _call_key collects, so a call whose key was checked once skips straight to the launch;
# only what depends on the data pointers (overlap of `out` with the inputs) and the global modes (grad, autocast,
# tracing) is checked per call. The AMPKERNELS_*BACKEND variables are read when a signature is first seen: call
# clear_caches() after changing them. See dev/matmul/tuning.md.
_CALLS: dict[tuple, _Call] = {}
_MAX_CACHED = 4096


def clear_caches() -> None:
    """Forgets the cached call signatures, "auto" choices and Triton launchers (after changing AMPKERNELS_*
    variables)."""
    _CALLS.clear()
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
    is (no conversion copy), and a contiguous bias of float32 or a's dtype."""

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
    def make(cls, a, b, scale, scale_t, mode, alpha, bias, out_dtype, out, accumulate, found_inf, name, out_shape):
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
        if call.M > 0 and call.N > 0 and call.K > 0 and name in ("auto", "triton"):
            a2 = a if a.ndim == 2 else a.reshape(call.M, call.K)
            out2 = torch.empty(out_shape, dtype=out_dtype, device=a.device) if out is None else out
            out2 = out2.view(call.M, call.N)
            if name == "auto":
                name = auto_backend(a2, b, scale_t, mode, alpha, bias, out2, accumulate, found_inf)
            if name == "triton":
                # the kernel launcher itself (it reads the scale through its pointer: no reshaped view either)
                call.launcher = dispatch.triton_module("scaled_matmul").launcher_for(
                    a2, b, scale_t, mode, bias, out2, accumulate, found_inf
                )
        call.backend = name
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
        if torch.is_autocast_enabled(a.device.type) or not _plain_eager():
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
            launch(self.backend, a2, b, scale_t, self.mode, alpha, bias, out2, self.accumulate, found_inf)
        if found_inf is not None:
            torch.autograd.graph.increment_version(found_inf)
        return out


def _plain_eager(*tensors) -> bool:
    """True when no tracing, compiling, mode or tensor subclass needs to see the op (plain eager tensors)."""
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
    ):
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)


# --------------------------------------------------------------------------------------------------------------------
# Module
# --------------------------------------------------------------------------------------------------------------------


class ScaledLinear(torch.nn.Linear):
    """Drop-in ``torch.nn.Linear`` (same constructor, initialization and state_dict keys) on
    :func:`scaled_matmul`: ``y = output_scale * (x @ weight.T) + bias``, the scale and bias in the kernel's
    epilogue.

    Args (beyond ``nn.Linear``'s): output_scale: ``None`` (1), a float, or a tensor (one element, or per output
        feature [out_features]); a tensor is kept as a non-persistent buffer, so state_dict keys stay ``weight`` and
        ``bias``. backend: as :func:`scaled_matmul`.
    float16/bfloat16 inputs (or autocast) run on the kernels; float32/float64 without autocast run on the reference
    (``backend="torch"``), so the module works wherever ``nn.Linear`` does. Under autocast the bias stays fp32
    (``nn.Linear`` would round it to the autocast dtype first).
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
        self.backend = backend
        if isinstance(output_scale, torch.Tensor):
            self.register_buffer("output_scale", output_scale.detach().clone(), persistent=False)
        else:
            self.output_scale = output_scale

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        backend = self.backend
        autocasting = torch.is_autocast_enabled(input.device.type)
        if not autocasting and input.dtype in (torch.float32, torch.float64):
            backend = "torch"
        return scaled_matmul(input, self.weight.t(), self.output_scale, bias=self.bias, backend=backend)

    def extra_repr(self) -> str:
        if self.output_scale is None:
            return super().extra_repr()
        shown = "tensor" if isinstance(self.output_scale, torch.Tensor) else self.output_scale
        return f"{super().extra_repr()}, output_scale={shown}"
