"""Would split-K close the gap on the N=768 shapes? (Triton 0.66-0.81x cuBLAS there: 72-144 output tiles for 132 SMs)

A stand-alone probe, not wired into ampkernels: each of SPLIT programs per output tile sums its slice of K and the
partial tiles meet in an fp32 workspace, either by atomic adds (one workspace, zeroed first; order not fixed) or in
per-split slices summed in a fixed order by the epilogue (deterministic, SPLIT times the workspace traffic). The
epilogue applies the device-tensor scale and writes the output dtype. Timed with do_bench against cuBLAS mm alone
and cuBLAS then `* scale`, the whole op included (zeroing, GEMM, epilogue).

On the GPU machine: python3 dev/splitk_probe.py            (a table per shape: the best configs of each variant)
On the CPU:        TRITON_INTERPRET=1 python dev/splitk_probe.py --check   (correctness on small shapes)
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton
import triton.language as tl

# (M, N, K, layout): the shapes of the benchmark where Triton trails cuBLAS most (README, scaled_matmul table).
SHAPES = [(8192, 768, 3072, "fwd"), (8192, 768, 3072, "grad-in"), (3072, 768, 8192, "grad-wt")]
CONFIGS = [
    (bm, bn, bk, split, warps, stages)
    for bm, bn in ((128, 128), (128, 64), (64, 128))
    for bk in (64,)
    for split in (1, 2, 3, 4, 6)
    for warps, stages in ((4, 4), (8, 3))
]


@triton.jit
def _splitk_kernel(a_ptr, b_ptr, ws_ptr, M, N, K, k_per_split, stride_am, stride_ak, stride_bk, stride_bn,
                   ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr):  # fmt: skip
    tile, split = tl.program_id(0), tl.program_id(1)
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = tile // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    rows_in_group = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % rows_in_group)
    pid_n = (tile % (GROUP_M * num_pid_n)) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + (k_begin + offs_k)[None, :] * stride_ak
    b_ptrs = b_ptr + (k_begin + offs_k)[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        a = tl.load(a_ptrs, mask=(k + offs_k)[None, :] < k_end, other=0.0)
        b = tl.load(b_ptrs, mask=(k + offs_k)[:, None] < k_end, other=0.0)
        acc = tl.dot(a, b, acc)  # (bf16 tl.dot is wrong in the interpreter: --check runs fp16)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    offsets = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if ATOMIC:
        tl.atomic_add(ws_ptr + offsets, acc, mask=mask, sem="relaxed")
    else:
        tl.store(ws_ptr + split.to(tl.int64) * M * N + offsets, acc, mask=mask)


@triton.jit
def _epilogue_kernel(ws_ptr, out_ptr, scale_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # a fixed order: the same sum on every run
        acc += tl.load(ws_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, (acc * tl.load(scale_ptr)).to(out_ptr.dtype.element_ty), mask=mask)


def splitk_mm(a, b, scale, cfg, atomic: bool, out_dtype=None):
    bm, bn, bk, split, warps, stages = cfg
    M, K = a.shape
    N = b.shape[1]
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per_split)
    slices = 1 if atomic else split
    ws = (torch.zeros if atomic else torch.empty)((slices, M, N), dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), split)
    _splitk_kernel[grid](a, b, ws, M, N, K, k_per_split, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                         ATOMIC=atomic, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps,
                         num_stages=stages)  # fmt: skip
    out = torch.empty((M, N), dtype=out_dtype or a.dtype, device=a.device)
    block = 1024
    _epilogue_kernel[(triton.cdiv(M * N, block),)](ws, out, scale, M * N, SPLIT=slices, BLOCK=block)
    return out


def operands(M, N, K, layout, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(M, K, dtype=dtype, device=device, generator=gen)
    b = torch.randn(K, N, dtype=dtype, device=device, generator=gen)
    if layout == "grad-in":  # dY @ W: W stored [N, K] as the forward's weight, read transposed
        b = b.t().contiguous().t()
    if layout == "grad-wt":  # X^T @ dY: X stored [K, M]
        a = a.t().contiguous().t()
    return a, b


def check() -> None:
    for (M, N, K), atomic, split in itertools.product([(17, 33, 65), (64, 48, 200)], (True, False), (1, 3)):
        a, b = operands(M, N, K, "fwd", torch.float16, "cpu")
        scale = torch.tensor(0.5)
        got = splitk_mm(a, b, scale, (32, 32, 32, split, 4, 2), atomic, torch.float32)
        want = (a.double() @ b.double()) * 0.5
        torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-3)
    print("split-K probe: results match the float64 reference")


def probe_shape(M: int, N: int, K: int, layout: str, dtype: torch.dtype) -> None:
    from functools import partial

    from triton.testing import do_bench

    a, b = operands(M, N, K, layout, dtype, "cuda")
    scale = torch.tensor(0.5, device="cuda")

    def tflops(ms: float) -> float:
        return 2 * M * N * K / ms / 1e9

    mm = do_bench(lambda: torch.mm(a, b))
    mm_scale = do_bench(lambda: torch.mm(a, b).mul_(scale))
    reference = (a.float() @ b.float()) * 0.5
    print(f"{dtype} {M}x{N}x{K} {layout}: cuBLAS {tflops(mm):.0f} TFLOP/s, then scale {tflops(mm_scale):.0f}")
    for atomic in (True, False):
        rows = []
        for cfg in CONFIGS:
            if not atomic and cfg[3] == 1:
                continue
            run = partial(splitk_mm, a, b, scale, cfg, atomic)
            try:
                err = ((run().float() - reference).abs().max() / reference.abs().max()).item()
                rows.append((do_bench(run), cfg, err))
            except Exception as exc:  # a config the compiler refuses (shared memory): skip it
                print(f"  {cfg}: {type(exc).__name__}")
        for ms, cfg, err in sorted(rows)[:3]:
            kind = "atomic" if atomic else "ordered"
            print(f"  {kind} {cfg}: {tflops(ms):.0f} TFLOP/s ({mm / ms:.2f}x cuBLAS), max rel err {err:.1e}")


def main() -> None:
    for M, N, K, layout in SHAPES:
        probe_shape(M, N, K, layout, torch.bfloat16)


if __name__ == "__main__":
    check() if "--check" in sys.argv else main()
