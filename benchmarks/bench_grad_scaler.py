"""Stock ``torch.amp.GradScaler`` against ``ampkernels.FusedGradScaler`` on the post-backward ops.

Per parameter set, on the same tensors in the same run:

1. ``unscale_`` alone, with a plain SGD optimizer (lr 0). Floor: one read + write of the fp32 grads, 8 B/param.
2. ``unscale_`` + gradient clipping. Stock: ``unscale_`` then ``clip_grad_norm_(foreach=True)``; ampkernels:
   ``clip_grad_norm_`` with the SGD optimizer (grads unscaled and clipped in place: the total norm must be known
   before any grad is written, so a read-only pass and a read + write pass, floor 12 B/param) and with torch's
   fused AdamW, where the unscale and clip are deferred into the fused step and only a read-only pass runs here
   (floor 4 B/param; not the same work as stock, so no speedup is given).
3. The whole post-backward phase (check + clip + AdamW + scale update). Floor 32 B/param (AdamW reads p, g, m, v
   and writes p, m, v: 28 B; plus one read-only pass over the grads for the non-finite check and the norm: 4 B).
   - stock recipe: ``unscale_`` + ``clip_grad_norm_`` + ``step`` (torch fused AdamW) + ``update``;
   - stock sync-free: the best assembly of stock parts — read-only ``torch._foreach_norm`` of the scaled grads, the
     clip coefficient and found_inf on the device, torch's fused AdamW handed ``grad_scale``/``found_inf``,
     ``torch._amp_update_scale_`` — eager and captured in a CUDA graph;
   - ampkernels: ``clip_grad_norm_`` + ``step`` + ``update`` with torch's fused AdamW, and with
     ``ampkernels.FusedAdamW`` eager and captured in a CUDA graph.

Each ampkernels row's ratio is given against the standard stock recipe and against the best stock recipe run the same
way (``best_stock``), and its results are checked against stock's after the timed loops (``CHECK_NOTE``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state

import ampkernels
from ampkernels import FusedGradScaler, capture_step
from benchmarks.bench_optimizers import step_count_problems, trajectory_error, trajectory_problems
from benchmarks.common import (
    CPU_CACHE_NOTE,
    LoopTiming,
    RunContext,
    check_cell,
    check_result,
    failure_lines,
    format_ms,
    format_table,
    free_device_memory,
    mismatch,
    plot_grouped_bars,
    synchronize,
    time_interleaved,
)
from benchmarks.param_sets import PARAM_SETS, make_params

NAME = "grad_scaler"

# The loops repeat unscale and clip on the same grads: at the default scale 2^16, or with a real max_norm, they would
# shrink the grads to zero within a few iterations and we would time zeros. Scale 1 and max_norm 1e9 leave the grads
# as they are while doing the same arithmetic and memory traffic; the huge growth interval keeps the scale at 1.
TIMING_SCALER_SETTINGS = {"init_scale": 1.0, "growth_interval": 2**30}
TIMING_MAX_NORM = 1e9
TIMING_NOTE = (
    "timing loops use init_scale=1.0, max_norm=1e9 and growth_interval=2**30 so that repeated unscale and clip "
    "leave the gradients unchanged instead of driving them to zero; the arithmetic and memory traffic are identical "
    "for any scale and max_norm (max_norm 1.0 semantics)"
)
DEFERRED_NOTE = (
    "'deferred into the fused step': with torch's fused AdamW, FusedGradScaler.clip_grad_norm_ only runs a read-only "
    "pass (non-finite check + norm) and hands the unscale and clip to the optimizer step; it is not the same work as "
    "stock unscale_ + clip, so it gets no speedup; compare the post-backward rows for the whole phase"
)
TIMING_METHOD_NOTE = (
    "time = median over repeats of the wall time per iteration of a loop of `iters` iterations (host work included); "
    "device ms = CUDA events around the same loop; GB/s = floor bytes / time; x floor = time / (floor bytes / copy "
    "bandwidth); vs stock = stock time / time"
)
CPU_TIMING_METHOD_NOTE = (
    "time = median over repeats of the wall time per iteration of a loop of `iters` iterations; GB/s = floor bytes "
    "/ time; vs stock = stock time / time"
)
# A relative difference above this between the norms of stock and ampkernels means a benchmark of a wrong kernel.
NORM_AGREEMENT = 1e-4


@dataclass(frozen=True)
class Variant:
    case: str
    implementation: str
    label: str
    floor_bytes_per_param: int


CASES = ("unscale_", "unscale_+clip", "post-backward")
STOCK, FUSED, FUSED_DEFERRED = "stock", "ampkernels", "ampkernels-deferred"
STOCK_SYNC_FREE, STOCK_SYNC_FREE_GRAPHED = "stock-sync-free", "stock-sync-free-graphed"
FUSED_OWN, FUSED_OWN_GRAPHED = "ampkernels+FusedAdamW", "ampkernels+FusedAdamW-graphed"
SERIES_LABELS = {
    STOCK: "torch.amp.GradScaler",
    STOCK_SYNC_FREE: "best sync-free assembly of stock parts",
    STOCK_SYNC_FREE_GRAPHED: "best sync-free stock assembly, CUDA graph",
    FUSED: "ampkernels.FusedGradScaler",
    FUSED_DEFERRED: "FusedGradScaler, clip deferred into the fused step (read-only pass only)",
    FUSED_OWN: "FusedGradScaler + ampkernels.FusedAdamW",
    FUSED_OWN_GRAPHED: "FusedGradScaler + ampkernels.FusedAdamW, CUDA graph",
}
STOCK_UNSCALE = Variant("unscale_", STOCK, "GradScaler.unscale_", 8)
FUSED_UNSCALE = Variant("unscale_", FUSED, "FusedGradScaler.unscale_", 8)
STOCK_CLIP = Variant("unscale_+clip", STOCK, "unscale_ + clip_grad_norm_(foreach)", 12)
FUSED_CLIP = Variant("unscale_+clip", FUSED, "clip_grad_norm_ (SGD: in place)", 12)
FUSED_CLIP_DEFERRED = Variant(
    "unscale_+clip", FUSED_DEFERRED, "clip_grad_norm_ (AdamW: deferred into the fused step)", 4
)
STOCK_PHASE = Variant("post-backward", STOCK, "unscale_ + clip_grad_norm_ + step + update", 32)
FUSED_PHASE = Variant("post-backward", FUSED, "clip_grad_norm_ + step + update", 32)
STOCK_SYNC_FREE_PHASE = Variant("post-backward", STOCK_SYNC_FREE, "_foreach_norm + fused AdamW(grad_scale)", 32)
STOCK_SYNC_FREE_GRAPHED_PHASE = Variant(
    "post-backward", STOCK_SYNC_FREE_GRAPHED, "_foreach_norm + fused AdamW(grad_scale), CUDA graph", 32
)
FUSED_OWN_PHASE = Variant("post-backward", FUSED_OWN, "clip_grad_norm_ + FusedAdamW step + update", 32)
FUSED_OWN_GRAPHED_PHASE = Variant(
    "post-backward", FUSED_OWN_GRAPHED, "clip_grad_norm_ + FusedAdamW step + update, CUDA graph", 32
)


def _reset_stage(scaler: torch.amp.GradScaler) -> None:
    """Forget this iteration's unscale_/step, so that unscale_ may run again without an update()."""
    scaler._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)


