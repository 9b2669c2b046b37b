"""FP8 training: the fused casts, the FP8 GEMMs, one layer by size, and a whole Llama-style training step.

Sections (``python -m benchmarks --only float8``):

* casts (:mod:`benchmarks.float8_casts`): each cast of ampkernels.float8 against plain torch, GB/s and % of copy;
* fused producers (:mod:`benchmarks.float8_fused`): ``rms_norm`` against ``F.rms_norm``, ``silu_mul`` and
  ``rotary_embedding`` against the model's plain torch;
* GEMMs (:mod:`benchmarks.float8_gemms`): FP8 scaled_matmul against ``torch._scaled_mm`` and bf16 cuBLAS on the
  six training shapes of float8_gemms.SHAPES;
* where the step goes (:mod:`benchmarks.float8_profile`): the FP8 tensorwise + fused loss step, eager and graphed,
  profiled, its kernels' time by category beside each category's floor (FLOPs at the GEMM and attention rates,
  bytes at the copy bandwidth, measured in the same run), and the idle and launch gaps;
* layer sizes: forward + backward of one ``nn.Linear`` of width K -> N at 16384 tokens under bf16 autocast against
  the same layer as a Float8Linear (tensorwise, rowwise): where FP8 starts to pay, the rule behind
  ``convert_to_float8``'s ``min_features``;
* the training step of ``benchmarks.models.LlamaStack`` (``LLAMA_STACK``: 8 blocks of width 2048, SwiGLU 8192, 16
  heads, batch 8 x 2048 tokens) under bf16 autocast: stock bf16 eager and ``torch.compile``d (torch's fused AdamW),
  ampkernels bf16 and FP8 per recipe, eager and captured whole in a CUDA graph (``ampkernels.capture_step``;
  FusedAdamW; the model's RMSNorms, RoPE and SiLU-up on ``ampkernels.float8``'s fused kernels), the same with the
  head and its loss as ``ampkernels.linear_cross_entropy`` (bf16, and FP8 tensorwise eager and graphed: there the
  converted head's products run in FP8 too, ``float8=head_float8(head)``), and torchao's float8 training compiled
  when torchao is installed. With ``--full`` (and transformers installed) also a Hugging Face ``LlamaForCausalLM``
  built from the same config, from stock modules: stock bf16 eager, torchao compiled, and ampkernels' FP8 with
  ``fuse_modules``, eager and compiled, each against the HF model's stock bf16 eager. Per step: ms, peak memory,
  first-step time.

After its timed loops every section checks what it timed (the casts bit for bit against the reference, the fused
producers and the GEMMs against float64 within twice torch's error, each ampkernels stack row's losses within 1% of
stock bf16 eager's: ``LOSS_CHECK_NOTE``); the layer sizes are timing only.
"""

from __future__ import annotations

import math
import statistics
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from benchmarks.common import (
    RunContext,
    check_cell,
    check_result,
    failure_lines,
    format_ms,
    format_table,
    free_device_memory,
    plot_grouped_bars,
    synchronize,
)

NAME = "float8"

STACK_BATCH = (8, 2048)
# On the CPU a tiny stack checks the code paths (no compile, no graphs, no torchao: nothing to compare there).
CPU_STACK = dict(vocab=512, dim=128, layers=2, heads=4, ffn=512)
CPU_STACK_BATCH = (2, 64)
STACK_STEPS, CPU_STACK_STEPS = 8, 2  # timed steps per repeat
RECIPES = ("tensorwise", "rowwise", "delayed")
TORCHAO_RECIPES = ("tensorwise", "rowwise")

LAYER_TOKENS, CPU_LAYER_TOKENS = 16384, 256
LAYER_SHAPES = [
    (512, 512),
    (768, 768),
    (1024, 1024),
    (1536, 1536),
    (2048, 2048),
    (3072, 3072),
    (4096, 4096),
    (2048, 8192),
    (8192, 2048),
    (2048, 32000),
]
LAYER_RECIPES = ("tensorwise", "rowwise")
CPU_LAYER_SHAPES = [(64, 64), (128, 256)]


# --------------------------------------------------------------------------------------------------------------------
# The Llama-style training step
# --------------------------------------------------------------------------------------------------------------------


def _torchao_convert():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None

    def convert(model, recipe):
        config = Float8LinearConfig.from_recipe_name(recipe)
        return convert_to_float8_training(model, config=config)

    return convert


