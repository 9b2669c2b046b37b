"""Fused producers of FP8 inputs, :func:`rms_norm` (and the module :class:`RMSNorm`) and :func:`silu_mul`, and the
rest of the elementwise work around a transformer's FP8 projections (:func:`rotary_embedding`), each one kernel
forward and one backward.

In eager mode these are the model's own glue that torch.compile would fuse (Llama's RMSNorm in float32 is seven
kernels forward and more backward; ``silu(gate) * up`` two and five). Each forward can also reduce the amax of
what it writes, so that a :class:`~ampkernels.float8.Float8Linear` reading that output with current scaling takes
its scale from there and skips its own amax pass (:func:`produced_amax`). That amax is recorded only in plain eager
mode; the result is the same either way, bit for bit.

Ops (``torch.library``, with fake implementations): ``ampkernels::rms_norm``, ``ampkernels::rms_norm_backward``,
``ampkernels::silu_mul``, ``ampkernels::silu_mul_backward``, ``ampkernels::rotary``. Backends (op ``"float8_fused"`` of
:mod:`ampkernels.dispatch`, each a :class:`~ampkernels.float8.backends.FusedBackend`): ``"triton"`` (the default on
CUDA tensors) and ``"torch"`` (the reference's math, the default on CPU tensors). Semantics:
:func:`ampkernels.reference.rms_norm`, :func:`~ampkernels.reference.silu_mul`,
:func:`~ampkernels.reference.rotary_embedding`.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from ampkernels import dispatch
from ampkernels._autograd import first_order
from ampkernels._runtime import capturing, eager_or_op, plain_eager
from ampkernels.float8 import backends as _backends  # noqa: F401  (registers the ops' backends)
from ampkernels.float8 import reference

__all__ = ["RMSNorm", "produced_amax", "rms_norm", "rotary_embedding", "silu_mul"]

_OP = "float8_fused"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _error(fn: str, argument: str, message: str) -> ValueError:
    return ValueError(f"ampkernels.float8.{fn}: argument '{argument}': {message}")


def _check_float(fn: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ampkernels.float8.{fn}: argument '{name}': expected a tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise _error(fn, name, f"expected float32, bfloat16 or float16, got {t.dtype}")


# --------------------------------------------------------------------------------------------------------------------
# The amax a producer recorded for the next layer's FP8 cast
# --------------------------------------------------------------------------------------------------------------------


class _ProducedAmax:
    """Tensor -> the int32 [3] scratch of a tensorwise cast (finite amax bits, non-finite flag, ticket) its producer
    filled. Matched by the tensor object (a weak reference: nothing is kept alive) and its version counter (a tensor
    changed in place is not matched); inference tensors (torch.inference_mode) have none and are never matched."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple] = {}

    def put(self, t: torch.Tensor, scratch: torch.Tensor) -> None:
        if t.is_inference():
            return
        key = id(t)
        self.entries[key] = (weakref.ref(t, lambda ref, key=key: self._forget(key, ref)), t._version, scratch)

    def get(self, t: torch.Tensor) -> torch.Tensor | None:
        if t.is_inference():
            return None
        entry = self.entries.get(id(t))
        if entry is None or entry[0]() is not t or entry[1] != t._version:
            return None
        return entry[2]

    def _forget(self, key: int, ref) -> None:
        entry = self.entries.get(key)
        if entry is not None and entry[0] is ref:
            del self.entries[key]


_PRODUCED = _ProducedAmax()


def produced_amax(t: torch.Tensor) -> torch.Tensor | None:
    """The cast scratch (int32 [3]) that :func:`rms_norm` or :func:`silu_mul` filled with the amax of ``t``, its
    output, when ``t`` is that output unchanged; None otherwise (and always while torch.compile traces)."""
    if torch.compiler.is_compiling():
        return None
    return _PRODUCED.get(t)


def _new_scratch(like: torch.Tensor) -> torch.Tensor:
    """A zeroed tensorwise cast scratch (``float8_casts._Scratch``'s buffer) on ``like``'s device."""
    return torch.zeros(3, dtype=torch.int32, device=like.device)


