"""Where the FP8 Llama stack's training step goes (called by ``benchmarks/bench_float8.py``; also
``python -m benchmarks.float8_profile`` on its own): the step of ``fp8 tensorwise + fused loss`` (eager, and captured
in a CUDA graph) profiled over two steps, its kernels' time by category beside that category's floor.

Floors, per step, for the stack of ``LLAMA_STACK`` with T tokens (H width, F ffn, V vocab, L blocks, S sequence
length, P parameters), at rates measured in the same run on the stack's own shapes:

* FP8 GEMMs: 3 x 2·T·L·(4H² + 3HF) FLOP (forward, input and weight gradients of the blocks' projections) at the
  rate of an FP8 ``torch._scaled_mm`` of T x H x F (tensorwise);
* bf16 GEMMs: 3 x 2·T·H·V FLOP (the head) at the rate of a bf16 ``torch.mm`` of T x H x V;
* attention: 3.5 x 2·T·S·H·L FLOP (causal: half of the 4·T·S·H forward; backward 2.5 x forward) at the rate of
  SDPA forward + backward on the stack's shape;
* FP8 casts: one read of each cast input (2 B) and one write of both layouts (2 x 1 B): per block the 3H + F wide
  inputs, the 5H + 2F wide gradients and the 4H² + 3HF weights;
* norms, RoPE, SiLU-up: one read of each input and one write of each output, forward and backward: RMSNorm on the
  float32 residual stream (16 B per element both ways), SiLU-up (18 B per T·F element), RoPE of q and k (16 B per
  T·H element);
* loss: the per-chunk kernel's 6 B per logit (two reads of the 16-bit logits, one write of their gradient);
* optimizer: AdamW on float32 parameters, 28 B per parameter;
* other (embedding, residual adds, copies): no floor;
* idle / launch gaps: the step's wall time less the kernels' sum; 0 at the floor.

The byte floors are at the copy bandwidth the runner measured. A category's kernels are told apart by name
(:func:`category`), the FP8 GEMMs by the op that launched them in the eager step (:func:`fp8_gemm_kernels`);
``kernels`` lists each category's largest, so that a kernel in the wrong one shows.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from benchmarks.common import RunContext, format_table, free_device_memory, synchronize

CATEGORIES = (
    "FP8 GEMMs",
    "bf16 GEMMs",
    "attention",
    "FP8 casts",
    "norms, RoPE, SiLU-up",
    "loss",
    "optimizer",
    "other",
)
VARIANT_KEYS = ("fp8-tensorwise-fused-loss-eager", "fp8-tensorwise-fused-loss-graphed")
PROFILED_STEPS = 2
TIMED_STEPS = 5

# Name fragments, lower case, tried in this order (the first category that matches wins).
_PATTERNS = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient_attention")),
    ("loss", ("cross_entropy",)),
    ("norms, RoPE, SiLU-up", ("rms_norm", "silu_mul", "rotary")),
    ("FP8 casts", ("amax_", "cast_flat", "cast_rows", "cast_tiles", "cast_columns")),
    ("optimizer", ("adam", "::step_kernel", "::prologue_kernel", "multi_tensor", "unscale_reduce", "update_scale")),
    ("FP8 GEMMs", ("e4m3", "e5m2", "fp8", "float8", "f8f8", "qqtst", "_scaled_mm")),
    ("bf16 GEMMs", ("gemm", "nvjet", "xmma", "cutlass", "wgmma", "matmul", "aten::mm", "aten::addmm")),
)


#: The ops whose kernels are FP8 GEMMs: cuBLAS names its FP8 GEMM kernels as it likes, so the eager profile learns
#: their names from the op that launched them (:func:`fp8_gemm_kernels`), and the graphed replay reuses them.
FP8_GEMM_OPS = ("aten::_scaled_mm", "ampkernels::scaled_matmul_fp8_wgmma_", "ampkernels::scaled_mm_fp8_")


def category(kernel: str, fp8_gemms: frozenset[str] = frozenset()) -> str:
    """The category of a kernel (or, on the CPU, an op) by its name; ``fp8_gemms``: kernels known to be FP8 GEMMs."""
    if kernel in fp8_gemms:
        return "FP8 GEMMs"
    name = kernel.lower()
    return next((cat for cat, fragments in _PATTERNS if any(f in name for f in fragments)), "other")


def fp8_gemm_kernels(events) -> set[str]:
    """The names of the device kernels that the ops of :data:`FP8_GEMM_OPS` launched, in profiler ``events``
    (``prof.events()`` of a profile with CPU and CUDA activities: each op lists the kernels it launched)."""
    return {
        kernel.name
        for event in events
        if any(op in event.name for op in FP8_GEMM_OPS)
        for kernel in getattr(event, "kernels", ())
    }


def _time(fn, repeats: int) -> float:
    """Median ms of ``fn`` after one warm-up call (CUDA events)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_rates(config: dict, batch: tuple[int, int], device: torch.device) -> dict[str, float]:
    """FLOP/s of the FP8 GEMM, the bf16 GEMM and causal attention (forward + backward) on the stack's shapes."""
    tokens = batch[0] * batch[1]
    dim, ffn, vocab, heads = config["dim"], config["ffn"], config["vocab"], config["heads"]
    one = torch.ones((), device=device)
    fp8 = (
        torch.randn(tokens, dim, device=device).to(torch.float8_e4m3fn),
        torch.randn(ffn, dim, device=device).to(torch.float8_e4m3fn).t(),
    )
    fp8_ms = _time(lambda: torch._scaled_mm(*fp8, one, one, out_dtype=torch.bfloat16), 10)
    bf16 = (
        torch.randn(tokens, dim, device=device, dtype=torch.bfloat16),
        torch.randn(dim, vocab, device=device, dtype=torch.bfloat16),
    )
    bf16_ms = _time(lambda: torch.mm(*bf16), 10)
    # [B, heads, S, head_dim] views of [B, S, heads, head_dim] tensors, as the stack's attention hands SDPA
    shape = (batch[0], batch[1], heads, dim // heads)
    q, k, v = (
        torch.randn(shape, device=device, dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in range(3)
    )
    grad = torch.randn_like(q)

    def attention():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    attention_ms = _time(attention, 5)
    attention_flop = 3.5 * 2 * tokens * batch[1] * dim  # causal: half of the 4*T*S*H forward; backward 2.5x
    return {
        "fp8_gemm_tflops": 2 * tokens * dim * ffn / fp8_ms / 1e9,
        "bf16_gemm_tflops": 2 * tokens * dim * vocab / bf16_ms / 1e9,
        "attention_tflops": attention_flop / attention_ms / 1e9,
    }


def floors(config: dict, batch: tuple[int, int], params: int, rates: dict, copy_gbs: float) -> dict[str, float]:
    """Each category's floor in ms per step (the module docstring's table)."""
    T = batch[0] * batch[1]
    S = batch[1]
    H, F, V, L = config["dim"], config["ffn"], config["vocab"], config["layers"]
    flop = {
        "FP8 GEMMs": 3 * 2 * T * L * (4 * H * H + 3 * H * F),
        "bf16 GEMMs": 3 * 2 * T * H * V,
        "attention": 3.5 * 2 * T * S * H * L,
    }
    rate = {"FP8 GEMMs": "fp8_gemm_tflops", "bf16 GEMMs": "bf16_gemm_tflops", "attention": "attention_tflops"}
    bytes_ = {
        "FP8 casts": L * 4 * (T * (3 * H + F) + T * (5 * H + 2 * F) + 4 * H * H + 3 * H * F),
        "norms, RoPE, SiLU-up": L * (2 * 16 * T * H + 18 * T * F + 16 * T * H) + 16 * T * H,
        "loss": 6 * T * V,
        "optimizer": 28 * params,
    }
    out = {name: value / (rates[rate[name]] * 1e12) * 1e3 for name, value in flop.items()}
    out.update({name: value / (copy_gbs * 1e9) * 1e3 for name, value in bytes_.items()})
    return out


def _profile(step, inputs, device: torch.device, fp8_gemms: set[str]) -> tuple[dict, dict]:
    """(ms per step by category, each category's largest kernels) over :data:`PROFILED_STEPS` steps; adds the FP8
    GEMM kernels it finds launched by their ops to ``fp8_gemms``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            step(*inputs)
        synchronize(device)
    fp8_gemms |= fp8_gemm_kernels(prof.events())
    known = frozenset(fp8_gemms)
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    kernels: dict[str, list[tuple[str, float]]] = {name: [] for name in CATEGORIES}
    for event in prof.key_averages():
        if device.type == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = event.self_device_time_total
        else:
            us = event.self_cpu_time_total
        ms = us / 1e3 / PROFILED_STEPS
        kind = category(event.key, known)
        by_category[kind] += ms
        kernels[kind].append((event.key[:120], ms))
    return by_category, {name: sorted(found, key=lambda item: -item[1])[:6] for name, found in kernels.items()}


def run_profile(ctx: RunContext, config: dict, batch: tuple[int, int]) -> dict[str, Any]:
    """The profile of each of :data:`VARIANT_KEYS` that runs here (graphed: CUDA only), with the floors."""
    from benchmarks.bench_float8 import _build_stack_step, _stack_variants

    on_gpu = ctx.device.type == "cuda"
    variants = [v for v in _stack_variants(ctx) if v["key"] in VARIANT_KEYS]
    section: dict[str, Any] = {"config": config, "batch": list(batch), "rows": []}
    fp8_gemms: set[str] = set()  # learnt from the eager step (first), read for the graphed one
    if on_gpu:
        section["rates"] = measure_rates(config, batch, ctx.device)
    for variant in variants:
        free_device_memory(ctx.device)
        step, model, inputs = _build_stack_step(variant, ctx, config, batch)
        for _ in range(3):
            step(*inputs)
        synchronize(ctx.device)
        start = time.perf_counter()
        for _ in range(TIMED_STEPS):
            step(*inputs)
        synchronize(ctx.device)
        wall_ms = (time.perf_counter() - start) * 1e3 / TIMED_STEPS
        by_category, kernels = _profile(step, inputs, ctx.device, fp8_gemms)
        params = sum(p.numel() for p in model.parameters())
        row = {
            "key": variant["key"],
            "label": variant["label"],
            "wall_ms": wall_ms,
            "ms": by_category,
            "idle_ms": max(wall_ms - sum(by_category.values()), 0.0),
            "kernels": kernels,
            "params": params,
        }
        if on_gpu:
            row["floor_ms"] = floors(config, batch, params, section["rates"], ctx.copy_bandwidth_gbs)
        section["rows"].append(row)
        del step, model, inputs
    free_device_memory(ctx.device)
    return section


def report_profile(section: dict[str, Any]) -> str:
    if not section.get("rows"):
        return "FP8 stack profile: not run"
    parts = []
    for r in section["rows"]:
        floor = r.get("floor_ms", {})
        rows = []
        for name in (*CATEGORIES, "idle / launch gaps"):
            ms = r["idle_ms"] if name == "idle / launch gaps" else r["ms"][name]
            f = 0.0 if name == "idle / launch gaps" else floor.get(name)
            rows.append(
                [
                    name,
                    f"{ms:.1f}",
                    f"{100 * ms / r['wall_ms']:.0f}%",
                    "" if f is None else f"{f:.1f}",
                    "" if not f else f"{ms / f:.2f}x",
                    "" if f is None else f"{ms - f:.1f}",
                ]
            )
        total_floor = sum(floor.values()) if floor else None
        rows.append(
            [
                "step (wall)",
                f"{r['wall_ms']:.1f}",
                "100%",
                "" if total_floor is None else f"{total_floor:.1f}",
                "" if not total_floor else f"{r['wall_ms'] / total_floor:.2f}x",
                "" if total_floor is None else f"{r['wall_ms'] - total_floor:.1f}",
            ]
        )
        title = (
            f"Where the step goes: {r['label']}, ms per step by kernel category (profiled over {PROFILED_STEPS} steps)"
        )
        parts.append(
            title
            + "\n"
            + format_table(["category", "ms", "of step", "floor ms", "x floor", "above floor"], rows, "lrrrrr")
        )
        for name in ("FP8 GEMMs", "bf16 GEMMs", "other"):
            for kernel, ms in r["kernels"][name][:3]:
                parts.append(f"  {name}: {ms:6.2f} ms  {kernel[:100]}")
    rates = section.get("rates")
    if rates:
        parts.append(
            "note: floors at the rates measured here: FP8 GEMM {fp8_gemm_tflops:.0f}, "
            "bf16 GEMM {bf16_gemm_tflops:.0f}, "
            "causal attention forward + backward {attention_tflops:.0f} TFLOP/s; bytes at the copy bandwidth "
            "(benchmarks/float8_profile.py says what each floor counts)".format(**rates)
        )
    return "\n".join(parts)


def main() -> None:
    """The profile alone, at the sizes ``python -m benchmarks --only float8`` uses here."""
    import os

    from benchmarks.bench_float8 import CPU_STACK, CPU_STACK_BATCH, STACK_BATCH
    from benchmarks.common import measure_copy_bandwidth
    from benchmarks.models import LLAMA_STACK

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    copy = measure_copy_bandwidth(device, 3, 0.2 if on_gpu else 0.05)
    ctx = RunContext(device, [], 1, 3, 0.2, copy["gbs"], progress=None)
    config, batch = (dict(LLAMA_STACK), STACK_BATCH) if on_gpu else (dict(CPU_STACK), CPU_STACK_BATCH)
    print(report_profile(run_profile(ctx, config, batch)))


if __name__ == "__main__":
    main()
