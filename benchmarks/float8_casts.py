"""The FP8 casts against plain torch (called by ``benchmarks/bench_float8.py``): :func:`run_casts` times every path
of ``ampkernels.float8.to_float8`` / ``to_float8_pair`` and the amax + scale + cast a user writes in torch, on one
bf16 tensor per shape; :func:`report_casts` prints the table.

Bytes counted per row: the one-pass floor of what the op must move, x read once (2 B/element in bf16) plus the FP8
data written (1 B/element; 2 for the pair, which writes both layouts). GB/s = those bytes / time; "x floor" = time /
(bytes at the copy bandwidth measured in the same run). Current scaling reads x twice (amax pass, cast pass), so its
floor ratio is at least 5/3 when nothing stays in L2; the cast pass reads the amax pass's tail from L2 first.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from benchmarks.common import (
    CPU_CACHE_NOTE,
    check_cell,
    check_result,
    failure_lines,
    format_table,
    free_device_memory,
    time_interleaved,
)

GPU_SHAPES = ((8192, 8192), (16384, 2048), (16384, 8192))
CPU_SHAPES = ((256, 256),)
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448, as a user writes it in torch
STOCK = "torch"

VARIANTS = {
    STOCK: "plain torch: amax, 448 / amax, (x * scale).clamp().to(fp8)",
    "tensor": "to_float8 tensorwise, current",
    "delayed": "to_float8 tensorwise, delayed (scale given, amax recorded)",
    "row": "to_float8 rowwise, current",
    "transpose": "to_float8 tensorwise + transpose, current",
    "pair": "to_float8_pair (both layouts), current",
}


def _stock(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().max()
    scale = FP8_MAX / amax.float()
    return (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _variants(x: torch.Tensor, backend: str) -> dict[str, Any]:
    from ampkernels.float8 import to_float8, to_float8_pair

    scale = torch.full((), FP8_MAX, device=x.device) / x.abs().amax().float()
    amax_out = torch.zeros((), device=x.device)
    found_inf = torch.zeros(1, device=x.device)
    b = backend
    return {
        "tensor": lambda: to_float8(x, backend=b),
        "delayed": lambda: to_float8(x, scale=scale, amax_out=amax_out, found_inf=found_inf, backend=b),
        "row": lambda: to_float8(x, granularity="row", backend=b),
        "transpose": lambda: to_float8(x, transpose=True, backend=b),
        "pair": lambda: to_float8_pair(x, backend=b),
    }


def _backends(device: torch.device) -> list[str]:
    """The kernel backends of the casts that run here (native and Triton on a GPU), else the default."""
    from ampkernels import dispatch

    running = [name for name in ("native", "triton") if dispatch.why_not("to_float8", name, device) is None]
    return running if device.type == "cuda" and running else [dispatch.select("to_float8", device)]


CHECK_NOTE = (
    "check, after the timed loops: every output of each kernel backend's cast (fp8 codes, scale_inv) bit for bit "
    "that of the same call on the torch reference (backend='torch'), as tests/float8/test_float8_casts.py requires; "
    "the reference itself and plain torch are not checked"
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _check_casts(x: torch.Tensor, backends: list[str]) -> dict[str, str | None]:
    """Per ``backend:variant`` key: its outputs against the reference's, bit for bit (None for the reference)."""
    expected = {variant: fn() for variant, fn in _variants(x, "torch").items()}
    checks: dict[str, str | None] = {}
    for backend in backends:
        for variant, fn in _variants(x, backend).items():
            if backend == "torch":
                checks[f"{backend}:{variant}"] = None
                continue
            got, want = fn(), expected[variant]
            names = ("data", "scale_inv") if len(got) == 2 else tuple(f"output {i}" for i in range(len(got)))
            problems = [
                f"{name} differs from the reference's"
                for name, a, b in zip(names, got, want, strict=True)
                if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(_bits(a), _bits(b))
            ]
            checks[f"{backend}:{variant}"] = check_result(problems)
    return checks