def _ready(scaler: torch.amp.GradScaler, device: torch.device) -> torch.amp.GradScaler:
    scaler.scale(torch.ones((), device=device))  # creates the scale tensor, which unscale_ needs
    return scaler


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


def _relative_difference(value: torch.Tensor, reference: torch.Tensor) -> float:
    return abs(float(value) - float(reference)) / float(reference)


def _bench_param_set(ctx: RunContext, set_name: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    shapes = PARAM_SETS[set_name](ctx.shrink)
    params = make_params(shapes, ctx.device, seed=0)
    grads = [param.grad for param in params]
    num_params = sum(param.numel() for param in params)
    initial_grad_norm = _total_norm(grads)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)

    sgd = torch.optim.SGD(params, lr=0.0)
    stock_adamw = torch.optim.AdamW(params, fused=True)
    fused_adamw = torch.optim.AdamW(params, fused=True)
    stock = _ready(torch.amp.GradScaler(ctx.device.type, **TIMING_SCALER_SETTINGS), ctx.device)
    fused = _ready(FusedGradScaler(ctx.device.type, **TIMING_SCALER_SETTINGS), ctx.device)

    def stock_unscale() -> None:
        _reset_stage(stock)
        stock.unscale_(sgd)

    def fused_unscale() -> None:
        _reset_stage(fused)
        fused.unscale_(sgd)

    def stock_clip() -> torch.Tensor:
        _reset_stage(stock)
        stock.unscale_(sgd)
        return torch.nn.utils.clip_grad_norm_(params, TIMING_MAX_NORM, foreach=True)

    def fused_clip() -> torch.Tensor:
        _reset_stage(fused)
        return fused.clip_grad_norm_(sgd, TIMING_MAX_NORM)

    def fused_clip_deferred() -> torch.Tensor:
        _reset_stage(fused)
        return fused.clip_grad_norm_(fused_adamw, TIMING_MAX_NORM)

    def stock_phase() -> None:
        stock.unscale_(stock_adamw)
        torch.nn.utils.clip_grad_norm_(params, TIMING_MAX_NORM, foreach=True)
        stock.step(stock_adamw)
        stock.update()

    def fused_phase() -> None:
        fused.clip_grad_norm_(fused_adamw, TIMING_MAX_NORM)
        fused.step(fused_adamw)
        fused.update()

    sync_free_adamw = torch.optim.AdamW(params, fused=True, capturable=ctx.device.type == "cuda")
    sync_free_scale = torch.ones((), dtype=torch.float32, device=ctx.device)
    sync_free_tracker = torch.zeros((), dtype=torch.int32, device=ctx.device)

    def stock_sync_free_phase() -> None:
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))  # of the scaled grads, read-only
        found_inf = (~torch.isfinite(total)).float()
        coef = torch.clamp(TIMING_MAX_NORM / (total / sync_free_scale + 1e-6), max=1.0)
        sync_free_adamw.grad_scale = sync_free_scale / coef
        sync_free_adamw.found_inf = found_inf
        sync_free_adamw.step()
        torch._amp_update_scale_(sync_free_scale, sync_free_tracker, found_inf, 2.0, 0.5, 2**30)

    phases = {STOCK_PHASE: stock_phase, FUSED_PHASE: fused_phase, STOCK_SYNC_FREE_PHASE: stock_sync_free_phase}
    # What each post-backward row steps: (its optimizer, its scaler, the rows that step the same optimizer).
    stepped = {STOCK_PHASE: (stock_adamw, stock, [STOCK_PHASE]), FUSED_PHASE: (fused_adamw, fused, [FUSED_PHASE])}
    if hasattr(ampkernels, "FusedAdamW"):
        own_adamw = ampkernels.FusedAdamW(params)
        own = _ready(FusedGradScaler(ctx.device.type, **TIMING_SCALER_SETTINGS), ctx.device)
        own_rows = [FUSED_OWN_PHASE] + ([FUSED_OWN_GRAPHED_PHASE] if ctx.device.type == "cuda" else [])
        stepped.update({row: (own_adamw, own, own_rows) for row in own_rows})

        def own_phase() -> None:
            own.clip_grad_norm_(own_adamw, TIMING_MAX_NORM)
            own.step(own_adamw)
            own.update()

        phases[FUSED_OWN_PHASE] = own_phase
    if ctx.device.type == "cuda":  # the phases are sync-free: one graph each, replayed
        phases[STOCK_SYNC_FREE_GRAPHED_PHASE] = capture_step(stock_sync_free_phase)
        if FUSED_OWN_PHASE in phases:
            phases[FUSED_OWN_GRAPHED_PHASE] = capture_step(phases[FUSED_OWN_PHASE])

    # One untimed pass checks that both scalers compute the same norm: timing a wrong kernel is worthless.
    stock_norm = stock_clip()
    norm_differences = {
        "in_place": _relative_difference(fused_clip(), stock_norm),
        "deferred": _relative_difference(fused_clip_deferred(), stock_norm),
    }

    cases: dict[str, dict[Variant, Callable[[], Any]]] = {
        "unscale_": {STOCK_UNSCALE: stock_unscale, FUSED_UNSCALE: fused_unscale},
        "unscale_+clip": {STOCK_CLIP: stock_clip, FUSED_CLIP: fused_clip, FUSED_CLIP_DEFERRED: fused_clip_deferred},
        "post-backward": phases,
    }
    timings: dict[Variant, LoopTiming] = {}
    for case, variants in cases.items():
        ctx.progress.set_postfix_str(f"{set_name}: {case}")
        _reset_stage(stock)
        _reset_stage(fused)
        timings.update(time_interleaved(variants, ctx.device, ctx.repeats, ctx.target_loop_s))
        ctx.progress.update()
    synchronize(ctx.device)
    grad_norm_ratio = float(_total_norm(grads) / initial_grad_norm)
    scales = {STOCK: stock.get_scale(), FUSED: fused.get_scale(), STOCK_SYNC_FREE: float(sync_free_scale)}
    if FUSED_OWN_PHASE in stepped:
        scales[FUSED_OWN] = stepped[FUSED_OWN_PHASE][1].get_scale()
    checks = _check_set(params, grads, timings, stepped, grad_norm_ratio, scales, (stock_clip, fused_clip,
                        fused_clip_deferred))  # fmt: skip

    set_info = {
        "num_tensors": len(params),
        "num_params": num_params,
        "norm_relative_difference": norm_differences,
        # Stays 1 when the timing loops left the grads as they were (see TIMING_NOTE).
        "grad_norm_ratio_after_timing": grad_norm_ratio,
        "scales_after_timing": scales,
    }
    if ctx.device.type == "cuda":
        set_info["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(ctx.device) / 2**30, 2)

    stock_ms = {variant.case: timings[variant].median_wall_ms for variant in timings if variant.implementation == STOCK}
    rows = [
        _row(set_name, variant, timing, len(params), num_params, ctx.copy_bandwidth_gbs, stock_ms[variant.case])
        | {"calls": timing.calls, "check": checks.get(variant)}
        for variant, timing in timings.items()
    ]
    return rows, set_info


# ---- checks of what was timed, after the timed loops ----

CHECK_SCALE = 2.0**16  # the default init_scale: a power of two, so unscaling is exact
CHECK_MAX_NORM = 1.0
CHECK_ELEMENTS = 2**26  # the real-scale checks run on the first tensors up to this many elements (at least one)
#: tests/scaler/test_grad_scaler_clip.py: a float32 norm's relative error against float64 at most 2x that of torch's
#: float32 norm, or this; the grads after the clip within rtol 1e-6 of the float64 unscaled grads times the
#: coefficient of the returned norm.
NORM_RTOL_FLOOR, CLIP_RTOL = 1e-6, 1e-6
CHECK_NOTE = (
    "check, after the timed loops: the gradients are as before the loops; the clip norms of FusedGradScaler (in "
    "place and deferred) against float64, within twice the error of torch's float32 norm (or 1e-6); with the real "
    f"scale 2^16 and max_norm {CHECK_MAX_NORM}: FusedGradScaler.unscale_ bit for bit stock's, clip_grad_norm_'s "
    "gradients within rtol 1e-6 of the float64 unscaled gradients times its coefficient, and an inf in the last "
    "gradient backs both scalers off to the same scale; post-backward rows: every step count equals the steps "
    "taken, the AdamW moments against the exact trajectory of constant gradients (as the optimizers module), and "
    "the scale after the loops equal to stock's"
)


def _relative(value: torch.Tensor | float, exact: torch.Tensor) -> float:
    return abs(float(value) - float(exact)) / float(exact)


def _norm64(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.double().norm() for g in grads]).norm()


