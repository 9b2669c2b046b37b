"""The benchmarks check what they timed: a wrong result after the timed loops turns the row's ``check`` into
"FAILED: ...", the printed table says FAILED, and ``python -m benchmarks`` exits with status 1. Each check is shown
to pass on correct results and to fail on a deliberately wrong one; their tolerances are the tests' own."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ampkernels import FusedAdamW, FusedGradScaler
from benchmarks import (
    bench_float8,
    bench_grad_scaler,
    bench_optimizers,
    bench_scaled_matmul,
    float8_casts,
    float8_fused,
    float8_gemms,
)
from benchmarks.common import RunContext, check_failures, check_result, failure_lines, mismatch
from benchmarks.param_sets import PARAM_SETS, make_params

SHAPES = [(64, 32), (7,), (3, 5)]
PUBLISHED = Path(__file__).resolve().parents[2] / "benchmarks" / "published"


def _optimizers(seed: int = 0):
    base = make_params(SHAPES, "cpu", seed=seed)
    initial = [p.detach().clone() for p in base]
    optimizers = {}
    for implementation in bench_optimizers.IMPLEMENTATIONS:
        optimizers[implementation] = bench_optimizers._optimizer(
            implementation, bench_optimizers._copies(base) if optimizers else base
        )
    return optimizers, initial


def _step(optimizers, calls):
    for name, optimizer in optimizers.items():
        for _ in range(calls[name]):
            optimizer.step()


CALLS = {"stock-fused": 5, "stock-foreach": 3, "ampkernels": 9}  # as a timed loop leaves them: all different


# ---- the shared pieces ----


def test_tolerances_are_the_tests_own():
    """The benchmarks' tolerances are copies of the tests' (a benchmark cannot import tests/): kept equal here."""
    from tolerances import NORM_RTOL_FLOOR, OPTIMIZER_FP32, TRAINING_LOSS_RTOL

    from tests.optim.test_blockwise_adam import close

    assert bench_optimizers.FP32_TOL == OPTIMIZER_FP32
    assert bench_optimizers.BF16_TOL == close(torch.bfloat16)
    assert bench_optimizers.FP32_BLOCKWISE_TOL == close(torch.float32)
    assert bench_float8.LOSS_TOLERANCE == TRAINING_LOSS_RTOL
    assert bench_grad_scaler.NORM_RTOL_FLOOR == NORM_RTOL_FLOOR


def test_mismatch_names_what_differs_and_nan_fails():
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert mismatch("x", x, x.clone(), rtol=1e-5, atol=1e-6) is None
    y = x.clone()
    y[17] += 1e-3
    found = mismatch("x", y, x, rtol=1e-5, atol=1e-6)
    assert found.startswith("x: 1 of 100 elements") and "flat index 17" in found
    y[17] = math.nan
    assert "flat index 17" in mismatch("x", y, x, rtol=1e-5, atol=1e-6)
    assert "shape" in mismatch("x", x[:5], x, rtol=1e-5, atol=1e-6)


def test_failures_are_found_anywhere_in_a_document_and_printed_under_a_table():
    document = {
        "rows": [{"set": "a", "label": "ours", "check": "ok"}, {"set": "b", "label": "ours", "check": None}],
        "low_precision": {"rows": [{"set": "c", "label": "ours 8-bit", "check": check_result(["exp_avg differs"])}]},
    }
    assert check_failures(document) == ["c / ours 8-bit: FAILED: exp_avg differs"]
    assert failure_lines(document["low_precision"]["rows"]) == check_failures(document)
    assert failure_lines(document["rows"]) == []


# ---- optimizers ----


def test_adamw_check_passes_on_the_timed_state():
    optimizers, initial = _optimizers()
    _step(optimizers, CALLS)
    checks = bench_optimizers._check_adamw(optimizers, CALLS, initial)
    assert checks["ampkernels"] == "ok"
    errors = checks["trajectory_error"]
    assert set(errors) == set(CALLS) and errors["ampkernels"]["steps"] == 9
    assert all(0 <= error[key] < 1 for error in errors.values() for key in ("param", "exp_avg", "exp_avg_sq"))
    assert "stock-foreach" not in optimizers  # freed before the extra step


def test_adamw_check_catches_a_step_that_perturbs_a_parameter(monkeypatch):
    optimizers, initial = _optimizers()
    real_step = FusedAdamW.step

    def wrong_step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].view(-1)[3] += 1e-4
        return out

    monkeypatch.setattr(FusedAdamW, "step", wrong_step)
    _step(optimizers, CALLS)
    check = bench_optimizers._check_adamw(optimizers, CALLS, initial)["ampkernels"]
    assert check.startswith("FAILED: param after 9 steps")
    assert "one more step against torch fused: param of parameter 0: 1 of 2048 elements" in check


def test_adamw_check_catches_wrong_moments_and_step_counts():
    optimizers, initial = _optimizers()
    _step(optimizers, CALLS)
    ours = optimizers["ampkernels"]
    first = ours.param_groups[0]["params"][0]
    assert bench_optimizers.step_count_problems(ours, 10) == ["step counts [9.0], 10 steps taken"]
    ours.state[first]["exp_avg_sq"].view(-1)[0] *= 1.001  # as a kernel writing a wrong moment would leave it
    check = bench_optimizers._check_adamw(optimizers, CALLS, initial)["ampkernels"]
    assert check.startswith("FAILED: exp_avg_sq after 9 steps: ") and "param" not in check


@pytest.mark.parametrize("key", ["ampkernels-8bit", "ampkernels-bf16-sr", "ampkernels-bf16-master"])
def test_low_precision_check_passes_and_catches_a_wrong_step(monkeypatch, key):
    option = next(o for o in bench_optimizers.LOW_PRECISION_OPTIONS if o.key == key)
    shapes = [(64, 128), (7,)]  # a quantized moment (2-D, >= 4096 elements) beside a float32 one

    def stepped():
        params = bench_optimizers._copies(make_params(shapes, "cpu"), option.param_dtype)
        optimizer = bench_optimizers._build(option, params, None)
        for _ in range(4):
            optimizer.step()
        return optimizer

    assert bench_optimizers._check_low_precision(option, stepped(), 4) == "ok"
    optimizer = stepped()
    check = bench_optimizers._check_low_precision(option, optimizer, 5)  # steps it: 5 from here on
    assert check == "FAILED: step counts [4.0], 5 steps taken"
    real_step = FusedAdamW.step

    def wrong_step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        if self is optimizer:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[5] *= 1.5
        return out

    monkeypatch.setattr(FusedAdamW, "step", wrong_step)
    check = bench_optimizers._check_low_precision(option, optimizer, 5)
    assert check == "FAILED: one more step against the reference: param of parameter 0: not bit for bit the reference's"
    stock = next(o for o in bench_optimizers.LOW_PRECISION_OPTIONS if o.key == "torch-fp32")
    assert bench_optimizers._check_low_precision(stock, optimizer, 4) is None  # stock is the yardstick


# ---- grad_scaler ----


def _tiny_grad_scaler(monkeypatch, tmp_path=None):
    monkeypatch.setitem(PARAM_SETS, "tiny", lambda shrink=1: [(64, 32), (7,), (3, 5)])

    class Progress:
        def update(self, n=1):
            pass

        def set_postfix_str(self, text):
            pass

    return RunContext(torch.device("cpu"), ["tiny"], 1, 1, 0.001, 1.0, Progress())


def test_grad_scaler_checks_pass_on_correct_results(monkeypatch):
    rows, info = bench_grad_scaler._bench_param_set(_tiny_grad_scaler(monkeypatch), "tiny")
    checks = {row["implementation"] + " " + row["case"]: row["check"] for row in rows}
    ours = {name: check for name, check in checks.items() if not name.startswith("stock")}
    assert ours and all(check == "ok" for check in ours.values()), ours
    assert all(check is None for name, check in checks.items() if name.startswith("stock"))
    assert set(info["scales_after_timing"].values()) == {1.0}


def _wrong_exp_avg(monkeypatch):
    """FusedAdamW.step, made to write a wrong first moment."""
    real_step = FusedAdamW.step

    def wrong_step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        first = self.param_groups[0]["params"][0]
        self.state[first]["exp_avg"].view(-1)[0] += 1.0
        return out

    monkeypatch.setattr(FusedAdamW, "step", wrong_step)


def test_grad_scaler_check_catches_a_wrong_optimizer_step(monkeypatch):
    _wrong_exp_avg(monkeypatch)
    rows, _ = bench_grad_scaler._bench_param_set(_tiny_grad_scaler(monkeypatch), "tiny")
    phase = {row["implementation"]: row["check"] for row in rows if row["case"] == "post-backward"}
    assert phase["ampkernels+FusedAdamW"].startswith("FAILED: exp_avg after ")
    assert phase["ampkernels"] == "ok"  # torch's fused AdamW under FusedGradScaler
    table = bench_grad_scaler.report({"mode": "cpu-small", "rows": rows, "param_sets": {}, "notes": [], "warnings": []})
    row_line = next(line for line in table.splitlines() if "clip_grad_norm_ + FusedAdamW step + update" in line)
    assert row_line.endswith("FAILED")
    assert "tiny / post-backward / clip_grad_norm_ + FusedAdamW step + update: FAILED: exp_avg after" in table


def test_grad_scaler_check_catches_a_scale_that_differs_from_stocks(monkeypatch):
    monkeypatch.setattr(FusedGradScaler, "get_scale", lambda self: 2.0)
    rows, _ = bench_grad_scaler._bench_param_set(_tiny_grad_scaler(monkeypatch), "tiny")
    phase = {row["implementation"]: row["check"] for row in rows if row["case"] == "post-backward"}
    assert "scale 2.0 after the loops, stock's 1.0" in phase["ampkernels"]
    assert "after an inf gradient the scale is 2.0, stock's 32768.0" in phase["ampkernels"]


def test_grad_scaler_real_scale_check_catches_wrong_unscale_clip_and_backoff(monkeypatch):
    grads = [p.grad for p in make_params([(64, 32), (7,)], "cpu")]
    found = bench_grad_scaler._real_scale_problems(grads, torch.device("cpu"))
    assert found == {"unscale": [], "clip": [], "overflow": []}
    real_unscale, real_clip = FusedGradScaler.unscale_, FusedGradScaler.clip_grad_norm_

    def wrong_unscale(self, optimizer):
        real_unscale(self, optimizer)
        optimizer.param_groups[0]["params"][-1].grad.mul_(1 + 2**-20)

    def wrong_clip(self, optimizer, max_norm, *args, **kwargs):
        return real_clip(self, optimizer, max_norm, *args, **kwargs) * 1.001

    monkeypatch.setattr(FusedGradScaler, "unscale_", wrong_unscale)
    monkeypatch.setattr(FusedGradScaler, "clip_grad_norm_", wrong_clip)
    monkeypatch.setattr(FusedGradScaler, "update", lambda self, new_scale=None: None)  # never backs off
    found = bench_grad_scaler._real_scale_problems(grads, torch.device("cpu"))
    assert found["unscale"] == ["unscale_ at scale 2^16: 1 gradients differ from stock's (first 1)"]
    assert (
        found["clip"][0].startswith("clip_grad_norm_ at scale 2^16 norm") and "clipped gradient 0" in found["clip"][1]
    )
    assert found["overflow"] == ["after an inf gradient the scale is 65536.0, stock's 32768.0"]


def test_runner_exits_non_zero_and_says_failed(monkeypatch, tmp_path, capsys):
    pytest.importorskip("tqdm")
    from benchmarks.__main__ import main

    _tiny_grad_scaler(monkeypatch)
    _wrong_exp_avg(monkeypatch)
    args = ["--only", "grad_scaler", "--quick", "--sets", "tiny", "--no-plot", "--out", str(tmp_path)]
    assert main(args) == 1
    out = capsys.readouterr()
    assert "== FAILED CHECKS: these timed results differ from stock's ==" in out.out
    failed = "grad_scaler: tiny / post-backward / clip_grad_norm_ + FusedAdamW step + update: FAILED: exp_avg after"
    assert failed in out.out and failed in out.err
    (json_path,) = tmp_path.glob("grad_scaler_*.json")
    rows = json.loads(json_path.read_text())["rows"]
    own = next(row for row in rows if row["implementation"] == "ampkernels+FusedAdamW")
    assert own["check"].startswith("FAILED: exp_avg after")


# ---- scaled_matmul and the FP8 modules ----


def test_scaled_matmul_check():
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(48, 48, generator=gen).to(torch.float16) for _ in range(2))
    scale = torch.tensor(0.73)
    variants = {
        bench_scaled_matmul.CUBLAS: lambda: torch.mm(a, b),
        bench_scaled_matmul.CUBLAS_SCALE: lambda: torch.mm(a, b) * scale,
        "reference": lambda: (a.float() @ b.float() * scale).to(torch.float16),
        "wrong": lambda: (a.float() @ b.float() * scale * 1.01).to(torch.float16),
    }
    errors, checks = bench_scaled_matmul._check_case(a, b, scale, variants)
    assert set(errors) == {"cublas_then_scale", "reference", "wrong"} and checks["reference"] == "ok"
    assert checks["wrong"].startswith("FAILED: relative error 1.0")
    assert bench_scaled_matmul.CUBLAS_SCALE not in checks  # the yardstick


def test_float8_loss_check():
    def row(key, losses, stock=False):
        return {"key": key, "label": key, "stock": stock, "losses": losses, "loss_steps": [1, 5, 9]}

    # Gaps relative to stock's first loss (6.0): a memorized batch's last losses are near zero.
    base = row("bf16-eager", [6.0, 5.0, 0.005], stock=True)
    close, off = row("a", [6.0, 5.02, 0.007]), row("b", [6.0, 5.0, 0.1])
    nan, first = row("c", [6.0, math.nan, 0.005]), row("d", [4.1, 5.0, 0.005])
    peer = row("torchao", [6.0, 5.0, 0.755], stock=True)
    for r in (base, close, off, nan, first, peer):
        bench_float8._check_losses(r, base)
    assert base["check"] is None and close["check"] == "ok" and peer["check"] is None
    assert (
        off["check"]
        == "FAILED: loss 0.1 at step 9, stock bf16 eager's 0.005: 1.58% of its first loss apart (at most 1%)"
    )
    assert first["check"].startswith("FAILED: loss 4.1 at step 1, stock bf16 eager's 6: 31.67%")
    assert nan["check"].startswith("FAILED: loss nan at step 5")
    assert peer["max_loss_gap_vs_bf16_eager"] == pytest.approx(0.125)


def test_float8_stack_keeps_the_first_loss_of_a_step_that_reuses_its_output(monkeypatch):
    """A captured step returns one output tensor, which every replay overwrites: the first step's loss is read at
    once, not after the replays that follow it."""
    output = torch.zeros(())

    def build(variant, ctx, config, batch):
        def step(*inputs):
            output.add_(1.0)  # (the replays' output tensor: the loss of step n is n)
            return output

        return step, torch.nn.Linear(1, 1), ()

    monkeypatch.setattr(bench_float8, "_build_stack_step", build)
    ctx = _tiny_grad_scaler(monkeypatch)
    variant = {"key": "fp8-graphed", "label": "graphed", "stock": False}
    row = bench_float8._time_stack_variant(variant, ctx, {}, (1, 1))
    assert row["losses"][0] == 1.0 and row["loss_steps"][0] == 1
    assert row["losses"][1] == row["loss_steps"][1]


def test_float8_cast_check(monkeypatch):
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)).mul_(3.0).to(torch.bfloat16)
    assert set(float8_casts._check_casts(x, ["torch"]).values()) == {
        None
    }  # the reference is not checked against itself
    real = float8_casts._variants

    def variants(x, backend):
        found = real(x, "torch")  # an "other" backend: the reference, one of whose casts gets its scale wrong
        if backend == "torch":
            return found
        wrong = found["row"]
        found["row"] = lambda: (wrong()[0], wrong()[1] * 2)
        return found

    monkeypatch.setattr(float8_casts, "_variants", variants)
    checks = float8_casts._check_casts(x, ["other"])
    assert checks["other:row"] == "FAILED: scale_inv differs from the reference's"
    assert checks["other:tensor"] == "ok" and checks["other:pair"] == "ok"


def test_float8_fused_and_gemm_checks():
    gen = torch.Generator().manual_seed(0)
    exact = torch.randn(32, 32, generator=gen, dtype=torch.float64)
    stock = exact.to(torch.bfloat16)
    good = {"verify": lambda: [("output", stock.clone(), stock, exact)]}
    bad = {"verify": lambda: [("output", (exact * 1.05).to(torch.bfloat16), stock, exact)]}
    assert float8_fused._check(good)[1] == "ok"
    assert float8_fused._check(bad)[1].startswith("FAILED: output: error 4.9")

    a = torch.randn(32, 64, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(48, 64, generator=gen).to(torch.float8_e4m3fn).t()
    sa, sb = torch.tensor(0.8), torch.tensor(1.25)

    def product(factor=1.0):
        return lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16) * factor

    variants = {
        (float8_gemms.SCALED_MM, "tensorwise"): product(),
        ("ampkernels torch", "tensorwise"): product(),
        ("ampkernels wrong", "tensorwise"): product(1.02),
    }
    checks = float8_gemms._check_shape(variants, (a, b, {"tensorwise": (sa, sb)}))
    assert checks[(float8_gemms.SCALED_MM, "tensorwise")]["check"] is None
    assert checks[("ampkernels torch", "tensorwise")]["check"] == "ok"
    assert checks[("ampkernels wrong", "tensorwise")]["check"].startswith("FAILED: relative error 2.0")


# ---- the generated results page and plots ----


def test_published_page_puts_a_blank_line_between_a_table_and_its_caption():
    """Markdown reads a line of text glued under a table as one more row of it."""
    from benchmarks import report

    lines = report.render(PUBLISHED).splitlines()
    glued = [b for a, b in zip(lines, lines[1:]) if a.startswith("|") and b and not b.startswith("|")]
    assert not glued, glued
    assert report._separate_tables(["| a |", "caption", "", "| b |", "| c |"]) == [
        "| a |",
        "",
        "caption",
        "",
        "| b |",
        "| c |",
    ]


def test_cpu_matmul_plot_is_log_scale_and_says_it_is_no_speed_claim(monkeypatch):
    drawn = {}
    monkeypatch.setattr(
        bench_scaled_matmul, "plot_grouped_bars", lambda *args, **kwargs: drawn.update(a=args, k=kwargs)
    )
    rows = [
        {"dtype": "float16", "case": "64x64x64 nn", "implementation": name, "tflops": value}
        for name, value in (("cublas_mm", 1e-3), ("triton", 1e-6))
    ]
    bench_scaled_matmul.plot({"mode": "cpu-small", "rows": rows}, None, "title")
    assert drawn["k"]["log_scale"] and bench_scaled_matmul.CPU_PLOT_CAVEAT in drawn["a"][1]
    assert "not a speed claim" in bench_scaled_matmul.CPU_PLOT_CAVEAT
    bench_scaled_matmul.plot({"mode": "gpu", "rows": rows}, None, "title")
    assert not drawn["k"]["log_scale"] and drawn["a"][1] == "title"


def test_float8_plot_labels_wrap(monkeypatch):
    """The published stack plot's 12 labels wrap to 14 characters a line (they overlapped on one line)."""
    drawn = {}
    published = json.loads((PUBLISHED / "float8_nvidia-h200.json").read_text())
    monkeypatch.setattr(bench_float8, "plot_grouped_bars", lambda *args, **kwargs: drawn.update(a=args) or True)
    assert bench_float8.plot(published, None, "title")
    ((groups, _),) = drawn["a"][2].values()
    assert len(groups) == 12 and max(len(line) for label in groups for line in label.split("\n")) <= 14
