"""The FP8 GEMMs on six training shapes, TFLOP/s, against ``torch._scaled_mm`` and bf16 cuBLAS in the same run
(called by ``benchmarks/bench_float8.py``; not a module of its own).

Per M×N×K shape (``SHAPES``), on the same operands (a = x8 [M, K] row-major, b = w8.t()
with w8 [N, K] contiguous: the forward GEMM's layout, the only one cuBLAS's FP8 GEMM takes):

* bf16 cuBLAS ``torch.mm`` (the ceiling FP8 has to beat);
* ``torch._scaled_mm`` e4m3, tensorwise (0-d scales) and rowwise ([M, 1] and [1, N] scales), bf16 output;
* the same with ``use_fast_accum=True`` (cuBLAS's faster, less precise accumulation; not the default);
* ampkernels ``scaled_matmul(a, b, scale_a=, scale_b=)`` with the same scales: the default (``auto``), ``triton``,
  ``wgmma`` when the extension has it, and ``cublas`` (``torch._scaled_mm`` with fast accumulation where that stays
  within the accuracy rule: ``ampkernels.matmul.launch.fast_accumulation_ok``).

Ratios are to ``torch._scaled_mm`` as called by default, with the same scaling.

GPU: medians of ``triton.testing.do_bench`` with bench_scaled_matmul's warm-up at the power-capped clock, the
variants taking turns. CPU: 64³ through the reference and torch's CPU ``_scaled_mm``, wall time (a smoke run).
"""

from __future__ import annotations

from typing import Any

import torch

from ampkernels import dispatch
from ampkernels.scaled_matmul import scaled_matmul
from benchmarks.bench_scaled_matmul import _geomean, _time_gpu
from benchmarks.common import (
    RunContext,
    check_cell,
    check_result,
    failure_lines,
    format_table,
    free_device_memory,
    time_interleaved,
)

#: M x N x K: square; the Llama-style MLP's up (d 2048 -> 8192) and down; attention; BERT-sized.
SHAPES = (
    (8192, 8192, 8192),
    (16384, 2048, 8192),
    (16384, 8192, 2048),
    (16384, 6144, 2048),
    (8192, 3072, 768),
    (8192, 768, 3072),
)
CPU_SHAPES = ((64, 64, 64),)
BF16, SCALED_MM, SCALED_MM_FAST = "bf16 cuBLAS mm", "torch._scaled_mm", "torch._scaled_mm use_fast_accum"


def _backends(device: torch.device) -> list[str]:
    """ampkernels' float8 backends to time here (the reference only on the CPU)."""
    if device.type != "cuda":
        return ["torch"]
    names = ["auto"] if dispatch.select("scaled_matmul_float8", device) == "auto" else []
    ours = ("triton", "wgmma", "cublas")
    return names + [n for n in ours if dispatch.why_not("scaled_matmul_float8", n, device) is None]


#: tests/matmul/test_scaled_matmul_float8.py (_assert_within_twice): the relative error against float64 at most twice
#: torch._scaled_mm's (same operands, same scales) plus this.
ERROR_SLACK = 1e-6
CHECK_NOTE = (
    "check, after the timed loops (ampkernels rows): the relative error (Frobenius norm) of each result against a "
    "float64 product of the same fp8 operands and scales at most twice torch._scaled_mm's + 1e-6, as "
    "tests/matmul/test_scaled_matmul_float8.py requires"
)


def _check_shape(variants: dict[tuple[str, str], Any], operands) -> dict[tuple[str, str], dict[str, Any]]:
    """Per variant but bf16 cuBLAS (other operands): its relative error against float64 and, for ampkernels', the
    check against torch._scaled_mm's error with the same scaling."""
    a, b, scales = operands
    a64, b64 = a.double(), b.double()
    errors = {}
    for granularity, (sa, sb) in scales.items():
        exact = (a64 * sa.double()) @ (b64 * sb.double())
        for key, fn in variants.items():
            if key[1] == granularity:
                errors[key] = float((fn().double() - exact).norm() / exact.norm())
        del exact
    out = {}
    for key, error in errors.items():
        name, granularity = key
        allowed = 2.0 * errors[(SCALED_MM, granularity)] + ERROR_SLACK
        problems = [] if error <= allowed else [f"relative error {error:.3e} against float64 > {allowed:.3e}"]
        out[key] = {
            "rel_err_vs_fp64": error,
            "check": check_result(problems) if name.startswith("ampkernels") else None,
        }
    return out


