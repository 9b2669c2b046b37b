"""The benchmark parameter sets match the models they stand for, and the runner works end to end at tiny size."""

import importlib.util
import json
import math

import pytest
import torch

import ampkernels
from benchmarks.param_sets import CPU_SHRINK, GRAD_MAGNITUDE, PARAM_SETS, make_params, num_params

# (tensors, params) of named_parameters() of the models in shared/REFERENCE.md.
EXPECTED_SIZES = {
    "bert-base": (202, 109_514_298),
    "gpt2-medium": (292, 354_823_168),
    "llama-1b": (201, 1_261_529_088),
    "many-small": (10_000, 10_240_000),
}


@pytest.mark.parametrize("set_name", EXPECTED_SIZES)
def test_param_set_matches_the_model(set_name):
    shapes = PARAM_SETS[set_name]()
    assert (len(shapes), num_params(shapes)) == EXPECTED_SIZES[set_name]


@pytest.mark.parametrize("set_name", EXPECTED_SIZES)
def test_cpu_small_set_keeps_the_layers_and_shrinks_the_params(set_name):
    shapes = PARAM_SETS[set_name](CPU_SHRINK)
    full_tensors, _ = EXPECTED_SIZES[set_name]
    if set_name == "many-small":
        assert len(shapes) == full_tensors // CPU_SHRINK
    else:
        assert len(shapes) == full_tensors
    assert 1_000_000 <= num_params(shapes) <= 25_000_000


def test_make_params_gives_scaled_random_grads():
    params = make_params([(64, 32), (7,)], "cpu", seed=3)
    again = make_params([(64, 32), (7,)], "cpu", seed=3)
    assert all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float32 for p in params)
    assert [p.shape for p in params] == [torch.Size([64, 32]), torch.Size([7])]
    assert all(bool((p.grad != 0).all()) for p in params)
    assert abs(params[0].grad.std().item() / GRAD_MAGNITUDE - 1.0) < 0.1
    assert all(torch.equal(a.grad, b.grad) and torch.equal(a, b) for a, b in zip(params, again))


def test_runner_rejects_unknown_sets():
    pytest.importorskip("tqdm")
    from benchmarks.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--sets", "bert-base,no-such-set"])


def test_runner_smoke(tmp_path):
    pytest.importorskip("tqdm")
    try:
        from ampkernels import FusedGradScaler  # noqa: F401
    except ImportError as error:
        pytest.skip(f"ampkernels.FusedGradScaler cannot be imported: {error}")
    from benchmarks import bench_grad_scaler
    from benchmarks.__main__ import main

    args = ["--only", "grad_scaler", "--quick", "--sets", "many-small", "--shrink", "64", "--no-plot"]
    assert main([*args, "--out", str(tmp_path)]) == 0

    (json_path,) = tmp_path.glob("grad_scaler_*.json")
    assert not list(tmp_path.glob("*.png"))
    document = json.loads(json_path.read_text())
    on_cpu = not torch.cuda.is_available()
    assert document["mode"] == ("cpu-small" if on_cpu else "gpu")
    assert (document["mode_note"] is not None) == on_cpu
    assert document["copy_bandwidth"]["gbs"] > 0
    assert {"device_name", "torch", "triton", "cuda", "date"} <= document["environment"].keys()
    assert document["warnings"] == []
    assert document["param_sets"]["many-small"]["num_tensors"] == 10_000 // 64

    rows = document["rows"]
    assert [(row["case"], row["implementation"]) for row in rows[:5]] == [
        ("unscale_", "stock"),
        ("unscale_", "ampkernels"),
        ("unscale_+clip", "stock"),
        ("unscale_+clip", "ampkernels"),
        ("unscale_+clip", "ampkernels-deferred"),
    ]
    phase = [row["implementation"] for row in rows[5:]]
    assert all(row["case"] == "post-backward" for row in rows[5:])
    assert phase[:3] == ["stock", "ampkernels", "stock-sync-free"]
    assert ("ampkernels+FusedAdamW" in phase) == hasattr(ampkernels, "FusedAdamW")
    assert any(name.endswith("graphed") for name in phase) == torch.cuda.is_available()
    assert all(row["wall_ms"] > 0 and row["x_floor"] > 0 and row["repeats"] == 3 for row in rows)
    assert [row["speedup_over_stock"] is None for row in rows] == [False] * 4 + [True] + [False] * len(phase)
    assert all(row["speedup_over_stock"] == 1.0 for row in rows if row["implementation"] == "stock")
    assert "many-small" in bench_grad_scaler.report(document)

    if importlib.util.find_spec("matplotlib") is not None:
        png_path = tmp_path / "plot.png"
        assert bench_grad_scaler.plot(document, png_path, "smoke")
        assert png_path.stat().st_size > 0


def test_training_benchmark_smoke(tmp_path):
    """The end-to-end benchmark runs its CPU-sized MLP for every eager recipe and the 200-step numerics run."""
    pytest.importorskip("tqdm")
    from benchmarks import bench_training
    from benchmarks.__main__ import main

    # On the CPU also where a GPU is present: the GPU-sized run (BERT-base, ...) is the benchmark itself, not a test.
    assert main(["--only", "training", "--quick", "--device", "cpu", "--out", str(tmp_path), "--no-plot"]) == 0
    (json_path,) = tmp_path.glob("training_*.json")
    document = json.loads(json_path.read_text())
    recipes = {row["recipe"] for row in document["rows"] if row["model"] == "mlp-800" and "error" not in row}
    expected = set(bench_training.RECIPES) - {"ampkernels-graphed"}
    assert recipes == expected
    versus = document["numerics"]["mlp-800"]["versus_stock"]["ampkernels"]
    assert versus["scale_history_equal"]
    runs = document["numerics"]["mlp-800"]["runs"]
    for run in runs.values():
        assert len(run["loss"]) == bench_training.NUMERICS_STEPS
        assert all(not math.isfinite(run["loss"][step - 1]) for step in bench_training.OVERFLOW_STEPS)
    assert "mlp-800" in bench_training.report(document)


def test_optimizers_benchmark_smoke(tmp_path):
    pytest.importorskip("tqdm")
    from benchmarks import bench_optimizers
    from benchmarks.__main__ import main

    args = ["--quick", "--only", "optimizers", "--sets", "many-small", "--shrink", "64", "--out", str(tmp_path)]
    assert main([*args, "--no-plot"]) == 0
    (json_path,) = tmp_path.glob("optimizers_*.json")
    document = json.loads(json_path.read_text())
    rows = document["rows"]
    assert [row["implementation"] for row in rows] == ["stock-fused", "stock-foreach", "ampkernels"]
    assert all(row["wall_ms"] > 0 and 0 < row["pct_of_copy"] and row["num_tensors"] == 10_000 // 64 for row in rows)
    assert rows[0]["speedup_over_stock"] == 1.0
    assert "many-small" in bench_optimizers.report(document)