def _stack_variants(ctx: RunContext) -> list[dict[str, Any]]:
    """The rows of the stack table: (key, label, how the model is built and stepped)."""
    on_gpu = ctx.device.type == "cuda"
    rows = [dict(key="bf16-eager", label="stock bf16, eager", fp8=None, compiled=False, graphed=False, stock=True)]
    if on_gpu:
        rows.append(dict(key="bf16-compiled", label="stock bf16, torch.compile", fp8=None, compiled=True, stock=True))
    # The ampkernels rows build the model with the fused RMSNorm, RoPE and SiLU-up (LlamaStack(fused=True)); its bf16
    # rows show what the fusion alone gives, the FP8 rows what FP8 adds on top.
    rows.append(dict(key="bf16-fused-eager", label="ampkernels bf16 (fused norm, RoPE, SiLU-up), eager", fp8=None))
    if on_gpu:
        rows.append(
            dict(key="bf16-graphed", label="ampkernels bf16 (fused norm, RoPE, SiLU-up), graphed", graphed=True)
        )
    for recipe in RECIPES:
        rows.append(dict(key=f"fp8-{recipe}-eager", label=f"ampkernels fp8 {recipe}, eager", fp8=recipe))
        if on_gpu:
            rows.append(
                dict(key=f"fp8-{recipe}-graphed", label=f"ampkernels fp8 {recipe}, graphed", fp8=recipe, graphed=True)
            )
    # The head and its loss as ampkernels.linear_cross_entropy: no [tokens, vocab] float32 logits or gradient.
    loss = "fused norm, RoPE, SiLU-up, loss"
    rows.append(dict(key="bf16-fused-loss-eager", label=f"ampkernels bf16 ({loss}), eager", fused_loss=True))
    for mode in ("eager", "graphed") if on_gpu else ("eager",):
        rows.append(
            dict(
                key=f"fp8-tensorwise-fused-loss-{mode}",
                label=f"ampkernels fp8 tensorwise + fused loss, {mode}",
                fp8="tensorwise",
                graphed=mode == "graphed",
                fused_loss=True,
            )
        )
    if on_gpu:
        for recipe in TORCHAO_RECIPES:
            rows.append(
                dict(
                    key=f"torchao-{recipe}-compiled",
                    label=f"torchao fp8 {recipe}, torch.compile",
                    torchao=recipe,
                    compiled=True,
                    stock=True,
                )
            )
    if (ctx.full or ctx.recipes) and _package_version("transformers") is not None:
        rows += _hf_llama_variants(on_gpu)
    for row in rows:
        for flag in ("compiled", "graphed", "stock", "fused_loss", "hf", "fuse"):
            row.setdefault(flag, False)
        row.setdefault("fp8", None)
        row.setdefault("torchao", None)
    if ctx.recipes:  # the rows named, each with its model's stock bf16 eager (a partial run, not for publishing)
        known = [row["key"] for row in rows] + ["profile"]
        unknown = [key for key in ctx.recipes if key not in known]
        if unknown:
            raise ValueError(f"--recipes: unknown {unknown}; the float8 stack has {', '.join(known)}")
        bases = {_BASES[row["hf"]] for row in rows if row["key"] in ctx.recipes}
        rows = [row for row in rows if row["key"] in ctx.recipes or row["key"] in bases]
    return rows


def _hf_llama_variants(on_gpu: bool) -> list[dict[str, Any]]:
    """Hugging Face ``LlamaForCausalLM`` built from the stack's config (stock modules: its RMSNorm, gated MLP, rotary
    and SDPA): stock bf16, torchao compiled, and ampkernels' FP8 with :func:`ampkernels.float8.fuse_modules`, eager
    and compiled (``--full`` only; each row against the HF model's stock bf16 eager)."""
    ours = "HF Llama: ampkernels fp8 tensorwise + fuse_modules"
    rows = [dict(key="hf-bf16-eager", label="HF Llama: stock bf16, eager", stock=True, hf=True)]
    if on_gpu:
        rows.append(
            dict(
                key="hf-torchao-tensorwise-compiled",
                label="HF Llama: torchao fp8 tensorwise, torch.compile",
                torchao="tensorwise",
                compiled=True,
                stock=True,
                hf=True,
            )
        )
    rows.append(dict(key="hf-fp8-tensorwise-eager", label=f"{ours}, eager", fp8="tensorwise", hf=True, fuse=True))
    if on_gpu:
        rows.append(
            dict(
                key="hf-fp8-tensorwise-compiled",
                label=f"{ours}, torch.compile",
                fp8="tensorwise",
                compiled=True,
                hf=True,
                fuse=True,
            )
        )
    return rows