def _floor_bytes(variant: str, numel: int) -> int:
    return numel * (2 + (2 if variant == "pair" else 1))


def run_casts(ctx) -> list[dict[str, Any]]:
    """One row per (shape, backend, variant): ms (device time on a GPU, wall on the CPU) of a call in an eager loop,
    bytes, GB/s, % of copy, x floor, speedup over plain torch. Every kernel backend that runs here is timed, in the
    same interleaved loop as plain torch."""
    backends = _backends(ctx.device)
    rows: list[dict[str, Any]] = []
    shapes = CPU_SHAPES if ctx.cpu_small else GPU_SHAPES
    for M, K in shapes:
        x = torch.randn(M, K, device=ctx.device).mul_(3.0).to(torch.bfloat16)
        fns = {STOCK: functools.partial(_stock, x)}
        for backend in backends:
            fns.update({f"{backend}:{variant}": fn for variant, fn in _variants(x, backend).items()})
        timings = time_interleaved(fns, ctx.device, ctx.repeats, ctx.target_loop_s)
        checks = _check_casts(x, backends)
        ms = {key: t.median_device_ms or t.median_wall_ms for key, t in timings.items()}
        for key, t in timings.items():
            backend, _, variant = key.rpartition(":")
            label = VARIANTS[variant] + (f" [{backend}]" if len(backends) > 1 and backend else "")
            moved = _floor_bytes(variant, x.numel())
            gbs = moved / (ms[key] * 1e-3) / 1e9
            floor_ms = moved / (ctx.copy_bandwidth_gbs * 1e9) * 1e3
            rows.append(
                {
                    "shape": f"{M}x{K}",
                    "variant": variant,
                    "label": label,
                    "iterations": t.iterations,
                    "ms": ms[key],
                    "wall_ms": t.median_wall_ms,
                    "device_ms": t.median_device_ms,
                    "bytes": moved,
                    "gbs": gbs,
                    "pct_of_copy": 100.0 * gbs / ctx.copy_bandwidth_gbs,
                    "x_floor": ms[key] / floor_ms,
                    "speedup_over_torch": ms[STOCK] / ms[key],
                    "on_gpu": not ctx.cpu_small,
                    "backend": backend or STOCK,
                    "check": checks.get(key),
                }
            )
        del x, timings
        free_device_memory(ctx.device)
    return rows


def report_casts(rows: list[dict[str, Any]]) -> str:
    """The casts table (no % of copy or x floor on the CPU: CPU_CACHE_NOTE)."""
    on_gpu = bool(rows) and rows[0]["on_gpu"]
    headers = ["shape", "cast", "ms", "MB moved", "GB/s"] + (["% copy", "x floor"] if on_gpu else [])
    headers += ["vs torch", "check"]
    table = []
    for row in rows:
        cells = [row["shape"], row["label"], f"{row['ms']:.4f}", f"{row['bytes'] / 1e6:.1f}", f"{row['gbs']:.0f}"]
        if on_gpu:
            cells += [f"{row['pct_of_copy']:.0f}%", f"{row['x_floor']:.2f}"]
        table.append([*cells, f"{row['speedup_over_torch']:.2f}x", check_cell(row)])
    notes = [
        "bytes moved: x read once (bf16, 2 B/element) + the fp8 data written (1 B/element, 2 for the pair)",
        "x floor: time / (those bytes at the copy bandwidth); current scaling reads x twice (>= 1.67x from HBM)",
    ]
    if rows:
        notes.append(f"ampkernels backends: {', '.join(dict.fromkeys(r['backend'] for r in rows[1:]))}")
    if not on_gpu:
        notes.append(CPU_CACHE_NOTE)
    notes.append(CHECK_NOTE)
    align = "ll" + "r" * (len(headers) - 3) + "l"
    table_text = format_table(headers, table, align)
    return "\n".join([table_text, *failure_lines(rows), *[f"note: {n}" for n in notes]])
