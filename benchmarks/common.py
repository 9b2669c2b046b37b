"""Shared pieces of the benchmarks: timing, copy bandwidth, environment, saving, tables and plots."""

from __future__ import annotations

import gc
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import textwrap
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

CPU_SMALL_NOTE = "cpu-small: sizes scaled down, not comparable to GPU figures"
CPU_CACHE_NOTE = (
    "on the CPU the scaled-down tensors fit in the caches, so rates above the copy bandwidth (measured on 64 MiB, "
    "beyond the caches) are possible: no % of copy or x floor is given"
)


@dataclass
class RunContext:
    """What the runner hands every benchmark module's ``run``."""

    device: torch.device
    sets: list[str]
    shrink: int  # every width of the parameter sets is divided by this
    repeats: int
    target_loop_s: float  # each timed loop runs enough iterations to last at least this long
    copy_bandwidth_gbs: float
    progress: Any  # a tqdm bar: the module sets its total and advances it
    full: bool = False  # the complete sweep (--full) rather than the default subset
    only: str | None = None  # the module --only named, if any
    models: list[str] | None = None  # the models --models named (the model zoo), if any
    recipes: list[str] | None = None  # the recipes --recipes named (the model zoo), if any

    @property
    def cpu_small(self) -> bool:
        return self.device.type == "cpu"


@dataclass
class LoopTiming:
    """Milliseconds per iteration, one entry per repeat of a loop of ``iterations`` calls."""

    iterations: int
    wall_ms: list[float] = field(default_factory=list)
    device_ms: list[float] = field(default_factory=list)  # CUDA events around the same loop; empty on the CPU
    calls: int = 0  # every call of the variant, warm-up included: what a check after the loop expects to find

    @property
    def median_wall_ms(self) -> float:
        return statistics.median(self.wall_ms)

    @property
    def median_device_ms(self) -> float | None:
        return statistics.median(self.device_ms) if self.device_ms else None


def missing_package(package: str) -> str | None:
    """None when ``package`` imports, else why what needs it is skipped."""
    try:
        __import__(package)
    except ImportError:
        return f"{package} is not installed (pip install {package})"
    return None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _time_loop(fn: Callable[[], Any], iterations: int, device: torch.device) -> tuple[float, float | None]:
    """Wall and device milliseconds per iteration over ``iterations`` back-to-back calls of ``fn``.

    Wall time is the primary figure: these ops include host work (Python loops, launches) that device events miss.
    """
    events = None
    if device.type == "cuda":
        events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    synchronize(device)
    start = time.perf_counter()
    if events:
        events[0].record()
    for _ in range(iterations):
        fn()
    if events:
        events[1].record()
    synchronize(device)
    wall_ms = (time.perf_counter() - start) * 1e3 / iterations
    device_ms = events[0].elapsed_time(events[1]) / iterations if events else None
    return wall_ms, device_ms


def time_interleaved(
    variants: dict[Hashable, Callable[[], Any]],
    device: torch.device,
    repeats: int,
    target_loop_s: float,
    warmup_iterations: int = 3,
) -> dict[Hashable, LoopTiming]:
    """Times each variant's loop ``repeats`` times, taking turns so that clock or thermal drift hits all alike.

    Each variant first runs ``warmup_iterations`` calls (compilation, caches, lazily allocated optimizer state), then
    one timed call sets its iteration count so that a loop lasts at least ``target_loop_s``.
    """
    timings = {}
    for key, fn in variants.items():
        for _ in range(warmup_iterations):
            fn()
        one_call_ms, _ = _time_loop(fn, 1, device)
        iterations = max(1, math.ceil(target_loop_s * 1e3 / one_call_ms))
        timings[key] = LoopTiming(iterations=iterations, calls=warmup_iterations + 1 + repeats * iterations)
    for _ in range(repeats):
        for key, fn in variants.items():
            wall_ms, device_ms = _time_loop(fn, timings[key].iterations, device)
            timings[key].wall_ms.append(wall_ms)
            if device_ms is not None:
                timings[key].device_ms.append(device_ms)
    return timings


