"""Probe of the FP8 wgmma scaled matmul (csrc/matmul/wgmma_fp8.cuh) on the GPU: correctness first (every tile width
and operand-type pair, tensorwise and rowwise scales, shapes with edges, against float64 and torch._scaled_mm's error
on the same operands), then TFLOP/s against torch._scaled_mm in the same process on the FP8 stack's six shapes, per tile
width (ampkernels.matmul.tuning.WGMMA_BN) and the launcher's own choice.

Run on the device after the build: ``PYTHONPATH=$PWD timeout 300 python3 dev/matmul/wgmma/fp8_probe.py [--quick]``.
Stops at the first wrong result (printing where), so a broken kernel costs seconds, not a test suite.
"""

from __future__ import annotations

import functools
import math
import sys

import ampkernels._C  # noqa: F401  (registers torch.ops.ampkernels.*)
import torch
import triton.testing

from ampkernels import reference
from ampkernels.matmul import tuning

OP = torch.ops.ampkernels.scaled_matmul_fp8_wgmma_
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# The FP8 stack's training GEMM shapes, M x N x K.
SHAPES = [
    (8192, 8192, 8192),
    (16384, 2048, 8192),
    (16384, 8192, 2048),
    (16384, 6144, 2048),
    (8192, 3072, 768),
    (8192, 768, 3072),
]


def operands(M, N, K, dtype_a=E4M3, dtype_b=E4M3, granularity="tensor"):
    """a [M, K] row-major, b [K, N] column-major (float8 casts of random normal data) and their scale_inv."""
    a, sa = reference.to_float8(torch.randn(M, K, device="cuda") * 3, dtype_a, granularity)
    bt, sb = reference.to_float8(torch.randn(N, K, device="cuda") * 0.02, dtype_b, granularity)
    return a, bt.t(), sa, sb


def scaled_mm(a, b, sa, sb, out_dtype, fast_accum):
    """torch._scaled_mm with our scale shapes ([M, 1] and [1, N] for rowwise)."""
    rowwise = sa.numel() > 1
    sa_, sb_ = (sa.reshape(-1, 1), sb.reshape(1, -1)) if rowwise else (sa, sb)
    return torch._scaled_mm(a, b, sa_, sb_, out_dtype=out_dtype, use_fast_accum=fast_accum)


def force_width(width: int | None) -> None:
    """The wgmma kernels' tile width for the launches that follow (None: the launcher's choice)."""
    tuning.WGMMA_BN = width
    tuning.apply()  # the op is called directly: hand the switch to the extension


def check(M, N, K, width, dtypes=(E4M3, E4M3), granularity="tensor", out_dtype=torch.bfloat16):
    force_width(width)
    a, b, sa, sb = operands(M, N, K, *dtypes, granularity)
    ref = (a.double() @ b.double()) * sa.double().reshape(-1, 1) * sb.double().reshape(1, -1)
    # torch's error: its fp32 product (tensor-core accumulation, as ours) on the operands zero-padded to its multiples
    # of 16, scaled in float64 and rounded to the output dtype.
    M16, N16 = -(-M // 16) * 16, -(-N // 16) * 16
    a_pad = torch.zeros(M16, K, device="cuda", dtype=a.dtype)
    a_pad[:M] = a
    bt_pad = torch.zeros(N16, K, device="cuda", dtype=b.dtype)
    bt_pad[:N] = b.t()
    one = torch.ones((), device="cuda")
    product = torch._scaled_mm(a_pad, bt_pad.t(), one, one, out_dtype=torch.float32, use_fast_accum=True)
    low = (product[:M, :N].double() * sa.double().reshape(-1, 1) * sb.double().reshape(1, -1)).to(out_dtype).double()
    low_err = ((low - ref).norm() / ref.norm()).item()
    out = torch.full((M, N), math.nan, device="cuda", dtype=out_dtype)
    amax = torch.zeros(1, device="cuda")
    OP(a, b, sa, sb, None, 0, 1.0, None, out, False, None, amax)
    torch.cuda.synchronize()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    amax_ok = amax.item() == out.float().abs().max().item()
    ok = not out.isnan().any().item() and err <= 2 * low_err + 1e-6 and amax_ok
    names = "x".join(str(d).removeprefix("torch.float8_") for d in dtypes)
    print(f"{names} {M}x{N}x{K} {granularity} -> {out_dtype} BN {width}: err {err:.2e} (torch {low_err:.2e}), "
          f"amax {amax.item():.4g} {'ok' if amax_ok else 'WRONG'}: {'ok' if ok else 'WRONG'}", flush=True)  # fmt: skip
    if not ok:
        bad = (out.double() - ref).abs() > 1e-2 * ref.abs().max()
        rows, cols = bad.nonzero(as_tuple=True)
        print("  wrong elements:", bad.sum().item(), "first", list(zip(rows[:8].tolist(), cols[:8].tolist())))
        sys.exit(1)


def tflops(fn, flop) -> float:
    # 250 ms warm-up: timed at the steady power-capped clock (see benchmarks/bench_scaled_matmul.py, WARMUP_MS)
    return flop / triton.testing.do_bench(fn, warmup=250, rep=150) / 1e9


def main(quick: bool) -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for width in (256, 192, 128):
        for dtypes in ((E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)):
            check(256, 2 * width, 256, width, dtypes)  # whole tiles
        for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
            check(300, width + 40, 208, width, out_dtype=out_dtype)  # edges, K tail
            check(300, width + 40, 208, width, granularity="row", out_dtype=out_dtype)
        check(65, 33, 48, width, out_dtype=torch.float32)  # N % 8 != 0: the fp32 epilogue
    check(2100, 2400, 1024, 256)  # several tiles per block, ring wrap
    check(2048, 2048, 8192, 256, granularity="row")  # deep K against torch's rowwise
    force_width(None)

    shapes = SHAPES[:2] + SHAPES[-2:] if quick else SHAPES
    for granularity in ("tensor", "row"):
        for M, N, K in shapes:
            a, b, sa, sb = operands(M, N, K, granularity=granularity)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            flop = 2 * M * N * K
            fast = functools.partial(scaled_mm, a, b, sa, sb, torch.bfloat16, True)
            default = functools.partial(scaled_mm, a, b, sa, sb, torch.bfloat16, False)
            line = [f"_scaled_mm fast-accum {tflops(fast, flop):.0f}", f"default {tflops(default, flop):.0f}"]
            ours = functools.partial(OP, a, b, sa, sb, None, 0, 1.0, None, out, False, None, None)
            for width in (None, 256, 192, 128):
                force_width(width)
                line.append(f"{width or 'auto'} {tflops(ours, flop):.0f}")
            force_width(None)
            amax = torch.zeros(1, device="cuda")
            with_amax = functools.partial(OP, a, b, sa, sb, None, 0, 1.0, None, out, False, None, amax)
            line.append(f"auto+amax {tflops(with_amax, flop):.0f}")
            line.append(f"_scaled_mm fast-accum again {tflops(fast, flop):.0f}")
            print(f"fp8 e4m3 {granularity} {M}x{N}x{K} -> bf16 TFLOP/s: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main("--quick" in sys.argv)
