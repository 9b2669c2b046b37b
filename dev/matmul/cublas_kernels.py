"""Which cuBLAS kernels torch.mm runs for the benchmark's N=768 shapes (tile shape, stream-K or split-K in the name),
and their device times. python3 dev/matmul/cublas_kernels.py (GPU machine)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

# (M, N, K, layout) as in benchmarks/bench_scaled_matmul.py: fwd = x @ W^T, grad-in = dY @ W, grad-wt = dY^T @ X.
CASES = [(8192, 3072, 768, "fwd"), (8192, 768, 3072, "fwd"), (8192, 768, 3072, "grad-in"), (3072, 768, 8192, "grad-wt")]


def operands(M, N, K, layout):
    def randn(*shape):
        return torch.randn(*shape, device="cuda").bfloat16()

    a = randn(K, M).t() if layout == "grad-wt" else randn(M, K)
    b = randn(N, K).t() if layout == "fwd" else randn(K, N)
    return a, b


def main() -> None:
    for M, N, K, layout in CASES:
        a, b = operands(M, N, K, layout)
        for _ in range(3):
            torch.mm(a, b)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                torch.mm(a, b)
            torch.cuda.synchronize()
        for evt in prof.key_averages():
            if evt.device_type == torch.autograd.DeviceType.CUDA or "gemm" in evt.key.lower():
                us = evt.device_time_total / max(evt.count, 1)
                print(f"{M}x{N}x{K} {layout:8s} {us:7.1f} us  {evt.key[:150]}")


if __name__ == "__main__":
    main()