def measure_copy_bandwidth(device: torch.device, repeats: int, target_loop_s: float) -> dict[str, float]:
    """Rate of ``dst.copy_(src)`` on one large fp32 tensor, counting bytes read plus bytes written.

    The buffers (1 GiB on a GPU, 64 MiB on the CPU) are far larger than any cache, so this is the memory ceiling that
    the bandwidth floors of the benchmarks are computed against. Device time on a GPU, wall time on the CPU.
    """
    numel = (256 if device.type == "cuda" else 16) * 2**20
    copy_ms = _time_copy(numel, device, repeats, target_loop_s)
    free_device_memory(device)
    bytes_moved = 2 * numel * 4
    return {"gbs": bytes_moved / (copy_ms * 1e-3) / 1e9, "bytes_per_copy": bytes_moved, "ms_per_copy": copy_ms}


def _time_copy(numel: int, device: torch.device, repeats: int, target_loop_s: float) -> float:
    source = torch.randn(numel, device=device)
    destination = torch.empty_like(source)
    timing = time_interleaved({"copy": lambda: destination.copy_(source)}, device, repeats, target_loop_s)["copy"]
    return timing.median_device_ms or timing.median_wall_ms


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device_type": device.type,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _package_version("triton"),
        "cuda": torch.version.cuda,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(
            device_name=properties.name,
            compute_capability=f"{properties.major}.{properties.minor}",
            multiprocessors=properties.multi_processor_count,
            memory_gib=round(properties.total_memory / 2**30, 1),
        )
    else:
        info["device_name"] = info["cpu_model"]
    return info


def device_slug(environment: dict[str, Any]) -> str:
    """File-name form of the device: ``nvidia-h200`` for "NVIDIA H200", ``cpu`` for any CPU."""
    if environment["device_type"] == "cpu":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", environment["device_name"].lower()).strip("-")


def describe_environment(environment: dict[str, Any]) -> str:
    """One line naming the device and the versions, for table headers and plot titles."""
    if environment["device_type"] == "cuda":
        device = (
            f"{environment['device_name']} (sm {environment['compute_capability']}, "
            f"{environment['multiprocessors']} SMs)"
        )
    else:
        device = f"CPU {environment['cpu_model']} ({environment['torch_threads']} threads)"
    versions = f"torch {environment['torch']} | triton {environment['triton']}"
    if environment["device_type"] == "cuda":
        versions += f" | CUDA {environment['cuda']}"
    return f"{device} | {versions} | {environment['date'][:10]}"


def save_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def format_ms(value: float | None) -> str:
    """Milliseconds for a table: 3 decimals below 10 ms, 1 above, "-" for none."""
    return "-" if value is None else f"{value:.3f}" if value < 10 else f"{value:.1f}"


def format_table(headers: list[str], rows: list[list[str]], align: str) -> str:
    """Plain-text table; ``align`` has one letter per column, ``l`` or ``r``."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        padded = (cell.ljust(w) if a == "l" else cell.rjust(w) for cell, w, a in zip(cells, widths, align))
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(row) for row in rows)])


# ---- checks of what was timed ----
# Every module compares what it timed with stock's (or the reference's) after its timed loops and puts the result in
# the row's ``check`` field: "ok", "FAILED: <what differs>", or None where the row is itself the yardstick. The
# runner exits non-zero when any check failed (``check_failures``).

CHECK_OK = "ok"
FAILED = "FAILED"


def check_result(problems: list[str]) -> str:
    """A row's ``check`` field: "ok", or "FAILED: " and every problem found."""
    return CHECK_OK if not problems else f"{FAILED}: " + "; ".join(problems)


def mismatch(name: str, actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float) -> str | None:
    """None when every element of ``actual`` is within ``atol + rtol * |expected|`` of ``expected`` (the rule of
    ``torch.testing.assert_close``; NaN matches NaN only), else one line naming ``name``, how many elements differ
    and the worst one."""
    if actual.shape != expected.shape:
        return f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    a = actual.detach().double()
    e = expected.detach().to(a.device).double()
    close = torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    bad = int((~close).sum())
    if bad == 0:
        return None
    error = (a - e).abs().nan_to_num(nan=math.inf).masked_fill(close, 0.0).flatten()
    worst = int(error.argmax())
    return (
        f"{name}: {bad} of {a.numel()} elements beyond rtol {rtol:g}, atol {atol:g} (worst at flat index {worst}: "
        f"{a.flatten()[worst].item():.9g}, expected {e.flatten()[worst].item():.9g})"
    )


