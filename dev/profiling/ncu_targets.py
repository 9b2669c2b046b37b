"""One launch of each kernel the notes leave open, for Nsight Compute (driven by dev/profiling/ncu_probe.sh).

python3 dev/profiling/ncu_targets.py unscale|wmma|wgmma|wgmma_small_k
- unscale: FusedGradScaler.unscale_ over 64 fp32 gradients of 16M elements (4.3 GB, Llama-1B scale): the write path
  at 85-88% of copy bandwidth;
- wmma: the CUDA WMMA kernel on 8192^3 bf16 (45% of cuBLAS), 128x128x64 tiles of 4 warps, single- then
  double-buffered fragments;
- wgmma: the sm_90a wgmma kernel on 4096 x 4096 x 4096 bf16 (nn), 256- then 128-wide tiles (the 256-wide ones ran
  ~25% slower per FLOP in the first measurement);
- wgmma_small_k: the same kernel on 8192 x 3072 x 768 bf16 (x @ W.T), where it reaches 0.47x cuBLAS: ~11 us per
  tile beyond its k-steps.
Only public entry points are used (the backend names and the native kernels' tile switches
ampkernels.matmul.tuning.WMMA_TILE and WGMMA_BN). Each target runs its kernel twice (compile/warm-up, then the one to
profile).
"""

import sys

import torch


def unscale() -> None:
    from ampkernels import FusedGradScaler

    params = [torch.nn.Parameter(torch.empty(1 << 24, device="cuda")) for _ in range(64)]
    for p in params:
        p.grad = torch.randn(1 << 24, device="cuda")
    opt = torch.optim.SGD(params, lr=0.0)
    scaler = FusedGradScaler(init_scale=1.0)
    scaler.scale(torch.ones((), device="cuda"))
    for _ in range(2):
        scaler.unscale_(opt)
        scaler.update()


def wmma() -> None:
    from ampkernels import scaled_matmul
    from ampkernels.matmul import clear_caches, tuning

    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    b = torch.randn(8192, 8192, device="cuda").bfloat16()
    for tile in ("128x128x64w4", "128x128x64w4db"):  # fragments single-, then double-buffered
        tuning.WMMA_TILE = tile
        clear_caches()  # hands the switch to the extension
        for _ in range(2):
            scaled_matmul(a, b, 1.0, backend="wmma")


def wgmma() -> None:
    from ampkernels import scaled_matmul
    from ampkernels.matmul import clear_caches, tuning

    a = torch.randn(4096, 4096, device="cuda").bfloat16()
    b = torch.randn(4096, 4096, device="cuda").bfloat16()
    for width in (256, 128):
        tuning.WGMMA_BN = width
        clear_caches()  # hands the switch to the extension
        for _ in range(2):
            scaled_matmul(a, b, 1.0, backend="wgmma")


def wgmma_small_k() -> None:
    from ampkernels import scaled_matmul

    a = torch.randn(8192, 768, device="cuda").bfloat16()
    w = torch.randn(3072, 768, device="cuda").bfloat16()
    for _ in range(2):
        scaled_matmul(a, w.t(), 1.0, backend="wgmma")


if __name__ == "__main__":
    targets = {"unscale": unscale, "wmma": wmma, "wgmma": wgmma, "wgmma_small_k": wgmma_small_k}
    targets[sys.argv[1]]()
    torch.cuda.synchronize()
