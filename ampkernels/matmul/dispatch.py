"""How a scaled_matmul call reaches its backend: :func:`launch` (on normalized 2-D arguments) and the per-problem
choice of ``"auto"`` (:func:`auto_backend`). Which backends exist and which runs by default: :mod:`ampkernels.dispatch`.
"""

from __future__ import annotations

import functools
from collections import deque

import torch

from ampkernels import dispatch, reference
from ampkernels._constants import SCALE_ROW
from ampkernels.triton import capturing, num_sms, time_in_turns

# NOTE (H200, benchmarks/bench_scaled_matmul.py, at the steady power-capped clock): on the large shapes Triton and
# wgmma are within 1-2% of each other, either one ahead; on the 768-wide layers, whose 128x256 Triton tiles leave the
# last wave mostly idle, the wgmma kernel leads (3072x768x8192: 0.87x cuBLAS against 0.81x; 8192x768x3072:
# 0.97-0.98x against 0.91-0.92x). Neither wins everywhere, so "auto" times both once per problem signature, like
# Triton's own tuner does its configs.
AUTO_MIN_MACS = 2**32  # below (~10 us on an H200), Triton: its launcher costs a few us of host time, the op ~20
_AUTO: dict[tuple, str] = {}
_MAX_CACHED = 4096  # problem signatures remembered; dynamic shapes would otherwise grow the cache without bound
#: What the latest timed choices measured (read by the benchmark).
AUTO_LOG: deque[dict] = deque(maxlen=256)


def _auto_untimed(M: int, N: int, K: int, device: torch.device) -> str:
    """The choice without timing (AMPKERNELS_TUNE=0, or inside a CUDA graph capture): wgmma where Triton's 128x256
    tiles fill fewer than two waves of the GPU (the three 768-wide shapes of the benchmark), else Triton."""
    tiles = -(-M // 128) * -(-N // 256)
    return "wgmma" if M * N * K >= AUTO_MIN_MACS and tiles < 2 * num_sms(device) else "triton"


def auto_backend(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> str:
    """The backend ``"auto"`` runs for this problem (normalized 2-D arguments, as :func:`launch` takes them): the
    only candidate that runs here, Triton below ``AUTO_MIN_MACS``, else the faster of Triton and wgmma as timed on
    the first call of each signature (shape, strides, alignment, dtypes, epilogue). Never timed inside a CUDA graph
    capture (timing synchronizes): there it is :func:`_auto_untimed`, and the next eager call times."""
    candidates = dispatch.auto_candidates(out.device)
    if len(candidates) == 1:
        return candidates[0]
    M, K = a.shape
    N = b.shape[1]
    if M * N * K < AUTO_MIN_MACS:
        return "triton"
    key = (
        out.device,
        a.dtype,
        out.dtype,
        a.shape,
        a.stride(),
        b.shape,
        b.stride(),
        not a.data_ptr() & 15,
        not b.data_ptr() & 15,
        scale_mode,
        bias is not None,
        accumulate,
        found_inf is not None,
    )
    choice = _AUTO.get(key)
    if choice is not None:
        return choice
    if capturing():
        return _auto_untimed(M, N, K, out.device)
    if not dispatch.triton_module("scaled_matmul").tuning_enabled():
        choice = _auto_untimed(M, N, K, out.device)
    else:
        choice = _time_auto(candidates, key, (a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf))
    if len(_AUTO) >= _MAX_CACHED:
        _AUTO.clear()
    _AUTO[key] = choice
    return choice


def _time_auto(candidates: tuple[str, ...], key: tuple, args: tuple) -> str:
    """Times each candidate on scratch outputs (the caller's ``out`` and ``found_inf`` are not touched), the way
    Triton's tuner times its configs (:func:`ampkernels.triton.time_in_turns`)."""
    a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf = args
    scratch_out = torch.zeros_like(out)
    scratch_flag = None if found_inf is None else torch.zeros_like(found_inf)
    runs = {
        name: functools.partial(
            launch, name, a, b, scale, scale_mode, alpha, bias, scratch_out, accumulate, scratch_flag
        )
        for name in candidates
    }
    with torch.cuda.device(out.device):  # do_bench times on the current device's stream
        for run in runs.values():
            run()  # compiles; Triton tunes its configs for this problem here
        ms = time_in_turns(runs)
    best = min(ms, key=ms.get)
    AUTO_LOG.append({"key": repr(key), "ms": ms, "best": best})
    return best


def launch(backend, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> None:
    """``out (+)= alpha * scale * (a @ b) + bias`` on normalized 2-D arguments (see the op schema)."""
    if a.shape[0] == 0 or b.shape[1] == 0:
        return
    if backend == "auto" and a.shape[1] > 0:
        backend = auto_backend(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)
    if backend == "torch" or a.shape[1] == 0:  # K == 0: out (+)= bias; not worth a kernel's edge case
        ref_scale = scale
        if scale_mode == SCALE_ROW:
            ref_scale = scale[:, None]
        reference.scaled_matmul(
            a, b, ref_scale, alpha=alpha, bias=bias, out=out, accumulate=accumulate, found_inf=found_inf
        )
    elif backend == "triton":
        dispatch.triton_module("scaled_matmul").scaled_mm_(
            a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf
        )
    elif backend in ("wmma", "wgmma"):
        # The native ops take row- or column-major operands only.
        a = a if a.is_contiguous() or a.t().is_contiguous() else a.contiguous()
        b = b if b.is_contiguous() or b.t().is_contiguous() else b.contiguous()
        op = dispatch.wmma_op() if backend == "wmma" else dispatch.wgmma_op()
        op(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)
    else:
        raise AssertionError(f"unknown backend {backend!r}")  # select() returns only known names


def clear_caches() -> None:
    """Forgets the "auto" choices, the backends found per device and the Triton launchers."""
    _AUTO.clear()
    dispatch.clear_caches()
    module = dispatch.triton_module("scaled_matmul")
    if module is not None:
        module.clear_caches()