def _norm_problem(name: str, norm: torch.Tensor, grads: list[torch.Tensor]) -> list[str]:
    exact = _norm64(grads)
    error, allowed = _relative(norm, exact), max(2 * _relative(_total_norm(grads), exact), NORM_RTOL_FLOOR)
    return [] if error <= allowed else [f"{name} norm {float(norm):.9g}: relative error {error:.2e} > {allowed:.2e}"]


def _check_params(grads: list[torch.Tensor], scale: float) -> tuple[list[torch.nn.Parameter], torch.optim.SGD]:
    """Stand-in parameters holding ``grads * scale`` (their values are never read), with an SGD of lr 0."""
    params = []
    for grad in grads:
        param = torch.nn.Parameter(torch.empty_like(grad))
        param.grad = grad * scale
        params.append(param)
    return params, torch.optim.SGD(params, lr=0.0)


def _real_scale_problems(grads: list[torch.Tensor], device: torch.device) -> dict[str, list[str]]:
    """Stock and FusedGradScaler at the real scale, on copies of (the first CHECK_ELEMENTS of) the gradients:
    unscale_, clip_grad_norm_ and an overflow's back-off."""
    subset, total = [], 0
    for grad in grads:
        if subset and total + grad.numel() > CHECK_ELEMENTS:
            break
        subset.append(grad)
        total += grad.numel()
    found: dict[str, list[str]] = {"unscale": [], "clip": [], "overflow": []}
    stock_params, stock_sgd = _check_params(subset, CHECK_SCALE)
    ours_params, ours_sgd = _check_params(subset, CHECK_SCALE)
    stock = _ready(torch.amp.GradScaler(device.type, init_scale=CHECK_SCALE), device)
    ours = _ready(FusedGradScaler(device.type, init_scale=CHECK_SCALE), device)
    stock.unscale_(stock_sgd)
    ours.unscale_(ours_sgd)
    differ = [i for i, (a, b) in enumerate(zip(stock_params, ours_params)) if not torch.equal(a.grad, b.grad)]
    if differ:
        found["unscale"].append(
            f"unscale_ at scale 2^16: {len(differ)} gradients differ from stock's (first {differ[0]})"
        )
    del ours_params, ours_sgd
    clip_params, clip_sgd = _check_params(subset, CHECK_SCALE)
    clipper = _ready(FusedGradScaler(device.type, init_scale=CHECK_SCALE), device)
    norm = clipper.clip_grad_norm_(clip_sgd, CHECK_MAX_NORM)
    found["clip"] += _norm_problem("clip_grad_norm_ at scale 2^16", norm, subset)
    coef = min(1.0, CHECK_MAX_NORM / (float(norm) + 1e-6))
    for i, (param, grad) in enumerate(zip(clip_params, subset)):
        problem = mismatch(
            f"clipped gradient {i}", param.grad, (grad.double() * coef).float(), rtol=CLIP_RTOL, atol=0.0
        )
        if problem:
            found["clip"].append(problem)
            break
    for params in (stock_params, clip_params):
        params[-1].grad.view(-1)[-1] = math.inf
    backed_off = []
    for scaler, sgd in ((torch.amp.GradScaler, stock_sgd), (FusedGradScaler, clip_sgd)):
        fresh = _ready(scaler(device.type, init_scale=CHECK_SCALE), device)
        fresh.unscale_(sgd)
        fresh.step(sgd)
        fresh.update()
        backed_off.append(fresh.get_scale())
    if backed_off[1] != backed_off[0]:
        found["overflow"].append(f"after an inf gradient the scale is {backed_off[1]}, stock's {backed_off[0]}")
    return found


