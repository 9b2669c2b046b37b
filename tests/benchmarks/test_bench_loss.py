"""The loss benchmark on the CPU: every implementation runs, its loss and gradients are checked against stock's,
and a wrong gradient fails the check."""

import json

import pytest
import torch

from benchmarks import bench_loss, report


def test_cpu_run_checks_ours_against_stock(tmp_path):
    pytest.importorskip("tqdm")
    from benchmarks.__main__ import main

    assert main(["--only", "loss", "--device", "cpu", "--out", str(tmp_path), "--no-plot"]) == 0
    (path,) = tmp_path.glob("loss_*.json")
    document = json.loads(path.read_text())
    ours = [r for r in document["rows"] if r["implementation"] == "ampkernels"]
    assert len(ours) == len(bench_loss.CPU_SHAPES)
    assert all(r["check"] == "ok" and r["speedup_over_stock"] > 0 and r["peak_gib"] is None for r in ours)
    assert "## " + report.TITLES["loss"] in report.render(tmp_path)


def test_a_wrong_gradient_fails_the_check():
    h, w, t = bench_loss._inputs((64, 16, 50), torch.device("cpu"))
    results = {}
    for name, fn in (("stock", bench_loss._stock), ("ampkernels", bench_loss._ours)):
        loss = bench_loss._step(fn, h, w, t)
        results[name] = [loss, h.grad.clone(), w.grad.clone()]
    assert bench_loss._check(results, "ampkernels") == "ok"
    results["ampkernels"][2] = results["ampkernels"][2] * 1.2
    assert bench_loss._check(results, "ampkernels").startswith("FAILED: weight grad")
