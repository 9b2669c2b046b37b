"""End-to-end fp16 AMP training steps: stock against ampkernels, eager and captured in one CUDA graph.

Models (random init): BERT-base (``transformers.BertForMaskedLM``, batch 32, seq 512), tiny GPT-2 (4 layers, 256 wide,
4 heads, vocab 8192, batch 8, seq 128), and an MLP of 200 x (Linear 256->256, LayerNorm, GELU) at batch 64 (800
parameter tensors). A step is autocast forward + scaled backward + unscale/clip to max_norm 1.0 + AdamW + scale
update. Recipes, each on its own copy of the model:

- ``stock-foreach``: torch.amp.GradScaler, unscale_, clip_grad_norm_, AdamW (foreach, torch's default), update;
- ``stock-fused``: the same with ``AdamW(fused=True)``;
- ``stock-fused-graphed``: the stock-fused step with ``AdamW(fused=True, capturable=True)``, captured whole with
  ``ampkernels.capture_step`` (torch's GradScaler syncs with the host only for an optimizer that is not fused, so
  this stock step can be captured too: what a torch user who graphs the step gets);
- ``ampkernels``: FusedGradScaler.clip_grad_norm_ (one read-only pass), step with ampkernels.FusedAdamW (torch's
  fused AdamW where the native optimizers are not built), update — no host sync;
- ``ampkernels-graphed``: the ampkernels step captured whole with ``ampkernels.capture_step`` and replayed.

Then a numerics run (on every model with --full, on one by default): 200 steps with overflows injected (the loss
multiplied by inf on a few steps, through a device tensor so that the graph sees it too), dropout off, recording the
loss and the scale of every step, for stock-fused, stock-foreach, ampkernels and ampkernels-graphed. Clipping makes
bitwise equality impossible between any two implementations (the total norm is summed in another order, so the clip
coefficient differs in its last bits); the scale history and the skipped steps must be identical, and ampkernels'
loss must stay as close to stock-fused as stock-foreach does. On a CPU-only machine only the MLP runs (shrunk, eager,
bf16).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ampkernels
from ampkernels import FusedGradScaler, capture_step
from benchmarks.common import (
    RunContext,
    format_table,
    free_device_memory,
    load_pyplot,
    save_figure,
    synchronize,
    wrap_title,
)

NAME = "training"

MAX_NORM = 1.0
LR = 1e-4
NUMERICS_STEPS = 200
OVERFLOW_STEPS = (20, 21, 90, 150)  # the loss is multiplied by inf: every recipe must skip these steps
NUMERICS_SCALER = {"init_scale": 2.0**16, "growth_interval": 25}  # short interval: growth shows within 200 steps
RECIPES = ("stock-foreach", "stock-fused", "stock-fused-graphed", "ampkernels", "ampkernels-graphed")
# stock-foreach against stock-fused measures how far two stock recipes drift apart: the yardstick for ampkernels.
NUMERICS_RECIPES = ("stock-fused", "stock-foreach", "ampkernels", "ampkernels-graphed")


# ---- models and batches ----


def _mlp(ctx: RunContext, dropout: float) -> tuple[torch.nn.Module, Callable[[int], tuple], str]:
    width, depth, batch = (256, 200, 64) if not ctx.cpu_small else (64, 8, 16)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)

    def batch_of(step: int) -> tuple:
        gen = torch.Generator().manual_seed(step)
        return torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)

    return model, batch_of, f"{depth} x (Linear {width}, LayerNorm, GELU), batch {batch}"


def _mlp_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _tokens(vocab: int, batch: int, seq: int) -> Callable[[int], tuple]:
    def batch_of(step: int) -> tuple:
        gen = torch.Generator().manual_seed(step)
        return (torch.randint(0, vocab, (batch, seq), generator=gen),)

    return batch_of


def _bert(ctx: RunContext, dropout: float):
    import transformers

    config = transformers.BertConfig(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return transformers.BertForMaskedLM(config), _tokens(config.vocab_size, 32, 512), "batch 32, seq 512"


def _gpt2(ctx: RunContext, dropout: float):
    import transformers

    config = transformers.GPT2Config(
        n_embd=256, n_layer=4, n_head=4, vocab_size=8192, n_positions=128, resid_pdrop=dropout, embd_pdrop=dropout
    )
    config.attn_pdrop = dropout
    return transformers.GPT2LMHeadModel(config), _tokens(8192, 8, 128), "4 layers, 256 wide, batch 8, seq 128"


def _lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


MODELS = {
    "bert-base": (_bert, _lm_loss, True),
    "tiny-gpt2": (_gpt2, _lm_loss, True),
    "mlp-800": (_mlp, _mlp_loss, False),
}


def _available(name: str, ctx: RunContext) -> str | None:
    """None when the model can run here, else why not."""
    _, _, needs_transformers = MODELS[name]
    if ctx.cpu_small and needs_transformers:
        return "CPU-only machine: transformer models skipped"
    if needs_transformers:
        try:
            import transformers  # noqa: F401
        except ImportError:
            return "transformers is not installed"
    return None


# ---- recipes ----


def _optimizer(recipe: str, params) -> torch.optim.Optimizer:
    if recipe == "stock-foreach":
        return torch.optim.AdamW(params, lr=LR, foreach=True)
    if recipe == "stock-fused-graphed":
        return torch.optim.AdamW(params, lr=LR, fused=True, capturable=True)  # torch refuses capture without it
    if recipe == "stock-fused" or not hasattr(ampkernels, "FusedAdamW"):
        return torch.optim.AdamW(params, lr=LR, fused=True)
    return ampkernels.FusedAdamW(params, lr=LR)


def _make_step(recipe: str, model, loss_fn, device, dtype, scaler_settings: dict):
    """A function ``step(*batch, poison) -> loss`` for ``recipe``; ``poison`` is a 0-d tensor, 1 or inf."""
    opt = _optimizer(recipe, model.parameters())
    if recipe.startswith("stock"):
        scaler = torch.amp.GradScaler(device.type, **scaler_settings)
    else:
        scaler = FusedGradScaler(device.type, **scaler_settings)

    def step(*inputs):
        *batch, poison = inputs
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = loss_fn(model, *batch) * poison
        scaler.scale(loss).backward()
        if recipe.startswith("stock"):
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        else:
            scaler.clip_grad_norm_(opt, MAX_NORM)
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return step, scaler


def _build(name: str, recipe: str, ctx: RunContext, dropout: float, scaler_settings: dict, warmup: bool = True):
    """The model, its step for ``recipe`` (captured for the graphed recipes) and its batches.

    ``warmup``: run 3 eager steps on batch 0 first (compilation, lazily created state) before timing. The numerics
    run passes False, so that its first step is the first training step of every recipe; a graphed step is then
    compared as ``capture_step`` leaves it.
    """
    make_model, loss_fn, _ = MODELS[name]
    torch.manual_seed(0)
    model, batch_of, description = make_model(ctx, dropout)
    model = model.to(ctx.device).train()
    dtype = torch.float16 if ctx.device.type == "cuda" else torch.bfloat16
    step, scaler = _make_step(recipe, model, loss_fn, ctx.device, dtype, scaler_settings)

    def inputs(i: int, poison: float = 1.0) -> tuple:
        batch = tuple(t.to(ctx.device) for t in batch_of(i))
        return (*batch, torch.tensor(poison, device=ctx.device))

    if recipe.endswith("graphed"):
        # The batches carry no attention mask: without transformers_mask_skip the captured attention runs masked
        # (BERT-base 107 ms against 52 ms eager on the H200, see ampkernels.cuda_graph.transformers_mask_skip).
        step = capture_step(step, *inputs(0), transformers_mask_skip=True)
    elif warmup:
        for _ in range(3):
            step(*inputs(0))
    return step, scaler, inputs, description


# ---- timing ----


def _time_recipe(name: str, recipe: str, ctx: RunContext) -> dict[str, Any]:
    free_device_memory(ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    step, _, inputs, description = _build(name, recipe, ctx, dropout=0.1, scaler_settings={})
    batches = [inputs(i) for i in range(4)]  # on the device before timing: the step, not the host copy, is timed
    synchronize(ctx.device)
    start = time.perf_counter()
    step(*batches[0])
    synchronize(ctx.device)
    one_ms = (time.perf_counter() - start) * 1e3
    iterations = max(3, math.ceil(ctx.target_loop_s * 4e3 / one_ms))
    per_repeat = []
    for _ in range(ctx.repeats):
        synchronize(ctx.device)
        start = time.perf_counter()
        for i in range(iterations):
            step(*batches[i % len(batches)])
        synchronize(ctx.device)
        per_repeat.append((time.perf_counter() - start) * 1e3 / iterations)
    row = {
        "model": name,
        "description": description,
        "recipe": recipe,
        "iterations": iterations,
        "step_ms": statistics.median(per_repeat),
        "step_ms_per_repeat": per_repeat,
        "peak_memory_gib": (
            round(torch.cuda.max_memory_allocated(ctx.device) / 2**30, 2) if ctx.device.type == "cuda" else None
        ),
    }
    del step, batches
    return row


# ---- where the time goes (eager against graphed) ----

PROFILE_MODELS = ("bert-base",)
# NOTE (H200): a 200-step numerics run takes ~4 s per recipe on tiny-gpt2 against ~11 s on BERT-base and ~17 s on
# the eager MLP (84 ms a step); the default run checks the numerics on the cheapest model that runs.
DEFAULT_NUMERICS_MODELS = ("tiny-gpt2", "mlp-800")
PROFILE_STEPS = 3


def _kernel_profile(name: str, recipe: str, ctx: RunContext, top: int = 12) -> dict[str, Any]:
    """The CUDA kernels of ``PROFILE_STEPS`` steps, by total time: explains a graphed step slower than eager."""
    from torch.profiler import ProfilerActivity, profile

    free_device_memory(ctx.device)
    step, _, inputs, _ = _build(name, recipe, ctx, dropout=0.1, scaler_settings={})
    batch = inputs(1)
    synchronize(ctx.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_STEPS):
            step(*batch)
        synchronize(ctx.device)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in kernels)
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    del step
    return {
        "kernel_ms_per_step": total_us / 1e3 / PROFILE_STEPS,
        "kernels_per_step": sum(e.count for e in kernels) / PROFILE_STEPS,
        "top": [
            {"name": e.key[:120], "ms_per_step": e.self_device_time_total / 1e3 / PROFILE_STEPS, "calls": e.count}
            for e in kernels[:top]
        ],
    }


# ---- numerics ----


def _numerics_run(name: str, recipe: str, ctx: RunContext) -> dict[str, Any]:
    free_device_memory(ctx.device)
    step, scaler, inputs, _ = _build(name, recipe, ctx, dropout=0.0, scaler_settings=NUMERICS_SCALER, warmup=False)
    losses, scales = [], []
    for i in range(1, NUMERICS_STEPS + 1):
        losses.append(step(*inputs(i, math.inf if i in OVERFLOW_STEPS else 1.0)).float().clone())
        scales.append(scaler._scale.detach().clone() if scaler._scale is not None else None)
    losses_host = torch.stack(losses).tolist()  # one sync at the end: the loop itself stays sync-free
    scales_host = [float(s) for s in scales]
    del step
    return {"loss": losses_host, "scale": scales_host}


def _compare(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    finite = [
        (a, b) for a, b in zip(reference["loss"], other["loss"]) if math.isfinite(a) and math.isfinite(b) and a != 0
    ]
    return {
        "scale_history_equal": reference["scale"] == other["scale"],
        "max_relative_loss_difference": max((abs(a - b) / abs(a) for a, b in finite), default=0.0),
        "final_loss": other["loss"][-1],
    }


# ---- the module interface ----


def _jobs(
    models: list[str], recipes: list[str], numerics_recipes: list[str], cuda: bool, full: bool = True
) -> list[tuple]:
    """(kind, model, recipe) in run order: every eager job first, then the graphed ones, BERT-base's last. A device-side
    assert loses the CUDA context for the rest of the process, so the riskiest jobs go where they can lose least.

    Not ``full``: the numerics run only for the first model of DEFAULT_NUMERICS_MODELS that runs here, and no kernel
    profile."""
    numerics_models = models if full else [name for name in DEFAULT_NUMERICS_MODELS if name in models][:1]
    eager, graphed = [], []
    for name in models:
        for recipe in recipes:
            (graphed if recipe.endswith("graphed") else eager).append(("time", name, recipe))
        for recipe in numerics_recipes if name in numerics_models else ():
            (graphed if recipe.endswith("graphed") else eager).append(("numerics", name, recipe))
        if cuda and full and name in PROFILE_MODELS:
            eager.append(("profile", name, "ampkernels"))
            graphed.append(("profile", name, "ampkernels-graphed"))
    graphed.sort(key=lambda job: job[1] in PROFILE_MODELS)  # stable: BERT-base's graphed jobs last
    return eager + graphed


def run(ctx: RunContext) -> dict[str, Any]:
    recipes = [r for r in RECIPES if ctx.device.type == "cuda" or not r.endswith("graphed")]
    numerics_recipes = [r for r in NUMERICS_RECIPES if r in recipes]
    skipped = {name: why for name in MODELS if (why := _available(name, ctx)) is not None}
    models = [name for name in MODELS if name not in skipped]
    jobs = _jobs(models, recipes, numerics_recipes, ctx.device.type == "cuda", ctx.full)
    ctx.progress.reset(total=len(jobs))
    rows, profiles = [], {}
    runs: dict[str, dict[str, Any]] = {name: {} for name in models}
    lost_context = None
    for kind, name, recipe in jobs:
        ctx.progress.set_postfix_str(f"{name}: {kind} {recipe}")
        if lost_context is not None:
            result = {"error": f"not run: the CUDA context was lost in {lost_context}"}
        else:
            try:
                if kind == "time":
                    result = _time_recipe(name, recipe, ctx)
                elif kind == "numerics":
                    result = _numerics_run(name, recipe, ctx)
                else:
                    result = _kernel_profile(name, recipe, ctx)
            except Exception as exc:  # a failed job is reported, not fatal to the others
                result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                if "device-side assert" in str(exc) or "illegal memory access" in str(exc):
                    lost_context = f"{kind} {name} {recipe}"
        if kind == "time":
            rows.append({"model": name, "recipe": recipe, **result})
        elif kind == "numerics":
            runs[name][recipe] = result
        else:
            profiles.setdefault(name, {})[recipe] = result
        ctx.progress.update()
    order = {recipe: i for i, recipe in enumerate(RECIPES)}
    rows.sort(key=lambda row: (models.index(row["model"]), order[row["recipe"]]))
    numerics = {}
    for name in (name for name in models if runs[name]):
        reference = runs[name].get("stock-fused")
        ordered = {recipe: runs[name][recipe] for recipe in NUMERICS_RECIPES if recipe in runs[name]}
        numerics[name] = {
            "runs": ordered,
            "versus_stock": {
                recipe: _compare(reference, run)
                for recipe, run in ordered.items()
                if recipe != "stock-fused" and reference and "error" not in reference and "error" not in run
            },
        }
    for row in rows:
        base = next((r for r in rows if r["model"] == row["model"] and r["recipe"] == "stock-fused"), None)
        if "error" not in row and base is not None and "error" not in base:
            row["speedup_over_stock_fused"] = base["step_ms"] / row["step_ms"]
            foreach = next((r for r in rows if r["model"] == row["model"] and r["recipe"] == "stock-foreach"), None)
            if foreach is not None and "error" not in foreach:
                row["speedup_over_stock_foreach"] = foreach["step_ms"] / row["step_ms"]
        stock_graphed = next(
            (r for r in rows if r["model"] == row["model"] and r["recipe"] == "stock-fused-graphed"), None
        )
        if (
            row["recipe"] == "ampkernels-graphed"
            and "error" not in row
            and stock_graphed
            and "error" not in stock_graphed
        ):
            row["speedup_over_stock_fused_graphed"] = stock_graphed["step_ms"] / row["step_ms"]
    return {
        "rows": rows,
        "numerics": numerics,
        "skipped": skipped,
        "kernel_profiles": profiles,
        "notes": [
            f"numerics: {NUMERICS_STEPS} steps, overflows injected at steps {list(OVERFLOW_STEPS)}, dropout 0, "
            f"scaler {NUMERICS_SCALER}; compared with stock-fused (torch.amp.GradScaler + torch fused AdamW)",
            "step time: median over repeats of the wall time per step of a loop, host work included",
        ],
    }


def report(document: dict[str, Any]) -> str:
    headers = ["model", "recipe", "step ms", "vs stock-fused", "vs stock-foreach", "vs stock graphed", "peak GiB"]
    table = []
    for row in document["rows"]:
        if "error" in row:
            table.append([row["model"], row["recipe"], "error", row["error"][:60], "", "", ""])
            continue
        graphed = row.get("speedup_over_stock_fused_graphed")
        table.append(
            [
                row["model"],
                row["recipe"],
                f"{row['step_ms']:.2f}",
                f"{row.get('speedup_over_stock_fused', 0):.2f}x",
                f"{row.get('speedup_over_stock_foreach', 0):.2f}x",
                "-" if graphed is None else f"{graphed:.2f}x",
                "-" if row["peak_memory_gib"] is None else f"{row['peak_memory_gib']:.2f}",
            ]
        )
    lines = [format_table(headers, table, "llrrrrr"), ""]
    for name, info in document["numerics"].items():
        for recipe, run in info["runs"].items():
            if "error" in run:
                lines.append(f"{name} {NUMERICS_STEPS}-step run, {recipe}: error {run['error'][:200]}")
        for recipe, cmp in info["versus_stock"].items():
            lines.append(
                f"{name} {NUMERICS_STEPS}-step run, {recipe} vs stock: scale history "
                f"{'identical' if cmp['scale_history_equal'] else 'DIFFERS'}, max relative loss difference "
                f"{cmp['max_relative_loss_difference']:.2e}, final loss {cmp['final_loss']:.4f}"
            )
    for name, by_recipe in document.get("kernel_profiles", {}).items():
        for recipe, prof in by_recipe.items():
            if "error" in prof:
                lines.append(f"{name} kernel profile, {recipe}: error {prof['error'][:200]}")
                continue
            lines.append(
                f"{name} kernel profile, {recipe}: {prof['kernel_ms_per_step']:.2f} ms of kernels in "
                f"{prof['kernels_per_step']:.0f} launches per step; top: "
                + "; ".join(f"{k['name'][:50]} {k['ms_per_step']:.2f} ms" for k in prof["top"][:4])
            )
    lines += [f"skipped {name}: {why}" for name, why in document["skipped"].items()]
    lines += [f"note: {note}" for note in document["notes"]]
    return "\n".join(lines)


def summary(document: dict[str, Any]) -> list[str]:
    """Per model: the ampkernels step, eager and graphed, against the stock recipe with torch's fused AdamW."""
    lines = []
    precision = "fp16" if document["mode"] == "gpu" else "bf16"  # as _build picks
    for name in dict.fromkeys(row["model"] for row in document["rows"]):
        by = {r["recipe"]: r for r in document["rows"] if r["model"] == name and "error" not in r}
        if "stock-fused" not in by:
            continue
        parts = [
            f"{label} {by[recipe]['speedup_over_stock_fused']:.2f}x"
            for recipe, label in (("ampkernels", "eager"), ("ampkernels-graphed", "graphed"))
            if recipe in by
        ]
        if "speedup_over_stock_fused_graphed" in by.get("ampkernels-graphed", {}):
            parts.append(
                f"graphed vs stock graphed ({by['stock-fused-graphed']['step_ms']:.3g} ms) "
                f"{by['ampkernels-graphed']['speedup_over_stock_fused_graphed']:.2f}x"
            )
        failed = [r["recipe"] for r in document["rows"] if r["model"] == name and "error" in r]
        lines.append(
            f"{name} training step vs stock {precision} AMP (fused AdamW, {by['stock-fused']['step_ms']:.3g} ms): "
            + ", ".join(parts)
            + (f" (failed: {', '.join(failed)})" if failed else "")
        )
    for name, info in document["numerics"].items():
        for recipe, cmp in info["versus_stock"].items():
            if recipe.startswith("ampkernels"):
                lines.append(
                    f"{name} {NUMERICS_STEPS}-step numerics, {recipe}: scale history "
                    f"{'identical' if cmp['scale_history_equal'] else 'DIFFERS'} to stock"
                )
    return lines


