"""The model zoo: whole training steps of real models, stock PyTorch against ampkernels, measured in the same run.

Models (built from their configs with random weights, no downloads; the same seed and batches for every recipe):

- ``bert-base``: ``transformers.BertForMaskedLM(BertConfig())``, batch 32 x seq 512, masked-LM loss on 15% of tokens;
- ``gpt2``: ``transformers.GPT2LMHeadModel(GPT2Config())`` (124M), batch 8 x seq 1024, causal-LM loss;
- ``llama-1b``: ``transformers.LlamaForCausalLM`` of 1.1B parameters (width 2048, 22 layers, 32 heads, 4 key/value
  heads, ffn 5632, vocab 32000), batch 4 x seq 2048;
- ``t5-small``: ``transformers.T5ForConditionalGeneration(T5Config())``, batch 32, 512 source and 128 target tokens;
- ``resnet-50`` and ``resnet-50-cl``: ``torchvision.models.resnet50()`` at batch 64 x 224^2, NCHW and channels_last;
- ``vit-b16``: ``torchvision.models.vit_b_16()``, batch 64 x 224^2;
- ``convnext-t``: ``timm.create_model("convnext_tiny")``, batch 64 x 224^2, channels_last.

A step: zero_grad, forward under autocast, backward, clip to max_norm 1.0, AdamW (lr 1e-4), scale update. Recipes:

- ``fp16-stock``: ``torch.amp.GradScaler`` + ``unscale_`` + ``torch.nn.utils.clip_grad_norm_`` + torch
  ``AdamW(fused=True)`` (the recipe of PyTorch's AMP documentation, with its fastest optimizer);
- ``fp16-ampkernels``: ``FusedGradScaler.clip_grad_norm_`` + ``FusedAdamW``;
- ``fp16-stock-graphed`` / ``fp16-ampkernels-graphed``: the same steps captured whole with ``capture_step`` (stock
  with ``AdamW(fused=True, capturable=True)``);
- ``bf16-stock`` / ``bf16-ampkernels``: bf16 autocast, no scaler;
- ``fp8-ampkernels`` (transformer models): ``convert_to_float8(model, "tensorwise")`` + bf16 autocast +
  ``FusedAdamW``, against ``bf16-stock``;
- ``bf16-ampkernels-8bit`` (``llama-1b``): ``FusedAdamW`` with 8-bit moments, against ``bf16-stock``;
- ``stock-trainer`` / ``ampkernels-trainer`` (``bert-base``), ``stock-accelerate`` / ``ampkernels-accelerate`` and
  ``stock-lightning`` / ``ampkernels-lightning`` (``gpt2``): fp16 training through Hugging Face ``Trainer``,
  Accelerate and Lightning, stock against ``ampkernels.integrations`` (:mod:`benchmarks.zoo_frameworks`);
- ``stock-trainer-bf16`` / ``ampkernels-trainer-fp8-8bit`` and the same pair for ``lightning`` (``llama-1b``):
  everything asked for through the framework (``fuse_modules(model, loss=True)``: fused RMSNorms, SiLU·up and the
  fused linear + cross-entropy; FP8 layers; 8-bit AdamW state) against stock bf16 through it.

Method: the two recipes compared with each other (stock and ampkernels of one precision, eager or graphed) live side
by side and are timed alternately, repeat by repeat, so that clock and host drift fall on both alike. Every recipe of
a model runs the same steps on the same batches (3 warm-up steps, then ``repeats x iterations`` timed ones), so the
loss after the timed steps is comparable: each row's loss is checked against its stock recipe's (``LOSS_RTOL``; FP8
against bf16 with the FP8 training tests' 1%). Time: median over repeats of the wall time per step (host work
included); peak memory: ``torch.cuda.max_memory_allocated`` over the recipe's warm-up, above what was allocated
before the recipe was built.

The default run (``python -m benchmarks`` or ``--only models``) times ``DEFAULT_MODELS`` with the fp16 recipes;
``--full`` every model and recipe, ``--models a,b`` every recipe of the models named. On a CPU-only machine: tiny
configs of the same models and the bf16 recipes (FP8 and 8-bit state too with ``--full``), a smoke run, not a
measurement. A model whose package is not
installed is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

import ampkernels
from ampkernels import FusedGradScaler, capture_step
from benchmarks import zoo_frameworks
from benchmarks.common import (
    RunContext,
    format_table,
    free_device_memory,
    missing_package,
    plot_grouped_bars,
    synchronize,
)

NAME = "models"

MAX_NORM, LR = 1.0, 1e-4
WARMUP_STEPS = 3
# Losses, ampkernels against its stock recipe. The step's math is stock's (unscale by a power of two, torch's AdamW
# arithmetic), but cuDNN/cuBLAS backward kernels accumulate in a run-dependent order, and the timed steps of two
# alternating recipes draw different dropout masks, so the two trajectories part slowly:
# - the last warm-up step (same seed, same batch, two updates in): within the autocast dtype's eps of stock's (the
#   backward kernels' run-dependent order moves the gradients by about that rounding unit; bf16 ResNet-50
#   channels_last differed by 3.4e-3 on an H100, fp16 steps by at most 2e-5);
# - after the timed steps: within LOSS_RTOL of the first step's loss. Relative to the final loss instead, a model that
#   memorizes its 4 batches turns run-to-run drift into a large ratio (ResNet-50 channels_last, fp16, H100: 0.4352
#   against 0.4438 after ~900 steps from 6.9, 2% of the final loss, 0.12% of the first).
LOSS_RTOL = 1e-2
FLOAT8_LOSS_RTOL = 0.01  # tests/float8/test_float8_training.py: each FP8 recipe within 1% of bf16 (both checks)
# NOTE: loops of >= 0.2 s per repeat keep a step's run-to-run spread near 1% on the H200 (eager steps of 20-150 ms).
MIN_LOOP_S_GPU, MIN_ITERATIONS = 0.2, 3

DEFAULT_MODELS = ("resnet-50", "gpt2")
DEFAULT_RECIPES = ("fp16-stock", "fp16-ampkernels", "fp16-stock-graphed", "fp16-ampkernels-graphed")
# --models NAMES (or --full) runs every recipe of the models named.


@dataclass(frozen=True)
class Recipe:
    name: str
    library: str  # "stock" or "ampkernels"
    autocast: torch.dtype
    graphed: bool = False
    float8: bool = False
    moments: str | None = None  # FusedAdamW's exp_avg_dtype / exp_avg_sq_dtype
    fuse: bool = False  # fuse_modules(model, loss=True): fused norms, SiLU·up and the HF causal-LM loss
    baseline: str | None = None  # the stock recipe its ratio and loss are taken against
    framework: str | None = None  # trained through this framework (benchmarks.zoo_frameworks), not our loop
    models: tuple[str, ...] | None = None  # the zoo models it runs on (None: every one its options allow)

    @property
    def stock(self) -> bool:
        return self.library == "stock"


RECIPES = (
    Recipe("fp16-stock", "stock", torch.float16),
    Recipe("fp16-ampkernels", "ampkernels", torch.float16, baseline="fp16-stock"),
    Recipe("fp16-stock-graphed", "stock", torch.float16, graphed=True),
    Recipe("fp16-ampkernels-graphed", "ampkernels", torch.float16, graphed=True, baseline="fp16-stock-graphed"),
    Recipe("bf16-stock", "stock", torch.bfloat16),
    Recipe("bf16-ampkernels", "ampkernels", torch.bfloat16, baseline="bf16-stock"),
    Recipe("fp8-ampkernels", "ampkernels", torch.bfloat16, float8=True, baseline="bf16-stock"),
    Recipe("bf16-ampkernels-8bit", "ampkernels", torch.bfloat16, moments="8bit", baseline="bf16-stock"),
    *(
        recipe
        for fw, (model, _) in zoo_frameworks.FRAMEWORKS.items()
        for recipe in (
            Recipe(f"stock-{fw}", "stock", torch.float16, framework=fw, models=(model,)),
            Recipe(
                f"ampkernels-{fw}", "ampkernels", torch.float16, baseline=f"stock-{fw}", framework=fw, models=(model,)
            ),
        )
    ),
    # What a user gets by asking for everything through a framework: fused norms, SiLU·up and loss, FP8 layers and
    # 8-bit AdamW state, against stock bf16 through the same framework.
    *(
        recipe
        for fw in zoo_frameworks.EVERYTHING_FRAMEWORKS
        for recipe in (
            Recipe(f"stock-{fw}-bf16", "stock", torch.bfloat16, framework=fw, models=("llama-1b",)),
            Recipe(
                f"ampkernels-{fw}-fp8-8bit",
                "ampkernels",
                torch.bfloat16,
                float8=True,
                moments="8bit",
                fuse=True,
                baseline=f"stock-{fw}-bf16",
                framework=fw,
                models=("llama-1b",),
            ),
        )
    ),
)
BY_NAME = {recipe.name: recipe for recipe in RECIPES}
CPU_RECIPES = ("bf16-stock", "bf16-ampkernels")
CPU_FULL_RECIPES = CPU_RECIPES + ("fp8-ampkernels", "bf16-ampkernels-8bit")
CPU_FULL_RECIPES += tuple(r.name for r in RECIPES if r.framework)
# The recipes timed side by side (alternating repeats); the others are timed alone and compared with their baseline.
PAIRS = (("fp16-stock", "fp16-ampkernels"), ("fp16-stock-graphed", "fp16-ampkernels-graphed"))
PAIRS += (("bf16-stock", "bf16-ampkernels"),)
PAIRS += tuple((f"stock-{fw}", f"ampkernels-{fw}") for fw in zoo_frameworks.FRAMEWORKS)
PAIRS += tuple((f"stock-{fw}-bf16", f"ampkernels-{fw}-fp8-8bit") for fw in zoo_frameworks.EVERYTHING_FRAMEWORKS)


# ---- models ----


@dataclass
class Model:
    module: torch.nn.Module
    batch_of: Callable[[int], tuple[torch.Tensor, ...]]  # batch i, on the CPU
    loss_fn: Callable[..., torch.Tensor]
    description: str
    unit: str  # "tokens" or "images"
    per_batch: int  # tokens or images per batch
    huggingface: bool
    channels_last: bool = False
    float8_layers: tuple[int, int] | None = None  # (converted, nn.Linear layers before) for an FP8 recipe


def _tokens(vocab: int, batch: int, seq: int, i: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(i))


def _bert(small: bool) -> Model:
    import transformers

    if small:
        config = transformers.BertConfig(
            vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
        )
        batch, seq = 2, 32
    else:
        config, batch, seq = transformers.BertConfig(), 32, 512

    def batch_of(i: int):
        ids = _tokens(config.vocab_size, batch, seq, i)
        masked = torch.rand(batch, seq, generator=torch.Generator().manual_seed(10_000 + i)) < 0.15
        return ids, torch.where(masked, ids, torch.full_like(ids, -100))

    def loss_fn(model, ids, labels):
        return model(input_ids=ids, labels=labels).loss

    module = transformers.BertForMaskedLM(config)
    return Model(module, batch_of, loss_fn, f"BertForMaskedLM, batch {batch} x {seq}", "tokens", batch * seq, True)


def _causal_lm(module, vocab: int, batch: int, seq: int, what: str) -> Model:
    def batch_of(i: int):
        return (_tokens(vocab, batch, seq, i),)

    def loss_fn(model, ids):
        return model(input_ids=ids, labels=ids).loss

    return Model(module, batch_of, loss_fn, f"{what}, batch {batch} x {seq}", "tokens", batch * seq, True)


def _gpt2(small: bool) -> Model:
    import transformers

    if small:
        config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2)
        batch, seq = 2, 32
    else:
        config, batch, seq = transformers.GPT2Config(), 8, 1024
    return _causal_lm(transformers.GPT2LMHeadModel(config), config.vocab_size, batch, seq, "GPT2LMHeadModel")


def _llama(small: bool) -> Model:
    import transformers

    if small:
        sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        config = transformers.LlamaConfig(vocab_size=512, num_key_value_heads=2, **sizes)
        batch, seq = 2, 32
    else:
        sizes = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32)
        config = transformers.LlamaConfig(vocab_size=32000, num_key_value_heads=4, **sizes)
        batch, seq = 4, 2048
    what = f"LlamaForCausalLM ({config.num_hidden_layers} layers, {config.hidden_size} wide)"
    return _causal_lm(transformers.LlamaForCausalLM(config), config.vocab_size, batch, seq, what)


def _t5(small: bool) -> Model:
    import transformers

    if small:
        sizes = dict(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
        batch, source, target = 2, 32, 16
    else:
        sizes, batch, source, target = {}, 32, 512, 128
    # T5 starts decoding from the pad token (transformers 5.25's T5Config no longer sets it).
    config = transformers.T5Config(decoder_start_token_id=0, **sizes)

    def batch_of(i: int):
        return _tokens(config.vocab_size, batch, source, i), _tokens(config.vocab_size, batch, target, 10_000 + i)

    def loss_fn(model, ids, labels):
        return model(input_ids=ids, labels=labels).loss

    module = transformers.T5ForConditionalGeneration(config)
    what = f"T5ForConditionalGeneration, batch {batch}, {source} -> {target} tokens"
    return Model(module, batch_of, loss_fn, what, "tokens", batch * (source + target), True)


def _vision(module, batch: int, size: int, classes: int, what: str, channels_last: bool) -> Model:
    def batch_of(i: int):
        gen = torch.Generator().manual_seed(i)
        return torch.randn(batch, 3, size, size, generator=gen), torch.randint(0, classes, (batch,), generator=gen)

    def loss_fn(model, images, labels):
        return F.cross_entropy(model(images).float(), labels)

    layout = "channels_last" if channels_last else "NCHW"
    description = f"{what}, batch {batch} x {size}^2, {layout}"
    return Model(module, batch_of, loss_fn, description, "images", batch, False, channels_last)


def _resnet(small: bool, channels_last: bool) -> Model:
    import torchvision

    if small:  # NOTE: bfloat16 convolutions are slow on CPU (~1 s per ResNet-18 step at 32^2): one block a stage
        module = torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=10)
        return _vision(module, 2, 16, 10, "ResNet-10", channels_last)
    return _vision(torchvision.models.resnet50(), 64, 224, 1000, "ResNet-50", channels_last)


def _vit(small: bool) -> Model:
    import torchvision

    if small:
        module = torchvision.models.VisionTransformer(32, 8, 2, 2, 64, 128, num_classes=10)
        return _vision(module, 4, 32, 10, "ViT (2 layers, 64 wide)", False)
    return _vision(torchvision.models.vit_b_16(), 64, 224, 1000, "ViT-B/16", False)


def _convnext(small: bool) -> Model:
    import timm

    if small:
        module = timm.create_model("convnext_atto", num_classes=10)
        return _vision(module, 4, 32, 10, "ConvNeXt-atto (timm)", True)
    return _vision(timm.create_model("convnext_tiny"), 64, 224, 1000, "ConvNeXt-T (timm)", True)


#: name -> (builder(small) -> Model, the package it needs)
MODELS: dict[str, tuple[Callable[[bool], Model], str]] = {
    "bert-base": (_bert, "transformers"),
    "gpt2": (_gpt2, "transformers"),
    "llama-1b": (_llama, "transformers"),
    "t5-small": (_t5, "transformers"),
    "resnet-50": (lambda small: _resnet(small, False), "torchvision"),
    "resnet-50-cl": (lambda small: _resnet(small, True), "torchvision"),
    "vit-b16": (_vit, "torchvision"),
    "convnext-t": (_convnext, "timm"),
}
TRANSFORMERS = ("bert-base", "gpt2", "llama-1b", "t5-small")


def _why_not(name: str) -> str | None:
    return missing_package(MODELS[name][1])


def _recipes_of(name: str, ctx: RunContext) -> list[Recipe]:
    if ctx.cpu_small:
        names = CPU_FULL_RECIPES if ctx.full else CPU_RECIPES
    else:
        names = [r.name for r in RECIPES] if ctx.full or ctx.models else DEFAULT_RECIPES
    if ctx.recipes:
        unknown = [n for n in ctx.recipes if n not in BY_NAME]
        if unknown:
            raise ValueError(f"--recipes: unknown {unknown}; the zoo has {', '.join(BY_NAME)}")
        # (each with its baseline, against which its ratio and loss are taken)
        asked = [b for n in ctx.recipes for b in (BY_NAME[n].baseline, n) if b is not None]
        names = [n for n in names if n in asked] if ctx.cpu_small else list(dict.fromkeys(asked))
    recipes = [BY_NAME[n] for n in names]
    recipes = [r for r in recipes if not r.float8 or name in TRANSFORMERS]
    recipes = [r for r in recipes if r.models is None or name in r.models]
    return [r for r in recipes if r.moments is None or name == "llama-1b"]


def _models(ctx: RunContext) -> list[str]:
    if ctx.models:
        unknown = [name for name in ctx.models if name not in MODELS]
        if unknown:
            raise ValueError(f"--models: unknown {unknown}; the zoo has {', '.join(MODELS)}")
        return list(ctx.models)
    return list(MODELS) if ctx.full else list(DEFAULT_MODELS)


# ---- steps ----


def _make_step(recipe: Recipe, model: Model, device: torch.device) -> Callable[..., torch.Tensor]:
    module = model.module
    if recipe.float8:
        from ampkernels.float8 import Float8Linear, convert_to_float8

        linear = sum(type(m) is torch.nn.Linear for m in module.modules())
        convert_to_float8(module, "tensorwise", min_features=0 if device.type == "cpu" else None)
        model.float8_layers = (sum(isinstance(m, Float8Linear) for m in module.modules()), linear)
    params = [p for p in module.parameters() if p.requires_grad]
    if recipe.stock:
        optimizer = torch.optim.AdamW(params, lr=LR, fused=True, capturable=recipe.graphed)
    else:
        moments = dict(exp_avg_dtype=recipe.moments, exp_avg_sq_dtype=recipe.moments) if recipe.moments else {}
        optimizer = ampkernels.FusedAdamW(params, lr=LR, **moments)
    scaler = None
    if recipe.autocast == torch.float16:
        scaler = torch.amp.GradScaler(device.type) if recipe.stock else FusedGradScaler(device.type)

    def step(*batch: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=recipe.autocast):
            loss = model.loss_fn(module, *batch)
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            optimizer.step()
        elif recipe.stock:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            scaler.step(optimizer)
            scaler.update()
        else:
            scaler.scale(loss).backward()
            scaler.clip_grad_norm_(optimizer, MAX_NORM)
            scaler.step(optimizer)
            scaler.update()
        return loss.detach()

    return step


@dataclass
class _Live:
    """One recipe built and warmed up, ready to time."""

    recipe: Recipe
    model: Model
    step: Callable[..., torch.Tensor]
    batches: list[tuple[torch.Tensor, ...]]
    peak_gib: float | None
    per_repeat: list[float]
    warmup_losses: list[float]
    loss: torch.Tensor | None = None


def _build(name: str, recipe: Recipe, ctx: RunContext) -> _Live:
    cuda = ctx.device.type == "cuda"
    before = torch.cuda.memory_allocated(ctx.device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    torch.manual_seed(0)
    with ctx.device:
        model = MODELS[name][0](ctx.cpu_small)
    module = model.module.train()
    if model.channels_last:
        model.module = module.to(memory_format=torch.channels_last)
    batches = []
    for i in range(4):
        batch = [t.to(ctx.device) for t in model.batch_of(i)]
        if model.channels_last:
            batch[0] = batch[0].contiguous(memory_format=torch.channels_last)
        batches.append(tuple(batch))
    step = _make_step(recipe, model, ctx.device)
    if recipe.graphed:
        # Capture leaves model, optimizer and scaler as they were: the warm-up replays below are the first steps.
        step = capture_step(step, *batches[0], transformers_mask_skip=model.huggingface)
    torch.manual_seed(1)  # the same dropout masks in every recipe's warm-up, whatever building them drew
    warmup_losses = [float(step(*batches[0])) for _ in range(WARMUP_STEPS)]
    peak = (torch.cuda.max_memory_allocated(ctx.device) - before) / 2**30 if cuda else None
    return _Live(recipe, model, step, batches, peak, [], warmup_losses)


def _run_loop(live: _Live, iterations: int, device: torch.device) -> None:
    synchronize(device)
    start = time.perf_counter()
    for i in range(iterations):
        live.loss = live.step(*live.batches[i % len(live.batches)])
    synchronize(device)
    live.per_repeat.append((time.perf_counter() - start) * 1e3 / iterations)


def _iterations(live: _Live, ctx: RunContext) -> int:
    synchronize(ctx.device)
    start = time.perf_counter()
    live.step(*live.batches[1])
    synchronize(ctx.device)
    one_s = time.perf_counter() - start
    if ctx.cpu_small:
        return 1
    return max(MIN_ITERATIONS, math.ceil(max(MIN_LOOP_S_GPU, ctx.target_loop_s) / one_s))


def _row(name: str, live: _Live) -> dict[str, Any]:
    step_ms = statistics.median(live.per_repeat)
    loss = float(live.loss)
    return {
        "model": name,
        "description": live.model.description,
        "recipe": live.recipe.name,
        "step_ms": step_ms,
        "step_ms_per_repeat": live.per_repeat,
        "per_second": live.model.per_batch / step_ms * 1e3,
        "unit": live.model.unit,
        "peak_memory_gib": None if live.peak_gib is None else round(live.peak_gib, 2),
        "warmup_losses": live.warmup_losses,
        "final_loss": loss,
        **({"float8_layers": list(live.model.float8_layers)} if live.model.float8_layers else {}),
    }


def _time_group(name: str, recipes: list[Recipe], ctx: RunContext, iterations: int | None) -> tuple[list, int]:
    """Builds ``recipes`` side by side and times them alternately; the rows and the iteration count used. A group
    that does not fit in memory side by side (Llama-1B graphed on an 80 GB GPU) is timed one recipe after the
    other instead, and its rows say so."""
    if recipes[0].framework is not None:  # the framework runs its own loop
        return _framework_rows(name, recipes, ctx), iterations
    lives = []
    try:
        for recipe in recipes:
            lives.append(_build(name, recipe, ctx))
        iterations = _first_steps(lives, iterations, ctx)
        for _ in range(ctx.repeats):
            for live in lives:
                _run_loop(live, iterations, ctx.device)
        return [_row(name, live) for live in lives], iterations
    except torch.OutOfMemoryError:
        if len(recipes) == 1:
            raise
    finally:
        del lives
        free_device_memory(ctx.device)
    rows = []
    for recipe in recipes:
        row, iterations = _time_group(name, [recipe], ctx, iterations)
        rows.append({**row[0], "alternated": False})
    return rows, iterations


def _first_steps(lives: list[_Live], iterations: int | None, ctx: RunContext) -> int:
    """One more step per recipe (the first sizes the timed loop when ``iterations`` is None): every recipe of a
    model runs the same step count."""
    if iterations is None:
        iterations = _iterations(lives[0], ctx)
        lives = lives[1:]
    for live in lives:
        live.step(*live.batches[1])
    return iterations


def _framework_rows(name: str, recipes: list[Recipe], ctx: RunContext) -> list[dict[str, Any]]:
    """Stock and ours through the framework, ``zoo_frameworks.ROUNDS`` rounds alternating; the median step of all."""
    reason = zoo_frameworks.why_not(recipes[0].framework)
    if reason is not None:
        return [{"model": name, "recipe": recipe.name, "error": f"skipped: {reason}"} for recipe in recipes]
    runs: dict[str, list[dict[str, Any]]] = {recipe.name: [] for recipe in recipes}
    for _ in range(1 if ctx.cpu_small else zoo_frameworks.ROUNDS):
        for recipe in recipes:
            runs[recipe.name].append(
                zoo_frameworks.time_framework(
                    recipe.framework,
                    lambda: MODELS[name][0](ctx.cpu_small),
                    ctx.device,
                    zoo_frameworks.Options(
                        not recipe.stock, recipe.autocast, recipe.float8, recipe.moments, recipe.fuse
                    ),
                )
            )
            free_device_memory(ctx.device)
    return [{"model": name, "recipe": recipe.name, **zoo_frameworks.merge(runs[recipe.name])} for recipe in recipes]


def _groups(recipes: list[Recipe]) -> list[list[Recipe]]:
    names = [r.name for r in recipes]
    groups, done = [], set()
    for pair in PAIRS:
        if all(n in names for n in pair):
            groups.append([BY_NAME[n] for n in pair])
            done.update(pair)
    groups += [[r] for r in recipes if r.name not in done]
    # Eager groups first: a device-side assert inside a graph would lose the CUDA context for what follows.
    return sorted(groups, key=lambda group: group[0].graphed)


def warmup_loss_rtol(recipe: Recipe) -> float:
    """The last warm-up step's tolerance: the autocast dtype's eps (fp16 9.8e-4, bf16 7.8e-3)."""
    return torch.finfo(recipe.autocast).eps


def _check(row: dict[str, Any], baseline: dict[str, Any] | None, recipe: Recipe) -> None:
    """Adds the ratio to the baseline and the loss check to ``row``."""
    if not math.isfinite(row["final_loss"]):
        row["check"] = f"FAILED: loss {row['final_loss']}"
        return
    if baseline is None or "error" in baseline:
        return
    row["speedup_over_stock"] = baseline["step_ms"] / row["step_ms"]
    problems = []
    if "warmup_losses" in row and "warmup_losses" in baseline:
        ours, stock = row["warmup_losses"][-1], baseline["warmup_losses"][-1]
        row["warmup_loss_rel_diff"] = abs(ours - stock) / abs(stock)
        if not row["warmup_loss_rel_diff"] <= (FLOAT8_LOSS_RTOL if recipe.float8 else warmup_loss_rtol(recipe)):
            problems.append(f"warm-up loss {row['warmup_loss_rel_diff']:.2e}")
    # the loss scale: the first step's
    first = (baseline.get("warmup_losses") or baseline.get("step_losses") or [baseline["final_loss"]])[0]
    row["loss_rel_diff"] = abs(row["final_loss"] - baseline["final_loss"]) / abs(first)
    if not row["loss_rel_diff"] <= (FLOAT8_LOSS_RTOL if recipe.float8 else LOSS_RTOL):
        problems.append(f"loss {row['loss_rel_diff']:.2e} of the first")
    row["check"] = f"FAILED: {', '.join(problems)} from {baseline['recipe']}'s" if problems else "ok"


def run(ctx: RunContext) -> dict[str, Any]:
    names = _models(ctx)
    skipped = {name: why for name in names if (why := _why_not(name)) is not None}
    names = [name for name in names if name not in skipped]
    jobs = [(name, group) for name in names for group in _groups(_recipes_of(name, ctx))]
    ctx.progress.reset(total=len(jobs))
    rows, iterations, lost_context = [], {}, None
    for name, group in jobs:
        ctx.progress.set_postfix_str(f"{name}: {'/'.join(r.name for r in group)}")
        if lost_context is not None:
            new = [
                {"model": name, "recipe": r.name, "error": f"not run: CUDA context lost in {lost_context}"}
                for r in group
            ]
        else:
            try:
                new, iterations[name] = _time_group(name, group, ctx, iterations.get(name))
            except Exception as exc:  # a recipe that fails (capture, memory) is reported, not fatal to the others
                error = f"{type(exc).__name__}: {exc}"[:500]
                new = [{"model": name, "recipe": r.name, "error": error} for r in group]
                if "device-side assert" in str(exc) or "illegal memory access" in str(exc):
                    lost_context = f"{name} {group[0].name}"
        rows += new
        for row in new:  # on stderr as they come: a run cut short still leaves what it measured
            ctx.progress.write("row " + json.dumps(row, default=str))
        ctx.progress.update()
    order = {r.name: i for i, r in enumerate(RECIPES)}
    rows.sort(key=lambda row: (names.index(row["model"]), order[row["recipe"]]))
    for row in rows:
        recipe = BY_NAME[row["recipe"]]
        if "error" in row:
            continue
        baseline = next((r for r in rows if r["model"] == row["model"] and r["recipe"] == recipe.baseline), None)
        _check(row, baseline, recipe)
    return {
        "rows": rows,
        "skipped": skipped,
        "iterations": iterations,
        "loss_rtol": LOSS_RTOL,
        "notes": [
            "step time: median over repeats of the wall time per step, host work included; each ampkernels recipe "
            "timed alternately with its stock recipe",
            "loss: after the same warm-up and timed steps on the same batches; checked against the stock recipe's "
            "(last warm-up step within the autocast dtype's eps, fp16 9.8e-4, bf16 7.8e-3; after the timed steps "
            f"within {LOSS_RTOL:g} of the first step's loss; FP8 {FLOAT8_LOSS_RTOL:g} both)",
            *(
                [
                    "timed one after the other, not alternating (the pair did not fit in memory side by side): "
                    + ", ".join(sorted({f"{r['model']} {r['recipe']}" for r in rows if r.get("alternated") is False}))
                ]
                if any(r.get("alternated") is False for r in rows)
                else []
            ),
            *(
                ["smoke run of tiny models: every recipe runs, the times say nothing about a GPU"]
                if ctx.cpu_small
                else ["peak memory: max_memory_allocated during the recipe's warm-up, above what was allocated before"]
            ),
        ],
    }


def failures(document: dict[str, Any]) -> list[str]:
    """The rows whose check failed, as lines."""
    return [f"{r['model']} {r['recipe']}: {r['check']}" for r in document["rows"] if r.get("check", "").startswith("F")]


def report(document: dict[str, Any]) -> str:
    headers = ["model", "recipe", "ms/step", "x stock", "per s", "peak GiB", "loss", "check"]
    table = []
    for row in document["rows"]:
        if "error" in row:
            table.append([row["model"], row["recipe"], "error", "-", "", "", "", row["error"][:90]])
            continue
        ratio = row.get("speedup_over_stock")
        peak = row["peak_memory_gib"]
        table.append(
            [
                row["model"],
                row["recipe"],
                f"{row['step_ms']:.2f}",
                "-" if ratio is None else f"{ratio:.3f}x",
                f"{row['per_second']:,.0f} {row['unit'][:3]}",
                "-" if peak is None else f"{peak:.2f}",
                f"{row['final_loss']:.4f}",
                row.get("check", "-"),
            ]
        )
    lines = [format_table(headers, table, "llrrrrrl"), ""]
    descriptions: dict[str, str] = {}
    for row in document["rows"]:  # the model's own loop first: a framework row's description names the framework
        if "description" in row and "through" not in row["description"]:
            descriptions.setdefault(row["model"], row["description"])
    lines += [f"{name}: {description}" for name, description in descriptions.items()]
    lines += [f"skipped {name}: {why}" for name, why in document["skipped"].items()]
    lines += [f"note: {note}" for note in document["notes"]]
    converted = [f"{r['model']} {r['float8_layers'][0]} of {r['float8_layers'][1]}" for r in document["rows"]
                 if "float8_layers" in r]  # fmt: skip
    if converted:
        lines.append(f"note: fp8: nn.Linear layers converted by convert_to_float8's size rule: {', '.join(converted)}")
    return "\n".join(lines)


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def summary(document: dict[str, Any]) -> list[str]:
    lines = []
    ours = ("fp16-ampkernels", "fp16-ampkernels-graphed", "bf16-ampkernels", "fp8-ampkernels", "bf16-ampkernels-8bit")
    ours += tuple(f"ampkernels-{fw}" for fw in zoo_frameworks.FRAMEWORKS)
    ours += tuple(f"ampkernels-{fw}-fp8-8bit" for fw in zoo_frameworks.EVERYTHING_FRAMEWORKS)
    for recipe in ours:
        rows = [r for r in document["rows"] if r["recipe"] == recipe and "speedup_over_stock" in r]
        if not rows:
            continue
        parts = ", ".join(f"{r['model']} {r['speedup_over_stock']:.2f}x" for r in rows)
        baseline = BY_NAME[recipe].baseline
        geomean = _geomean([r["speedup_over_stock"] for r in rows])
        lines.append(f"{recipe} against {baseline}: geomean {geomean:.3f}x ({parts})")
    lines += [f"CHECK FAILED {line}" for line in failures(document)]
    lines += [f"skipped {name}: {why}" for name, why in document["skipped"].items()]
    return lines


def plot(document: dict[str, Any], path: Path, title: str) -> bool:
    """One panel per model: ms per step by recipe."""
    panels = {}
    for name in dict.fromkeys(row["model"] for row in document["rows"]):
        rows = [r for r in document["rows"] if r["model"] == name and "error" not in r]
        if not rows:
            continue
        groups = [r["recipe"].replace("-", "\n", 1) for r in rows]
        panels[f"{name}: {rows[0]['description']}"] = (groups, {"ms per step": [r["step_ms"] for r in rows]})
    if not panels:
        return False
    with contextlib.suppress(TypeError):
        return plot_grouped_bars(
            path, title, panels, "ms per step", log_scale=False, max_columns=2, panel_width=8, tick_fontsize=7
        )
    return False
