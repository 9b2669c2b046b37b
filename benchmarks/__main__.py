"""Runner behind ``python -m benchmarks``: runs the benchmark modules, prints their tables and a summary, saves JSON
and PNG.

By default a subset that takes a few minutes on one GPU (or on a 2-core CPU, at scaled-down sizes): the modules of
``DEFAULT_MODULES`` on the parameter sets of ``DEFAULT_SETS``, each module choosing its own default cases, with
``QUICK_REPEATS`` repeats. ``--full`` runs every module on every set and case with ``REPEATS`` repeats; ``--only``
runs one module (its default cases unless ``--full``).

Every module named in ``BENCHMARK_MODULES`` provides ``NAME``, ``run(ctx: RunContext) -> dict`` (rows and anything
else worth keeping), ``report(document) -> str`` (the table), ``summary(document) -> list[str]`` (its headline
ratios against stock) and ``plot(document, path, title) -> bool``. Results go to ``<out>/<NAME>_<device>.json`` and
``.png``, e.g. ``grad_scaler_nvidia-h200.json``; ``<out>`` is ``./benchmark-results`` unless ``--out`` is given.
Rows whose ``check`` field (a module's comparison of what it timed with stock's) says FAILED are listed at the
end, and the run exits with status 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common import (
    CPU_SMALL_NOTE,
    RunContext,
    check_failures,
    describe_environment,
    device_slug,
    environment_info,
    measure_copy_bandwidth,
    save_json,
)
from benchmarks.param_sets import CPU_SHRINK, PARAM_SETS

BENCHMARK_MODULES = (
    "bench_grad_scaler",
    "bench_optimizers",
    "bench_training",
    "bench_scaled_matmul",
    "bench_precision",
    "bench_float8",
    "bench_models",
    "bench_loss",
)
# NOTE: the default run took 100-109 s on the H200 (two runs; README.md); bench_precision takes ~1 min more and
# runs with --only precision or --full.
DEFAULT_MODULES = ("bench_grad_scaler", "bench_optimizers", "bench_training", "bench_scaled_matmul", "bench_models")
# Two regimes: bandwidth-bound (BERT-base, 202 tensors) and per-tensor host work (10,000 small tensors). GPT-2-medium
# and Llama-1B are bandwidth-bound too (post-backward phase 1.8x against BERT-base's 2.1x on the H200) and take most
# of the complete sweep's time.
DEFAULT_SETS = ("bert-base", "many-small")
DEFAULT_OUT = Path("benchmark-results")

# NOTE: loops of >= 50 ms keep the launch and clock jitter of a GPU loop near 1%; on the CPU, 20 ms loops keep the
# default run within a few minutes on 2 cores.
GPU_TARGET_LOOP_S, CPU_TARGET_LOOP_S = 0.05, 0.02
REPEATS, QUICK_REPEATS = 7, 3


def _benchmark_name(module_name: str) -> str:
    return module_name.removeprefix("bench_")


class _Progress(tqdm):
    """The modules' progress bar, whose ``write`` (interim tables and lines) goes to stderr with the bar, so that
    stdout keeps only the final report (tqdm's own ``write`` prints to stdout)."""

    @classmethod
    def write(cls, s, file=None, end="\n", nolock=False):
        super().write(s, file=sys.stderr if file is None else file, end=end, nolock=nolock)


def _unwritable(out: Path) -> str | None:
    """Why the JSON and PNG files cannot be written under ``out`` (created if missing), or None: checked before any
    benchmark runs rather than after the first one."""
    if out.exists() and not out.is_dir():
        return "exists and is not a folder"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # a real write, the surest check
            pass
    except OSError as error:
        return f"cannot write there ({error.strerror or error})"
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Time ampkernels against stock PyTorch in the same run; print tables, save JSON and PNG.",
    )
    parser.add_argument("--only", choices=[_benchmark_name(name) for name in BENCHMARK_MODULES], help="one benchmark")
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"every module, parameter set and case, {REPEATS} repeats per loop (tens of minutes on a GPU)",
    )
    parser.add_argument(
        "--sets",
        help=f"comma-separated parameter sets (default: {','.join(DEFAULT_SETS)}; with --full all of "
        f"{','.join(PARAM_SETS)})",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_REPEATS} repeats per loop also with --full (the default run's)"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"folder for the JSON and PNG files (default: ./{DEFAULT_OUT})"
    )
    parser.add_argument("--models", help="comma-separated models of the model zoo (default: a subset; all with --full)")
    parser.add_argument(
        "--recipes",
        help="comma-separated recipes of the model zoo, or rows of the float8 stack (a partial float8 run: those rows "
        "and their baselines; 'profile' adds the step profile); each with its baseline",
    )
    parser.add_argument("--no-plot", action="store_true", help="save no PNG")
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        help="where to run (default: cuda when a GPU is present; cpu runs the scaled-down sizes)",
    )
    parser.add_argument(
        "--shrink",
        type=int,
        help=f"divide every width of the parameter sets by this (default: 1 on a GPU, {CPU_SHRINK} on the CPU)",
    )
    args = parser.parse_args(argv)
    sets = args.sets if args.sets is not None else ",".join(PARAM_SETS if args.full else DEFAULT_SETS)
    args.sets = list(dict.fromkeys(name.strip() for name in sets.split(",") if name.strip()))
    unknown = [name for name in args.sets if name not in PARAM_SETS]
    if unknown or not args.sets:
        what = f"unknown parameter sets {unknown}" if unknown else "--sets names no parameter set"
        parser.error(f"{what}; choose from {','.join(PARAM_SETS)}")
    if args.shrink is not None and args.shrink < 1:
        parser.error("--shrink must be at least 1")
    return args