def _hf_llama(config: dict, batch: tuple[int, int]):
    import transformers

    llama = transformers.LlamaConfig(
        vocab_size=config["vocab"],
        hidden_size=config["dim"],
        intermediate_size=config["ffn"],
        num_hidden_layers=config["layers"],
        num_attention_heads=config["heads"],
        num_key_value_heads=config.get("kv_heads", config["heads"]),
        max_position_embeddings=max(batch[1], 2048),
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(llama)


def _build_stack_step(variant: dict, ctx: RunContext, config: dict, batch: tuple[int, int]):
    """(step(tokens, targets) -> loss, model, example inputs), for one variant."""
    import ampkernels
    from ampkernels.float8 import convert_to_float8
    from benchmarks.models import LlamaStack

    torch.manual_seed(0)
    with torch.device(ctx.device):  # built where it trains: 0.7 B parameters initialized on the CPU took ~10 s
        model = _hf_llama(config, batch) if variant["hf"] else LlamaStack(**config, fused=not variant["stock"])
    if variant["fuse"]:
        from ampkernels.float8 import fuse_modules

        fuse_modules(model)
    if variant["fp8"] is not None:
        # On the CPU every Linear of the tiny stack is below convert_to_float8's size rule: min_features=0 converts
        # them all anyway, so that the smoke run takes the FP8 path (and its loss check means something).
        convert_to_float8(model, variant["fp8"], min_features=None if ctx.device.type == "cuda" else 0)
    if variant["torchao"] is not None:
        convert = _torchao_convert()
        if convert is None:
            raise RuntimeError("torchao is not installed (an optional extra of this benchmark)")
        convert(model, variant["torchao"])
    if variant["stock"]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ctx.device.type == "cuda")
    else:
        lr = torch.tensor(1e-4, device=ctx.device) if variant["graphed"] else 1e-4
        optimizer = ampkernels.FusedAdamW(model.parameters(), lr=lr)
    forward = torch.compile(model) if variant["compiled"] else model
    device_type = ctx.device.type
    vocab = config["vocab"]
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    tokens = torch.randint(vocab, batch, device=ctx.device, generator=generator)
    targets = torch.randint(vocab, batch, device=ctx.device, generator=generator)

    def step(tokens, targets):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.bfloat16):
            if variant["fused_loss"]:
                hidden = model.hidden_states(tokens).flatten(0, 1)
                head = model.head  # (FP8 where it was converted: a tensorwise Float8Linear)
                float8 = ampkernels.loss.head_float8(head)
                loss = ampkernels.linear_cross_entropy(hidden, head.weight, targets.flatten(), float8=float8)
            else:
                logits = forward(tokens)
                logits = logits.logits if variant["hf"] else logits
        if not variant["fused_loss"]:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        return loss.detach()

    if variant["graphed"]:
        step = ampkernels.capture_step(step, tokens, targets, models=model, optimizers=optimizer)
    return step, model, (tokens, targets)


