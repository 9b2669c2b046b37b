"""How a scaled_matmul call reaches its backend: :func:`launch` (on normalized 2-D arguments), :func:`launch_float8`
(float8 operands, and the 16-bit ones with ``amax_out``), each on a backend named as the custom ops carry it, and the
per-problem choice of ``"auto"`` (:func:`auto_backend`, :func:`float8_auto_backend`). The launches themselves are the
backends' methods (:mod:`ampkernels.matmul.backends`); which backends exist and which runs by default:
:mod:`ampkernels.dispatch`.
"""

from __future__ import annotations

import functools
from collections import deque

import torch

from ampkernels import dispatch
from ampkernels._constants import FLOAT8_DTYPES
from ampkernels._runtime import capturing, num_sms, time_in_turns
from ampkernels.matmul import backends as _backends  # registers the ops' backends
from ampkernels.matmul import tuning
from ampkernels.matmul.backends import (  # noqa: F401  (the rules, at their former import path)
    FAST_ACCUMULATION_MAX_K,
    cublas_refuses,
    fast_accumulation_ok,
    wgmma_float8_takes,
)

# NOTE: on the large shapes Triton and wgmma measured within a few percent of each other, either one ahead; on the
# 768-wide layers, whose 128x256 Triton tiles leave the last wave mostly idle, the wgmma kernel leads
# (benchmarks/bench_scaled_matmul.py; the figures are in dev/matmul/NOTES.md). Neither wins everywhere, so "auto" times
# both once per problem signature, like Triton's own tuner does its configs.
AUTO_MIN_MACS = 2**32  # below (microseconds of GPU time), Triton: its launcher costs less host time than a native op
_AUTO: dict[tuple, str] = {}
_MAX_CACHED = 4096  # problem signatures remembered; dynamic shapes would otherwise grow the cache without bound
#: What the latest timed choices measured (read by the benchmark).
AUTO_LOG: deque[dict] = deque(maxlen=256)


def _auto_untimed(M: int, N: int, K: int, device: torch.device) -> str:
    """The choice without timing (``tuning.TUNE`` False, or inside a CUDA graph capture): wgmma where Triton's 128x256
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
    Triton's tuner times its configs (:func:`ampkernels._runtime.time_in_turns`)."""
    a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf = args
    scratch_out = torch.zeros_like(out)
    scratch_flag = None if found_inf is None else torch.zeros_like(found_inf)
    backend = _backends.SCALED_MATMUL.backend
    runs = {
        name: functools.partial(
            backend(name).launch, a, b, scale, scale_mode, alpha, bias, scratch_out, accumulate, scratch_flag
        )
        for name in candidates
    }
    return _fastest(runs, key, out.device)


def _fastest(runs: dict, key: tuple, device: torch.device) -> str:
    """The name of the fastest of ``runs`` (name -> callable), each run once first (compiling, tuning), then timed
    in turns; logged in :data:`AUTO_LOG`."""
    with torch.cuda.device(device):  # do_bench times on the current device's stream
        for run in runs.values():
            run()  # compiles; Triton tunes its configs for this problem here
        ms = time_in_turns(runs)
    best = min(ms, key=ms.get)
    AUTO_LOG.append({"key": repr(key), "ms": ms, "best": best})
    return best


def launch(backend: str, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf) -> None:
    """``out (+)= alpha * scale * (a @ b) + bias`` on normalized 2-D arguments (see the op schema), on the
    scaled_matmul backend called ``backend`` (:meth:`~ampkernels.matmul.backends.MatmulBackend.launch`)."""
    _backends.SCALED_MATMUL.backend(backend).launch(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)


def clear_caches() -> None:
    """Forgets the "auto" choices (16-bit and float8), the backends found per device and the Triton launchers, and
    hands the native kernels' switches of :mod:`ampkernels.matmul.tuning` to the extension (:func:`tuning.apply`)."""
    tuning.apply()
    _AUTO.clear()
    dispatch.clear_caches()
    module = dispatch.triton_module("scaled_matmul")
    if module is not None:
        module.clear_caches()


