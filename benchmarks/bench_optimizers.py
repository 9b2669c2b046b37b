"""The optimizer step alone: ``ampkernels.FusedAdamW`` against torch's ``AdamW(fused=True)`` and ``(foreach=True)``.

Per parameter set, on copies of the same fp32 parameters and gradients in the same run, the step alone (no scaler,
no clipping; a step updates the parameters, which does not change the work). Floor: AdamW in fp32 reads p, g, m, v
and writes p, m, v: 28 B/param at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ampkernels import FusedAdamW
from benchmarks.common import (
    CPU_CACHE_NOTE,
    format_ms,
    format_table,
    free_device_memory,
    plot_grouped_bars,
    time_interleaved,
)
from benchmarks.param_sets import PARAM_SETS, make_params

NAME = "optimizers"
FLOOR_BYTES_PER_PARAM = 28
STOCK = "stock-fused"
# implementation -> label; the first is the baseline of the speedups.
IMPLEMENTATIONS = {
    STOCK: "torch AdamW(fused=True)",
    "stock-foreach": "torch AdamW(foreach=True)",
    "ampkernels": "ampkernels FusedAdamW",
}
OPTIONS = dict(lr=1e-3, weight_decay=0.01)
TIMING_NOTE = "time = wall time per step (host work included); GB/s = 28 B/param / time"


def _optimizer(implementation: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if implementation == "ampkernels":
        return FusedAdamW(params, **OPTIONS)
    return torch.optim.AdamW(params, fused=implementation == STOCK, foreach=implementation != STOCK, **OPTIONS)


def _copies(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params, strict=True):
        c.grad = p.grad.clone()
    return copies


def run(ctx) -> dict[str, Any]:
    ctx.progress.reset(total=len(ctx.sets))
    rows: list[dict[str, Any]] = []
    param_sets: dict[str, dict[str, Any]] = {}
    for set_name in ctx.sets:
        shapes = PARAM_SETS[set_name](ctx.shrink)
        base = make_params(shapes, ctx.device)
        num_params = sum(p.numel() for p in base)
        param_sets[set_name] = {"num_tensors": len(base), "num_params": num_params}
        optimizers = {}
        for implementation in IMPLEMENTATIONS:
            optimizers[implementation] = _optimizer(implementation, _copies(base) if optimizers else base)
        timings = time_interleaved(
            {name: opt.step for name, opt in optimizers.items()}, ctx.device, ctx.repeats, ctx.target_loop_s
        )
        floor_bytes = FLOOR_BYTES_PER_PARAM * num_params
        floor_ms = floor_bytes / (ctx.copy_bandwidth_gbs * 1e9) * 1e3
        stock_ms = timings[STOCK].median_wall_ms
        for implementation, timing in timings.items():
            wall_ms = timing.median_wall_ms
            gbs = floor_bytes / (wall_ms * 1e-3) / 1e9
            rows.append(
                {
                    "set": set_name,
                    "implementation": implementation,
                    "label": IMPLEMENTATIONS[implementation],
                    "num_tensors": len(base),
                    "num_params": num_params,
                    "iterations": timing.iterations,
                    "repeats": len(timing.wall_ms),
                    "wall_ms": wall_ms,
                    "wall_ms_per_repeat": timing.wall_ms,
                    "device_ms": timing.median_device_ms,
                    "floor_ms": floor_ms,
                    "gbs": gbs,
                    "pct_of_copy": 100.0 * gbs / ctx.copy_bandwidth_gbs,
                    "x_floor": wall_ms / floor_ms,
                    "speedup_over_stock": stock_ms / wall_ms,
                }
            )
        del optimizers, base
        free_device_memory(ctx.device)
        ctx.progress.update(1)
    notes = [TIMING_NOTE] + ([CPU_CACHE_NOTE] if ctx.cpu_small else [])
    return {"param_sets": param_sets, "notes": notes, "warnings": [], "rows": rows}


def report(document: dict[str, Any]) -> str:
    # On the CPU the sizes fit in the caches: no % of copy or x floor there (CPU_CACHE_NOTE).
    on_gpu = document["mode"] == "gpu"
    headers = ["set", "implementation", "iters", "time ms"]
    headers += ["device ms", "GB/s", "% copy", "x floor", "speedup"] if on_gpu else ["GB/s", "speedup"]
    table_rows = []
    for row in document["rows"]:
        cells = [row["set"], row["label"], str(row["iterations"]), format_ms(row["wall_ms"])]
        if on_gpu:
            cells += [format_ms(row["device_ms"]), f"{row['gbs']:.1f}", f"{row['pct_of_copy']:.0f}%"]
            cells.append(f"{row['x_floor']:.2f}")
        else:
            cells.append(f"{row['gbs']:.1f}")
        table_rows.append([*cells, f"{row['speedup_over_stock']:.2f}x"])
    set_lines = [
        f"{name}: {info['num_tensors']} tensors, {info['num_params'] / 1e6:.2f}M params"
        for name, info in document["param_sets"].items()
    ]
    notes = [f"note: {note}" for note in document["notes"]]
    align = "ll" + "r" * (len(headers) - 2)
    return "\n".join([format_table(headers, table_rows, align), "", *set_lines, *notes, *document["warnings"]])


def summary(document: dict[str, Any]) -> list[str]:
    """Per parameter set: the ampkernels AdamW step against torch's fused and foreach ones."""
    lines = []
    for set_name in document["param_sets"]:
        by = {r["implementation"]: r for r in document["rows"] if r["set"] == set_name}
        ours = by["ampkernels"]
        lines.append(
            f"{set_name} AdamW step: FusedAdamW {ours['wall_ms']:.3g} ms, {ours['speedup_over_stock']:.2f}x torch "
            f"fused, {by['stock-foreach']['wall_ms'] / ours['wall_ms']:.2f}x torch foreach"
        )
    return lines


def plot(document: dict[str, Any], path: Path, title: str) -> bool:
    time_ms = {(row["set"], row["implementation"]): row["wall_ms"] for row in document["rows"]}
    sets = list(document["param_sets"])
    series = {label: [time_ms.get((s, impl)) for s in sets] for impl, label in IMPLEMENTATIONS.items()}
    return plot_grouped_bars(path, title, {"AdamW step": (sets, series)}, ylabel="time per step, ms (log)")