def _check_set(params, grads, timings, stepped, grad_norm_ratio, scales, clips) -> dict[Variant, str]:
    """The ``check`` of every ampkernels row of a parameter set (CHECK_NOTE); stock rows get none."""
    common = []
    if abs(grad_norm_ratio - 1.0) > NORM_RTOL_FLOOR:
        common.append(f"the gradients changed while timing (norm x{grad_norm_ratio:.9g})")
    stock_clip, fused_clip, fused_clip_deferred = clips
    real = _real_scale_problems(grads, grads[0].device)
    checks = {
        FUSED_UNSCALE: common + real["unscale"],
        FUSED_CLIP: common + _norm_problem("in-place clip", fused_clip(), grads) + real["clip"],
        FUSED_CLIP_DEFERRED: common + _norm_problem("deferred clip", fused_clip_deferred(), grads),
    }
    stock_norm_problems = _norm_problem("stock clip", stock_clip(), grads)
    stock_optimizer = stepped[STOCK_PHASE][0]
    stock_steps = timings[STOCK_PHASE].calls
    stock_error = {SERIES_LABELS[STOCK] + " + fused AdamW": (trajectory_error(stock_optimizer, stock_steps),
                                                              stock_steps)}  # fmt: skip
    stock_problems = step_count_problems(stock_optimizer, stock_steps)
    for variant, (optimizer, scaler, rows) in stepped.items():
        if variant == STOCK_PHASE:
            continue
        steps = sum(timings[row].calls for row in rows)
        problems = common + [f"stock: {p}" for p in stock_problems + stock_norm_problems]
        problems += step_count_problems(optimizer, steps)
        problems += trajectory_problems(trajectory_error(optimizer, steps), steps, stock_error)
        if scaler.get_scale() != scales[STOCK]:
            problems.append(f"scale {scaler.get_scale()} after the loops, stock's {scales[STOCK]}")
        checks[variant] = problems + real["overflow"]
    return {variant: check_result(problems) for variant, problems in checks.items()}