def _time_stack_variant(variant: dict, ctx: RunContext, config: dict, batch) -> dict[str, Any]:
    row = {k: variant[k] for k in ("key", "label", "stock")}
    free_device_memory(ctx.device)
    on_gpu = ctx.device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    start = time.perf_counter()
    try:
        step, model, inputs = _build_stack_step(variant, ctx, config, batch)
        # (read now: a captured step returns the same output tensor at every replay, which the next ones overwrite)
        first_loss = float(step(*inputs))
    except Exception as error:  # a missing optional piece (torchao, a compiler) skips the row, saying why
        row["skipped"] = f"{type(error).__name__}: {error}"[:300]
        return row
    row["first_step_s"] = time.perf_counter() - start  # build + graph capture or compile + one step
    for _ in range(2):
        step(*inputs)
    steps = STACK_STEPS if on_gpu else CPU_STACK_STEPS
    per_step = []
    # The loss of the first step and of the last of each timed loop, with its step number: every variant trains the
    # same initial weights on the same batch for the same steps, so these are comparable across variants.
    losses, loss_steps = [first_loss], [1]
    for _ in range(ctx.repeats):
        synchronize(ctx.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step(*inputs)
        synchronize(ctx.device)
        per_step.append((time.perf_counter() - t0) * 1e3 / steps)
        losses.append(float(loss))
        loss_steps.append(loss_steps[-1] + (2 if len(loss_steps) == 1 else 0) + steps)
    row["ms"] = statistics.median(per_step)
    row["ms_all"] = per_step
    row["losses"], row["loss_steps"] = losses, loss_steps
    row["losses_finite"] = all(math.isfinite(x) for x in losses)
    row["peak_gib"] = round(torch.cuda.max_memory_allocated(ctx.device) / 2**30, 2) if on_gpu else None
    row["params"] = sum(p.numel() for p in model.parameters())
    del step, model, inputs
    free_device_memory(ctx.device)
    return row


#: tests/float8/test_float8_training.py TOLERANCE: every FP8 recipe's loss within 1% of bf16's.
LOSS_TOLERANCE = 0.01
LOSS_CHECK_NOTE = (
    "check, after the timed steps (ampkernels rows): the loss of the first step and of the last step of every timed "
    "loop differs from its model's stock bf16 eager's at the same step by at most 1% of stock's first-step loss "
    "(all variants of a model train the same initial weights on the same batch, which they memorize: an FP8 head's "
    "loss settles near 0.007 where bf16's reaches 0.005, torchao's too), the 1% of "
    "tests/float8/test_float8_training.py; the other rows' largest gap is recorded"
)


def _check_losses(row: dict[str, Any], base: dict[str, Any]) -> None:
    """Sets ``row``'s largest relative loss gap to ``base`` (stock bf16 eager) and, for ampkernels rows, its check."""
    if row is base:
        row["check"] = None
        return
    problems = []
    if row["loss_steps"] != base["loss_steps"]:
        problems.append(f"losses at steps {row['loss_steps']}, stock bf16's at {base['loss_steps']}")
        gaps = [math.inf]
    else:
        # Relative to the first step's loss, the scale of the loss: the batch is memorized (10.8 to ~0.005), and
        # near zero a relative gap measures FP8's floor, not training (an FP8 head: 0.0066 against bf16's 0.0055).
        first = abs(base["losses"][0])
        gaps = [abs(x - b) / first if math.isfinite(x) else math.inf for x, b in zip(row["losses"], base["losses"])]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    row["max_loss_gap_vs_bf16_eager"] = gaps[worst]
    if not gaps[worst] <= LOSS_TOLERANCE and not problems:
        problems.append(
            f"loss {row['losses'][worst]:.6g} at step {row['loss_steps'][worst]}, stock bf16 eager's "
            f"{base['losses'][worst]:.6g}: {gaps[worst]:.2%} of its first loss apart (at most {LOSS_TOLERANCE:.0%})"
        )
    row["check"] = None if row["stock"] else check_result(problems)


_BASES = {False: "bf16-eager", True: "hf-bf16-eager"}


def _stack_section(ctx: RunContext) -> dict[str, Any]:
    on_gpu = ctx.device.type == "cuda"
    from benchmarks.models import LLAMA_STACK

    config = dict(LLAMA_STACK) if on_gpu else dict(CPU_STACK)
    batch = STACK_BATCH if on_gpu else CPU_STACK_BATCH
    variants = _stack_variants(ctx)
    rows = []
    for variant in variants:
        ctx.progress.set_postfix_str(f"stack: {variant['label']}")
        row = _time_stack_variant(variant, ctx, config, batch)
        rows.append(row)
        ctx.progress.update()
        # Each row as it finishes: a run cut short by a time limit still shows what it measured.
        if "ms" in row:
            peak = "" if row["peak_gib"] is None else f", peak {row['peak_gib']:.1f} GiB"
            ctx.progress.write(
                f"float8 stack: {row['label']}: {row['ms']:.1f} ms/step{peak}, first step {row['first_step_s']:.1f} s"
            )
        else:
            ctx.progress.write(f"float8 stack: {row['label']}: skipped ({row.get('skipped')})")
    # Each row against its model's stock bf16 eager (the benchmark's stack, or the Hugging Face model).
    bases = {hf: next((r for r in rows if r["key"] == key and "ms" in r), None) for hf, key in _BASES.items()}
    for row, variant in zip(rows, variants, strict=True):
        base = bases[variant["hf"]]
        if base is not None and "ms" in row:
            row["speedup_over_bf16_eager"] = base["ms"] / row["ms"]
            _check_losses(row, base)
    return {
        "model": "LlamaStack",
        "config": config,
        "batch": list(batch),
        "torchao": _package_version("torchao"),
        "rows": rows,
    }


def _package_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


# --------------------------------------------------------------------------------------------------------------------
# One layer by size
# --------------------------------------------------------------------------------------------------------------------


def _layer_step(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    device_type = x.device.type

    def run():
        # x.grad too: in a model the input's gradient goes to the layer below; accumulating it here would add a
        # read-modify-write of the whole [tokens, K] input to every timed step.
        layer.weight.grad = x.grad = None
        with torch.autocast(device_type, dtype=torch.bfloat16):
            out = layer(x)
        out.backward(grad)

    return run


def _graphed(run: Callable[[], None]) -> Callable[[], None]:
    """``run`` (warmed up: caches filled, ``auto`` timed) captured in a CUDA graph: its replay, which costs the GPU
    time alone. A layer alone in an eager loop is host-bound below ~2 ms of work (its ~10 casts and 3 GEMMs each
    cost a launch); in a model the GPU queue hides that, and so does a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def _layer_section(ctx: RunContext) -> dict[str, Any]:
    from ampkernels.float8 import Float8Linear
    from benchmarks.common import time_interleaved

    on_gpu = ctx.device.type == "cuda"
    tokens = LAYER_TOKENS if on_gpu else CPU_LAYER_TOKENS
    rows = []
    for k, n in LAYER_SHAPES if on_gpu else CPU_LAYER_SHAPES:
        ctx.progress.set_postfix_str(f"layer {k} -> {n}")
        free_device_memory(ctx.device)
        torch.manual_seed(0)
        plain = torch.nn.Linear(k, n, bias=False, device=ctx.device)
        layers = {"bf16": plain}
        for recipe in LAYER_RECIPES:
            layers[recipe] = Float8Linear.from_linear(plain, recipe)
        x = torch.randn(tokens, k, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(tokens, n, device=ctx.device, dtype=torch.bfloat16)
        steps = {name: _layer_step(layer, x, grad) for name, layer in layers.items()}
        timings = time_interleaved(steps, ctx.device, ctx.repeats, ctx.target_loop_s)
        if on_gpu:  # after the eager loops: those warmed every cache the capture must not fill
            graphed = time_interleaved(
                {name: _graphed(step) for name, step in steps.items()}, ctx.device, ctx.repeats, ctx.target_loop_s
            )
            timings.update({f"{name}_graphed": timing for name, timing in graphed.items()})
        row = {"tokens": tokens, "in_features": k, "out_features": n, "tflop": 6 * tokens * k * n / 1e12}
        for name, timing in timings.items():
            row[f"{name}_ms"] = timing.median_wall_ms
        for recipe in LAYER_RECIPES:
            row[f"{recipe}_speedup"] = row["bf16_ms"] / row[f"{recipe}_ms"]
            if on_gpu:
                row[f"{recipe}_graphed_speedup"] = row["bf16_graphed_ms"] / row[f"{recipe}_graphed_ms"]
        rows.append(row)
        del steps, timings
        ctx.progress.update()
    return {"rows": rows, "size_rule": _measured_size_rule(rows) if on_gpu else None}


def _measured_size_rule(rows: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per recipe, the size rule the graphed rows give: the smallest GEMM FLOPs per cast element, 2KN / (K + N),
    from which on FP8 was faster than bf16 on every measured layer at least as large (None: on none).
    convert_to_float8's default, ``ampkernels.float8.linear.MIN_FLOPS_PER_CAST_ELEMENT``, is set from it."""
    from ampkernels.float8.linear import flops_per_cast_element

    rule = {}
    for recipe in LAYER_RECIPES:
        by_size = sorted(
            (round(flops_per_cast_element(r["in_features"], r["out_features"])), r[f"{recipe}_graphed_speedup"])
            for r in rows
        )
        rule[recipe] = None
        for size, speedup in reversed(by_size):
            if speedup <= 1.0:
                break
            rule[recipe] = size
    return rule


# --------------------------------------------------------------------------------------------------------------------
# Runner entry points
# --------------------------------------------------------------------------------------------------------------------


def run(ctx: RunContext) -> dict[str, Any]:
    from benchmarks import float8_casts, float8_fused, float8_gemms, float8_profile

    on_gpu = ctx.device.type == "cuda"
    ctx.progress.reset(total=len(_stack_variants(ctx)) + len(LAYER_SHAPES if on_gpu else CPU_LAYER_SHAPES) + 4)
    document: dict[str, Any] = {"mode": "gpu" if on_gpu else "cpu-small"}
    if ctx.recipes:  # --recipes: only the stack rows named (and "profile": the step profile)
        document["partial"] = True
        document["stack"] = _stack_section(ctx)
        ctx.progress.write(_report_stack(document["stack"]))
        if "profile" in ctx.recipes:
            stack = document["stack"]
            document["profile"] = float8_profile.run_profile(ctx, stack["config"], tuple(stack["batch"]))
        return document
    ctx.progress.set_postfix_str("casts")
    # Each section's table is also written as it finishes, for a run cut short by a time limit.
    document["casts"] = float8_casts.run_casts(ctx)
    ctx.progress.write(float8_casts.report_casts(document["casts"]))
    ctx.progress.update()
    ctx.progress.set_postfix_str("fused producers")
    document["fused"] = float8_fused.run_fused(ctx)
    ctx.progress.write(float8_fused.report_fused(document["fused"]))
    ctx.progress.update()
    ctx.progress.set_postfix_str("gemms")
    document["gemms"] = float8_gemms.run_gemms(ctx)
    ctx.progress.write(float8_gemms.report_gemms(document["gemms"]))
    ctx.progress.update()
    document["stack"] = _stack_section(ctx)
    ctx.progress.set_postfix_str("step profile")
    stack = document["stack"]
    document["profile"] = float8_profile.run_profile(ctx, stack["config"], tuple(stack["batch"]))
    ctx.progress.write(float8_profile.report_profile(document["profile"]))
    ctx.progress.update()
    document["layers"] = _layer_section(ctx)
    return document


def _report_layers(section: dict[str, Any]) -> str:
    graphed = any("bf16_graphed_ms" in r for r in section["rows"])
    rows = []
    for r in section["rows"]:
        row = [f"{r['in_features']} -> {r['out_features']}", format_ms(r["bf16_ms"])]
        for recipe in LAYER_RECIPES:
            row += [format_ms(r[f"{recipe}_ms"]), f"{r[f'{recipe}_speedup']:.2f}x"]
        if graphed:
            row.append(format_ms(r["bf16_graphed_ms"]))
            for recipe in LAYER_RECIPES:
                row += [format_ms(r[f"{recipe}_graphed_ms"]), f"{r[f'{recipe}_graphed_speedup']:.2f}x"]
        rows.append(row)
    tokens = section["rows"][0]["tokens"] if section["rows"] else 0
    title = f"One layer, forward + backward at {tokens} tokens (bf16 autocast), ms"
    headers = ["K -> N", "bf16", "fp8 tensorwise", "vs bf16", "fp8 rowwise", "vs bf16"]
    if graphed:
        title += "; eager loop, then CUDA-graph replays (the GPU's time alone)"
        headers += ["bf16 graphed", "tensorwise", "vs bf16", "rowwise", "vs bf16"]
    table = title + "\n" + format_table(headers, rows, "l" + "r" * (len(headers) - 1))
    for recipe, size in (section.get("size_rule") or {}).items():
        where = f"every measured layer with 2KN/(K+N) >= {size:,}" if size else "no measured layer"
        table += f"\nGraphed, fp8 {recipe} beats bf16 on {where} (the size rule of convert_to_float8)"
    return table


def _report_stack(section: dict[str, Any]) -> str:
    rows = []
    for r in section["rows"]:
        if "skipped" in r:
            rows.append([r["label"], "skipped", "", "", "", "", "", r["skipped"][:60]])
            continue
        gap = r.get("max_loss_gap_vs_bf16_eager")
        rows.append(
            [
                r["label"],
                format_ms(r["ms"]),
                f"{r['speedup_over_bf16_eager']:.2f}x" if "speedup_over_bf16_eager" in r else "",
                "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}",
                f"{r['first_step_s']:.1f}",
                "-" if gap is None else f"{gap:.2%}",
                check_cell(r),
                "" if r["losses_finite"] else "NON-FINITE LOSS",
            ]
        )
    c = section["config"]
    title = (
        f"{section['model']} training step (dim {c['dim']}, {c['layers']} blocks, ffn {c['ffn']}, vocab {c['vocab']}), "
        f"batch {section['batch'][0]} x {section['batch'][1]}, bf16 autocast"
    )
    headers = ["variant", "ms/step", "vs bf16 eager", "peak GiB", "first step s", "loss gap", "check", ""]
    lines = [title, format_table(headers, rows, "lrrrrrll"), *failure_lines(section["rows"])]
    note = f"note: loss gap: the largest gap to stock bf16 eager's loss, relative to its first; {LOSS_CHECK_NOTE}"
    return "\n".join([*lines, note])


def report(document: dict[str, Any]) -> str:
    from benchmarks import float8_casts, float8_fused, float8_gemms, float8_profile

    if document.get("partial"):
        profile = float8_profile.report_profile(document.get("profile", {}))
        return "\n\n".join([_report_stack(document["stack"]), profile])
    parts = [
        float8_casts.report_casts(document["casts"]),
        float8_fused.report_fused(document.get("fused", [])),
        float8_gemms.report_gemms(document["gemms"]),
        _report_layers(document["layers"]),
        _report_stack(document["stack"]),
        float8_profile.report_profile(document.get("profile", {})),
    ]
    return "\n\n".join(parts)


def summary(document: dict[str, Any]) -> list[str]:
    lines = []
    stack = {r["key"]: r for r in document["stack"]["rows"] if "ms" in r}
    base = stack.get("bf16-eager")
    keys = (
        "bf16-fused-eager",
        "fp8-tensorwise-eager",
        "fp8-tensorwise-graphed",
        "fp8-rowwise-eager",
        "fp8-delayed-eager",
        "bf16-fused-loss-eager",
        "fp8-tensorwise-fused-loss-eager",
        "fp8-tensorwise-fused-loss-graphed",
    )
    for key in keys:
        if key in stack and base:
            r = stack[key]
            memory = ""
            if r.get("peak_gib") and base.get("peak_gib"):
                memory = f", peak {r['peak_gib']:.1f} GiB ({r['peak_gib'] / base['peak_gib']:.2f}x stock's)"
            lines.append(
                f"Llama stack {r['label'].removeprefix('ampkernels ')}: {r['ms']:.1f} ms/step, "
                f"{base['ms'] / r['ms']:.2f}x stock bf16 eager ({base['ms']:.1f} ms){memory}"
            )
    hf_compiled = stack.get("hf-torchao-tensorwise-compiled")
    for key in ("hf-fp8-tensorwise-eager", "hf-fp8-tensorwise-compiled"):
        if hf_compiled and key in stack:
            r = stack[key]
            lines.append(f"{r['label']} vs torchao compiled: {hf_compiled['ms'] / r['ms']:.2f}x")
    compiled = stack.get("torchao-tensorwise-compiled")
    if compiled and "fp8-tensorwise-eager" in stack:
        ours = stack["fp8-tensorwise-eager"]
        lines.append(f"fp8 tensorwise eager vs torchao compiled: {compiled['ms'] / ours['ms']:.2f}x")
    if compiled and "fp8-tensorwise-fused-loss-eager" in stack:
        ours = stack["fp8-tensorwise-fused-loss-eager"]
        lines.append(f"fp8 tensorwise + fused loss eager vs torchao compiled: {compiled['ms'] / ours['ms']:.2f}x")
    return lines


def plot(document: dict[str, Any], path: Path, title: str) -> bool:
    rows = [r for r in document["stack"]["rows"] if "ms" in r]
    if not rows:
        return False
    # The labels wrapped to 14 characters a line, so that neighbours do not overlap at 12 bars in 16 inches.
    groups = ["\n".join(textwrap.wrap(r["label"], 14, break_long_words=False)) for r in rows]
    panels = {"training step, ms": (groups, {"ms per step": [r["ms"] for r in rows]})}
    return plot_grouped_bars(
        path, title, panels, ylabel="ms per step", log_scale=False, panel_width=16, tick_fontsize=7
    )
