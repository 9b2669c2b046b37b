"""Where the time of one training step of the benchmarks' Llama-style stack goes, bf16 against FP8 (tensorwise):
the top kernels by GPU time over two profiled steps (after warm-up), grouped into matmuls, FP8 casts, attention and
everything else, with the first step's time (compilation, the "auto" timings) and the wall time per step. Answers
which part separates the FP8 step from its ideal (the bf16 step minus the matmul time saved).

Run: ``python3 dev/float8/stack_profile.py [--fused] [recipe ...]`` (CUDA needed; default: tensorwise).
``--fused`` builds the FP8 models with ampkernels' fused RMSNorm, RoPE and SiLU·up (``LlamaStack(fused=True)``) and
adds a bf16 row of the fused model.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.nn import functional as F

import ampkernels
from ampkernels.float8 import convert_to_float8
from benchmarks.models import LLAMA_STACK, LlamaStack

BATCH = (8, 2048)


def _group(name: str) -> str:
    lowered = name.lower()
    if "_rms_norm" in lowered or "_silu_mul" in lowered or "_rotary" in lowered:
        return "fused norm/RoPE/SiLU"
    if "float8" in lowered or "_cast_" in lowered or "amax" in lowered:
        return "fp8 casts"
    if "flash" in lowered or "fmha" in lowered or "attention" in lowered:
        return "attention"
    if "gemm" in lowered or "matmul" in lowered or "scaled_mm" in lowered or "wgmma" in lowered or "sm90" in lowered:
        return "matmuls"
    if "adam" in lowered or "multi_tensor" in lowered:
        return "optimizer"
    return "other"


def profile(recipe: str | None, fused: bool = False) -> None:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaStack(**LLAMA_STACK, fused=fused)
    if recipe is not None:
        convert_to_float8(model, recipe)
    opt = ampkernels.FusedAdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(LLAMA_STACK["vocab"], BATCH, device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
        opt.step()

    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) * 200
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / 2e3  # ms per step
    groups: dict[str, float] = {}
    for e in events:
        groups[_group(e.key)] = groups.get(_group(e.key), 0.0) + e.self_device_time_total / 2e3
    label = (recipe or "bf16") + (" (fused norm, RoPE, SiLU-up)" if fused else "")
    head = f"== {label}: first step {first_s:.1f} s, {step_ms:.1f} ms per step, {total:.1f} ms of kernels per step"
    print(head + "; " + ", ".join(f"{k} {v:.1f}" for k, v in groups.items()))
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:30]:
        ms = e.self_device_time_total / 2e3
        print(f"  {ms:7.2f} ms  {e.count // 2:4d}x  [{_group(e.key)}] {e.key[:110]}")


if __name__ == "__main__":
    args = sys.argv[1:]
    fused = "--fused" in args
    recipes = [a for a in args if a != "--fused"] or ["tensorwise"]
    profile(None)
    if fused:
        torch.cuda.empty_cache()
        profile(None, fused=True)
    for recipe in recipes:
        torch.cuda.empty_cache()  # the previous model is gone with its frame
        profile(recipe, fused)