def _row(
    set_name: str,
    variant: Variant,
    timing: LoopTiming,
    num_tensors: int,
    num_params: int,
    copy_bandwidth_gbs: float,
    stock_ms: float,
) -> dict[str, Any]:
    wall_ms = timing.median_wall_ms
    floor_bytes = variant.floor_bytes_per_param * num_params
    floor_ms = floor_bytes / (copy_bandwidth_gbs * 1e9) * 1e3
    return {
        "set": set_name,
        "case": variant.case,
        "implementation": variant.implementation,
        "label": variant.label,
        "num_tensors": num_tensors,
        "num_params": num_params,
        "iterations": timing.iterations,
        "repeats": len(timing.wall_ms),
        "wall_ms": wall_ms,
        "wall_ms_per_repeat": timing.wall_ms,
        "device_ms": timing.median_device_ms,
        "device_ms_per_repeat": timing.device_ms,
        "floor_bytes_per_param": variant.floor_bytes_per_param,
        "floor_ms": floor_ms,
        "gbs": floor_bytes / (wall_ms * 1e-3) / 1e9,
        "x_floor": wall_ms / floor_ms,
        "speedup_over_stock": None if variant.implementation == FUSED_DEFERRED else stock_ms / wall_ms,
    }


def _warnings(param_sets: dict[str, dict[str, Any]]) -> list[str]:
    found = []
    for set_name, info in param_sets.items():
        for path, difference in info["norm_relative_difference"].items():
            if difference > NORM_AGREEMENT:
                found.append(f"WARNING {set_name}: {path} clip norm differs from stock by {difference:.2e} (relative)")
        if abs(info["grad_norm_ratio_after_timing"] - 1.0) > NORM_AGREEMENT:
            found.append(
                f"WARNING {set_name}: grad norm changed by x{info['grad_norm_ratio_after_timing']:.4g} while timing"
            )
    return found


