"""``ampkernels.scaled_matmul`` against cuBLAS, TFLOP/s, in the same run.

Per case (dtype, M×N×K, layout), on the same operands:

* cuBLAS mm alone: ``torch.mm(a, b)`` (no scale: the ceiling to match);
* cuBLAS then scale: ``torch.mm(a, b) * scale`` with a 0-d device tensor (what a sync-free scale costs unfused);
* ampkernels Triton, and the CUDA wgmma (sm_90a builds on Hopper) and WMMA kernels when the extension has them:
  ``scaled_matmul(a, b, scale, backend=...)``;
* on Hopper, the library's default ``"auto"`` (the faster of Triton and wgmma per problem, timed on first use):
  ``scaled_matmul(a, b, scale)``.

Layouts: ``nn`` (row-major a and b), ``fwd`` = ``x @ W.T`` (b a column-major view), ``grad-in`` = ``dy @ W`` (nn),
``grad-wt`` = ``dy.T @ x`` (a a column-major view). Transformer shapes use M = 8192 tokens and Linear widths
768/3072 (BERT) and 4096/11008 (Llama-7B). Time: ``triton.testing.do_bench`` medians after WARMUP_MS of warm-up
(GPU: at the steady power-capped clock, see the note at WARMUP_MS); on the CPU a 64³ smoke set through the reference
and the Triton interpreter, wall time (not comparable to anything).
After its timed loops each case checks every result: relative error against a float64 matmul, ours ≤ 2×
cuBLAS-then-scale's + 1e-6 (``CHECK_NOTE``).
"""

from __future__ import annotations

import importlib
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ampkernels import scaled_matmul
from benchmarks.common import (
    RunContext,
    check_cell,
    check_result,
    failure_lines,
    format_table,
    free_device_memory,
    plot_grouped_bars,
    time_interleaved,
)

NAME = "scaled_matmul"

CUBLAS, CUBLAS_SCALE, TRITON, WMMA, REFERENCE = "cublas_mm", "cublas_then_scale", "triton", "wmma", "reference"
WGMMA, AUTO = "wgmma", "auto"
LABELS = {
    AUTO: "ampkernels default (auto: Triton or wgmma)",
    CUBLAS: "cuBLAS mm (no scale)",
    CUBLAS_SCALE: "cuBLAS mm, then * scale",
    TRITON: "ampkernels Triton",
    WGMMA: "ampkernels CUDA wgmma (sm_90a)",
    WMMA: "ampkernels CUDA WMMA",
    REFERENCE: "ampkernels reference (torch)",
}
CPU_PLOT_CAVEAT = (
    "CPU smoke run: 64^3 products, the Triton kernel in its interpreter; the bars check the code paths and are not a "
    "speed claim"
)
CPU_LABELS = {CUBLAS: "torch mm (CPU)", CUBLAS_SCALE: "torch mm, then * scale (CPU)", TRITON: "Triton interpreter"}


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    M: int
    N: int
    K: int
    layout: str  # nn | fwd | grad-in | grad-wt

    @property
    def label(self) -> str:
        return f"{self.M}x{self.N}x{self.K} {self.layout}"


# NOTE: a case costs ~10 s on the H200 (the warm-up below, for 5-6 variants, 3 rounds): the default run times four,
# a square product, the widest and the narrowest BERT/Llama projections, and fp16 beside bf16.
DEFAULT_CASES = (
    ("bfloat16", "8192x8192x8192 nn"),
    ("bfloat16", "8192x4096x4096 fwd"),
    ("bfloat16", "8192x768x3072 fwd"),
    ("float16", "8192x4096x4096 fwd"),
)


