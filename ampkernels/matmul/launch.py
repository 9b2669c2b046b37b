"""How a scaled_matmul call reaches its backend: :func:`launch` (on normalized 2-D arguments), :func:`launch_float8`
(float8 operands, and the 16-bit ones with ``amax_out``) and the per-problem choice of ``"auto"``
(:func:`auto_backend`, :func:`float8_auto_backend`). Which backends exist and which runs by default:
:mod:`ampkernels.dispatch`.
"""

from __future__ import annotations

import functools
from collections import deque

import torch

from ampkernels import dispatch
from ampkernels._constants import FLOAT8_DTYPES, SCALE_COL, SCALE_NONE, SCALE_ROW, SCALE_TENSOR
from ampkernels._runtime import capturing, num_sms, time_in_turns
from ampkernels.matmul import backends as _backends  # noqa: F401  (registers the ops' backends)
from ampkernels.matmul import reference, tuning

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
    runs = {
        name: functools.partial(
            launch, name, a, b, scale, scale_mode, alpha, bias, scratch_out, accumulate, scratch_flag
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
        op = dispatch.native_op("scaled_matmul_wmma_" if backend == "wmma" else "scaled_matmul_wgmma_")
        op(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)
    else:
        raise AssertionError(f"unknown backend {backend!r}")  # select() returns only known names


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


def _untimed_float8(candidates: tuple[str, ...]) -> str:
    """The choice without timing (``tuning.TUNE`` False, small problems, inside a capture): cuBLAS, the measured
    baseline, where it takes the problem; else the native kernel; else Triton."""
    return next(name for name in ("cublas", "wgmma", "triton") if name in candidates)


def float8_auto_backend(a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out):
    """The backend ``"auto"`` runs for this float8 problem (arguments as :func:`launch_float8` takes them): the
    faster of wgmma and cuBLAS where they take it (Triton where neither does), timed on the first call of each
    signature above ``AUTO_MIN_MACS``; :func:`_untimed_float8` below it, with ``tuning.TUNE`` False, and inside a
    CUDA graph capture."""
    M, K = a.shape
    N = b.shape[1]
    candidates = tuple(
        name
        for name in dispatch.auto_candidates(out.device, "scaled_matmul_float8")
        if (name != "cublas" or cublas_refuses(K, N, out.device) is None)
        and (name != "wgmma" or (fast_accumulation_ok(K, out.dtype) and wgmma_float8_takes(a)))
    )
    if len(candidates) > 1 and ("cublas" in candidates or "wgmma" in candidates):
        # NOTE: Triton's FP8 GEMM measured the slowest backend on all six training shapes, and timing it compiles
        # its configs, most of a Float8Linear model's first step (dev/float8/NOTES.md). It runs where neither native
        # backend takes the problem.
        candidates = tuple(name for name in candidates if name != "triton")
    if len(candidates) == 1:
        return candidates[0]
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
        runs = {
            name: functools.partial(
                launch_float8,
                name,
                a,
                b,
                scale_a,
                scale_b,
                scale,
                scale_mode,
                alpha,
                bias,
                scratch_out,
                accumulate,
                scratch_flag,
                scratch_amax,
            )  # fmt: skip
            for name in candidates
        }
        choice = _fastest(runs, key, out.device)
    if len(_AUTO) >= _MAX_CACHED:
        _AUTO.clear()
    _AUTO[key] = choice
    return choice


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


def _reference_scale(scale, scale_mode, alpha):
    """The normalized scale as the references take it (a per-row scale as a column)."""
    if scale_mode == SCALE_ROW:
        return scale[:, None]
    if scale_mode in (SCALE_TENSOR, SCALE_COL):
        return scale
    return None if alpha == 1.0 else alpha


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


def launch_float8(
    backend, a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
) -> None:
    """``out (+)= alpha * scale * ((a @ b) * scale_a * scale_b) + bias``, then found_inf and ``amax_out = max(amax_out,
    max |out|)``, on normalized 2-D arguments (see the ``ampkernels::scaled_mm_fp8_`` schema). ``a``/``b`` float8,
    or 16-bit with ``scale_a``/``scale_b`` None (a call with ``amax_out``: the Triton epilogue records it, the other
    backends after their launch in torch ops)."""
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return
    if a.dtype not in FLOAT8_DTYPES:
        if backend == "auto" and K > 0:
            backend = auto_backend(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)
        if backend == "triton" and K > 0:
            dispatch.triton_module("scaled_matmul").scaled_mm_(
                a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out=amax_out
            )
        else:
            launch(backend, a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf)
            _record_stored(out, None, amax_out)
        return
    if backend == "auto" and K > 0:
        backend = float8_auto_backend(
            a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
        )
    if backend == "torch" or K == 0:  # K == 0: out (+)= bias; not worth a kernel's edge case
        reference.scaled_matmul_float8(
            a, b, scale_a, scale_b, _reference_scale(scale, scale_mode, alpha), bias=bias, out_dtype=out.dtype,
            out=out, accumulate=accumulate, found_inf=found_inf, amax_out=amax_out,
        )  # fmt: skip
    elif backend == "triton":
        a, b = _k_major(a, b)
        dispatch.triton_module("scaled_matmul").scaled_mm_(
            a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf,
            scale_a=scale_a, scale_b=scale_b, amax_out=amax_out,
        )  # fmt: skip
    elif backend == "wgmma":
        a, b = _k_major(a, b)
        dispatch.native_op("scaled_matmul_fp8_wgmma_")(
            a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, amax_out
        )
    elif backend == "cublas":
        _cublas_float8(a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out, accumulate)
        _record_stored(out, found_inf, amax_out)
    else:
        raise AssertionError(f"unknown backend {backend!r}")  # select() returns only known names
