"""The model zoo benchmark: every model builds and trains at tiny size on the CPU, the recipes compared with each
other run the same steps, and a loss that departs from stock's is reported as a failed check."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from benchmarks import bench_models


def _ctx(**overrides):
    lines = []  # what the module wrote beside the bar (tqdm.write), kept for the test
    progress = SimpleNamespace(
        reset=lambda total: None,
        set_postfix_str=lambda s: None,
        update=lambda: None,
        write=lambda s, **kwargs: lines.append(s),
        lines=lines,
    )
    ctx = dict(device=torch.device("cpu"), repeats=1, target_loop_s=0.0, progress=progress, full=False, models=None)
    ctx["recipes"] = None
    ctx.update(overrides)
    return SimpleNamespace(**ctx, cpu_small=ctx["device"].type == "cpu", only="models")


@pytest.mark.parametrize("name", list(bench_models.MODELS))
def test_every_zoo_model_builds_small_and_its_loss_is_finite(name):
    if bench_models._why_not(name) is not None:
        pytest.skip(bench_models._why_not(name))
    torch.manual_seed(0)
    model = bench_models.MODELS[name][0](True)
    loss = model.loss_fn(model.module, *model.batch_of(0))
    assert loss.ndim == 0 and math.isfinite(loss.item())
    assert model.per_batch > 0 and model.unit in ("tokens", "images")


def test_default_cpu_run_compares_each_recipe_with_stock():
    pytest.importorskip("transformers")
    pytest.importorskip("torchvision")
    ctx = _ctx()
    document = bench_models.run(ctx)
    rows = document["rows"]
    # each row went to stderr as it was measured, for a run cut short
    written = [json.loads(line.removeprefix("row ")) for line in ctx.progress.lines if line.startswith("row ")]
    assert sorted((r["model"], r["recipe"]) for r in written) == sorted((r["model"], r["recipe"]) for r in rows)
    assert {r["model"] for r in rows} == set(bench_models.DEFAULT_MODELS)
    for row in rows:
        assert "error" not in row, row
        assert math.isfinite(row["final_loss"])
        if row["recipe"] == "bf16-ampkernels":
            assert row["check"] == "ok" and row["speedup_over_stock"] > 0
    # every recipe of a model ran the same steps on the same batches
    assert len(set(document["iterations"].values())) >= 1
    assert bench_models.failures(document) == []
    assert "bf16-ampkernels against bf16-stock" in "\n".join(bench_models.summary(document))


def test_a_loss_away_from_stock_fails_the_check():
    recipe = bench_models.BY_NAME["fp16-ampkernels"]
    baseline = {"recipe": "fp16-stock", "step_ms": 10.0, "final_loss": 6.0}
    close = {"step_ms": 9.0, "final_loss": 6.0 * (1 + 0.5 * bench_models.LOSS_RTOL)}
    far = {"step_ms": 9.0, "final_loss": 6.0 * (1 + 3 * bench_models.LOSS_RTOL)}
    bench_models._check(close, baseline, recipe)
    bench_models._check(far, baseline, recipe)
    assert close["check"] == "ok" and close["speedup_over_stock"] == pytest.approx(10 / 9)
    assert far["check"].startswith("FAILED")
    nan = {"step_ms": 9.0, "final_loss": float("nan")}
    bench_models._check(nan, baseline, recipe)
    assert nan["check"].startswith("FAILED")
    document = {"rows": [{"model": "m", "recipe": "fp16-ampkernels", **far}], "skipped": {}}
    assert bench_models.failures(document) and "CHECK FAILED" in "\n".join(bench_models.summary(document))


def test_unknown_model_is_refused_by_name():
    with pytest.raises(ValueError, match="--models: unknown"):
        bench_models._models(_ctx(models=["resnet-51"]))


def test_warmup_losses_are_checked_tightly_and_the_final_one_against_the_first():
    recipe = bench_models.BY_NAME["fp16-ampkernels"]
    baseline = {"recipe": "fp16-stock", "step_ms": 10.0, "warmup_losses": [7.0, 6.9, 6.8], "final_loss": 0.40}
    # a model that memorized its batches: 3% of the final loss, 0.17% of the first step's
    drifted = {"step_ms": 9.0, "warmup_losses": [7.0, 6.9, 6.8], "final_loss": 0.412}
    bench_models._check(drifted, baseline, recipe)
    assert drifted["check"] == "ok", drifted
    early = {
        "step_ms": 9.0,
        "warmup_losses": [7.0, 6.9, 6.8 * (1 + 3 * bench_models.warmup_loss_rtol(recipe))],
        "final_loss": 0.4,
    }
    bench_models._check(early, baseline, recipe)
    assert early["check"].startswith("FAILED: warm-up loss"), early
    bf16 = bench_models.BY_NAME["bf16-ampkernels"]  # bf16's rounding unit: 8x fp16's
    assert bench_models.warmup_loss_rtol(bf16) == 8 * bench_models.warmup_loss_rtol(recipe) == 2**-7
    drifted_bf16 = {"step_ms": 9.0, "warmup_losses": [7.0, 6.9, 6.8 * (1 + 3.4e-3)], "final_loss": 0.4}
    bench_models._check(drifted_bf16, {**baseline, "recipe": "bf16-stock"}, bf16)
    assert drifted_bf16["check"] == "ok", drifted_bf16
    late = {"step_ms": 9.0, "warmup_losses": [7.0, 6.9, 6.8], "final_loss": 0.4 + 2 * bench_models.LOSS_RTOL * 7.0}
    bench_models._check(late, baseline, recipe)
    assert late["check"].startswith("FAILED: loss"), late


def test_a_pair_that_does_not_fit_side_by_side_is_timed_one_after_the_other(monkeypatch):
    pytest.importorskip("torchvision")
    build = bench_models._build
    calls = []

    def build_one_at_a_time(name, recipe, ctx):
        calls.append(recipe.name)
        if len(calls) == 2:  # the second recipe of the pair, built beside the first
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return build(name, recipe, ctx)

    monkeypatch.setattr(bench_models, "_build", build_one_at_a_time)
    group = [bench_models.BY_NAME["bf16-stock"], bench_models.BY_NAME["bf16-ampkernels"]]
    rows, iterations = bench_models._time_group("resnet-50", group, _ctx(), None)
    assert [r["recipe"] for r in rows] == ["bf16-stock", "bf16-ampkernels"]
    assert all(r["alternated"] is False and math.isfinite(r["final_loss"]) for r in rows) and iterations == 1
    assert calls == ["bf16-stock", "bf16-ampkernels", "bf16-stock", "bf16-ampkernels"]


def test_everything_through_a_framework_runs_on_the_llama_model_only():
    full = _ctx(device=torch.device("cpu"), full=True)
    everything = {"stock-trainer-bf16", "ampkernels-trainer-fp8-8bit", "stock-lightning-bf16"}
    everything.add("ampkernels-lightning-fp8-8bit")
    assert everything <= {r.name for r in bench_models._recipes_of("llama-1b", full)}
    assert not everything & {r.name for r in bench_models._recipes_of("bert-base", full)}
    ours = bench_models.BY_NAME["ampkernels-trainer-fp8-8bit"]
    assert ours.float8 and ours.moments == "8bit" and ours.baseline == "stock-trainer-bf16"
    assert ("stock-lightning-bf16", "ampkernels-lightning-fp8-8bit") in bench_models.PAIRS


def test_framework_rows_check_their_last_step_relative_to_the_first():
    """Framework rows keep every step's loss: the last is compared with stock's, relative to stock's first."""
    recipe = bench_models.BY_NAME["ampkernels-trainer-fp8-8bit"]
    baseline = {"recipe": "stock-trainer-bf16", "step_ms": 10.0, "step_losses": [10.0, 8.0, 4.0], "final_loss": 4.0}
    close = {"step_ms": 9.0, "step_losses": [10.0, 8.1, 4.05], "final_loss": 4.05}  # 0.5% of the first loss
    far = {"step_ms": 9.0, "step_losses": [10.0, 8.1, 4.2], "final_loss": 4.2}  # 2% of it (5% of the last)
    bench_models._check(close, baseline, recipe)
    bench_models._check(far, baseline, recipe)
    assert close["check"] == "ok" and close["loss_rel_diff"] == pytest.approx(0.005)
    assert far["check"].startswith("FAILED: loss") and far["loss_rel_diff"] == pytest.approx(0.02)


def test_recipes_named_run_with_their_baselines():
    ctx = _ctx(full=True, recipes=["ampkernels-trainer-fp8-8bit"])
    assert [r.name for r in bench_models._recipes_of("llama-1b", ctx)] == [
        "stock-trainer-bf16",
        "ampkernels-trainer-fp8-8bit",
    ]
    assert bench_models._recipes_of("bert-base", ctx) == []  # (a Llama-only recipe)
    with pytest.raises(ValueError, match="--recipes: unknown"):
        bench_models._recipes_of("llama-1b", _ctx(recipes=["no-such-recipe"]))