# --------------------------------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("ampkernels::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, D] contiguous, weight [D] -> (out [M, D], rstd [M] float32). (The amax of out is recorded in plain eager
    mode only, where the backend is launched directly: no op takes the scratch.)"""
    return dispatch.backend(_OP, backend).rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps, backend):
    out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return out, x.new_empty(x.shape[:1], dtype=torch.float32)


@torch.library.custom_op("ampkernels::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (grad_x like x, grad_weight like weight)."""
    return dispatch.backend(_OP, backend).rms_norm_backward(grad, x, weight, rstd)


@_rms_norm_backward_op.register_fake
def _(grad, x, weight, rstd, backend):
    return torch.empty_like(x), torch.empty_like(weight)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, scratch, backend):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        w = weight.detach().contiguous()  # (the kernels read the weight as a dense [D] vector)
        if scratch is None:
            out, rstd = eager_or_op(backend.rms_norm, torch.ops.ampkernels.rms_norm, (x2, w, eps), backend.name)
        else:  # (recording: rms_norm found plain eager mode, where nothing traces the launch)
            out, rstd = backend.rms_norm(x2, w, eps, scratch)
        ctx.save_for_backward(x2, w, rstd)
        ctx.shape, ctx.backend = shape, backend
        return out.view(shape)

    @staticmethod
    @first_order
    def backward(ctx, grad):
        x2, w, rstd = ctx.saved_tensors
        g = grad.reshape(x2.shape).contiguous()
        backend = ctx.backend
        op = torch.ops.ampkernels.rms_norm_backward
        grad_x, grad_w = eager_or_op(backend.rms_norm_backward, op, (g, x2, w, rstd), backend.name)
        need_x, need_w = ctx.needs_input_grad[:2]
        return (grad_x.view(ctx.shape) if need_x else None), (grad_w if need_w else None), None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *, backend: str | None = None) -> torch.Tensor:
    """Llama's RMSNorm over the last dimension in one kernel (forward and backward), differentiable in ``x`` and
    ``weight``: ``(x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype) * weight``
    (:func:`ampkernels.reference.rms_norm`; the output has the promoted dtype of x and weight).

    Args:
        x: [..., D] float32, bfloat16 or float16, any strides (copied to rows when not contiguous).
        weight: [D] float32, bfloat16 or float16 on x's device, any stride.
        eps: added to the mean square, a float >= 0.
        backend: ``"triton"`` or ``"torch"``; default: :mod:`ampkernels.dispatch`'s choice (op ``"float8_fused"``).

    In plain eager mode on the Triton backend, the amax of the output is recorded for the next
    :class:`~ampkernels.float8.Float8Linear` (:func:`produced_amax`).
    """
    fn = "rms_norm"
    _check_float(fn, "x", x)
    _check_float(fn, "weight", weight)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise _error(fn, "x", f"expected [..., D] with D >= 1, got shape {list(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise _error(fn, "weight", f"expected shape [{x.shape[-1]}] (x's last dimension), got {list(weight.shape)}")
    if weight.device != x.device:
        raise _error(fn, "weight", f"expected a tensor on {x.device} (like x), got one on {weight.device}")
    if not isinstance(eps, (int, float)) or not eps >= 0 or math.isinf(eps):
        raise _error(fn, "eps", f"expected a finite float >= 0, got {eps!r}")
    chosen = dispatch.choose(_OP, x.device, dispatch.check_backend(_OP, backend))
    if x.numel() == 0:
        return reference.rms_norm(x, weight, eps)
    record = chosen.records_amax and plain_eager(x) and not torch.compiler.is_compiling()
    scratch = _new_scratch(x) if record else None
    out = _RMSNormFunction.apply(x, weight, float(eps), scratch, chosen)
    if scratch is not None:
        _PRODUCED.put(out, scratch)
    return out


class RMSNorm(nn.Module):
    """Llama's RMSNorm (normalized in float32, cast back to the input's dtype, then scaled by a learned ``[dim]``
    weight initialized to ones) on :func:`rms_norm`'s fused kernels. Parameters and ``state_dict`` (``weight``) as
    the usual hand-written module and as ``torch.nn.RMSNorm`` (whose rounding differs: it applies the weight before
    casting back)."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        """The weight back to ones, as ``torch.nn.RMSNorm``'s (deferred initialization calls it after ``to_empty``)."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


# --------------------------------------------------------------------------------------------------------------------
# SiLU * up
# --------------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("ampkernels::silu_mul", mutates_args=())
def _silu_mul_op(gate: torch.Tensor, up: torch.Tensor, backend: str) -> torch.Tensor:
    """gate, up contiguous, one shape -> silu(gate) * up. (As rms_norm's op, no scratch: Inductor could not lower a
    one-output op beside an optional mutated argument given None.)"""
    return dispatch.backend(_OP, backend).silu_mul(gate, up)


@_silu_mul_op.register_fake
def _(gate, up, backend):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("ampkernels::silu_mul_backward", mutates_args=())
def _silu_mul_backward_op(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (grad_gate like gate, grad_up like up)."""
    return dispatch.backend(_OP, backend).silu_mul_backward(grad, gate, up)


@_silu_mul_backward_op.register_fake
def _(grad, gate, up, backend):
    return torch.empty_like(gate), torch.empty_like(up)


class _SiluMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, scratch, backend):
        g, u = gate.contiguous(), up.contiguous()
        if scratch is None:
            out = eager_or_op(backend.silu_mul, torch.ops.ampkernels.silu_mul, (g, u), backend.name)
        else:  # (recording: silu_mul found plain eager mode, where nothing traces the launch)
            out = backend.silu_mul(g, u, scratch)
        ctx.save_for_backward(g, u)
        ctx.backend = backend
        return out

    @staticmethod
    @first_order
    def backward(ctx, grad):
        g, u = ctx.saved_tensors
        grad = grad.contiguous()
        backend = ctx.backend
        op = torch.ops.ampkernels.silu_mul_backward
        grad_gate, grad_up = eager_or_op(backend.silu_mul_backward, op, (grad, g, u), backend.name)
        need_gate, need_up = ctx.needs_input_grad[:2]
        return (grad_gate if need_gate else None), (grad_up if need_up else None), None, None


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """SwiGLU's gate ``silu(gate) * up`` in one kernel (forward and backward), differentiable in both: computed in
    float32 and rounded once to the promoted dtype (:func:`ampkernels.reference.silu_mul`; torch's two kernels round
    ``silu(gate)`` first).

    Args:
        gate, up: float32, bfloat16 or float16 tensors of one shape on one device, any strides.
        backend: ``"triton"`` or ``"torch"``; default: :mod:`ampkernels.dispatch`'s choice (op ``"float8_fused"``).

    In plain eager mode on the Triton backend, the amax of the output is recorded for the next
    :class:`~ampkernels.float8.Float8Linear` (:func:`produced_amax`).
    """
    fn = "silu_mul"
    _check_float(fn, "gate", gate)
    _check_float(fn, "up", up)
    if up.shape != gate.shape:
        raise _error(fn, "up", f"expected gate's shape {list(gate.shape)}, got {list(up.shape)} (no broadcasting)")
    if up.device != gate.device:
        raise _error(fn, "up", f"expected a tensor on {gate.device} (like gate), got one on {up.device}")
    chosen = dispatch.choose(_OP, gate.device, dispatch.check_backend(_OP, backend))
    if gate.numel() == 0:
        return reference.silu_mul(gate, up)
    record = chosen.records_amax and plain_eager(gate, up) and not torch.compiler.is_compiling()
    scratch = _new_scratch(gate) if record else None
    out = _SiluMulFunction.apply(gate, up, scratch, chosen)
    if scratch is not None:
        _PRODUCED.put(out, scratch)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Rotary position embedding
# --------------------------------------------------------------------------------------------------------------------

_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_MAX_TABLES = 16


def _tables(positions: int, half: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rotary_tables, kept per (positions, half, base, device) in plain eager mode (a few small kernels
    less per call)."""
    if torch.compiler.is_compiling() or capturing():
        # NOTE: nothing kept from a CUDA graph capture: its kernels run only at replay, and an eager call before
        # that would read unwritten tables.
        return reference.rotary_tables(positions, half, base, device)
    key = (positions, half, base, device)
    tables = _TABLES.get(key)
    if tables is None:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        tables = _TABLES[key] = reference.rotary_tables(positions, half, base, device)
    return tables


@torch.library.custom_op("ampkernels::rotary", mutates_args=())
def _rotary_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool, backend: str) -> torch.Tensor:
    """x [B, H, T, D] rotated by the float32 tables [T, D / 2] (``inverse``: by minus the angles)."""
    return dispatch.backend(_OP, backend).rotary(x, cos, sin, inverse)


@_rotary_op.register_fake
def _(x, cos, sin, inverse, backend):
    return torch.empty_like(x)


def _rotate(x, cos, sin, inverse, backend):
    return eager_or_op(backend.rotary, torch.ops.ampkernels.rotary, (x, cos, sin, inverse), backend.name)


class _RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, backend):
        ctx.save_for_backward(cos, sin)
        ctx.backend = backend
        return _rotate(x, cos, sin, False, backend)

    @staticmethod
    @first_order
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, True, ctx.backend), None, None, None