def selected_modules(args: argparse.Namespace) -> list[str]:
    """The benchmark modules that ``args`` runs, in run order."""
    if args.only is not None:
        return [name for name in BENCHMARK_MODULES if _benchmark_name(name) == args.only]
    return list(BENCHMARK_MODULES if args.full else DEFAULT_MODULES)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    unwritable = _unwritable(args.out)
    if unwritable is not None:
        print(f"--out {args.out}: {unwritable}", file=sys.stderr)
        return 2
    cpu_small = device.type == "cpu"
    if cpu_small:
        # Triton kernels on CPU tensors run in its interpreter, which @triton.jit reads when a kernel is defined:
        # set before any benchmark module imports a kernel module.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shrink = args.shrink or (CPU_SHRINK if cpu_small else 1)
    repeats = REPEATS if args.full and not args.quick else QUICK_REPEATS
    target_loop_s = CPU_TARGET_LOOP_S if cpu_small else GPU_TARGET_LOOP_S
    environment = environment_info(device)
    header = [f"== {describe_environment(environment)} =="]
    if cpu_small:
        header.append(f"!! {CPU_SMALL_NOTE} (every width divided by {shrink}) !!")
    elif shrink > 1:
        header.append(f"!! sizes scaled down: every width divided by {shrink} !!")
    print("\n".join(header), file=sys.stderr, flush=True)  # stdout keeps only the final report

    copy_bandwidth = measure_copy_bandwidth(device, repeats, target_loop_s)
    header.append(f"copy bandwidth: {copy_bandwidth['gbs']:.1f} GB/s (bytes read + written)")
    reports, summary, failures = [], [], []
    for module_name in selected_modules(args):
        module = importlib.import_module(f"benchmarks.{module_name}")
        with _Progress(desc=module.NAME, unit="case", dynamic_ncols=True) as progress:
            ctx = RunContext(
                device,
                args.sets,
                shrink,
                repeats,
                target_loop_s,
                copy_bandwidth["gbs"],
                progress,
                full=args.full,
                only=args.only,
                models=args.models.split(",") if args.models else None,
                recipes=args.recipes.split(",") if args.recipes else None,
            )
            results = module.run(ctx)
        document = {
            "benchmark": module.NAME,
            "mode": "cpu-small" if cpu_small else "gpu",
            "mode_note": CPU_SMALL_NOTE if cpu_small else None,
            "environment": environment,
            "copy_bandwidth": copy_bandwidth,
            "settings": {
                "sets": args.sets,
                "shrink": shrink,
                "quick": args.quick,
                "full": args.full,
                "repeats": repeats,
                "target_loop_ms": target_loop_s * 1e3,
            },
            **results,
        }
        stem = args.out / f"{module.NAME}_{device_slug(environment)}"
        save_json(stem.with_suffix(".json"), document)
        saved = [stem.with_suffix(".json")]
        if not args.no_plot:
            title = f"{module.NAME}: {describe_environment(environment)}"
            if cpu_small:
                title += f"\n{CPU_SMALL_NOTE}"
            if module.plot(document, stem.with_suffix(".png"), title):
                saved.append(stem.with_suffix(".png"))
        reports.append(f"[{module.NAME}]\n{module.report(document)}\nsaved: {', '.join(map(str, saved))}")
        summary += [f"{module.NAME}: {line}" for line in module.summary(document)]
        failures += [f"{module.NAME}: {line}" for line in check_failures(document)]

    print("\n".join(header))
    print("\n\n".join(reports))
    print("\n== summary (ratios against stock PyTorch, measured in this run) ==")
    print("\n".join(summary))
    print(f"finished in {time.perf_counter() - started:.0f} s")
    if failures:  # a timed result that differs from stock's: its figures are worthless, and the exit code says so
        failed = "\n".join(["== FAILED CHECKS: these timed results differ from stock's ==", *failures])
        print(f"\n{failed}")
        print(failed, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