def _cases(cpu_small: bool, full: bool = True) -> list[Case]:
    """Every case (``full``) or those of DEFAULT_CASES; on the CPU four 64^3 cases either way."""
    if not cpu_small and not full:
        return [c for c in _cases(False) if (str(c.dtype).removeprefix("torch."), c.label) in DEFAULT_CASES]
    if cpu_small:
        return [
            Case(dtype, 64, 64, 64, layout) for dtype in (torch.bfloat16, torch.float16) for layout in ("nn", "fwd")
        ]
    bf16 = [
        Case(torch.bfloat16, 4096, 4096, 4096, "nn"),
        Case(torch.bfloat16, 8192, 8192, 8192, "nn"),
        Case(torch.bfloat16, 16384, 4096, 4096, "nn"),
        Case(torch.bfloat16, 8192, 3072, 768, "fwd"),  # BERT up-projection
        Case(torch.bfloat16, 8192, 768, 3072, "fwd"),  # BERT down-projection
        Case(torch.bfloat16, 8192, 4096, 4096, "fwd"),  # Llama attention projections
        Case(torch.bfloat16, 8192, 11008, 4096, "fwd"),  # Llama MLP up/gate
        Case(torch.bfloat16, 8192, 4096, 11008, "grad-in"),  # dy @ W of the MLP up/gate
        Case(torch.bfloat16, 8192, 768, 3072, "grad-in"),  # dy @ W of the BERT up-projection
        Case(torch.bfloat16, 11008, 4096, 8192, "grad-wt"),  # dy.T @ x of the MLP up/gate
        Case(torch.bfloat16, 3072, 768, 8192, "grad-wt"),  # dy.T @ x of the BERT up-projection
    ]
    fp16 = [
        Case(torch.float16, 4096, 4096, 4096, "nn"),
        Case(torch.float16, 8192, 8192, 8192, "nn"),
        Case(torch.float16, 8192, 4096, 4096, "fwd"),
        Case(torch.float16, 8192, 11008, 4096, "fwd"),
    ]
    return bf16 + fp16