def _variants(M: int, N: int, K: int, device: torch.device, backends: list[str]):
    """(the timed calls by (implementation, scaling), (a, b, {scaling: (scale_a, scale_b)}))."""
    x = torch.randn(M, K, device=device)
    w = torch.randn(N, K, device=device)
    x16, w16 = x.to(torch.bfloat16), w.to(torch.bfloat16)
    a, b = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).t()
    del x, w
    scales = {
        "tensorwise": (torch.tensor(0.8, device=device), torch.tensor(1.25, device=device)),
        "rowwise": (torch.rand(M, 1, device=device) + 0.5, torch.rand(1, N, device=device) + 0.5),
    }
    variants: dict[tuple[str, str], Any] = {(BF16, "-"): lambda: torch.mm(x16, w16.t())}
    for granularity, (sa, sb) in scales.items():
        variants[(SCALED_MM, granularity)] = lambda sa=sa, sb=sb: torch._scaled_mm(
            a, b, sa, sb, out_dtype=torch.bfloat16
        )
        if device.type == "cuda":  # cuBLAS's faster mode, shown for what the ratios would be against it
            variants[(SCALED_MM_FAST, granularity)] = lambda sa=sa, sb=sb: torch._scaled_mm(
                a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True
            )
        for backend in backends:
            variants[(f"ampkernels {backend}", granularity)] = lambda sa=sa, sb=sb, backend=backend: scaled_matmul(
                a, b, scale_a=sa, scale_b=sb, backend=backend
            )
    return variants, (a, b, scales)


def run_gemms(ctx: RunContext) -> list[dict]:
    """One row per (shape, implementation, scaling): ms, TFLOP/s, ratio to ``torch._scaled_mm`` with the same
    scaling (and to bf16 cuBLAS), then a geomean row per implementation and scaling."""
    shapes = CPU_SHAPES if ctx.cpu_small else SHAPES
    backends = _backends(ctx.device)
    rows: list[dict] = []
    for M, N, K in shapes:
        variants, operands = _variants(M, N, K, ctx.device, backends)
        if ctx.cpu_small:
            timings = time_interleaved(variants, ctx.device, ctx.repeats, ctx.target_loop_s)
            ms = {key: timing.median_wall_ms for key, timing in timings.items()}
        else:
            ms = _time_gpu(variants, max(3, ctx.repeats))
        checks = _check_shape(variants, operands)
        flops = 2.0 * M * N * K
        for (name, granularity), time_ms in ms.items():
            stock = ms.get((SCALED_MM, granularity))
            rows.append(
                {
                    "shape": f"{M}x{N}x{K}",
                    "M": M,
                    "N": N,
                    "K": K,
                    "implementation": name,
                    "scaling": granularity,
                    "ms": time_ms,
                    "tflops": flops / (time_ms * 1e-3) / 1e12,
                    "vs_scaled_mm": None if stock is None else stock / time_ms,
                    "vs_bf16": ms[(BF16, "-")] / time_ms,
                    **checks.get((name, granularity), {"check": None}),
                }
            )
        del variants, operands
        free_device_memory(ctx.device)
    for name, granularity in dict.fromkeys((r["implementation"], r["scaling"]) for r in rows):
        picked = [r for r in rows if r["implementation"] == name and r["scaling"] == granularity]
        ratios = [r["vs_scaled_mm"] for r in picked if r["vs_scaled_mm"] is not None]
        rows.append(
            {
                "shape": f"geomean over {len(picked)}",
                "implementation": name,
                "scaling": granularity,
                "tflops": _geomean([r["tflops"] for r in picked]),
                "vs_scaled_mm": _geomean(ratios) if ratios else None,
                "min_vs_scaled_mm": min(ratios) if ratios else None,
                "vs_bf16": _geomean([r["vs_bf16"] for r in picked]),
            }
        )
    return rows


def report_gemms(rows: list[dict]) -> str:
    """The rows as a table: TFLOP/s, x torch._scaled_mm (same scaling; the geomean rows with the worst shape)."""
    headers = ["M x N x K", "implementation", "scaling", "ms", "TFLOP/s", "x _scaled_mm", "x bf16 mm", "check"]
    table = []
    for r in rows:
        ratio = "-" if r["vs_scaled_mm"] is None else f"{r['vs_scaled_mm']:.3f}"
        if r.get("min_vs_scaled_mm") is not None:
            ratio += f" (min {r['min_vs_scaled_mm']:.2f})"
        ms = f"{r['ms']:.3f}" if "ms" in r else ""
        table.append(
            [r["shape"], r["implementation"], r["scaling"], ms, f"{r['tflops']:.1f}", ratio, f"{r['vs_bf16']:.2f}"]
            + [check_cell(r)]
        )
    lines = [format_table(headers, table, "lllrrrrl"), *failure_lines(rows)]
    return "\n".join([*lines, f"note: {CHECK_NOTE}"])
