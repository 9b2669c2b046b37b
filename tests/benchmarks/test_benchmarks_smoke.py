"""The benchmark parameter sets match the models they stand for, the runner picks the default subset or the full
sweep, and every module works end to end at tiny size on the CPU."""

import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

import ampkernels
from benchmarks.param_sets import CPU_SHRINK, GRAD_MAGNITUDE, PARAM_SETS, make_params, num_params

GITIGNORE = Path(__file__).resolve().parents[2] / ".gitignore"

# (tensors, params) of named_parameters() of BertForMaskedLM(BertConfig()), GPT2LMHeadModel(n_embd=1024, n_layer=24),
# a Llama-shaped 1B model (hidden 2048, intermediate 5632, 22 layers, vocab 32000), Llama-3.2-1B's layers (hidden 2048,
# intermediate 8192, 16 layers, k/v 512 wide) with vocab 32000 and an untied head, and 10,000 tensors of 1024.
EXPECTED_SIZES = {
    "bert-base": (202, 109_514_298),
    "gpt2-medium": (292, 354_823_168),
    "llama-1b": (201, 1_261_529_088),
    "llama-3.2-1b": (147, 1_104_218_112),
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


def test_runner_rejects_unknown_sets(capsys):
    pytest.importorskip("tqdm")
    from benchmarks.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--sets", "bert-base,no-such-set"])
    assert "unknown parameter sets ['no-such-set']" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # nothing named: said so, not "unknown parameter sets []"
        parse_args(["--sets", " , "])
    assert "--sets names no parameter set; choose from bert-base," in capsys.readouterr().err


def test_default_run_is_the_subset_and_full_the_sweep():
    pytest.importorskip("tqdm")
    from benchmarks import __main__ as runner

    default = runner.parse_args([])
    assert not default.full and default.sets == list(runner.DEFAULT_SETS)
    assert runner.selected_modules(default) == list(runner.DEFAULT_MODULES)
    assert "bench_precision" not in runner.DEFAULT_MODULES

    full = runner.parse_args(["--full"])
    assert full.full and full.sets == list(PARAM_SETS)
    assert runner.selected_modules(full) == list(runner.BENCHMARK_MODULES)
    assert set(runner.DEFAULT_MODULES) < set(runner.BENCHMARK_MODULES)

    assert runner.selected_modules(runner.parse_args(["--only", "precision"])) == ["bench_precision"]
    assert runner.parse_args(["--full", "--sets", "llama-1b"]).sets == ["llama-1b"]
    # User runs write outside the package, into a folder that .gitignore names.
    assert not runner.DEFAULT_OUT.is_absolute() and "benchmarks" not in runner.DEFAULT_OUT.parts
    assert any(line.strip("/") == runner.DEFAULT_OUT.name for line in GITIGNORE.read_text().splitlines())


def test_default_subsets_of_training_and_scaled_matmul():
    from benchmarks import bench_scaled_matmul, bench_training

    models, recipes = list(bench_training.MODELS), list(bench_training.RECIPES)
    numerics = list(bench_training.NUMERICS_RECIPES)
    default = bench_training._jobs(models, recipes, numerics, cuda=True, full=False)
    full = bench_training._jobs(models, recipes, numerics, cuda=True, full=True)
    timed = {(model, recipe) for kind, model, recipe in default if kind == "time"}
    assert timed == {(model, recipe) for model in models for recipe in recipes}
    assert {model for kind, model, _ in default if kind == "numerics"} == {bench_training.DEFAULT_NUMERICS_MODELS[0]}
    assert not any(kind == "profile" for kind, _, _ in default)
    assert set(default) < set(full) and any(kind == "profile" for kind, _, _ in full)
    eager = [recipe for recipe in recipes if not recipe.endswith("graphed")]
    cpu_default = bench_training._jobs(["mlp-800"], eager, numerics[:3], cuda=False, full=False)
    assert {model for kind, model, _ in cpu_default if kind == "numerics"} == {"mlp-800"}

    every_case = bench_scaled_matmul._cases(cpu_small=False)
    default_cases = bench_scaled_matmul._cases(cpu_small=False, full=False)
    assert len(default_cases) == len(bench_scaled_matmul.DEFAULT_CASES) and set(default_cases) < set(every_case)
    assert bench_scaled_matmul._cases(cpu_small=True, full=False) == bench_scaled_matmul._cases(cpu_small=True)


def test_grouped_bars_leave_out_empty_series(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.common import plot_grouped_bars

    panels = {
        "a": (["x", "y"], {"stock": [1.0, 2.0], "graphed": [None, None], "ours": [0.5, None]}),
        "b": (["x"], {"stock": [None], "graphed": [None], "ours": [None]}),
    }
    assert plot_grouped_bars(tmp_path / "bars.png", "a title " * 40, panels, "ms")
    assert (tmp_path / "bars.png").stat().st_size > 0


def test_environment_date_is_utc():
    from benchmarks.common import environment_info

    assert environment_info(torch.device("cpu"))["date"].endswith("+00:00")


def test_runner_smoke(tmp_path, capsys):
    pytest.importorskip("tqdm")
    from benchmarks import bench_grad_scaler
    from benchmarks.__main__ import main

    args = ["--only", "grad_scaler", "--quick", "--sets", "many-small", "--shrink", "64", "--no-plot"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    summary = printed.split("== summary")[1]
    assert "grad_scaler: many-small post-backward phase" in summary
    if not torch.cuda.is_available():
        assert "CUDA" not in printed and "GPU" not in printed.replace("not comparable to GPU figures", "")

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
    # What was timed was checked against stock after the loops: ours "ok", stock (the yardstick) unchecked.
    stock_recipes = bench_grad_scaler.STOCK_RECIPES
    assert all((row["check"] is None) == (row["implementation"] in stock_recipes) for row in rows)
    assert all(row["check"] == "ok" for row in rows if row["implementation"] not in stock_recipes)
    best = [row["speedup_over_best_stock"] for row in rows if row["implementation"] == "ampkernels+FusedAdamW"]
    assert best and all(ratio > 0 for ratio in best)
    table = bench_grad_scaler.report(document)
    assert "many-small" in table
    if on_cpu:  # cache-resident sizes: no copy-bandwidth figures, and no GPU wording
        header = table.splitlines()[0]
        assert "x floor" not in header and "device ms" not in header and "CUDA" not in table

    if importlib.util.find_spec("matplotlib") is not None:
        png_path = tmp_path / "plot.png"
        assert bench_grad_scaler.plot(document, png_path, "smoke")
        assert png_path.stat().st_size > 0


def _fake_grad_scaler_module(monkeypatch, ran: list):
    """Stands a tiny module in for bench_grad_scaler (and a fixed copy bandwidth in for its measurement), so that the
    runner itself is tested in a second: its run writes an interim line through the progress bar, as bench_float8's
    does."""
    pytest.importorskip("tqdm")
    from benchmarks import __main__ as runner

    fake = types.ModuleType("benchmarks.bench_grad_scaler")
    fake.NAME = "grad_scaler"

    def run(ctx):
        ran.append(ctx)
        ctx.progress.write("interim table of the fake module")
        return {"rows": []}

    fake.run = run
    fake.report = lambda document: "final table of the fake module"
    fake.summary = lambda document: ["summary line of the fake module"]
    fake.plot = lambda document, path, title: False
    monkeypatch.setitem(sys.modules, "benchmarks.bench_grad_scaler", fake)
    bandwidth = {"gbs": 1.0, "bytes_per_copy": 8, "ms_per_copy": 1.0}
    monkeypatch.setattr(runner, "measure_copy_bandwidth", lambda *args: bandwidth)
    return runner


def test_runner_keeps_interim_lines_off_stdout(tmp_path, monkeypatch, capsys):
    """Interim output (the float8 module's tables as they finish) goes to stderr with the progress bar: stdout is the
    final report alone, each table once (tqdm.write alone prints to stdout)."""
    ran = []
    runner = _fake_grad_scaler_module(monkeypatch, ran)
    assert runner.main(["--only", "grad_scaler", "--out", str(tmp_path), "--no-plot"]) == 0
    printed = capsys.readouterr()
    assert len(ran) == 1 and "final table of the fake module" in printed.out
    assert "interim table" not in printed.out and "interim table of the fake module" in printed.err


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_runner_refuses_an_unwritable_out_before_running(tmp_path, monkeypatch, capsys, where):
    """An --out that cannot take the results fails at once with a message naming it, not with a traceback after the
    first module has run (minutes into a --full run)."""
    ran = []
    runner = _fake_grad_scaler_module(monkeypatch, ran)
    a_file = tmp_path / "results.txt"
    a_file.write_text("")
    out = a_file if where == "a file" else a_file / "results"
    assert runner.main(["--only", "grad_scaler", "--out", str(out), "--no-plot"]) == 2
    assert ran == [] and f"--out {out}: " in capsys.readouterr().err
    assert a_file.read_text() == ""


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
    expected = {recipe for recipe in bench_training.RECIPES if not recipe.endswith("graphed")}
    assert recipes == expected
    versus = document["numerics"]["mlp-800"]["versus_stock"]["ampkernels"]
    assert versus["scale_history_equal"]
    runs = document["numerics"]["mlp-800"]["runs"]
    for run in runs.values():
        assert len(run["loss"]) == bench_training.NUMERICS_STEPS
        assert all(not math.isfinite(run["loss"][step - 1]) for step in bench_training.OVERFLOW_STEPS)
    assert "mlp-800" in bench_training.report(document)
    assert any(line.startswith("mlp-800 training step") for line in bench_training.summary(document))


def test_optimizers_benchmark_smoke(tmp_path, monkeypatch):
    pytest.importorskip("tqdm")
    from benchmarks import bench_optimizers
    from benchmarks.__main__ import main

    # torchao compiles its step per shape and dtype (a minute on 2 cores): the test takes the path without it.
    monkeypatch.setattr(bench_optimizers, "_import_torchao", lambda: (None, "torchao cannot be imported (test)"))
    args = ["--quick", "--only", "optimizers", "--sets", "many-small", "--shrink", "64", "--out", str(tmp_path)]
    assert main([*args, "--no-plot"]) == 0
    (json_path,) = tmp_path.glob("optimizers_*.json")
    document = json.loads(json_path.read_text())
    rows = document["rows"]
    assert [row["implementation"] for row in rows] == ["stock-fused", "stock-foreach", "ampkernels"]
    assert all(row["wall_ms"] > 0 and 0 < row["pct_of_copy"] and row["num_tensors"] == 10_000 // 64 for row in rows)
    assert rows[0]["speedup_over_stock"] == 1.0
    assert [row["check"] for row in rows] == [None, None, "ok"]
    assert all(error["steps"] > 0 for error in document["param_sets"]["many-small"]["trajectory_error"].values())
    table = bench_optimizers.report(document)
    assert "many-small" in table
    if document["mode"] == "cpu-small":
        assert "% copy" not in table.splitlines()[0] and "x floor" not in table.splitlines()[0]
    assert bench_optimizers.summary(document)[0].startswith("many-small AdamW step: FusedAdamW")

    # --only optimizers adds the low-precision table on llama-3.2-1b, every option but torchao's timed.
    section = document["low_precision"]
    assert (section["set"], section["num_tensors"]) == ("llama-3.2-1b", 147)
    options = bench_optimizers.LOW_PRECISION_OPTIONS
    assert [row["key"] for row in section["rows"]] == [o.key for o in options if o.family != "torchao"]
    assert [s["key"] for s in section["skipped"]] == [o.key for o in options if o.family == "torchao"]
    assert "torchao rows skipped (5): torchao cannot be imported" in table
    # The byte count's state sizes are the measured ones (else a warning says which differs).
    assert section["warnings"] == []
    by = {row["key"]: row for row in section["rows"]}
    assert all(row["wall_ms"] > 0 and row["first_step_ms"] > 0 and row["vs_torchao"] is None for row in by.values())
    assert all(row["check"] == ("ok" if row["family"] == "ampkernels" else None) for row in by.values())
    assert by["torch-fp32"]["vs_torch_fp32"] == 1.0
    assert (by["torch-fp32"]["bytes_per_param"], by["torch-bf16"]["bytes_per_param"]) == (28, 14)
    assert by["ampkernels-bf16-master"]["state_bytes_per_param"] == 12
    state = [by[key]["state_bytes_per_param"] for key in ("ampkernels-fp32", "ampkernels-8bit", "ampkernels-4bit")]
    assert state[0] == 8 and state[0] > state[1] > state[2]
    assert all(bool(row["backend"]) == (row["family"] == "ampkernels") for row in by.values())

    memory = document["training_memory"]
    if "skipped" in memory:  # until benchmarks.models lands
        assert "training-step memory skipped: benchmarks.models.LlamaStack cannot be imported" in table
        with pytest.raises(ImportError):
            from benchmarks.models import LlamaStack  # noqa: F401
    else:
        assert [row["key"] for row in memory["rows"]] == list(bench_optimizers.MEMORY_OPTIONS)
        assert all("error" not in row and row["state_gib"] > 0 for row in memory["rows"])
        assert all((row["peak_gib"] is None) == (document["mode"] == "cpu-small") for row in memory["rows"])


def test_default_run_leaves_out_the_low_precision_table():
    """The default run of every module times only the AdamW step table; the low-precision one needs --only or --full."""
    from benchmarks import bench_optimizers
    from benchmarks.common import RunContext

    class Progress:
        def reset(self, total):
            self.total = total

        def update(self, n):
            pass

    ctx = RunContext(torch.device("cpu"), ["many-small"], 64, 1, 0.001, 10.0, Progress())
    document = bench_optimizers.run(ctx)
    assert "low_precision" not in document and "training_memory" not in document
    assert ctx.progress.total == 1


def test_float8_benchmark_smoke(tmp_path):
    """--only float8 on the CPU: every section runs at its small size, and the report and summary render."""
    pytest.importorskip("tqdm")
    from benchmarks import bench_float8
    from benchmarks.__main__ import main

    assert main(["--only", "float8", "--quick", "--device", "cpu", "--out", str(tmp_path), "--no-plot"]) == 0
    (json_path,) = tmp_path.glob("float8_*.json")
    document = json.loads(json_path.read_text())
    assert document["casts"] and document["fused"] and document["gemms"] and document["layers"]["rows"]
    stack = {row["key"]: row for row in document["stack"]["rows"]}
    expected = {"bf16-eager", "bf16-fused-eager"} | {f"fp8-{recipe}-eager" for recipe in bench_float8.RECIPES}
    expected |= {"bf16-fused-loss-eager", "fp8-tensorwise-fused-loss-eager"}  # the head's loss fused
    assert set(stack) == expected
    assert all("ms" in row and row["losses_finite"] for row in stack.values()), stack
    # Every ampkernels row's losses within 1% of stock bf16 eager's; the FP8 rows took the FP8 path (their losses
    # differ from the bf16 ones: on the CPU the tiny stack's Linears are converted whatever their size).
    assert all(row["check"] == (None if row["stock"] else "ok") for row in stack.values())
    assert stack["fp8-tensorwise-eager"]["losses"] != stack["bf16-fused-eager"]["losses"]
    assert stack["bf16-fused-loss-eager"]["losses"] != stack["bf16-fused-eager"]["losses"]  # another loss path
    checked = document["casts"] + document["fused"] + document["gemms"]
    assert all(row.get("check") in (None, "ok") for row in checked) and any(row.get("check") == "ok" for row in checked)
    report = bench_float8.report(document)
    assert "LlamaStack training step" in report and "One layer" in report and "Fused RMSNorm" in report
    from benchmarks import report as published  # the published table names the torch code each row was timed as

    assert {row["op"]: row["torch_code"] for row in document["fused"]}["rms_norm"] == "F.rms_norm"
    assert "| F.rms_norm |" in "\n".join(published.RENDERERS["float8"](document))
    assert any(line.startswith("Llama stack fp8 tensorwise") for line in bench_float8.summary(document))


def test_float8_recipes_run_the_rows_named_with_their_baselines(tmp_path):
    """--recipes on the float8 benchmark: only the stack rows named and their model's stock bf16 eager (the Hugging
    Face Llama rows without --full), marked partial; an unknown row is refused by name."""
    pytest.importorskip("tqdm")
    pytest.importorskip("transformers")
    from benchmarks import bench_float8
    from benchmarks.__main__ import main

    rows = "fp8-tensorwise-fused-loss-eager,hf-fp8-tensorwise-eager"
    args = ["--only", "float8", "--quick", "--device", "cpu", "--out", str(tmp_path), "--no-plot", "--recipes", rows]
    assert main(args) == 0
    (json_path,) = tmp_path.glob("float8_*.json")
    document = json.loads(json_path.read_text())
    assert document["partial"] and "casts" not in document
    keys = [row["key"] for row in document["stack"]["rows"]]
    assert keys == ["bf16-eager", "fp8-tensorwise-fused-loss-eager", "hf-bf16-eager", "hf-fp8-tensorwise-eager"]
    assert all(row["check"] == (None if row["stock"] else "ok") for row in document["stack"]["rows"])
    assert "LlamaStack training step" in bench_float8.report(document)
    with pytest.raises(ValueError, match="--recipes: unknown"):
        main([*args[:-1], "no-such-row"])