def row_name(row: dict[str, Any]) -> str:
    """The fields that say which row of a table ``row`` is, joined."""
    keys = ("set", "model", "recipe", "dtype", "shape", "case", "op", "pass", "label", "scaling")
    return " / ".join(str(row[key]) for key in keys if row.get(key) not in (None, "")) or "(row)"


def check_failures(document: Any) -> list[str]:
    """One line per failed check anywhere in ``document`` (a module's results), naming its row."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            check = node.get("check")
            if isinstance(check, str) and check.startswith(FAILED):
                found.append(f"{row_name(node)}: {check}")
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(document)
    return found


def check_cell(row: dict[str, Any]) -> str:
    """The table cell of a row's check: "ok", "FAILED", or "-" (not checked: the yardstick itself)."""
    check = row.get("check")
    return "-" if check is None else FAILED if check.startswith(FAILED) else check


def failure_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The lines printed under a table for each of its rows whose check failed, in full."""
    return [f"{row_name(row)}: {row['check']}" for row in rows if check_cell(row) == FAILED]


def load_pyplot(path: Path) -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None (after saying so) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: {path.name} not drawn")
        return None
    return plt


def wrap_title(title: str, width_in: float, fontsize: float = 10) -> str:
    """``title`` broken into lines that fit ``width_in`` inches at ``fontsize`` points (existing breaks kept)."""
    chars = max(30, int(width_in * 72 / (0.55 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) for line in title.split("\n"))


def save_figure(figure: Any, path: Path, dpi: int = 120) -> None:
    """Saves with ``bbox_inches="tight"``, so that titles and legends placed outside the axes are kept whole."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(figure)


def plot_grouped_bars(
    path: Path,
    title: str,
    panels: dict[str, tuple[list[str], dict[str, list[float | None]]]],
    ylabel: str,
    *,
    log_scale: bool = True,
    max_columns: int = 2,
    panel_width: float = 6.5,
    tick_fontsize: int = 9,
) -> bool:
    """One panel per key of ``panels`` (``max_columns`` side by side): groups along x, one bar per series
    (``None``: no bar), log-scale y unless ``log_scale`` is False (values within one decade get no log ticks).
    The legend goes below the panels, in as many columns as its longest label allows.

    Returns False, after saying so, when matplotlib is not installed.
    """
    plt = load_pyplot(path)
    if plt is None:
        return False
    import matplotlib.ticker

    columns = min(max_columns, len(panels))
    rows = math.ceil(len(panels) / columns)
    width_in = panel_width * columns
    figure, axes = plt.subplots(rows, columns, figsize=(width_in, 4.5 * rows), layout="constrained", squeeze=False)
    axes = list(axes.flat)
    # A series keeps its colour in every panel; one with no value in a panel gets no slot there.
    colours = {label: f"C{i}" for i, label in enumerate(dict.fromkeys(k for _, s in panels.values() for k in s))}
    legend: dict[str, Any] = {}
    for axis, (panel_title, (groups, series)) in zip(axes, panels.items()):
        series = {label: values for label, values in series.items() if any(v is not None for v in values)}
        bar_width = 0.8 / max(1, len(series))
        for index, (label, values) in enumerate(series.items()):
            offset = (index - (len(series) - 1) / 2) * bar_width
            bars = [(group + offset, value) for group, value in enumerate(values) if value is not None]
            drawn = axis.bar(
                [x for x, _ in bars], [value for _, value in bars], bar_width, label=label, color=colours[label]
            )
            axis.bar_label(drawn, fmt="%.3g", fontsize=7 if len(series) <= 4 else 6)
            legend.setdefault(label, drawn)
        axis.set_xticks(range(len(groups)), groups, fontsize=tick_fontsize)
        if log_scale:
            axis.set_yscale("log")
            axis.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            axis.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_ylabel(ylabel)
        axis.set_title(wrap_title(panel_title, panel_width), fontsize=10)
        axis.grid(axis="y", which="both", alpha=0.3)
    for unused_axis in axes[len(panels) :]:
        unused_axis.set_visible(False)
    labels = [label for label in colours if label in legend]
    handles = [legend[label] for label in labels]
    if labels:
        # About 0.07 in per character at 9 pt, plus the colour patch.
        label_width_in = 0.07 * max(len(label) for label in labels) + 0.6
        ncol = max(1, min(len(labels), int(width_in // label_width_in)))
        figure.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, fontsize=9)
    figure.suptitle(wrap_title(title, width_in), fontsize=10)
    save_figure(figure, path)
    return True