def rotary_embedding(
    x: torch.Tensor,
    base: float = 10000.0,
    *,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Rotary position embedding in the half-split layout of Llama's Hugging Face port, one kernel forward and one
    backward, differentiable in ``x``: the pairs ``(x[..., i], x[..., i + D/2])`` at position t (dimension -2) turn
    by the angle ``t * base ** (-i / (D/2))``, in float32 and rounded once
    (:func:`ampkernels.reference.rotary_embedding`; torch written out rounds the tables and each product).

    Args:
        x: [..., T, D] float32, bfloat16 or float16 with D even, any strides ([B, heads, T, head_dim] as a
            transposed view of the projection's output is read as it lies; the output has x's layout).
        base: the frequency base, a float > 0.
        tables: the angles' (cos, sin) instead of ``base``'s: float32 [T, D / 2] each (e.g. a model's own RoPE
            scaling), on x's device.
        backend: ``"triton"`` or ``"torch"``; default: :mod:`ampkernels.dispatch`'s choice (op ``"float8_fused"``).
    """
    fn = "rotary_embedding"
    _check_float(fn, "x", x)
    if x.ndim < 2 or x.shape[-1] % 2:
        raise _error(fn, "x", f"expected [..., T, D] with D even, got shape {list(x.shape)}")
    if not isinstance(base, (int, float)) or not base > 0 or math.isinf(base):
        raise _error(fn, "base", f"expected a finite float > 0, got {base!r}")
    shape = x.shape
    T, D = shape[-2], shape[-1]
    if tables is not None:
        expected = (T, D // 2)
        if not (
            isinstance(tables, tuple)
            and len(tables) == 2
            and all(isinstance(t, torch.Tensor) for t in tables)
            and all(t.shape == expected and t.dtype == torch.float32 and t.device == x.device for t in tables)
        ):
            raise _error(fn, "tables", f"expected (cos, sin), float32 of shape {list(expected)} on {x.device} each")
    chosen = dispatch.choose(_OP, x.device, dispatch.check_backend(_OP, backend))
    if x.numel() == 0:
        return reference.rotary_embedding(x, base)
    x4 = (
        x if x.ndim == 4 else (x.reshape(-1, shape[-3], T, D) if x.ndim > 4 else x.reshape((1,) * (4 - x.ndim) + shape))
    )
    if tables is None:
        cos, sin = _tables(T, D // 2, float(base), x.device)
    else:
        cos, sin = (t.contiguous() for t in tables)
    return _RotaryFunction.apply(x4, cos, sin, chosen).view(shape)