GRAPHED = (STOCK_SYNC_FREE_GRAPHED, FUSED_OWN_GRAPHED)
STOCK_RECIPES = (STOCK, STOCK_SYNC_FREE, STOCK_SYNC_FREE_GRAPHED)
BEST_STOCK_NOTE = (
    "vs best stock: the row's time against the fastest stock recipe of its case run the same way (eager rows against "
    "the eager stock recipes: torch.amp.GradScaler's and the best sync-free assembly of stock parts"
)
GRAPHED_BEST_STOCK_NOTE = "; CUDA-graph rows against the stock assembly captured in a CUDA graph"


def best_stock(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any] | None:
    """The fastest stock row of ``row``'s set and case run the same way (eager or CUDA graph); None for stock rows
    and for the deferred clip (not the same work)."""
    if row["implementation"] in STOCK_RECIPES or row["implementation"] == FUSED_DEFERRED:
        return None
    graphed = row["implementation"] in GRAPHED
    candidates = [
        r
        for r in rows
        if r["set"] == row["set"]
        and r["case"] == row["case"]
        and r["implementation"] in STOCK_RECIPES
        and (r["implementation"] in GRAPHED) == graphed
    ]
    return min(candidates, key=lambda r: r["wall_ms"], default=None)


def with_best_stock(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with ``best_stock`` (its implementation) and ``speedup_over_best_stock`` set (also on documents
    saved before they were recorded)."""
    out = []
    for row in rows:
        best = best_stock(rows, row)
        out.append(
            row
            | {
                "best_stock": None if best is None else best["implementation"],
                "speedup_over_best_stock": None if best is None else best["wall_ms"] / row["wall_ms"],
            }
        )
    return out


def run(ctx: RunContext) -> dict[str, Any]:
    ctx.progress.reset(total=len(ctx.sets) * len(CASES))
    rows: list[dict[str, Any]] = []
    param_sets: dict[str, dict[str, Any]] = {}
    for set_name in ctx.sets:
        set_rows, param_sets[set_name] = _bench_param_set(ctx, set_name)
        rows += set_rows
        free_device_memory(ctx.device)
    return {
        "param_sets": param_sets,
        "notes": [
            TIMING_NOTE,
            DEFERRED_NOTE,
            BEST_STOCK_NOTE + ("" if ctx.cpu_small else GRAPHED_BEST_STOCK_NOTE) + ")",
        ]
        + [CHECK_NOTE]
        + ([CPU_TIMING_METHOD_NOTE, CPU_CACHE_NOTE] if ctx.cpu_small else [TIMING_METHOD_NOTE]),
        "warnings": _warnings(param_sets),
        "rows": with_best_stock(rows),
    }


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def report(document: dict[str, Any]) -> str:
    # On the CPU the sizes fit in the caches: the copy-bandwidth floor means nothing there (CPU_CACHE_NOTE).
    on_gpu = document["mode"] == "gpu"
    rows = with_best_stock(document["rows"])
    headers = ["set", "case", "implementation", "iters", "time ms"]
    headers += ["device ms", "GB/s", "x floor"] if on_gpu else ["GB/s"]
    headers += ["vs stock", "vs best stock", "check"]
    table_rows = []
    for row in rows:
        cells = [row["set"], row["case"], row["label"], str(row["iterations"]), format_ms(row["wall_ms"])]
        gpu_only = [format_ms(row["device_ms"]), f"{row['gbs']:.1f}", f"{row['x_floor']:.2f}"]
        cells += gpu_only if on_gpu else [f"{row['gbs']:.1f}"]
        cells += [_ratio(row["speedup_over_stock"]), _ratio(row["speedup_over_best_stock"]), check_cell(row)]
        table_rows.append(cells)
    set_lines = [
        f"{name}: {info['num_tensors']} tensors, {info['num_params'] / 1e6:.2f}M params; clip norm vs stock "
        f"(relative): in place {info['norm_relative_difference']['in_place']:.1e}, "
        f"deferred {info['norm_relative_difference']['deferred']:.1e}"
        for name, info in document["param_sets"].items()
    ]
    notes = [f"note: {note}" for note in document["notes"]]
    align = "lllr" + "r" * (len(headers) - 5) + "l"
    table = format_table(headers, table_rows, align)
    return "\n".join([table, *failure_lines(rows), "", *set_lines, *notes, *document["warnings"]])


def summary(document: dict[str, Any]) -> list[str]:
    """Per parameter set: the whole post-backward phase of ampkernels against the standard stock recipe and against
    the best stock recipe run the same way (eager or graphed)."""
    lines = []
    rows = with_best_stock(document["rows"])
    for set_name in document["param_sets"]:
        phase = {r["implementation"]: r for r in rows if r["set"] == set_name and r["case"] == CASES[-1]}
        parts = [
            f"{label} {phase[name]['speedup_over_stock']:.2f}x stock / {phase[name]['speedup_over_best_stock']:.2f}x "
            f"best stock ({phase[name]['best_stock']}, {phase[phase[name]['best_stock']]['wall_ms']:.3g} ms)"
            for name, label in ((FUSED_OWN, "eager"), (FUSED_OWN_GRAPHED, "graphed"))
            if name in phase
        ] or [
            f"{phase[FUSED]['speedup_over_stock']:.2f}x stock / {phase[FUSED]['speedup_over_best_stock']:.2f}x best "
            "stock, with torch fused AdamW"
        ]
        lines.append(
            f"{set_name} post-backward phase (FusedGradScaler + FusedAdamW vs torch.amp.GradScaler + fused AdamW, "
            f"{phase[STOCK]['wall_ms']:.3g} ms): " + ", ".join(parts)
        )
    return lines


def plot(document: dict[str, Any], path: Path, title: str) -> bool:
    time_ms = {(row["set"], row["case"], row["implementation"]): row["wall_ms"] for row in document["rows"]}
    panels = {}
    for set_name, info in document["param_sets"].items():
        series = {
            label: [time_ms.get((set_name, case, implementation)) for case in CASES]
            for implementation, label in SERIES_LABELS.items()
        }
        panel_title = f"{set_name} ({info['num_params'] / 1e6:.1f}M params, {info['num_tensors']} tensors)"
        panels[panel_title] = (list(CASES), series)
    return plot_grouped_bars(path, title, panels, ylabel="time per iteration, ms (log)")
