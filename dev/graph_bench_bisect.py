"""Bisect the graphed-numerics divergence seen only inside the bench_training process (a fresh-process probe,
dev/graph_replay_probe.py, matches eager). Each variant runs in its own process; it replays bench_training's own job
functions in the benchmark's order and prints the first step where the graphed scale differs from the eager one.
Usage on the GPU machine: python3 dev/graph_bench_bisect.py [model [variant,variant...]]
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys

VARIANTS = {
    "bench-order": "eager numerics, graphed time job, graphed numerics (what the benchmark does)",
    "no-time-job": "eager numerics, graphed numerics",
    "no-empty-cache": "bench order, free_device_memory without torch.cuda.empty_cache",
    "no-free": "bench order, free_device_memory does nothing",
    "keep-time-job": "bench order, the time job's step kept alive until the end",
    "sync-each-step": "no time job, torch.cuda.synchronize() after every graphed step",
    "gc-disabled": "no time job, Python's gc off for the graphed run",
    "no-mask-skip": "no time job, captured without transformers_mask_skip",
}


def variant(model: str, name: str) -> dict:
    import torch

    from benchmarks import bench_training as bt
    from benchmarks.common import RunContext

    ctx = RunContext(torch.device("cuda"), [], 1, 3, 0.2, 0.0, None)
    if name == "no-empty-cache":
        bt.free_device_memory = lambda device: gc.collect()
    if name == "no-free":
        bt.free_device_memory = lambda device: None
    kept = []
    if name == "keep-time-job":
        build = bt._build

        def keeping_build(*args, **kwargs):
            out = build(*args, **kwargs)
            kept.append(out)
            return out

        bt._build = keeping_build
    if name == "sync-each-step":
        build = bt._build

        def syncing_build(*args, **kwargs):
            step, *rest = build(*args, **kwargs)

            def synced(*inputs):
                out = step(*inputs)
                torch.cuda.synchronize()
                return out

            return (synced, *rest)

        bt._build = syncing_build
    if name == "no-mask-skip":
        capture = bt.capture_step
        bt.capture_step = lambda *args, transformers_mask_skip=False, **kwargs: capture(*args, **kwargs)
    eager = bt._numerics_run(model, "ampkernels", ctx)
    if name == "gc-disabled":
        gc.collect()
        gc.disable()
    if name in ("bench-order", "no-empty-cache", "no-free", "keep-time-job"):
        bt._time_recipe(model, "ampkernels-graphed", ctx)
    graphed = bt._numerics_run(model, "ampkernels-graphed", ctx)
    diff = [i + 1 for i, (a, b) in enumerate(zip(eager["scale"], graphed["scale"])) if a != b]
    return {"model": model, "variant": name, "first_scale_difference": diff[0] if diff else None,
            "graphed_scales_there": graphed["scale"][diff[0] - 2 : diff[0] + 2] if diff else None}  # fmt: skip


def main() -> None:
    if len(sys.argv) > 3:  # model, variant, "child"
        print(json.dumps(variant(sys.argv[1], sys.argv[2])), flush=True)
        return
    model = sys.argv[1] if len(sys.argv) > 1 else "mlp-800"
    names = sys.argv[2].split(",") if len(sys.argv) == 3 else list(VARIANTS)
    for name in names:
        done = subprocess.run(
            [sys.executable, __file__, model, name, "child"], capture_output=True, text=True, timeout=150
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        print(lines[-1] if lines else f"{name}: rc {done.returncode} {done.stderr[-400:]}", flush=True)


if __name__ == "__main__":
    main()
