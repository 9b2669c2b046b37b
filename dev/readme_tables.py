"""The README's result tables, printed from the committed benchmark JSON (so every figure there comes from a
`python -m benchmarks` run). python dev/readme_tables.py [results folder]  (default: benchmarks/results)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DTYPES = {"bfloat16": "bf16", "float16": "fp16"}


def _load(folder: Path, name: str) -> dict | None:
    paths = sorted(folder.glob(f"{name}_*.json"))
    return json.loads(paths[0].read_text()) if paths else None


def grad_scaler(doc: dict) -> list[str]:
    copy = doc["copy_bandwidth"]["gbs"]
    lines = [
        "| set | case | implementation | ms | GB/s (% of copy) | × floor | speedup |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        speedup = "–" if r["speedup_over_stock"] is None else f"{r['speedup_over_stock']:.2f}×"
        lines.append(
            f"| {r['set']} | {r['case']} | {r['label']} | {r['wall_ms']:.3f} | {r['gbs']:.0f} "
            f"({r['gbs'] / copy:.0%}) | {r['x_floor']:.2f} | {speedup} |"
        )
    return lines


def optimizers(doc: dict) -> list[str]:
    copy = doc["copy_bandwidth"]["gbs"]
    lines = ["| set | implementation | ms | GB/s | % of copy | speedup |", "|---|---|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        lines.append(
            f"| {r['set']} | {r['label']} | {r['wall_ms']:.3f} | {r['gbs']:.0f} | {r['gbs'] / copy:.0%} | "
            f"{r['speedup_over_stock']:.2f}× |"
        )
    return lines


def training(doc: dict) -> list[str]:
    lines = [
        "| model | recipe | step ms | vs stock fused | vs stock foreach | peak GiB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['model']} | {r['recipe']} | {r['step_ms']:.2f} | {r['speedup_over_stock_fused']:.2f}× | "
            f"{r['speedup_over_stock_foreach']:.2f}× | {r['peak_memory_gib']:.2f} |"
        )
    return lines


def scaled_matmul(doc: dict) -> list[str]:
    has = {name: any(r["implementation"] == name for r in doc["rows"]) for name in ("auto", "wgmma")}
    lines = [
        "| dtype | M×N×K layout | cuBLAS mm TFLOP/s | cuBLAS then scale "
        + ("| default: auto (× mm, × mm+scale) " if has["auto"] else "")
        + "| Triton (× mm, × mm+scale) "
        + ("| CUDA wgmma (× mm, × mm+scale) " if has["wgmma"] else "")
        + "| CUDA WMMA (× mm) |",
        "|---|---|---:|---:|" + "---:|" * (2 + has["auto"] + has["wgmma"]),
    ]
    cases: dict[tuple, dict] = {}
    for r in doc["rows"]:
        cases.setdefault((r["dtype"], r["case"]), {})[r["implementation"]] = r

    def both(r: dict | None) -> str:
        return f" {r['tflops']:.0f} ({r['vs_cublas_mm']:.2f}, {r['vs_cublas_then_scale']:.2f}) |" if r else ""

    for (dtype, case), by in cases.items():
        w = by["wmma"]
        lines.append(
            f"| {DTYPES.get(dtype, dtype)} | {case} | {by['cublas_mm']['tflops']:.0f} | "
            f"{by['cublas_then_scale']['tflops']:.0f} |{both(by.get('auto'))}{both(by['triton'])}"
            f"{both(by.get('wgmma'))} {w['tflops']:.0f} ({w['vs_cublas_mm']:.2f}) |"
        )
    lines.append("")
    for s in doc["summary"]:
        lines.append(
            f"geomean over {s['cases']} {s['dtype']} cases, {s['implementation']}: {s['geomean_vs_cublas_mm']:.2f}× "
            f"cuBLAS mm (min {s['min_vs_cublas_mm']:.2f}), {s['geomean_vs_cublas_then_scale']:.2f}× mm+scale"
        )
    return lines


def main(folder: Path) -> None:
    for name, render in (
        ("grad_scaler", grad_scaler),
        ("optimizers", optimizers),
        ("training", training),
        ("scaled_matmul", scaled_matmul),
    ):
        doc = _load(folder, name)
        if doc is None:
            continue
        print(f"## {name}: {doc['environment']['device_name']}, {doc['environment']['date'][:10]}, copy "
              f"{doc['copy_bandwidth']['gbs']:.0f} GB/s")  # fmt: skip
        print("\n".join(render(doc)) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("benchmarks/results"))