def _operands(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random a [M, K] and b [K, N] in the case's layout (transposed views where the layout has them)."""

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=torch.float32).to(case.dtype)

    a = randn(case.K, case.M).t() if case.layout == "grad-wt" else randn(case.M, case.K)
    b = randn(case.N, case.K).t() if case.layout == "fwd" else randn(case.K, case.N)
    return a, b


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (NaN where x is not finite)."""
    return float((x.double() - ref).norm() / ref.norm())


#: tests/matmul/scaled_matmul_helpers.py (_assert_accuracy): the relative error against float64 at most twice that of
#: cuBLAS then ``* scale`` in the low-precision dtype, plus this.
ERROR_SLACK = 1e-6
CHECK_NOTE = (
    "check, after the timed loops: each ampkernels result's relative error (Frobenius norm) against a float64 "
    "matmul times the scale at most twice cuBLAS-then-scale's + 1e-6, as tests/matmul/scaled_matmul_helpers.py requires"
)


def _check_case(
    a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, variants: dict[str, Any]
) -> tuple[dict[str, float], dict[str, str]]:
    """(relative error of every scaled variant against float64, the check of each ampkernels variant)."""
    ref = (a.double() @ b.double()) * scale.double()
    errors = {name: _rel_err(fn(), ref) for name, fn in variants.items() if name != CUBLAS}
    del ref
    allowed = 2.0 * errors[CUBLAS_SCALE] + ERROR_SLACK
    checks = {
        name: check_result(
            []
            if error <= allowed
            else [
                f"relative error {error:.3e} against float64, more than 2x cuBLAS-then-scale's + 1e-6 ({allowed:.3e})"
            ]
        )
        for name, error in errors.items()
        if name != CUBLAS_SCALE
    }
    return errors, checks


def _available_backends(device: torch.device) -> list[str]:
    module = importlib.import_module("ampkernels.scaled_matmul")
    found = [AUTO] if device.type == "cuda" and module.select_backend(device) == AUTO else []
    found += [TRITON] if module.why_not("triton", device) is None else []
    for name in (WGMMA, WMMA):
        if device.type == "cuda" and module.why_not(name, device) is None:
            found.append(name)
    return found


# NOTE (H200, dev/matmul/power_probe.py, 8192x4096x4096 bf16): the large products run at the board's 700 W cap, where
# the SM clock settles near 1500 MHz within ~100 ms of sustained load; after an idle pause or a lighter kernel it boosts
# toward 1980 MHz first (cuBLAS 0.363 ms in its first 100 ms after a pause, 0.412 ms from then on). A few ms of warm-up
# would time a variant inside that transient, so that its figure depended on what ran before it. Every
# variant is warmed up for WARMUP_MS of back-to-back runs and timed at the cap, as in a training step.
WARMUP_MS, REP_MS = 250, 150


def _time_gpu(variants: dict[str, Any], rounds: int) -> dict[str, float]:
    """Median ms of each variant over ``rounds`` turns of ``do_bench`` (L2 flushed before every run; WARMUP_MS of
    warm-up, so that each is timed at the steady power-capped clock), the variants taking turns."""
    import triton.testing

    for fn in variants.values():
        fn()  # compile / tune outside the timing
    torch.cuda.synchronize()
    per_round: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            ms = triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
            per_round[name].append(float(ms))
    return {name: statistics.median(times) for name, times in per_round.items()}


def _bench_case(ctx: RunContext, case: Case, backends: list[str]) -> list[dict[str, Any]]:
    a, b = _operands(case, ctx.device)
    scale = torch.tensor(0.73, device=ctx.device)
    variants = {
        CUBLAS: lambda: torch.mm(a, b),
        CUBLAS_SCALE: lambda: torch.mm(a, b) * scale,
    }
    if ctx.cpu_small:
        variants[REFERENCE] = lambda: scaled_matmul(a, b, scale, backend="torch")
    for backend in backends:
        variants[backend] = lambda backend=backend: scaled_matmul(a, b, scale, backend=backend)

    if ctx.cpu_small:
        timings = time_interleaved(variants, ctx.device, ctx.repeats, ctx.target_loop_s)
        ms = {name: timing.median_wall_ms for name, timing in timings.items()}
    else:
        ms = _time_gpu(variants, max(3, ctx.repeats))
    errors, checks = _check_case(a, b, scale, variants)
    flops = 2.0 * case.M * case.N * case.K
    rows = []
    for name, time_ms in ms.items():
        rows.append(
            {
                "dtype": str(case.dtype).removeprefix("torch."),
                "case": case.label,
                "M": case.M,
                "N": case.N,
                "K": case.K,
                "layout": case.layout,
                "implementation": name,
                "label": (CPU_LABELS if ctx.cpu_small else LABELS).get(name, LABELS.get(name, name)),
                "ms": time_ms,
                "tflops": flops / (time_ms * 1e-3) / 1e12,
                "vs_cublas_mm": ms[CUBLAS] / time_ms,
                "vs_cublas_then_scale": ms[CUBLAS_SCALE] / time_ms,
                "rel_err_vs_fp64": errors.get(name),
                "err_ratio_vs_cublas_then_scale": (
                    errors[name] / errors[CUBLAS_SCALE] if name in errors and errors[CUBLAS_SCALE] > 0 else None
                ),
                "check": checks.get(name),
            }
        )
    return rows


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Geomean (and worst case) of each kernel's speed ratios per dtype, and over all cases."""
    out = []
    ours = sorted({row["implementation"] for row in rows} - {CUBLAS, CUBLAS_SCALE})
    for dtype in sorted({row["dtype"] for row in rows}) + ["all"]:
        for name in ours:
            picked = [r for r in rows if r["implementation"] == name and dtype in ("all", r["dtype"])]
            if not picked:
                continue
            out.append(
                {
                    "dtype": dtype,
                    "implementation": name,
                    "cases": len(picked),
                    "geomean_vs_cublas_mm": _geomean([r["vs_cublas_mm"] for r in picked]),
                    "min_vs_cublas_mm": min(r["vs_cublas_mm"] for r in picked),
                    "geomean_vs_cublas_then_scale": _geomean([r["vs_cublas_then_scale"] for r in picked]),
                }
            )
    return out