# --------------------------------------------------------------------------------------------------------------------
# Float8 operands (and 16-bit ones with amax_out)
# --------------------------------------------------------------------------------------------------------------------


def _untimed_float8(candidates: tuple[str, ...]) -> str:
    """The choice without timing (``tuning.TUNE`` False, small problems, inside a capture): the first of
    :data:`~ampkernels.matmul.backends.FLOAT8_UNTIMED_ORDER` among ``candidates`` (cuBLAS, the measured baseline,
    where it takes the problem; else the native kernel; else Triton)."""
    return next(name for name in _backends.FLOAT8_UNTIMED_ORDER if name in candidates)


def float8_auto_backend(a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out):
    """The backend ``"auto"`` runs for this float8 problem (arguments as :func:`launch_float8` takes them): the
    faster of wgmma and cuBLAS where they take it (Triton where neither does), timed on the first call of each
    signature above ``AUTO_MIN_MACS``; :func:`_untimed_float8` below it, with ``tuning.TUNE`` False, and inside a
    CUDA graph capture. Each candidate says whether it takes the problem
    (:meth:`~ampkernels.matmul.backends.Float8MatmulBackend.takes`); a ``last_resort`` one (Triton) runs only where
    no other does."""
    M, K = a.shape
    N = b.shape[1]
    backend = _backends.SCALED_MATMUL_FLOAT8.backend
    offered = [
        candidate
        for candidate in map(backend, dispatch.auto_candidates(out.device, "scaled_matmul_float8"))
        if candidate.takes(a, b, out)
    ]
    if len(offered) > 1:
        preferred = [candidate for candidate in offered if not candidate.last_resort]
        if preferred:
            offered = preferred
    if len(offered) == 1:
        return offered[0].name
    candidates = tuple(candidate.name for candidate in offered)
    key = (
        out.device,
        a.dtype,
        b.dtype,
        out.dtype,
        a.shape,
        a.stride(),
        b.shape,
        b.stride(),
        not a.data_ptr() & 15,
        not b.data_ptr() & 15,
        None if scale_a is None else scale_a.numel() > 1,
        None if scale_b is None else scale_b.numel() > 1,
        scale_mode,
        alpha == 1.0,
        bias is None or bias.dtype,
        accumulate,
        found_inf is not None,
        amax_out is not None,
    )
    choice = _AUTO.get(key)
    if choice is not None:
        return choice
    if capturing():
        return _untimed_float8(candidates)
    if M * N * K < AUTO_MIN_MACS or not dispatch.triton_module("scaled_matmul").tuning_enabled():
        choice = _untimed_float8(candidates)
    else:
        scratch_out = torch.zeros_like(out)
        scratch_flag = None if found_inf is None else torch.zeros_like(found_inf)
        scratch_amax = None if amax_out is None else torch.zeros_like(amax_out)
        args = (a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, scratch_out, accumulate, scratch_flag)
        runs = {name: functools.partial(backend(name).launch_float8, *args, scratch_amax) for name in candidates}
        choice = _fastest(runs, key, out.device)
    if len(_AUTO) >= _MAX_CACHED:
        _AUTO.clear()
    _AUTO[key] = choice
    return choice


def launch_float8(
    backend: str, a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
) -> None:
    """``out (+)= alpha * scale * ((a @ b) * scale_a * scale_b) + bias``, then found_inf and ``amax_out = max(amax_out,
    max |out|)``, on normalized 2-D arguments (see the ``ampkernels::scaled_mm_fp8_`` schema). ``a``/``b`` float8, on
    the scaled_matmul_float8 backend called ``backend``, or 16-bit with ``scale_a``/``scale_b`` None, on the
    scaled_matmul one (a call with ``amax_out``: the Triton epilogue records it, the other backends after their
    launch in torch ops)."""
    if a.dtype in FLOAT8_DTYPES:
        _backends.SCALED_MATMUL_FLOAT8.backend(backend).launch_float8(
            a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
        )
    else:
        _backends.SCALED_MATMUL.backend(backend).launch_amax(
            a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
        )
