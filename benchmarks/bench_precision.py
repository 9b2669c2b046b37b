"""Training step time and peak memory by precision: FP32, TF32, FP16 and BF16, stock and with ampkernels.

Models (random init, each recipe on its own fresh copy with the same seed):

- BERT-base: ``transformers.BertForMaskedLM(BertConfig())``, batch 32 x seq 512, masked-LM loss on 15% of the
  tokens (labels -100 elsewhere), no attention mask;
- ResNet-50: ``torchvision.models.resnet50()``, batch 64, 3 x 224 x 224, cross-entropy over 1000 classes.

A step is forward + backward + gradient clipping to max_norm 1.0 + AdamW (lr 1e-4). Recipes:

- ``fp32``: no autocast, TF32 off for matmuls and cuDNN convolutions; torch ``AdamW(fused=True)``;
- ``tf32``: the same with TF32 on for both;
- ``fp16-stock``: fp16 autocast + ``torch.amp.GradScaler`` (unscale_, clip_grad_norm_, step, update) + torch fused
  AdamW;
- ``fp16-ampkernels``: fp16 autocast + ``ampkernels.FusedGradScaler.clip_grad_norm_`` + ``ampkernels.FusedAdamW``;
- ``bf16-stock``: bf16 autocast (no scaler) + clip_grad_norm_ + torch fused AdamW;
- ``bf16-ampkernels``: bf16 autocast + clip_grad_norm_ + ``ampkernels.FusedAdamW``;
- ``*-graphed``: each ampkernels recipe captured whole with ``ampkernels.capture_step`` and replayed (BERT with
  ``transformers_mask_skip=True``); a capture that fails is recorded with its reason.

The AMP recipes run with torch's default TF32 settings. Time: median over repeats of the wall time per step of a loop
(host work included); each ampkernels eager recipe is built beside its stock recipe and the two are timed
alternately, repeat by repeat (``PAIRS``); peak memory: ``torch.cuda.max_memory_allocated`` while the recipe builds
and warms up, above what was allocated before.
Beside ours the table quotes stock figures measured earlier on an H200 (``REFERENCE``), with what differs.

On a CPU-only machine: a 2-layer, 64-wide BERT (batch 4 x seq 32) and ResNet-18 at 32 x 32 (batch 8, 10 classes),
recipes fp32, bf16-stock and bf16-ampkernels (no TF32, no fp16 scaler recipes, no graphs): a smoke run, not a
measurement. A model whose package (transformers, torchvision) is not installed is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ampkernels
from ampkernels import FusedGradScaler, capture_step
from benchmarks.common import (
    RunContext,
    format_table,
    free_device_memory,
    missing_package,
    plot_grouped_bars,
    synchronize,
)

NAME = "precision"

MAX_NORM = 1.0
LR = 1e-4
MLM_PROBABILITY = 0.15
# At least 5 steps a loop on a GPU (3 repeats: 15 timed steps, ~4 s for BERT-base in FP32 on an H200); on the CPU the
# loops only need to show that every recipe runs.
MIN_ITERATIONS = 5


@dataclass(frozen=True)
class Recipe:
    name: str
    label: str  # for tables and plots
    autocast: torch.dtype | None  # None: no autocast
    tf32: bool | None  # True/False: force TF32 on/off for matmuls and convolutions; None: torch's defaults
    library: str  # "stock" or "ampkernels"
    graphed: bool = False


RECIPES = (
    Recipe("fp32", "FP32", None, False, "stock"),
    Recipe("tf32", "TF32", None, True, "stock"),
    Recipe("fp16-stock", "FP16 + torch GradScaler", torch.float16, None, "stock"),
    Recipe("fp16-ampkernels", "FP16 + FusedGradScaler + FusedAdamW", torch.float16, None, "ampkernels"),
    Recipe("fp16-ampkernels-graphed", "FP16 ampkernels, CUDA graph", torch.float16, None, "ampkernels", True),
    Recipe("bf16-stock", "BF16", torch.bfloat16, None, "stock"),
    Recipe("bf16-ampkernels", "BF16 + FusedAdamW", torch.bfloat16, None, "ampkernels"),
    Recipe("bf16-ampkernels-graphed", "BF16 + FusedAdamW, CUDA graph", torch.bfloat16, None, "ampkernels", True),
)
CPU_RECIPES = ("fp32", "bf16-stock", "bf16-ampkernels")
BY_NAME = {recipe.name: recipe for recipe in RECIPES}
# Built side by side and timed alternately, repeat by repeat: the eager ResNet-50 step is bound by the host's
# enqueue time (H100: 13.3 ms of host work for a 13.3 ms forward), and its wall time spread 25.6-32.4 ms over five
# rounds of one run; timed one recipe after the other, the H200 run put ampkernels 6-8% behind stock, while the
# profile of both steps gave ampkernels less device time (23.8 against 24.1 ms) and less host time after backward
# (1.2 against 4.2 ms). dev/models/step_profile.py measures both.
PAIRS = (("fp16-stock", "fp16-ampkernels"), ("bf16-stock", "bf16-ampkernels"))

# Stock PyTorch on the GPU-sized models, quoted beside this run's figures (every ampkernels figure is measured here).
REFERENCE = {
    "label": "reference figures measured on an H200 on 2026-11-29",
    "setup": "NVIDIA H200, torch 2.11.0+cu130; BERT-base batch 32 x seq 512, ResNet-50 batch 64 at 224 x 224; "
    "fp16 with torch.amp.GradScaler; clip_grad_norm_ 1.0 + AdamW",
    "device_name": "NVIDIA H200",
    "models": {
        "bert-base": {
            "ms": {"fp32": 278.7, "tf32": 115.2, "fp16-stock": 56.4, "bf16-stock": 55.1},
            "peak_gib": {"fp32": 16.4, "fp16-stock": 12.3, "bf16-stock": 12.3},
        },
        "resnet-50": {
            "ms": {"fp32": 78.3, "tf32": 33.4, "fp16-stock": 25.4, "bf16-stock": 30.0},
            "peak_gib": {"fp32": 5.55, "fp16-stock": 3.08, "bf16-stock": 3.08},
        },
    },
}


# ---- models and batches ----


@dataclass
class Model:
    module: torch.nn.Module
    batch_of: Callable[[int], tuple[torch.Tensor, ...]]  # batch i, on the CPU
    loss_fn: Callable[..., torch.Tensor]
    description: str
    huggingface: bool


def _bert(cpu_small: bool) -> Model:
    import transformers

    if cpu_small:
        config = transformers.BertConfig(
            vocab_size=1024,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=64,
        )
        batch, seq = 4, 32
    else:
        config = transformers.BertConfig()
        batch, seq = 32, 512
    module = transformers.BertForMaskedLM(config)

    def batch_of(i: int) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
        masked = torch.rand(batch, seq, generator=gen) < MLM_PROBABILITY
        return ids, torch.where(masked, ids, torch.full_like(ids, -100))

    def loss_fn(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=labels).loss

    layers = f"{config.num_hidden_layers} layers, {config.hidden_size} wide"
    return Model(module, batch_of, loss_fn, f"BertForMaskedLM ({layers}), batch {batch} x seq {seq}", True)


def _resnet(cpu_small: bool) -> Model:
    import torchvision

    if cpu_small:
        module, classes, batch, size, name = torchvision.models.resnet18(num_classes=10), 10, 8, 32, "ResNet-18"
    else:
        module, classes, batch, size, name = torchvision.models.resnet50(), 1000, 64, 224, "ResNet-50"

    def batch_of(i: int) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(i)
        return torch.randn(batch, 3, size, size, generator=gen), torch.randint(0, classes, (batch,), generator=gen)

    def loss_fn(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(images).float(), labels)

    return Model(module, batch_of, loss_fn, f"{name}, batch {batch} at {size} x {size}", False)


MODELS: dict[str, tuple[Callable[[bool], Model], str]] = {
    "bert-base": (_bert, "transformers"),
    "resnet-50": (_resnet, "torchvision"),
}


# The scaled-down stand-ins of a CPU-only run go by their own names.
CPU_NAMES = {"bert-base": "bert-tiny", "resnet-50": "resnet-18"}


def model_name(name: str, cpu_small: bool) -> str:
    return CPU_NAMES[name] if cpu_small else name


def _why_not(name: str) -> str | None:
    """None when the model's package is installed, else why the model is skipped."""
    return missing_package(MODELS[name][1])