def _host_time_us(device: torch.device) -> dict[str, float]:
    """Back-to-back calls at 256^3 bf16 (the kernels take a few us): wall time per call ~ host time per call."""
    import time

    a = torch.randn(256, 256, device=device).to(torch.bfloat16)
    b = torch.randn(256, 256, device=device).to(torch.bfloat16)
    scale = torch.tensor(0.73, device=device)
    calls = {
        "torch.mm": lambda: torch.mm(a, b),
        "scaled_matmul, 0-d tensor scale": lambda: scaled_matmul(a, b, scale),
        "scaled_matmul, float scale": lambda: scaled_matmul(a, b, 0.73),
        "scaled_matmul, x @ W.T": lambda: scaled_matmul(a, b.t(), scale),
    }
    result = {}
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize(device)
        best = math.inf
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(2000):
                fn()
            torch.cuda.synchronize(device)
            best = min(best, (time.perf_counter() - start) / 2000 * 1e6)
        result[name] = best
    return result


def run(ctx: RunContext) -> dict[str, Any]:
    cases = _cases(ctx.cpu_small, ctx.full)
    backends = _available_backends(ctx.device)
    ctx.progress.reset(total=len(cases))
    rows: list[dict[str, Any]] = []
    for case in cases:
        ctx.progress.set_postfix_str(f"{case.dtype} {case.label}")
        case_rows = _bench_case(ctx, case, backends)
        rows += case_rows
        # One line per case as it finishes (stderr), so a run cut short still shows what it measured.
        done = ", ".join(f"{r['implementation']} {r['tflops']:.0f} ({r['vs_cublas_mm']:.2f}x mm)" for r in case_rows)
        ctx.progress.write(f"{case.dtype} {case.label} TFLOP/s: {done}", file=sys.stderr)
        free_device_memory(ctx.device)
        ctx.progress.update()
    tuning = []
    module = importlib.import_module("ampkernels.scaled_matmul")
    triton_module = module._load_triton()[0]
    if triton_module is not None:
        tuning = list(triton_module.TUNING_LOG)
    host_us = _host_time_us(ctx.device) if ctx.device.type == "cuda" and TRITON in backends else {}
    return {
        "host_us_per_call": host_us,
        "rows": rows,
        "summary": _summary(rows),
        "backends": backends,
        "tuning": tuning,
        "auto_choices": list(module.AUTO_LOG),  # what "auto" timed per problem, and its pick
        "notes": [CHECK_NOTE],
        "warnings": [],
        "timing_note": (
            "median wall time of interleaved loops; 64^3 smoke cases through the Triton interpreter, not comparable "
            "to anything"
            if ctx.cpu_small
            else f"median of triton.testing.do_bench (L2 flushed between runs, {WARMUP_MS} ms warm-up: timed at the "
            "steady power-capped clock)"
        ),
    }


def _error(row: dict[str, Any]) -> float | None:
    # Runs before the check measured the error against float64 measured it against float32.
    return row.get("rel_err_vs_fp64", row.get("rel_err_vs_fp32"))


