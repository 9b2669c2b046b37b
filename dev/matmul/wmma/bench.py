"""Times ampkernels::scaled_matmul_wmma_ against torch.mm (cuBLAS) in the same process, for every tile configuration
the launcher knows (ampkernels.matmul.tuning.WMMA_TILE), and prints TFLOP/s and % of cuBLAS. Run from the repository
root after building the extension: ``python3 dev/matmul/wmma/bench.py [--quick]``.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.getcwd())
import ampkernels._C  # noqa: E402,F401  (registers torch.ops.ampkernels.*)

from ampkernels.matmul import tuning  # noqa: E402

OP = torch.ops.ampkernels.scaled_matmul_wmma_
TILES = ["auto", "128x128x32w4", "128x128x64w4", "128x128x64w4db", "portable"]


def timed(fn, reps: int) -> float:
    """Median milliseconds of fn over `reps` runs, each between CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def operands(M, N, K, dtype, layout):
    a = (
        torch.randn(M, K, device="cuda").to(dtype)
        if layout[0] == "r"
        else torch.randn(K, M, device="cuda").to(dtype).t()
    )
    b = (
        torch.randn(K, N, device="cuda").to(dtype)
        if layout[1] == "r"
        else torch.randn(N, K, device="cuda").to(dtype).t()
    )
    return a, b


def main():
    quick = "--quick" in sys.argv
    cases = [
        (4096, 4096, 4096, "rr"),
        (8192, 8192, 8192, "rr"),
        (8192, 8192, 8192, "rc"),
        (8192, 3072, 768, "rc"),  # transformer forward x @ W^T
        (8192, 768, 3072, "rr"),  # grad input dY @ W
        (768, 3072, 8192, "cr"),  # grad weight dY^T @ X
    ]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for M, N, K, layout in cases:
            a, b = operands(M, N, K, dtype, layout)
            scale = torch.tensor([0.5], device="cuda")
            out = torch.empty(M, N, device="cuda", dtype=dtype)
            flops = 2.0 * M * N * K
            reps = 10 if quick else 30
            t_ref = timed(lambda a=a, b=b: torch.mm(a, b), reps)
            ref = torch.mm(a.float(), b.float()) * 0.5
            line = [f"{str(dtype)[6:]:8s} {M}x{N}x{K} {layout}", f"cuBLAS {flops / t_ref / 1e9:6.0f}"]
            for tile in TILES:
                if tile == "portable" and M * N * K > 4096**3:
                    continue  # the scalar-load path is slow; one size is enough to place it
                tuning.WMMA_TILE = tile
                tuning.apply()  # the op is called directly: hand the switch to the extension
                fn = lambda a=a, b=b, s=scale, o=out: OP(a, b, s, 1, 1.0, None, o, False, None)  # noqa: E731
                t = timed(fn, reps)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                line.append(f"{tile} {flops / t / 1e9:6.0f} ({100 * t_ref / t:3.0f}%, err {err:.1e})")
                rows.append((str(dtype), M, N, K, layout, tile, flops / t / 1e9, flops / t_ref / 1e9))
            tuning.WMMA_TILE = "auto"
            tuning.apply()
            print(" | ".join(line), flush=True)
    print("\nTFLOP/s: dtype M N K layout tile wmma cuBLAS")
    for r in rows:
        print(*r[:6], f"{r[6]:.0f}", f"{r[7]:.0f}")


if __name__ == "__main__":
    main()