# ---- recipes ----


@contextlib.contextmanager
def _tf32(enabled: bool | None) -> Iterator[None]:
    """TF32 for matmuls and cuDNN convolutions forced on or off (None: left as it is), restored afterwards."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    if enabled is not None:
        torch.set_float32_matmul_precision("high" if enabled else "highest")
        torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


def _make_step(recipe: Recipe, model: Model, device: torch.device) -> Callable[..., torch.Tensor]:
    params = [p for p in model.module.parameters() if p.requires_grad]
    if recipe.library == "ampkernels":
        optimizer = ampkernels.FusedAdamW(params, lr=LR)
    else:
        optimizer = torch.optim.AdamW(params, lr=LR, fused=True)
    scaler = None
    if recipe.autocast == torch.float16:
        scaler = FusedGradScaler(device.type) if recipe.library == "ampkernels" else torch.amp.GradScaler(device.type)

    def step(*batch: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=recipe.autocast or torch.float32, enabled=recipe.autocast is not None):
            loss = model.loss_fn(model.module, *batch)
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            optimizer.step()
        elif isinstance(scaler, FusedGradScaler):
            scaler.scale(loss).backward()
            scaler.clip_grad_norm_(optimizer, MAX_NORM)
            scaler.step(optimizer)
            scaler.update()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            scaler.step(optimizer)
            scaler.update()
        return loss.detach()

    return step


@dataclass
class _Live:
    """One recipe built, warmed up and sized, ready to time."""

    recipe: Recipe
    model: Model
    step: Callable[..., torch.Tensor]
    batches: list[tuple[torch.Tensor, ...]]
    iterations: int
    peak_gib: float | None
    per_repeat: list[float]
    loss: torch.Tensor | None = None


def _build(name: str, recipe: Recipe, ctx: RunContext) -> _Live:
    cuda = ctx.device.type == "cuda"
    before = torch.cuda.memory_allocated(ctx.device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with _tf32(recipe.tf32 if cuda else None):
        torch.manual_seed(0)
        with ctx.device:
            model = MODELS[name][0](ctx.cpu_small)
        model.module.train()
        step = _make_step(recipe, model, ctx.device)
        batches = [tuple(t.to(ctx.device) for t in model.batch_of(i)) for i in range(4)]
        if recipe.graphed:
            step = capture_step(step, *batches[0], transformers_mask_skip=model.huggingface)
        else:
            for _ in range(3 if cuda else 1):  # cuBLAS/cuDNN workspaces and autotuning, optimizer state
                step(*batches[0])
        synchronize(ctx.device)
        start = time.perf_counter()
        step(*batches[1])
        synchronize(ctx.device)
        one_ms = (time.perf_counter() - start) * 1e3
    iterations = max(MIN_ITERATIONS if cuda else 1, math.ceil(ctx.target_loop_s * 4e3 / one_ms))
    peak = (torch.cuda.max_memory_allocated(ctx.device) - before) / 2**30 if cuda else None
    return _Live(recipe, model, step, batches, iterations, peak, [])


def _run_loop(live: _Live, iterations: int, ctx: RunContext) -> None:
    with _tf32(live.recipe.tf32 if ctx.device.type == "cuda" else None):
        synchronize(ctx.device)
        start = time.perf_counter()
        for i in range(iterations):
            live.loss = live.step(*live.batches[i % len(live.batches)])
        synchronize(ctx.device)
    live.per_repeat.append((time.perf_counter() - start) * 1e3 / iterations)


def _time_group(name: str, recipes: list[Recipe], ctx: RunContext) -> list[dict[str, Any]]:
    """Builds ``recipes`` side by side and times them alternately, repeat by repeat (the loop length of the first),
    so that clock and host drift fall on stock and ampkernels alike."""
    lives = []
    try:
        for recipe in recipes:
            lives.append(_build(name, recipe, ctx))
        iterations = lives[0].iterations
        for _ in range(ctx.repeats):
            for live in lives:
                _run_loop(live, iterations, ctx)
        return [
            {
                "model": name,
                "description": live.model.description,
                "recipe": live.recipe.name,
                "label": live.recipe.label,
                "iterations": iterations,
                "step_ms": statistics.median(live.per_repeat),
                "step_ms_per_repeat": live.per_repeat,
                "alternated": len(lives) > 1,
                "peak_memory_gib": None if live.peak_gib is None else round(live.peak_gib, 2),
                "final_loss": float(live.loss),
            }
            for live in lives
        ]
    finally:
        del lives
        free_device_memory(ctx.device)


# ---- the module interface ----


def _recipes(ctx: RunContext) -> list[Recipe]:
    if ctx.cpu_small:
        return [BY_NAME[name] for name in CPU_RECIPES]
    return list(RECIPES)


def run(ctx: RunContext) -> dict[str, Any]:
    skipped = {name: why for name in MODELS if (why := _why_not(name)) is not None}
    models = [name for name in MODELS if name not in skipped]
    recipes = _recipes(ctx)
    names = [r.name for r in recipes]
    groups = [[BY_NAME[n] for n in pair] for pair in PAIRS if all(n in names for n in pair)]
    paired = {r.name for group in groups for r in group}
    groups += [[r] for r in recipes if r.name not in paired]
    # Eager recipes first: a device-side assert in a graph would lose the CUDA context for everything after it.
    groups.sort(key=lambda group: (group[0].graphed, names.index(group[0].name)))
    jobs = [(name, group) for group in groups for name in models]
    ctx.progress.reset(total=len(jobs))
    rows, lost_context = [], None
    for name, group in jobs:
        ctx.progress.set_postfix_str(f"{name}: {'/'.join(r.name for r in group)}")
        if lost_context is not None:
            new = [{"error": f"not run: the CUDA context was lost in {lost_context}"} for _ in group]
        else:
            try:
                new = _time_group(name, group, ctx)
            except Exception as exc:  # a recipe that fails (a capture, memory) is reported, not fatal to the others
                new = [{"error": f"{type(exc).__name__}: {exc}"[:500]} for _ in group]
                if "device-side assert" in str(exc) or "illegal memory access" in str(exc):
                    lost_context = f"{name} {group[0].name}"
        for row, recipe in zip(new, group):
            rows.append({**row, "model": model_name(name, ctx.cpu_small), "recipe": recipe.name, "label": recipe.label})
        ctx.progress.update()
    order = {recipe.name: i for i, recipe in enumerate(RECIPES)}
    names = [model_name(name, ctx.cpu_small) for name in models]
    rows.sort(key=lambda row: (names.index(row["model"]), order[row["recipe"]]))
    for row in rows:
        fp32 = next((r for r in rows if r["model"] == row["model"] and r["recipe"] == "fp32"), None)
        if "error" not in row and fp32 is not None and "error" not in fp32:
            row["speedup_over_fp32"] = fp32["step_ms"] / row["step_ms"]
    return {
        "rows": rows,
        "skipped": skipped,
        "reference": REFERENCE,
        "differences_from_reference": _differences(ctx),
        "notes": [
            "step time: median over repeats of the wall time per step of a loop, host work included",
            *(
                (["smoke run of tiny models: every recipe runs, the times say nothing about a GPU"] if models else [])
                if ctx.cpu_small
                else [
                    "peak memory: torch.cuda.max_memory_allocated while the recipe builds and warms up, above what was "
                    "allocated before",
                    "fp16 and bf16, stock and ampkernels: built side by side and timed alternately, repeat by repeat",
                    "AMP recipes run with torch's default TF32 settings; fp32 forces TF32 off, tf32 forces it on",
                ]
            ),
        ],
    }


def _differences(ctx: RunContext) -> list[str]:
    """What separates this run from the setting of the reference figures."""
    if ctx.cpu_small:
        return ["CPU-only run: tiny models and batches, the reference figures (GPU-sized models) do not apply"]
    found = []
    name = torch.cuda.get_device_name(ctx.device)
    if name != REFERENCE["device_name"]:
        found.append(f"GPU: {name} here, {REFERENCE['device_name']} for the reference")
    if not torch.__version__.startswith("2.11."):
        found.append(f"torch {torch.__version__} here, 2.11.0+cu130 for the reference")
    found.append("same batches and models (BERT-base 32 x 512, ResNet-50 64 x 224^2)")
    return found


def _reference(document: dict[str, Any], row: dict[str, Any], key: str) -> float | None:
    if document["mode"] != "gpu":
        return None
    return document["reference"]["models"].get(row["model"], {}).get(key, {}).get(row["recipe"])


def report(document: dict[str, Any]) -> str:
    on_gpu = document["mode"] == "gpu"
    headers = ["model", "recipe", "ms/step", "peak GiB", "x FP32"]
    if on_gpu:
        headers += ["ref ms", "ref GiB", "ref x FP32"]
    table = []
    for row in document["rows"]:
        if "error" in row:
            table.append([row["model"], row["label"], "error", row["error"][:70], "", *([""] * 3 * on_gpu)])
            continue
        cells = [
            row["model"],
            row["label"],
            f"{row['step_ms']:.2f}",
            "-" if row["peak_memory_gib"] is None else f"{row['peak_memory_gib']:.2f}",
            f"{row['speedup_over_fp32']:.2f}x" if "speedup_over_fp32" in row else "-",
        ]
        if on_gpu:
            ref_ms, ref_gib = _reference(document, row, "ms"), _reference(document, row, "peak_gib")
            ref_fp32 = document["reference"]["models"].get(row["model"], {}).get("ms", {}).get("fp32")
            cells += [
                "-" if ref_ms is None else f"{ref_ms:.1f}",
                "-" if ref_gib is None else f"{ref_gib:.2f}",
                "-" if ref_ms is None or ref_fp32 is None else f"{ref_fp32 / ref_ms:.2f}x",
            ]
        table.append(cells)
    lines = [format_table(headers, table, "llrrr" + "rrr" * on_gpu), ""]
    descriptions = {row["model"]: row["description"] for row in document["rows"] if "description" in row}
    lines += [f"{name}: {description}" for name, description in descriptions.items()]
    if on_gpu:
        lines.append(f"ref: {document['reference']['label']} ({document['reference']['setup']})")
    lines += [f"differs from the reference: {line}" for line in document["differences_from_reference"]]
    lines += [f"skipped {name}: {why}" for name, why in document["skipped"].items()]
    lines += [f"note: {note}" for note in document["notes"]]
    return "\n".join(lines)


def summary(document: dict[str, Any]) -> list[str]:
    """Per model: each precision's speedup over FP32, and ampkernels against the stock recipe of its precision."""
    lines = []
    for name in dict.fromkeys(row["model"] for row in document["rows"]):
        by = {r["recipe"]: r for r in document["rows"] if r["model"] == name and "error" not in r}
        if "fp32" not in by:
            continue
        over_fp32 = ", ".join(f"{r['label']} {r['speedup_over_fp32']:.2f}x" for r in by.values() if r is not by["fp32"])
        lines.append(f"{name} step time over FP32 ({by['fp32']['step_ms']:.3g} ms): {over_fp32}")
        for precision in ("fp16", "bf16"):
            stock = by.get(f"{precision}-stock")
            ours = [by[n] for n in (f"{precision}-ampkernels", f"{precision}-ampkernels-graphed") if n in by]
            if stock and ours:
                parts = ", ".join(f"{r['label']} {stock['step_ms'] / r['step_ms']:.2f}x" for r in ours)
                lines.append(f"{name} {precision.upper()} against stock {stock['label']}: {parts}")
        failed = [r["recipe"] for r in document["rows"] if r["model"] == name and "error" in r]
        if failed:
            lines.append(f"{name} failed: {', '.join(failed)} (reasons in the table)")
    lines += [f"skipped {name}: {why}" for name, why in document["skipped"].items()]
    return lines


def plot(document: dict[str, Any], path: Path, title: str) -> bool:
    """One bar chart per model: ms per step by recipe, this run beside the reference figures."""
    panels = {}
    for name in dict.fromkeys(row["model"] for row in document["rows"]):
        rows = [r for r in document["rows"] if r["model"] == name]
        if all("error" in r for r in rows):
            continue
        groups = [r["label"].replace(" + ", "\n+ ").replace(", ", ",\n") for r in rows]
        series = {"this run": [r.get("step_ms") for r in rows]}
        if document["mode"] == "gpu":
            series[document["reference"]["label"]] = [_reference(document, r, "ms") for r in rows]
        description = next((r["description"] for r in rows if "description" in r), name)
        panels[f"{name}: {description}"] = (groups, series)
    if not panels:
        return False
    return plot_grouped_bars(
        path, title, panels, "ms per step", log_scale=False, max_columns=1, panel_width=13, tick_fontsize=8
    )