def plot(document: dict[str, Any], path: Path, title: str) -> bool:
    models = [name for name, info in document["numerics"].items() if info["runs"]]
    if not models:
        return False
    plt = load_pyplot(path)
    if plt is None:
        return False
    width_in = 5.5 * len(models)
    figure, axes = plt.subplots(2, len(models), figsize=(width_in, 7), squeeze=False, layout="constrained")
    for column, name in enumerate(models):
        for index, (recipe, run) in enumerate(document["numerics"][name]["runs"].items()):
            if "error" in run:
                continue
            steps = range(1, len(run["loss"]) + 1)
            style = {"label": recipe, "color": f"C{index}", "linewidth": max(0.9, 2.5 - index * 0.7)}
            axes[0][column].plot(steps, [v if math.isfinite(v) else math.nan for v in run["loss"]], **style)
            axes[1][column].plot(steps, [math.log2(s) for s in run["scale"]], **style)
        for step in OVERFLOW_STEPS:
            axes[1][column].axvline(step, color="grey", alpha=0.3, linewidth=0.8)
        axes[0][column].set_title(f"{name}: loss", fontsize=10)
        axes[1][column].set_title(f"{name}: log2(scale)\ngrey lines: injected overflows", fontsize=10)
        axes[1][column].set_xlabel("step")
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = min(len(labels), max(1, int(width_in // 1.9)))
    figure.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, fontsize=9)
    figure.suptitle(wrap_title(title, width_in), fontsize=10)
    save_figure(figure, path, dpi=110)
    return True
