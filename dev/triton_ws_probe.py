"""Does Triton 3.6's warp specialization on Hopper (``tl.range(..., warp_specialize=True)``: producer warps issue
the TMA loads, the others run the MMAs and the epilogue) close the Triton kernel's gap to cuBLAS?

For each of the benchmark's bf16 shapes: the tuner's choice without warp specialization, then every
warp-specialized candidate, each checked against torch.mm (relative error within 2x the tuned kernel's) and timed
against cuBLAS at the steady power-capped clock (250 ms warm-up, as the benchmark), in two turns.

python3 dev/triton_ws_probe.py   (GPU machine; PYTHONPATH=repository root)
"""

from __future__ import annotations

import functools
import sys

import torch
import triton.testing

from ampkernels.triton import scaled_matmul as sm

# (M, N, K, layout) as benchmarks/bench_scaled_matmul.py (fwd: b = W.T view; grad-wt: a = dy.T view).
SHAPES = [
    (4096, 4096, 4096, "nn"),
    (8192, 8192, 8192, "nn"),
    (8192, 4096, 4096, "fwd"),
    (8192, 11008, 4096, "fwd"),
    (8192, 4096, 11008, "grad-in"),
    (11008, 4096, 8192, "grad-wt"),
    (8192, 3072, 768, "fwd"),
    (8192, 768, 3072, "fwd"),
    (8192, 768, 3072, "grad-in"),
    (3072, 768, 8192, "grad-wt"),
]
WS = [
    sm.Config(128, 256, 64, 3, 8, epilogue_split=2, warp_specialize=True),
    sm.Config(128, 256, 64, 4, 8, epilogue_split=2, warp_specialize=True),
    sm.Config(128, 256, 64, 3, 4, epilogue_split=2, warp_specialize=True),
    sm.Config(128, 128, 64, 4, 8, warp_specialize=True),
    sm.Config(128, 128, 64, 5, 4, warp_specialize=True),
    sm.Config(128, 128, 64, 6, 8, warp_specialize=True),
]


def operands(M, N, K, layout):
    a = torch.randn(K, M, device="cuda").bfloat16().t() if layout == "grad-wt" else torch.randn(M, K, device="cuda")
    b = torch.randn(N, K, device="cuda").bfloat16().t() if layout == "fwd" else torch.randn(K, N, device="cuda")
    return a.bfloat16(), b.bfloat16()


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for M, N, K, layout in SHAPES:
        a, b = operands(M, N, K, layout)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor([0.73], device="cuda")
        p = sm.Problem(a, b, scale, sm.SCALE_TENSOR, 1.0, None, out, False, None)
        plan = sm.plan_for(a, b, out)
        tuned = sm.choose_config(p, plan)
        ref = (a.float() @ b.float()) * 0.73
        variants = {"cuBLAS": functools.partial(torch.mm, a, b)}
        errors = {}
        for cfg in (tuned, *WS):
            try:
                run = sm._Launcher(p, plan, cfg, direct=True)
                out.fill_(float("nan"))
                run(a, b, scale, 1.0, None, out, None)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result here
                print(f"  {cfg.describe()}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            errors[cfg.describe()] = float((out.float() - ref).norm() / ref.norm())
            variants[cfg.describe()] = functools.partial(run, a, b, scale, 1.0, None, out, None)
        flop = 2 * M * N * K
        tflops = {name: [] for name in variants}
        for turn in range(2):
            for name in variants if turn == 0 else reversed(list(variants)):
                ms = triton.testing.do_bench(variants[name], warmup=250, rep=150)
                tflops[name].append(flop / ms / 1e9)
        base = sum(tflops["cuBLAS"]) / 2
        print(f"bf16 {M}x{N}x{K} {layout}: cuBLAS {base:.0f} TFLOP/s", flush=True)
        limit = 2 * errors[tuned.describe()]
        for name, values in tflops.items():
            if name == "cuBLAS":
                continue
            mean = sum(values) / 2
            flag = "" if errors[name] <= limit else f"  WRONG (err {errors[name]:.2e} > {limit:.2e})"
            mark = " (tuned)" if name == tuned.describe() else ""
            print(f"  {name}{mark}: {mean:.0f} ({mean / base:.3f}x), err {errors[name]:.2e}{flag}", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
