"""The scaler's multi-tensor ops (unscale + non-finite check + norm, loss-scale update): public wrappers that check
every argument (errors name it), pick a backend (:mod:`ampkernels.dispatch`) and launch.

The checks run before the backend is chosen, so that every backend raises the same exception with the same message,
before anything is written. Each op has a plain-PyTorch reference in :mod:`ampkernels.reference` with the same
contract. The Triton launch code checks nothing again; the native ops keep their own checks
(``torch.ops.ampkernels.*`` can be called directly). They
are registered with ``torch.library`` (schemas in ``csrc/scaler/scaler_ops.cpp``), with fake implementations in
:mod:`ampkernels._native_fakes`, so ``torch.compile`` can trace through them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ampkernels import dispatch
from ampkernels._constants import NormKind, norm_kind
from ampkernels._runtime import is_dense
from ampkernels.scaler import backends as _backends  # noqa: F401  (registers the ops' backends)
from ampkernels.scaler import library as _library  # noqa: F401  (registers the native ops' fakes)
from ampkernels.scaler import reference


class UnscaleResult(NamedTuple):
    """What :func:`unscale_reduce_` computed; fields not requested are ``None``."""

    norm: torch.Tensor | None  # 0-d float32: the norm of all unscaled values
    per_tensor_norms: torch.Tensor | None  # [len(tensors)] float32
    clip_coef: torch.Tensor | None  # 0-d float32: min(max_norm / (norm + 1e-6), 1)


_TENSOR_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_scalar(t, name: str, device: torch.device, dtype: torch.dtype = torch.float32, numel: int = 1) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ampkernels: argument '{name}': expected a tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.numel() != numel:
        what = "1-element" if numel == 1 else f"{numel}-element"
        raise ValueError(
            f"ampkernels: argument '{name}': expected a {what} {dtype} tensor, got {t.dtype} {tuple(t.shape)}"
        )
    if t.device != device:
        raise ValueError(f"ampkernels: argument '{name}': expected a tensor on {device}, got one on {t.device}")
    if numel > 1 and not t.is_contiguous():
        raise ValueError(f"ampkernels: argument '{name}': expected a contiguous tensor, got strides {t.stride()}")


# The native op's message (csrc/scaler/scaler_ops.cpp), word for word: every backend raises it.
_SHARED_MEMORY = (
    "ampkernels: argument 'tensors': elements {} and {} share memory (the same tensor twice, or overlapping views) "
    "and would be unscaled twice; pass each tensor once, or write=False"
)


_is_dense = is_dense  # (``at::Tensor::is_non_overlapping_and_dense``)


def intersecting(spans: list[tuple[int, int, int]]) -> tuple[int, int] | None:
    """Two owners (the smaller first) of ``spans`` (``(begin, end, owner)``: the bytes ``[begin, end)`` of a
    tensor) that share a byte, or None: the native ``find_intersecting``. O(n log n)."""
    reach, owner = 0, -1
    for begin, end, i in sorted(s for s in spans if s[1] > s[0]):
        if owner >= 0 and begin < reach:
            return min(owner, i), max(owner, i)
        if end > reach:
            reach, owner = end, i
    return None


def memory_span(t: torch.Tensor, owner: int) -> tuple[int, int, int]:
    """The bytes ``[begin, end)`` all of a dense tensor's elements occupy; of any other only its first element, a
    subset, so that an intersection found with it is a real one (the native ``memory_span``)."""
    begin = t.data_ptr()
    n = t.numel() if _is_dense(t) else min(t.numel(), 1)
    return begin, begin + n * t.element_size(), owner


def _not_written_outside_autograd(t: torch.Tensor, arg: str, element: int | None = None) -> None:
    # torch's in-place rule (autograd raises for a leaf that requires grad, and would record the write of any other
    # tensor that does): the kernels write outside autograd, so every backend refuses what torch's would.
    if t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            f"ampkernels: argument '{arg}': {'' if element is None else f'element {element} '}requires grad and would "
            "be written in place, outside autograd; pass one that does not (.detach()), or call under torch.no_grad()"
        )


def _check_tensors(tensors: list, device: torch.device, write: bool) -> None:
    """Every element a strided floating-point tensor on ``device``; with ``write`` none expanded, none requiring grad
    (under grad mode) and no two dense ones sharing memory. One pass, before any backend runs: every backend raises
    the same errors, before anything is written."""
    spans = [] if write and device.type != "meta" and not torch.compiler.is_compiling() else None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ampkernels: argument 'tensors': element {i} is a {type(t).__name__}, not a tensor")
        if t.dtype not in _TENSOR_DTYPES:
            raise TypeError(
                f"ampkernels: argument 'tensors': element {i} has dtype {t.dtype}; "
                "supported: float32, float16, bfloat16, float64"
            )
        if t.device != device:
            raise ValueError(
                f"ampkernels: argument 'tensors': element {i} is on {t.device}, expected {device} (like found_inf)"
            )
        if t.layout != torch.strided:
            raise TypeError(f"ampkernels: argument 'tensors': element {i} has layout {t.layout}; only strided")
        if not write:
            continue
        # Refused before anything is written: the in-place write of an expanded tensor would fail only after the
        # tensors before it were unscaled.
        if not t.is_contiguous() and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
            raise ValueError(
                f"ampkernels: argument 'tensors': element {i} has elements that share memory (an expanded tensor?) "
                "and cannot be written in place; pass write=False or a tensor of its own (.clone())"
            )
        _not_written_outside_autograd(t, "tensors", i)
        # A non-dense tensor is read through a copy taken before anything is written: only dense ones can be
        # reached twice.
        if spans is not None and t.numel() and _is_dense(t):
            begin = t.data_ptr()
            spans.append((begin, begin + t.numel() * t.element_size(), i))
    if spans:
        pair = intersecting(spans)
        if pair is not None:
            raise ValueError(_SHARED_MEMORY.format(*pair))


def _check_real(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"ampkernels: argument '{name}': expected a real number, got {type(value).__name__}")


def unscale_reduce_(
    tensors: Sequence[torch.Tensor],
    scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    factor: torch.Tensor | None = None,
    write: bool = True,
    norm_type: float | None = None,
    per_tensor: bool = False,
    max_norm: float | None = None,
    backend: str | None = None,
) -> UnscaleResult:
    """One fused pass over many tensors: unscale in place, flag non-finite values, and take norms.

    Args:
        tensors: strided tensors of float32/float16/bfloat16/float64, mixed freely, all on ``found_inf``'s
            device; any strides (non-dense views are staged through a contiguous copy).
        scale: float32, 1 element: the loss scale; values are multiplied by ``fp32(1 / fp64(scale))``, exactly as
            ``torch.amp.GradScaler.unscale_`` does.
        found_inf: float32, 1 element: set to 1.0 when any input element is inf or NaN; never cleared.
        factor: optional float32, 1 element, multiplied in after unscaling (for example a clip coefficient).
        write: ``False`` for a read-only check (and norm): the tensors are not written.
        norm_type: ``None``, ``2.0`` or ``inf``: the norm of the unscaled values to return.
        per_tensor: also return each tensor's norm.
        max_norm: also return the clip coefficient ``min(max_norm / (norm + 1e-6), 1)`` (needs ``norm_type``;
            ``>= 0``, ``inf`` allowed).
        backend: ``"native"``, ``"triton"`` or ``"torch"``; default: the best available (see ``python -m
            ampkernels.info``).

    Is equivalent to ``torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, 1 / scale)`` followed by
    ``torch.nn.utils.get_total_norm(tensors, norm_type)`` — in one pass, with no host synchronization.
    """
    if isinstance(tensors, torch.Tensor):
        raise TypeError("ampkernels: argument 'tensors': expected a list or tuple of tensors, got one tensor")
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"ampkernels: argument 'found_inf': expected a tensor, got {type(found_inf).__name__}")
    device = found_inf.device
    _check_scalar(scale, "scale", device)
    _check_scalar(found_inf, "found_inf", device)
    _not_written_outside_autograd(found_inf, "found_inf")
    if factor is not None:
        _check_scalar(factor, "factor", device)
    kind = norm_kind(norm_type)
    if max_norm is not None:
        if kind is NormKind.NONE:
            raise ValueError("ampkernels: argument 'max_norm': a clip coefficient needs norm_type")
        _check_real(max_norm, "max_norm")
        # NOTE: a negative or NaN coefficient would flip or poison every gradient (and NO_CLIP would read as "no
        # coefficient" on the native op): refused on every backend, as FusedGradScaler.clip_grad_norm_ refuses it.
        if not max_norm >= 0:
            raise ValueError(f"ampkernels: argument 'max_norm': must be >= 0, got {max_norm}")
    tensors = list(tensors)
    _check_tensors(tensors, device, write)
    chosen = dispatch.choose("unscale_reduce_", device, backend)
    norm, each, coef = chosen.unscale_reduce_(tensors, scale, found_inf, factor, write, kind, per_tensor, max_norm)
    return UnscaleResult(norm, each, coef)


def unscale_(tensors, scale, found_inf, *, norm_type=None, per_tensor=False, backend=None) -> UnscaleResult:
    """Unscale ``tensors`` in place and set ``found_inf`` on non-finite values (optionally with norms).

    Is equivalent to ``torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, 1 / scale)``; see
    :func:`unscale_reduce_` for the arguments.
    """
    return unscale_reduce_(tensors, scale, found_inf, norm_type=norm_type, per_tensor=per_tensor, backend=backend)


def check_and_norm(tensors, scale, found_inf, *, norm_type=2.0, per_tensor=False, backend=None) -> UnscaleResult:
    """Read-only: set ``found_inf`` on non-finite values and return the norm of ``tensors / scale``.

    For when unscaling is folded into the optimizer step; see :func:`unscale_reduce_` for the arguments.
    """
    return unscale_reduce_(
        tensors, scale, found_inf, write=False, norm_type=norm_type, per_tensor=per_tensor, backend=backend
    )


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    *,
    hysteresis: int = 1,
    hysteresis_tracker: torch.Tensor | None = None,
    min_scale: float = reference.FLOAT32_TINY,
    max_scale: float = math.inf,
    history: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Update the loss scale on the device; equals ``torch._amp_update_scale_`` with the default options.

    Args:
        scale: float32, 1 element. growth_tracker: int32, 1 element. found_inf: float32, 1 element (non-zero =
            the step overflowed). hysteresis_tracker: int32, 1 element (required when ``hysteresis > 1``).
        hysteresis: back off only after this many overflows since the last growth (Megatron-LM semantics).
        min_scale, max_scale: bounds of the scale; by default it never drops below 2**-126.
        counters: int64 [2] (updates, skipped steps) and history: float32 [N] (ring buffer of scales), optional.
    See :func:`ampkernels.reference.update_scale_` for the exact rule.
    """
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"ampkernels: argument 'scale': expected a tensor, got {type(scale).__name__}")
    device = scale.device
    _check_scalar(scale, "scale", device)
    _not_written_outside_autograd(scale, "scale")
    _check_scalar(growth_tracker, "growth_tracker", device, torch.int32)
    _check_scalar(found_inf, "found_inf", device)
    for arg, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"ampkernels: argument '{arg}': expected an int, got {type(value).__name__}")
        if not 1 <= value < 2**31:
            raise ValueError(f"ampkernels: argument '{arg}': must be >= 1 (and < 2**31), got {value}")
    for arg, value in (
        ("growth_factor", growth_factor),
        ("backoff_factor", backoff_factor),
        ("min_scale", min_scale),
        ("max_scale", max_scale),
    ):
        _check_real(value, arg)
    if hysteresis_tracker is not None:
        _check_scalar(hysteresis_tracker, "hysteresis_tracker", device, torch.int32)
    elif hysteresis > 1:
        raise ValueError("ampkernels: argument 'hysteresis_tracker': required when hysteresis > 1")
    if counters is not None:
        _check_scalar(counters, "counters", device, torch.int64, numel=2)
    if history is not None:
        if counters is None:
            raise ValueError("ampkernels: argument 'history': needs counters (its write position is counters[0])")
        _check_scalar(history, "history", device, numel=history.numel())
        _not_written_outside_autograd(history, "history")
    dispatch.choose("update_scale_", device, backend).update_scale_(
        scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis,
        hysteresis_tracker, min_scale, max_scale, history, counters,
    )  # fmt: skip
