"""Why is stream-K slower than idle SMs on 3072x768x8192 (grad-weight layout)? dev/wgmma/probe.py, H200, bf16:
whole 128x192 tiles on 96 SMs 538 TFLOP/s; stream-K over 72 tiles of 128x256 on 132 SMs 489-499, i.e. ~1.13 us per
k-step a block against ~0.84 us at 8192^3. Hypothesis: a block's k-range starts at its own offset, so the three
tiles that read one row of A (3 x 256 columns) read each k-slice at unrelated times; A (48 MB) and B (12 MB) do not
both fit in the 50 MB L2, so A comes from DRAM up to three times. Whole tiles read it in step (L2 hits).

Test: the same comparison where both operands fit in L2 (K 4096: A 24 MB) and where they do not (K 8192, K 16384),
timed at the steady clock; with --ncu, one launch of each for Nsight Compute (DRAM bytes, L2 hit rate).

PYTHONPATH=$PWD python3 dev/wgmma/stream_k_probe.py [--ncu]   (GPU machine, after the build)
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import triton.testing

from ampkernels import _backend

_backend.native()
OP = torch.ops.ampkernels.scaled_matmul_wgmma_
# (label, AMPKERNELS_WGMMA_BN, AMPKERNELS_WGMMA_STREAMK)
VARIANTS = [("whole 192", "192", "0"), ("whole 256", "256", "0"), ("stream-K 256", "256", "1")]


def main(ncu: bool) -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for K in (4096, 8192, 16384) if not ncu else (4096, 8192):
        M, N = 3072, 768
        a = torch.randn(K, M, device="cuda").bfloat16().t()  # grad-weight: a = dy.T (column-major)
        b = torch.randn(K, N, device="cuda").bfloat16()
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        run = functools.partial(OP, a, b, None, 0, 1.0, None, out, False, None)
        line = []
        for label, width, stream_k in VARIANTS:
            os.environ["AMPKERNELS_WGMMA_BN"] = width
            os.environ["AMPKERNELS_WGMMA_STREAMK"] = stream_k
            if ncu:
                run()
                torch.cuda.synchronize()
                continue
            ms = triton.testing.do_bench(run, warmup=250, rep=150)
            line.append(f"{label} {2 * M * N * K / ms / 1e9:.0f}")
        if ncu:
            continue
        mm = triton.testing.do_bench(functools.partial(torch.mm, a, b), warmup=250, rep=150)
        print(f"bf16 {M}x{N}x{K} TFLOP/s: " + ", ".join(line) + f", cuBLAS {2 * M * N * K / mm / 1e9:.0f}", flush=True)


if __name__ == "__main__":
    main("--ncu" in sys.argv)