def report(document: dict[str, Any]) -> str:
    mm = "cuBLAS mm" if document["mode"] == "gpu" else "torch mm"
    headers = ["dtype", "M x N x K layout", "implementation", "ms", "TFLOP/s", "x mm+scale", f"x {mm}", "rel err"]
    headers.append("check")
    rows = [
        [
            r["dtype"],
            r["case"],
            r["label"],
            f"{r['ms']:.3f}",
            f"{r['tflops']:.1f}",
            f"{r['vs_cublas_then_scale']:.2f}",
            f"{r['vs_cublas_mm']:.2f}",
            "-" if _error(r) is None else f"{_error(r):.1e}",
            check_cell(r),
        ]
        for r in document["rows"]
    ]
    summary_rows = [
        [
            s["dtype"],
            f"geomean over {s['cases']} cases",
            _label(document, s["implementation"]),
            "",
            "",
            f"{s['geomean_vs_cublas_then_scale']:.3f}",
            f"{s['geomean_vs_cublas_mm']:.3f} (min {s['min_vs_cublas_mm']:.2f})",
            "",
            "",
        ]
        for s in document["summary"]
    ]
    lines = [format_table(headers, rows + summary_rows, "lllrrrrrl"), *failure_lines(document["rows"])]
    lines.append(
        f"x mm+scale: against {mm} then * scale (the standard stock recipe of a scaled product); x {mm}: against "
        f"{mm} without any scale (the fastest stock call, which does not scale)"
    )
    lines.append(document["timing_note"])
    host = document.get("host_us_per_call") or {}
    if host:
        lines.append(
            "host time per call, 256^3 bf16 back-to-back (us): " + ", ".join(f"{k} {v:.1f}" for k, v in host.items())
        )
    lines += [f"note: {note}" for note in document.get("notes", [])]
    lines += document["warnings"]
    return "\n".join(lines)


def _label(document: dict[str, Any], name: str) -> str:
    labels = CPU_LABELS if document["mode"] != "gpu" else {}
    return labels.get(name, LABELS.get(name, name))


def summary(document: dict[str, Any]) -> list[str]:
    """The library's default backend (the best one there is; on the CPU the torch reference) over every case,
    against the standard stock recipe (cuBLAS then ``* scale``) and against the fastest stock call (cuBLAS alone)."""
    overall = [s for s in document["summary"] if s["dtype"] == "all"]
    if not overall:
        return []
    preferred = (AUTO, WGMMA, TRITON) if document["mode"] == "gpu" else (REFERENCE, TRITON)
    by = {s["implementation"]: s for s in overall}
    picked = next((by[name] for name in preferred if name in by), overall[0])
    on_gpu = document["mode"] == "gpu"
    mm = "cuBLAS" if on_gpu else "torch mm on the CPU"
    return [
        f"{_label(document, picked['implementation'])}: geomean {picked['geomean_vs_cublas_then_scale']:.2f}x "
        f"{mm} then * scale / {picked['geomean_vs_cublas_mm']:.2f}x {mm} without a scale "
        f"(min {picked['min_vs_cublas_mm']:.2f}x), over {picked['cases']} cases"
        + ("" if on_gpu else " (not a speed claim)")
    ]


def plot(document: dict[str, Any], path: Path, title: str) -> bool:
    panels = {}
    for dtype in sorted({r["dtype"] for r in document["rows"]}):
        rows = [r for r in document["rows"] if r["dtype"] == dtype]
        groups = list(dict.fromkeys(r["case"] for r in rows))
        names = list(dict.fromkeys(r["implementation"] for r in rows))
        series = {
            _label(document, name): [
                next((r["tflops"] for r in rows if r["case"] == g and r["implementation"] == name), None)
                for g in groups
            ]
            for name in names
        }
        panels[f"{dtype}: TFLOP/s"] = ([g.replace(" ", "\n") for g in groups], series)
    on_gpu = document["mode"] == "gpu"
    if not on_gpu:
        title += f"\n{CPU_PLOT_CAVEAT}"
    # On a GPU the TFLOP/s span less than a decade: linear axis. On the CPU the interpreter runs orders of magnitude
    # below torch's CPU mm: a log axis, or its bars vanish. 11 shapes a panel: one panel per row, full width.
    return plot_grouped_bars(
        path,
        title,
        panels,
        "TFLOP/s" if on_gpu else "TFLOP/s (log)",
        log_scale=not on_gpu,
        max_columns=1,
        panel_width=16,
        tick_fontsize=8,
    )
