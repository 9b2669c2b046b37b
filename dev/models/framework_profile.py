"""Where a Llama 1.1B step through a framework goes: stock bf16 against everything asked for (the fused modules and
loss, FP8 tensorwise layers, 8-bit AdamW state), the zoo's ``stock-<fw>-bf16`` and ``ampkernels-<fw>-fp8-8bit`` rows.

For each recipe, three steps after the zoo's warm-up are profiled (``torch.profiler``): the wall time per step, the
device's busy time per step (the sum of its kernels and copies; the rest of the wall time the device waits on the
host), the top kernels by device time, and the kernels whose time differs most between the two recipes.

Run: ``python3 dev/models/framework_profile.py [trainer|lightning ...]`` (CUDA needed; default: trainer).
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch.autograd import DeviceType

from benchmarks import zoo_frameworks
from benchmarks.bench_models import MODELS

ACTIVE = 3
TOP = 25


def _llama():
    return MODELS["llama-1b"][0](False)


def _device_time(avg) -> float:
    return getattr(avg, "self_device_time_total", None) or avg.self_cuda_time_total


def profile(framework: str, ours: bool) -> tuple[float, dict[str, tuple[int, float]]]:
    """(wall ms per step, {kernel: (calls per step, device ms per step)}) over ``ACTIVE`` steps after the warm-up."""
    options = zoo_frameworks.Options(ours, torch.bfloat16, float8=ours, moments="8bit" if ours else None, fuse=ours)
    schedule = torch.profiler.schedule(wait=zoo_frameworks.WARMUP, warmup=1, active=ACTIVE, repeat=1)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        zoo_frameworks.STEP_HOOKS.append(prof.step)
        try:
            row = zoo_frameworks.time_framework(framework, _llama, torch.device("cuda"), options)
        finally:
            zoo_frameworks.STEP_HOOKS.remove(prof.step)
    steps = row["step_times_ms"][1 : 1 + ACTIVE]  # (the profiled ones: after wait + warm-up)
    kernels: dict[str, tuple[int, float]] = {}
    for avg in prof.key_averages():
        if avg.device_type == DeviceType.CUDA and _device_time(avg) > 0:
            kernels[avg.key] = (avg.count // ACTIVE, _device_time(avg) / 1e3 / ACTIVE)
    return sum(steps) / len(steps), kernels


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def main(frameworks: list[str]) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("framework_profile: needs a CUDA device")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for framework in frameworks:
        results = {}
        for ours in (False, True):
            name = f"ampkernels-{framework}-fp8-8bit" if ours else f"stock-{framework}-bf16"
            wall, kernels = profile(framework, ours)
            busy = sum(ms for _, ms in kernels.values())
            results[name] = kernels
            print(f"\n== {name}: wall {wall:.1f} ms/step, device busy {busy:.1f} ms/step, waiting {wall - busy:.1f}")
            ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
            for kernel, (calls, ms) in ranked[:TOP]:
                print(f"  {ms:8.2f} ms {calls:5d}x  {_short(kernel)}")
        stock, ours = results.values()
        diff: dict[str, float] = defaultdict(float)
        for kernel, (_, ms) in ours.items():
            diff[kernel] += ms
        for kernel, (_, ms) in stock.items():
            diff[kernel] -= ms
        print(f"\n== {framework}: largest differences, ours - stock (ms/step)")
        for kernel, ms in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:TOP]:
            print(f"  {ms:+8.2f} ms  {_short(kernel)}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["trainer"])
