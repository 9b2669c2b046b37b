"""A language-model head and its loss, forward + backward: stock against ``ampkernels.linear_cross_entropy`` (and
Liger-Kernel's fused linear cross-entropy when ``liger_kernel`` is installed), time and peak memory, same run.

- ``stock``: ``F.cross_entropy(F.linear(hidden, weight), target)`` under bf16 autocast: bf16 logits, their float32
  copy for the loss and a float32 gradient of the same size;
- ``ampkernels``: :func:`ampkernels.linear_cross_entropy` (the logits in chunks of tokens, never whole);
- ``ampkernels-fp8``: the same with ``float8="tensorwise"`` (the head's products in FP8, as a converted head's);
- ``liger``: ``liger_kernel``'s ``LigerFusedLinearCrossEntropyLoss`` (bf16 operands).

Shapes on a GPU: 16384 tokens at hidden 2048 with vocab 32000 and 128256, and hidden 4096 with vocab 128256; bf16
hidden states, bf16 weight. Time: the median over repeats of loss + backward, taken in turns with the others; peak
memory: ``torch.cuda.max_memory_allocated`` during one call, above what the inputs hold. Check: after the timed loops,
each implementation's loss and gradients against stock's (bf16 tolerances; FP8's by the relative norm of the
difference). On a CPU-only machine: float32, small
shapes, a smoke run, not a measurement.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

import ampkernels
from benchmarks.common import (
    RunContext,
    check_result,
    format_ms,
    format_table,
    free_device_memory,
    mismatch,
    missing_package,
    plot_grouped_bars,
    synchronize,
    time_interleaved,
)

NAME = "loss"

GPU_SHAPES = ((16384, 2048, 32000), (16384, 2048, 128256), (16384, 4096, 128256))  # tokens, hidden, vocab
CPU_SHAPES = ((512, 64, 1008), (512, 64, 8000))
# Against stock's bf16 logits: the loss to 1e-3 (a mean over 16k tokens), gradients to bf16's own spread.
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-3, 5e-2, 1e-3
# The FP8 head: e5m2 logit gradients carry ~6% relative error per element (2 mantissa bits), so its gradients are
# checked by the relative norm of their difference from stock's.
FLOAT8_LOSS_RTOL, FLOAT8_GRAD_NORM = 5e-3, 0.1


def _stock(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), target)


def _ours(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ampkernels.linear_cross_entropy(hidden, weight, target)


def _ours_float8(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ampkernels.linear_cross_entropy(hidden, weight, target, float8="tensorwise")


def _liger() -> Callable[..., torch.Tensor] | None:
    if missing_package("liger_kernel") is not None:
        return None
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda hidden, weight, target: loss(weight, hidden, target)


def _implementations() -> dict[str, Callable[..., torch.Tensor]]:
    found = {"stock": _stock, "ampkernels": _ours, "ampkernels-fp8": _ours_float8}
    liger = _liger()
    if liger is not None:
        found["liger"] = liger
    return found


def _inputs(shape: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, hidden, vocab = shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=gen) / math.sqrt(hidden)).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    return h, w, t


def _step(fn: Callable[..., torch.Tensor], h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    h.grad = w.grad = None
    loss = fn(h, w, t)
    loss.backward()
    return loss.detach()


def _peak_gib(fn: Callable[[], Any], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    free_device_memory(device)
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def _check(results: dict[str, list[torch.Tensor]], name: str) -> str:
    loss, grad_h, grad_w = results[name]
    stock = results["stock"]
    if name.endswith("fp8"):
        problems = [mismatch("loss", loss, stock[0], rtol=FLOAT8_LOSS_RTOL, atol=0.0)]
        for label, ours, theirs in (("hidden grad", grad_h, stock[1]), ("weight grad", grad_w, stock[2])):
            relative = ((ours - theirs).norm() / theirs.norm()).item()
            if not relative <= FLOAT8_GRAD_NORM:
                problems.append(f"{label}: relative norm of the difference {relative:.3g} > {FLOAT8_GRAD_NORM:g}")
        return check_result([p for p in problems if p is not None])
    problems = [
        mismatch("loss", loss, stock[0], rtol=LOSS_RTOL, atol=0.0),
        mismatch("hidden grad", grad_h, stock[1], rtol=GRAD_RTOL, atol=GRAD_ATOL),
        mismatch("weight grad", grad_w, stock[2], rtol=GRAD_RTOL, atol=GRAD_ATOL),
    ]
    return check_result([p for p in problems if p is not None])


def run(ctx: RunContext) -> dict[str, Any]:
    shapes = GPU_SHAPES if ctx.device.type == "cuda" else CPU_SHAPES
    ctx.progress.reset(total=len(shapes))
    implementations = _implementations()
    rows = []
    for shape in shapes:
        ctx.progress.set_postfix_str("x".join(map(str, shape)))
        h, w, t = _inputs(shape, ctx.device)
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=ctx.device.type == "cuda"):
            steps = {name: functools.partial(_step, fn, h, w, t) for name, fn in implementations.items()}
            peaks = {name: _peak_gib(step, ctx.device) for name, step in steps.items()}
            timings = time_interleaved(steps, ctx.device, ctx.repeats, ctx.target_loop_s)
            results = {}
            for name, step in steps.items():
                loss = step()
                results[name] = [loss.float(), h.grad.float(), w.grad.float()]
        stock_ms = timings["stock"].median_wall_ms
        for name in implementations:
            ms = timings[name].median_wall_ms
            row = {
                "shape": f"{shape[0]} tokens x {shape[1]} -> {shape[2]}",
                "tokens": shape[0],
                "hidden": shape[1],
                "vocab": shape[2],
                "implementation": name,
                "ms": ms,
                "ms_per_repeat": timings[name].wall_ms,
                "peak_gib": None if peaks[name] is None else round(peaks[name], 3),
                "loss": float(results[name][0]),
            }
            if name != "stock":
                row["speedup_over_stock"] = stock_ms / ms
                row["check"] = _check(results, name)
            rows.append(row)
        del h, w, t, results, steps
        free_device_memory(ctx.device)
        ctx.progress.update()
    skipped = {} if "liger" in implementations else {"liger": missing_package("liger_kernel")}
    return {
        "rows": rows,
        "skipped": skipped,
        "notes": [
            "time: median over repeats of loss + backward (wall), implementations in turns; peak: "
            "max_memory_allocated during one call above the inputs",
            f"check: loss within {LOSS_RTOL:g} of stock's, gradients within rtol {GRAD_RTOL:g} / atol {GRAD_ATOL:g}; "
            f"FP8 head: loss within {FLOAT8_LOSS_RTOL:g}, gradients' difference under {FLOAT8_GRAD_NORM:g} of their "
            "norm",
        ],
    }


def report(document: dict[str, Any]) -> str:
    headers = ["shape", "implementation", "ms", "x stock", "peak GiB", "loss", "check"]
    table = [
        [
            r["shape"],
            r["implementation"],
            format_ms(r["ms"]),
            f"{r['speedup_over_stock']:.2f}x" if "speedup_over_stock" in r else "-",
            "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}",
            f"{r['loss']:.4f}",
            r.get("check", "-"),
        ]
        for r in document["rows"]
    ]
    lines = [format_table(headers, table, "llrrrrl"), ""]
    lines += [f"skipped {name}: {why}" for name, why in document["skipped"].items()]
    lines += [f"note: {note}" for note in document["notes"]]
    return "\n".join(lines)


def summary(document: dict[str, Any]) -> list[str]:
    lines = []
    for r in document["rows"]:
        if r["implementation"] == "stock":
            continue
        stock = next(s for s in document["rows"] if s["shape"] == r["shape"] and s["implementation"] == "stock")
        memory = "" if r["peak_gib"] is None else f", peak {r['peak_gib']:.2f} against {stock['peak_gib']:.2f} GiB"
        lines.append(f"{r['shape']}: {r['implementation']} {r['speedup_over_stock']:.2f}x stock{memory}")
    return lines


def plot(document: dict[str, Any], path: Path, title: str) -> bool:
    shapes = list(dict.fromkeys(r["shape"] for r in document["rows"]))
    names = list(dict.fromkeys(r["implementation"] for r in document["rows"]))

    def value(shape: str, name: str, key: str) -> float | None:
        return next((r[key] for r in document["rows"] if r["shape"] == shape and r["implementation"] == name), None)

    panels = {"loss + backward, ms": (shapes, {name: [value(s, name, "ms") for s in shapes] for name in names})}
    if any(r["peak_gib"] is not None for r in document["rows"]):
        panels["peak memory, GiB"] = (shapes, {n: [value(s, n, "peak_gib") for s in shapes] for n in names})
    return plot_grouped_bars(path, title, panels, "ms or GiB", log_scale=False, max_columns=2)
