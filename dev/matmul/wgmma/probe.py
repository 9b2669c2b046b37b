"""Probe of the wgmma scaled matmul (csrc/matmul/wgmma.cuh) on the GPU: correctness first (every layout
and tile width against a float64 reference, on shapes with edges), then TFLOP/s against torch.mm in the same
process for the benchmark's layouts, per tile width (ampkernels.matmul.tuning.WGMMA_BN) and the launcher's own choice.

Run on the device after the build: ``PYTHONPATH=$PWD timeout 120 python3 dev/matmul/wgmma/probe.py [--quick]``.
Stops at the first wrong result (printing it), so a broken kernel costs seconds, not a test suite.
"""

from __future__ import annotations

import functools
import sys

import ampkernels._C  # noqa: F401  (registers torch.ops.ampkernels.*)
import torch
import triton.testing

from ampkernels.matmul import tuning

OP = torch.ops.ampkernels.scaled_matmul_wgmma_


def operand(rows, cols, dtype, row_major):
    if row_major:
        return torch.randn(rows, cols, device="cuda").to(dtype)
    return torch.randn(cols, rows, device="cuda").to(dtype).t()


def force_width(width: int | None) -> None:
    """The wgmma kernels' tile width for the launches that follow (None: the launcher's choice)."""
    tuning.WGMMA_BN = width
    tuning.apply()  # the op is called directly: hand the switch to the extension


def check(M, N, K, dtype, ra, rb, width):
    force_width(width)
    a, b = operand(M, K, dtype, ra), operand(K, N, dtype, rb)
    ref = a.double() @ b.double()
    low = ((a @ b).double() - ref).norm().item() / ref.norm().item()
    for out_dtype in (torch.float32, dtype):  # the fp32 epilogue, then the packed 16-bit one
        out = torch.full((M, N), float("nan"), device="cuda", dtype=out_dtype)
        OP(a, b, None, 0, 1.0, None, out, False, None)
        torch.cuda.synchronize()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        ok = not out.isnan().any().item() and err <= 2 * low + 1e-6
        if not ok:
            break
    print(f"{dtype} {M}x{N}x{K} a{'r' if ra else 'c'} b{'r' if rb else 'c'} BN {width}: err {err:.2e} "
          f"(torch {low:.2e}, out {out_dtype}) {'ok' if ok else 'WRONG'}", flush=True)  # fmt: skip
    if not ok:
        bad = (out.double() - ref).abs() > 1e-2 * ref.abs().max()
        rows, cols = bad.nonzero(as_tuple=True)
        print("  wrong elements:", bad.sum().item(), "first", list(zip(rows[:8].tolist(), cols[:8].tolist())))
        sys.exit(1)


def main(quick: bool) -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    for width in (256, 192, 128):
        for ra in (True, False):
            for rb in (True, False):
                check(256, 2 * width, 128, torch.bfloat16, ra, rb, width)  # whole tiles
                check(300, width + 40, 200, torch.float16, ra, rb, width)  # edges, K tail
    check(2100, 2400, 330, torch.bfloat16, True, True, 256)  # several tiles per block, ring wrap
    force_width(None)

    shapes = [
        (8192, 8192, 8192, True, True),  # nn
        (4096, 4096, 4096, True, True),
        (8192, 4096, 4096, True, False),  # fwd
        (8192, 768, 3072, True, False),
        (8192, 768, 3072, True, True),  # grad-in
        (3072, 768, 8192, False, True),  # grad-wt
        (3072, 768, 8192, True, False),  # the same product, K-major operands
        (8192, 3072, 768, True, False),
    ]
    if quick:
        shapes = shapes[:4]
    for M, N, K, ra, rb in shapes:
        a, b = operand(M, K, torch.bfloat16, ra), operand(K, N, torch.bfloat16, rb)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        flop = 2 * M * N * K
        line = []
        mm = functools.partial(torch.mm, a, b)
        ours = functools.partial(OP, a, b, None, 0, 1.0, None, out, False, None)
        # 250 ms warm-up: timed at the steady power-capped clock (see benchmarks/bench_scaled_matmul.py, WARMUP_MS)
        ms = triton.testing.do_bench(mm, warmup=250, rep=150)
        line.append(f"cuBLAS {flop / ms / 1e9:.0f}")
        for width in (None, 256, 192, 128):
            force_width(width)
            ms = triton.testing.do_bench(ours, warmup=250, rep=150)
            line.append(f"{width or 'auto'} {flop / ms / 1e9:.0f}")
        force_width(None)
        ms = triton.testing.do_bench(mm, warmup=250, rep=150)
        line.append(f"cuBLAS again {flop / ms / 1e9:.0f}")
        print(f"bf16 {M}x{N}x{K} a{'r' if ra else 'c'} b{'r' if rb else 'c'} TFLOP/s: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main("--quick" in sys.argv)
