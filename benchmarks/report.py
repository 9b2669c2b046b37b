"""Markdown result tables from the JSON files of ``python -m benchmarks``, so that every published figure comes from a
run: ``python -m benchmarks.report benchmarks/published > benchmarks/README.md``.

Reads every ``<NAME>_<device>.json`` (a module measured on two GPUs has two files), prints one section per module,
and in it, per file, the machine, the settings, the table, the notes and a link to the file's PNG where there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import bench_grad_scaler, bench_optimizers
from benchmarks.common import check_failures

MODULE_ORDER = ("models", "precision", "grad_scaler", "optimizers", "training", "scaled_matmul", "float8", "loss")
TITLES = {
    "models": "Model zoo: whole training steps, stock against ampkernels",
    "precision": "Training step by precision (FP32, TF32, FP16, BF16)",
    "grad_scaler": "Post-backward phase: torch.amp.GradScaler against FusedGradScaler",
    "optimizers": "AdamW step alone",
    "training": "End-to-end fp16 AMP training steps",
    "scaled_matmul": "scaled_matmul against cuBLAS",
    "float8": "FP8 training: casts, fused kernels, FP8 GEMMs, the Llama-stack step",
    "loss": "Fused linear + cross-entropy: a language-model head and its loss",
}
DTYPES = {"bfloat16": "bf16", "float16": "fp16"}


def load(folder: Path) -> dict[str, list[tuple[Path, dict[str, Any]]]]:
    """Module name -> [(path, document)] for the JSON files in ``folder``, in name order."""
    found: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for path in sorted(folder.glob("*.json")):
        document = json.loads(path.read_text())
        name = document.get("benchmark")
        if name in MODULE_ORDER:
            found.setdefault(name, []).append((path, document))
    return found


def _speedup(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _has_checks(rows: list[dict[str, Any]]) -> bool:
    return any("check" in r for r in rows)


def _check(row: dict[str, Any]) -> str:
    check = row.get("check")
    return "–" if check is None else "**FAILED**" if check.startswith("FAILED") else check


def grad_scaler(doc: dict[str, Any]) -> list[str]:
    on_gpu = doc["mode"] == "gpu"
    copy = doc["copy_bandwidth"]["gbs"]
    rows = bench_grad_scaler.with_best_stock(doc["rows"])
    checks = _has_checks(rows)
    lines = [
        "| set | case | implementation | ms | GB/s"
        + (" (% of copy) | × floor" if on_gpu else "")
        + " | vs stock | vs best stock |"
        + (" check |" if checks else ""),
        "|---|---|---|---:|---:|" + ("---:|" if on_gpu else "") + "---:|---:|" + ("---|" if checks else ""),
    ]
    for r in rows:
        rate = f"{r['gbs']:.0f} ({r['gbs'] / copy:.0%}) | {r['x_floor']:.2f}" if on_gpu else f"{r['gbs']:.0f}"
        lines.append(
            f"| {r['set']} | {r['case']} | {r['label']} | {_ms(r['wall_ms'])} | {rate} | "
            f"{_speedup(r['speedup_over_stock'])} | {_speedup(r['speedup_over_best_stock'])} |"
            + (f" {_check(r)} |" if checks else "")
        )
    lines += [
        "",
        "vs stock: against `torch.amp.GradScaler` with torch's fused AdamW (the standard recipe); vs best stock: "
        "against the fastest stock recipe of the case run the same way (eager rows: the standard recipe or the best "
        "sync-free assembly of stock parts; CUDA-graph rows: that assembly captured in a CUDA graph).",
    ]
    return lines


def optimizers(doc: dict[str, Any]) -> list[str]:
    on_gpu = doc["mode"] == "gpu"
    copy = doc["copy_bandwidth"]["gbs"]
    checks = _has_checks(doc["rows"])
    lines = [
        "| set | implementation | ms | GB/s"
        + (" | % of copy" if on_gpu else "")
        + " | speedup |"
        + (" check |" * checks),
        "|---|---|---:|---:|" + ("---:|" if on_gpu else "") + "---:|" + ("---|" * checks),
    ]
    for r in doc["rows"]:
        rate = f"{r['gbs']:.0f} | {r['gbs'] / copy:.0%}" if on_gpu else f"{r['gbs']:.0f}"
        speedup = _speedup(r["speedup_over_stock"])
        check = f" {_check(r)} |" if checks else ""
        lines.append(f"| {r['set']} | {r['label']} | {_ms(r['wall_ms'])} | {rate} | {speedup} |{check}")
    extra = bench_optimizers.markdown(doc)  # the low-precision state and training-memory tables, when run
    return lines + ([""] + extra if extra else [])


def models(doc: dict[str, Any]) -> list[str]:
    lines = [
        "| model | recipe | ms/step | vs stock | tokens or images /s | peak GiB | loss | check |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in doc["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['recipe']} | failed: {r['error'][:80]} | | | | | |")
            continue
        peak = "–" if r.get("peak_memory_gib") is None else f"{r['peak_memory_gib']:.2f}"
        lines.append(
            f"| {r['model']} | {r['recipe']} | {_ms(r['step_ms'])} | {_speedup(r.get('speedup_over_stock'))} | "
            f"{r['per_second']:,.0f} | {peak} | {r['final_loss']:.4f} | {_check(r)} |"
        )
    descriptions: dict[str, str] = {}
    for r in doc["rows"]:  # the model's own loop first: a framework row's description names the framework
        if "description" in r and "through" not in r["description"]:
            descriptions.setdefault(r["model"], r["description"])
    lines += [""] + [f"- {name}: {description}" for name, description in descriptions.items()]
    converted = [f"{r['model']} {r['float8_layers'][0]} of {r['float8_layers'][1]}" for r in doc["rows"]
                 if "float8_layers" in r]  # fmt: skip
    if converted:
        lines.append(f"- fp8: nn.Linear layers converted by convert_to_float8's size rule: {', '.join(converted)}")
    return lines


def loss(doc: dict[str, Any]) -> list[str]:
    lines = [
        "| shape | implementation | ms | vs stock | peak GiB | loss | check |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in doc["rows"]:
        peak = "–" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f}"
        lines.append(
            f"| {r['shape']} | {r['implementation']} | {_ms(r['ms'])} | {_speedup(r.get('speedup_over_stock'))} | "
            f"{peak} | {r['loss']:.4f} | {_check(r)} |"
        )
    return lines


def training(doc: dict[str, Any]) -> list[str]:
    lines = [
        "| model | recipe | step ms | vs stock fused | vs stock foreach | vs stock fused graphed | peak GiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['recipe']} | failed: {r['error'][:80]} | | | | |")
            continue
        peak = "–" if r.get("peak_memory_gib") is None else f"{r['peak_memory_gib']:.2f}"
        lines.append(
            f"| {r['model']} | {r['recipe']} | {r['step_ms']:.2f} | {_speedup(r.get('speedup_over_stock_fused'))} | "
            f"{_speedup(r.get('speedup_over_stock_foreach'))} | "
            f"{_speedup(r.get('speedup_over_stock_fused_graphed'))} | {peak} |"
        )
    numerics = [
        f"- {name}, {len(next(iter(info['runs'].values()))['loss'])} steps with injected overflows, {recipe} against "
        f"stock fused: scale history {'identical' if cmp['scale_history_equal'] else 'differs'}, largest relative "
        f"loss difference {cmp['max_relative_loss_difference']:.1e}"
        for name, info in doc.get("numerics", {}).items()
        for recipe, cmp in info["versus_stock"].items()
    ]
    return lines + ([""] + numerics if numerics else [])


def scaled_matmul(doc: dict[str, Any]) -> list[str]:
    names = list(dict.fromkeys(r["implementation"] for r in doc["rows"]))
    ours = [name for name in names if name not in ("cublas_mm", "cublas_then_scale")]
    labels = {name: next(r["label"] for r in doc["rows"] if r["implementation"] == name) for name in names}
    checks = _has_checks(doc["rows"])
    lines = [
        "| dtype | M×N×K layout | "
        + " | ".join(labels[name] for name in ("cublas_mm", "cublas_then_scale"))
        + " | "
        + " | ".join(f"{labels[name]} (× mm+scale, × mm)" for name in ours)
        + " |"
        + (" check |" if checks else ""),
        "|---|---|" + "---:|" * len(names) + ("---|" if checks else ""),
    ]
    cases: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in doc["rows"]:
        cases.setdefault((r["dtype"], r["case"]), {})[r["implementation"]] = r
    for (dtype, case), by in cases.items():
        cells = [f"{by[name]['tflops']:.0f}" for name in ("cublas_mm", "cublas_then_scale")]
        cells += [
            f"{by[name]['tflops']:.0f} ({by[name]['vs_cublas_then_scale']:.2f}, {by[name]['vs_cublas_mm']:.2f})"
            if name in by
            else "–"
            for name in ours
        ]
        if checks:
            failed = [labels[name] for name in ours if name in by and _check(by[name]) == "**FAILED**"]
            cells.append("**FAILED**: " + ", ".join(failed) if failed else "ok")
        lines.append(f"| {DTYPES.get(dtype, dtype)} | {case} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "TFLOP/s; in brackets the ratio to cuBLAS mm then `* scale` (the standard stock recipe of a scaled product) "
        "and to cuBLAS mm alone (the fastest stock call, which does not scale)."
    )
    lines.append("")
    for s in doc["summary"]:
        lines.append(
            f"- geomean over {s['cases']} {s['dtype']} cases, {labels.get(s['implementation'], s['implementation'])}: "
            f"{s['geomean_vs_cublas_then_scale']:.2f}× mm+scale, {s['geomean_vs_cublas_mm']:.2f}× cuBLAS mm "
            f"(min {s['min_vs_cublas_mm']:.2f})"
        )
    return lines


def precision(doc: dict[str, Any]) -> list[str]:
    on_gpu = doc["mode"] == "gpu"
    reference = doc["reference"]
    lines = [
        "| model | recipe | ms/step | peak GiB | × FP32 |"
        + (" reference ms | reference GiB | reference × FP32 |" * on_gpu),
        "|---|---|---:|---:|---:|" + ("---:|---:|---:|" * on_gpu),
    ]
    for r in doc["rows"]:
        ref = reference["models"].get(r["model"], {})
        ref_cells = ""
        if on_gpu:
            ref_ms, ref_gib = ref.get("ms", {}).get(r["recipe"]), ref.get("peak_gib", {}).get(r["recipe"])
            ref_fp32 = ref.get("ms", {}).get("fp32")
            ref_cells = (
                f" {'–' if ref_ms is None else f'{ref_ms:.1f}'} | {'–' if ref_gib is None else f'{ref_gib:.2f}'} | "
                f"{'–' if ref_ms is None or ref_fp32 is None else f'{ref_fp32 / ref_ms:.2f}×'} |"
            )
        if "error" in r:
            lines.append(f"| {r['model']} | {r['label']} | failed: {r['error'][:80]} | | |{ref_cells}")
            continue
        peak = "–" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
        lines.append(
            f"| {r['model']} | {r['label']} | {r['step_ms']:.1f} | {peak} | {_speedup(r.get('speedup_over_fp32'))} |"
            f"{ref_cells}"
        )
    lines.append("")
    descriptions = {r["model"]: r["description"] for r in doc["rows"] if "description" in r}
    lines += [f"- {name}: {description}" for name, description in descriptions.items()]
    if on_gpu:
        lines.append(f"- reference: {reference['label']} ({reference['setup']})")
    lines += [f"- differs from the reference: {line}" for line in doc["differences_from_reference"]]
    return lines


def float8(doc: dict[str, Any]) -> list[str]:
    stack = doc["stack"]
    c = stack["config"]
    lines = [
        f"Llama-style stack (dim {c['dim']}, {c['layers']} blocks, ffn {c['ffn']}, vocab {c['vocab']}), batch "
        f"{stack['batch'][0]} × {stack['batch'][1]}, bf16 autocast; torchao {stack['torchao'] or 'not installed'}:",
        "",
        "| variant | ms/step | × stock bf16 eager | peak GiB | first step s |"
        + (" loss gap to stock bf16 | check |" if _has_checks(stack["rows"]) else ""),
        "|---|---:|---:|---:|---:|" + ("---:|---|" if _has_checks(stack["rows"]) else ""),
    ]
    for r in stack["rows"]:
        extra = ""
        if _has_checks(stack["rows"]):
            gap = r.get("max_loss_gap_vs_bf16_eager")
            extra = f" {'–' if gap is None else f'{gap:.2%}'} | {_check(r)} |"
        if "ms" not in r:
            lines.append(f"| {r['label']} | skipped: {r.get('skipped', '')[:80]} | | | |" + (" | |" if extra else ""))
            continue
        peak = "–" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        lines.append(
            f"| {r['label']} | {r['ms']:.1f} | {_speedup(r.get('speedup_over_bf16_eager'))} | {peak} | "
            f"{r['first_step_s']:.1f} |{extra}"
        )
    on_gpu = doc["mode"] == "gpu"
    lines += [
        "",
        "| op | shape | pass | torch, timed as | torch ms | ampkernels ms | × torch |"
        + (" check |" if _has_checks(doc["fused"]) else ""),
        "|---|---|---|---|---:|---:|---:|" + ("---|" if _has_checks(doc["fused"]) else ""),
    ]
    for r in doc["fused"]:
        # Runs before torch_code was recorded timed the LlamaStack's own code for every op.
        code = r.get("torch_code", "the model's own code")
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['pass']} | {code} | {_ms(r['torch_ms'])} | {_ms(r['ms'])} | "
            f"{_speedup(r['speedup_over_torch'])} |" + (f" {_check(r)} |" if _has_checks(doc["fused"]) else "")
        )
    cast_checks = _has_checks(doc["casts"])
    lines += [
        "",
        "| shape | cast | ms | GB/s" + (" (% of copy)" if on_gpu else "") + " | × torch |" + (" check |" * cast_checks),
    ]
    lines.append("|---|---|---:|---:|---:|" + ("---|" * cast_checks))
    for r in doc["casts"]:
        rate = f"{r['gbs']:.0f} ({r['pct_of_copy']:.0f}%)" if on_gpu else f"{r['gbs']:.0f}"
        check = f" {_check(r)} |" if cast_checks else ""
        lines.append(
            f"| {r['shape']} | {r['label']} | {_ms(r['ms'])} | {rate} | {_speedup(r['speedup_over_torch'])} |{check}"
        )
    lines.append("")
    for r in doc["gemms"]:
        if r["shape"].startswith("geomean") and r["vs_scaled_mm"] is not None:
            lines.append(
                f"- FP8 GEMMs, {r['shape']} shapes, {r['implementation']} ({r['scaling']}): {r['tflops']:.0f} TFLOP/s, "
                f"{r['vs_scaled_mm']:.3f}× torch._scaled_mm (min {r['min_vs_scaled_mm']:.2f}), "
                f"{r['vs_bf16']:.2f}× bf16 cuBLAS"
            )
    return lines


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "models": models,
    "precision": precision,
    "grad_scaler": grad_scaler,
    "optimizers": optimizers,
    "training": training,
    "scaled_matmul": scaled_matmul,
    "float8": float8,
    "loss": loss,
}


def _machine(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    if env["device_type"] == "cuda":
        device = f"{env['device_name']} (sm {env['compute_capability']}, {env['multiprocessors']} SMs)"
    else:
        device = f"CPU {env['cpu_model']} ({env['torch_threads']} threads; sizes scaled down)"
    settings = doc["settings"]
    cuda = f", CUDA {env['cuda']}" if env["device_type"] == "cuda" else ""
    return (
        f"{device}; torch {env['torch']}, triton {env['triton']}{cuda}, Python {env['python']}; "
        f"{env['date'][:10]}; {settings['repeats']} repeats per loop; copy bandwidth "
        f"{doc['copy_bandwidth']['gbs']:.0f} GB/s (bytes read + written)"
    )


# The modules that compare what they timed with stock's (a ``check`` field in their rows).
CHECKED_MODULES = ("grad_scaler", "optimizers", "scaled_matmul", "float8", "models", "loss")
UNCHECKED = (
    "this run predates the benchmarks' comparison of what they timed with stock's after the timed loops (the "
    "`check` field); `python -m benchmarks` now records it and exits with status 1 when one fails"
)


def _any_check(node: Any) -> bool:
    if isinstance(node, dict):
        return "check" in node or any(_any_check(value) for value in node.values())
    return isinstance(node, list) and any(_any_check(value) for value in node)


def _separate_tables(lines: list[str]) -> list[str]:
    """``lines`` with a blank line between a table and a line of text glued under it (which markdown would read as
    one more row of the table)."""
    out: list[str] = []
    for line in lines:
        if out and out[-1].startswith("|") and line and not line.startswith("|"):
            out.append("")
        out.append(line)
    return out


def render(folder: Path, relative_to: Path | None = None) -> str:
    """The whole markdown document for the JSON (and PNG) files in ``folder``; links relative to ``relative_to``
    (default: the folder's parent, where ``benchmarks/README.md`` lives)."""
    relative_to = folder.parent if relative_to is None else relative_to
    documents = load(folder)
    lines = [
        "# Benchmark results",
        "",
        f"Generated by `python -m benchmarks.report` from the JSON files in `{folder.name}/`; do not edit by hand. "
        "Every figure comes from one `python -m benchmarks` run per module, stock PyTorch "
        "measured in the same run as ampkernels. Ratios are the figures to compare; absolute times drift by a few "
        "percent between runs and machines.",
        "",
    ]
    for name in MODULE_ORDER:
        for index, (path, doc) in enumerate(documents.get(name, [])):
            lines += [f"## {TITLES[name]}", ""] if index == 0 else []
            lines += _section(name, path, doc, relative_to)
    return "\n".join(_separate_tables(lines))


def _section(name: str, path: Path, doc: dict[str, Any], relative_to: Path) -> list[str]:
    """One JSON file's part of its module's section."""
    lines = [f"`{path.name}`: {_machine(doc)}.", ""]
    lines += RENDERERS[name](doc)
    notes = doc.get("notes", [])
    if "timing_note" in doc:
        notes = [*notes, doc["timing_note"]]
    if notes:
        lines += [""] + [f"- {note}" for note in notes]
    warnings = doc.get("warnings", [])
    lines += [""] + [f"- {warning}" for warning in warnings] if warnings else []
    failures = check_failures(doc)
    if failures:
        lines += ["", "**FAILED CHECKS**: these timed results differ from stock's; their figures mean nothing:", ""]
        lines += [f"- {failure}" for failure in failures]
    elif name in CHECKED_MODULES and not _any_check(doc):
        lines += ["", f"- checks: none recorded: {UNCHECKED}"]
    png = path.with_suffix(".png")
    if png.exists():
        lines += ["", f"![{name}]({Path(os.path.relpath(png, relative_to)).as_posix()})"]
    lines.append("")
    return lines


def redraw(folder: Path) -> list[Path]:
    """Draws each module's PNG again from its JSON in ``folder`` with the current plotting code."""
    import importlib

    from benchmarks.common import CPU_SMALL_NOTE, describe_environment

    drawn = []
    for name, path, doc in ((name, *entry) for name, entries in load(folder).items() for entry in entries):
        module = importlib.import_module(f"benchmarks.bench_{name}")
        title = f"{name}: {describe_environment(doc['environment'])}"
        if doc["mode"] != "gpu":
            title += f"\n{CPU_SMALL_NOTE}"
        if module.plot(doc, path.with_suffix(".png"), title):
            drawn.append(path.with_suffix(".png"))
    return drawn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="folder of the JSON (and PNG) files, e.g. benchmarks/published")
    parser.add_argument("--relative-to", type=Path, help="folder the image links start from (default: its parent)")
    parser.add_argument("--redraw", action="store_true", help="draw the PNG files again from the JSON first")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    if args.redraw:
        for path in redraw(args.folder):
            print(f"drew {path}", file=sys.stderr)
    sys.stdout.write(render(args.folder, args.relative_to))
    return 0


if __name__ == "__main__":
    sys.exit(main())
