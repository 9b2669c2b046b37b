"""The precision benchmark on tiny CPU models, its clean skip without transformers/torchvision, and the generated
result tables (benchmarks/README.md must be what benchmarks.report prints for the published JSON)."""

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks import report

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "benchmarks" / "published"
HAS_MODEL_PACKAGES = all(importlib.util.find_spec(name) for name in ("transformers", "torchvision"))


def test_results_readme_is_generated_from_the_published_json():
    rendered = report.render(PUBLISHED)
    assert (ROOT / "benchmarks" / "README.md").read_text() == rendered, (
        "benchmarks/README.md is out of date: python -m benchmarks.report benchmarks/published > benchmarks/README.md"
    )
    documents = report.load(PUBLISHED)  # module -> [(path, document)], one per GPU measured
    assert {"grad_scaler", "optimizers", "training", "scaled_matmul"} <= documents.keys()
    for name in documents:
        assert f"## {report.TITLES[name]}" in rendered
    for link in (line for line in rendered.splitlines() if line.startswith("![")):
        assert (ROOT / "benchmarks" / link.split("(")[1].rstrip(")")).is_file(), link


def test_report_command_prints_the_tables(capsys):
    assert report.main([str(PUBLISHED)]) == 0
    assert capsys.readouterr().out == report.render(PUBLISHED)
    with pytest.raises(SystemExit):
        report.main([str(PUBLISHED / "no-such-folder")])


def _run_precision(tmp_path, plot=False):
    pytest.importorskip("tqdm")
    from benchmarks.__main__ import main

    args = ["--only", "precision", "--device", "cpu", "--out", str(tmp_path)]
    assert main(args if plot else [*args, "--no-plot"]) == 0
    (json_path,) = tmp_path.glob("precision_*.json")
    return json.loads(json_path.read_text())


@pytest.mark.skipif(not HAS_MODEL_PACKAGES, reason="needs transformers and torchvision")
def test_precision_benchmark_on_tiny_cpu_models(tmp_path):
    from benchmarks import bench_precision

    document = _run_precision(tmp_path, plot=importlib.util.find_spec("matplotlib") is not None)
    assert document["skipped"] == {}
    rows = document["rows"]
    assert [(row["model"], row["recipe"]) for row in rows] == [
        (bench_precision.model_name(model, cpu_small=True), recipe)
        for model in bench_precision.MODELS
        for recipe in bench_precision.CPU_RECIPES
    ]
    assert all("error" not in row for row in rows), [row.get("error") for row in rows]
    assert all(row["step_ms"] > 0 and row["peak_memory_gib"] is None for row in rows)
    assert all(row["final_loss"] == row["final_loss"] and row["final_loss"] > 0 for row in rows)  # finite
    assert [row["speedup_over_fp32"] == 1.0 for row in rows] == [row["recipe"] == "fp32" for row in rows]
    # stock and ampkernels of one precision are timed alternately, the same loop length and repeat count
    pair = [row for row in rows if row["recipe"] in ("bf16-stock", "bf16-ampkernels")]
    assert [row["alternated"] for row in rows] == [row in pair for row in rows]
    assert all(len(row["step_ms_per_repeat"]) == len(pair[0]["step_ms_per_repeat"]) for row in pair)
    table = bench_precision.report(document)
    assert "batch 4 x seq 32" in table and "batch 8 at 32 x 32" in table
    assert "ref ms" not in table and "TF32" not in table  # no GPU reference or GPU recipe on the CPU
    summary = bench_precision.summary(document)
    assert any(line.startswith("bert-tiny step time over FP32") for line in summary)
    assert any(line.startswith("resnet-18 BF16 against stock") for line in summary)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "precision_cpu.png").stat().st_size > 0
        (tmp_path / "precision_cpu.png").unlink()
        assert report.redraw(tmp_path) == [tmp_path / "precision_cpu.png"]
    rendered = report.render(tmp_path)
    assert "## " + report.TITLES["precision"] in rendered and "reference ms" not in rendered


def test_precision_benchmark_skips_a_model_whose_package_is_missing(tmp_path, monkeypatch):
    from benchmarks import bench_precision

    monkeypatch.setattr(
        bench_precision, "MODELS", {"bert-base": (bench_precision._bert, "no_such_package_for_the_test")}
    )
    document = _run_precision(tmp_path)
    assert document["rows"] == []
    assert "no_such_package_for_the_test is not installed" in document["skipped"]["bert-base"]
    assert "skipped bert-base" in bench_precision.report(document)
    assert bench_precision.plot(document, tmp_path / "none.png", "empty") is False


def test_precision_reference_rows_render_on_a_gpu_document():
    """The GPU layout of the table (reference columns beside ours), on a document shaped like a GPU run's."""
    from benchmarks import bench_precision

    rows = [
        {"model": "bert-base", "recipe": "fp32", "label": "FP32", "step_ms": 200.0, "peak_memory_gib": 16.0},
        {"model": "bert-base", "recipe": "fp16-stock", "label": "FP16", "step_ms": 50.0, "peak_memory_gib": 12.0},
        {"model": "bert-base", "recipe": "fp16-ampkernels-graphed", "label": "graphed", "error": "RuntimeError: x"},
    ]
    for row in rows[:2]:
        row.update(description="BertForMaskedLM", speedup_over_fp32=200.0 / row["step_ms"])
    document = {
        "mode": "gpu",
        "rows": rows,
        "skipped": {},
        "reference": bench_precision.REFERENCE,
        "differences_from_reference": ["GPU: X here, NVIDIA H200 for the reference"],
        "notes": [],
    }
    table = bench_precision.report(document)
    assert "278.7" in table and "56.4" in table and f"{278.7 / 56.4:.2f}x" in table and "RuntimeError" in table
    assert bench_precision.REFERENCE["label"] in table
    lines = report.precision(document)
    assert any("| 278.7 |" in line for line in lines) and any("failed: RuntimeError" in line for line in lines)
