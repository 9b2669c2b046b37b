"""The figures of README.md's headline tables are those of the JSON in benchmarks/published/, recomputed here from it
and formatted as the README writes them, so that the README cannot drift from the runs it quotes."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "benchmarks" / "published"


def _load(name: str, gpu: str = "nvidia-h200") -> dict:
    return json.loads((PUBLISHED / f"{name}_{gpu}.json").read_text())


def _table(text: str, header_start: str) -> dict[str, list[str]]:
    """The rows of the markdown table whose header line starts with ``header_start``: first cell -> the others."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def _ms(value: float) -> str:
    """Milliseconds as the headline writes them: 3 significant digits."""
    return f"{value:#.3g}".rstrip(".") + " ms"


def _ratio(value: float) -> str:
    """A ratio as the headline writes it: 2 decimals below 10, else 3 significant digits."""
    return f"{value:.2f}×" if value < 10 else f"{value:.3g}×"


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def _post_backward(set_name: str) -> list[str]:
    rows = {r["implementation"]: r for r in _load("grad_scaler")["rows"]
            if r["set"] == set_name and r["case"] == "post-backward"}  # fmt: skip
    stock, best, ours = (rows[k]["wall_ms"] for k in ("stock", "stock-sync-free", "ampkernels+FusedAdamW"))
    assert best == min(rows[k]["wall_ms"] for k in ("stock", "stock-sync-free"))  # the best eager stock recipe
    return [_ms(stock), _ms(best), _ms(ours), f"{_ratio(stock / ours)} / {_ratio(best / ours)}"]


def _tiny_gpt2() -> list[str]:
    rows = {r["recipe"]: r["step_ms"] for r in _load("training", "nvidia-h100-80gb-hbm3")["rows"]
            if r["model"] == "tiny-gpt2"}  # fmt: skip
    stock, best, ours = rows["stock-fused"], rows["stock-fused-graphed"], rows["ampkernels-graphed"]
    return [_ms(stock), _ms(best), _ms(ours), f"{_ratio(stock / ours)} / {_ratio(best / ours)}"]


def _tiny_gpt2_h200() -> str:
    """Footnote 2's figures of the H200 run, which has no graphed stock recipe."""
    rows = {r["recipe"]: r["step_ms"] for r in _load("training")["rows"] if r["model"] == "tiny-gpt2"}
    stock, ours = rows["stock-fused"], rows["ampkernels-graphed"]
    return f"(there, stock eager {stock:.1f} ms, ampkernels graphed {ours:.2f} ms, {_ratio(stock / ours)})"


def _matmul() -> list[str]:
    document = _load("scaled_matmul")
    tflops = {
        name: _geomean([r["tflops"] for r in document["rows"] if r["implementation"] == name])
        for name in ("cublas_then_scale", "cublas_mm", "auto")
    }
    (summary,) = [s for s in document["summary"] if s["dtype"] == "all" and s["implementation"] == "auto"]
    assert summary["cases"] == 15
    # The ratio of the geomeans is the geomean of the per-shape ratios (same FLOPs per shape on every row).
    assert math.isclose(tflops["auto"] / tflops["cublas_then_scale"], summary["geomean_vs_cublas_then_scale"])
    assert math.isclose(tflops["auto"] / tflops["cublas_mm"], summary["geomean_vs_cublas_mm"])
    cells = [f"{tflops[name]:.0f} TFLOP/s" for name in ("cublas_then_scale", "cublas_mm", "auto")]
    ratios = f"{_ratio(summary['geomean_vs_cublas_then_scale'])} / {_ratio(summary['geomean_vs_cublas_mm'])}"
    return [*cells, ratios]


HEADLINE = {
    "post-backward phase¹, BERT-base (110M params, 202 tensors)": lambda: _post_backward("bert-base"),
    "post-backward phase¹, Llama-1B-shaped (1.26B params, 201 tensors)": lambda: _post_backward("llama-1b"),
    "post-backward phase¹, 10,000 tensors of 1024 elements": lambda: _post_backward("many-small"),
    "tiny GPT-2 training step, H100 run²: stock eager, ampkernels captured whole in a CUDA graph": _tiny_gpt2,
    "`scale * (a @ b)` bf16/fp16 with a device-tensor scale, geomean of 15 shapes³": _matmul,
}


def _float8(keys: tuple[str, ...]) -> list[str]:
    rows = {r["key"]: r for r in _load("float8")["stack"]["rows"]}
    ms = " / ".join(f"{rows[key]['ms']:.1f}" for key in keys)
    return [ms, " / ".join(f"{rows[key]['speedup_over_bf16_eager']:.2f}×" for key in keys)]


FLOAT8 = {
    "stock bf16, eager / `torch.compile`": ("bf16-eager", "bf16-compiled"),
    "ampkernels FP8 tensorwise, eager / captured in a CUDA graph (`capture_step`)": (
        "fp8-tensorwise-eager",
        "fp8-tensorwise-graphed",
    ),
    "ampkernels FP8 rowwise, eager": ("fp8-rowwise-eager",),
    "ampkernels FP8 delayed scaling, eager": ("fp8-delayed-eager",),
    "torchao 0.18 FP8 tensorwise / rowwise, `torch.compile`": (
        "torchao-tensorwise-compiled",
        "torchao-rowwise-compiled",
    ),
}


@pytest.fixture(scope="module")
def readme() -> str:
    return (ROOT / "README.md").read_text()


def test_headline_table_is_the_published_json(readme):
    rows = _table(readme, "| what | standard stock recipe | best stock recipe | ampkernels |")
    assert set(rows) == set(HEADLINE), "a headline row without its check here (add it to HEADLINE)"
    for label, expected in HEADLINE.items():
        assert rows[label] == expected(), label


def test_float8_table_is_the_published_json(readme):
    rows = _table(readme, "| variant | ms/step | vs stock bf16 eager |")
    assert set(rows) == set(FLOAT8)
    for label, keys in FLOAT8.items():
        assert rows[label] == _float8(keys), label


def test_the_footnotes_quote_the_published_json(readme):
    """The ranges and graphed ratios in the footnotes under the headline table (line breaks read as spaces)."""
    readme = " ".join(readme.split())
    grad_scaler = _load("grad_scaler")
    phase = [r for r in grad_scaler["rows"] if r["case"] == "post-backward"]
    floors = [
        r["x_floor"] for r in phase if r["implementation"] == "ampkernels+FusedAdamW" and r["set"] != "many-small"
    ]
    assert f"({min(floors):.2f}–{max(floors):.2f}× the 32 B/param bandwidth floor" in readme
    graphed = []
    for set_name in ("bert-base", "llama-1b", "many-small"):
        by = {r["implementation"]: r["wall_ms"] for r in phase if r["set"] == set_name}
        graphed.append(_ratio(by["stock-sync-free-graphed"] / by["ampkernels+FusedAdamW-graphed"]))
    assert f"ours is {graphed[0]}, {graphed[1]} and {graphed[2]} that stock assembly" in readme
    stack = [r for r in _load("float8")["stack"]["rows"] if "ms" in r]
    fp8 = [r for r in stack if r["key"].startswith("fp8-")]
    torchao = [r for r in stack if r["key"].startswith("torchao-")]
    assert max(r["first_step_s"] for r in fp8) < 1.0
    first = f"{min(r['first_step_s'] for r in torchao):.0f}–{max(r['first_step_s'] for r in torchao):.0f} s"
    assert f"(torchao's compiled ones {first})" in readme
    peaks = f"{min(r['peak_gib'] for r in fp8):.1f}–{max(r['peak_gib'] for r in fp8):.1f} GiB"
    base = next(r for r in stack if r["key"] == "bf16-eager")["peak_gib"]
    assert f"({peaks} against {base:.1f})" in readme
    assert _tiny_gpt2_h200() in readme


def test_formats():
    assert [_ms(1.904), _ms(17.889), _ms(0.19449), _ms(84.3), _ms(1.2751)] == [
        "1.90 ms",
        "17.9 ms",
        "0.194 ms",
        "84.3 ms",
        "1.28 ms",
    ]
    assert [_ratio(2.1336), _ratio(0.9696), _ratio(433.4), _ratio(331.8)] == ["2.13×", "0.97×", "433×", "332×"]


def test_cuda_graphs_doc_quotes_the_published_graphed_stock_run():
    doc = " ".join((ROOT / "docs" / "cuda-graphs.md").read_text().split())
    rows = _load("training", "nvidia-h100-80gb-hbm3")["rows"]
    quoted = []
    for model, label, digits in (("tiny-gpt2", "tiny GPT-2", 2), ("mlp-800", "the 800-tensor MLP", 2)):
        by = {r["recipe"]: r["step_ms"] for r in rows if r["model"] == model}
        stock, ours = by["stock-fused-graphed"], by["ampkernels-graphed"]
        quoted.append(f"{label} {stock:.{digits}f} → {ours:.{digits}f} ms ({_ratio(stock / ours)})")
    by = {r["recipe"]: r["step_ms"] for r in rows if r["model"] == "bert-base"}
    stock, ours = by["stock-fused-graphed"], by["ampkernels-graphed"]
    quoted.append(f"BERT-base {stock:.1f} → {ours:.1f} ms ({_ratio(stock / ours)})")
    assert "graphed against graphed: " + ", ".join(quoted) in doc


# README's model-zoo table: label -> the zoo's model name; every cell is the ratio in one run, ZOO_RUN.
ZOO_RUN = 7
ZOO_MODELS = {
    "BERT-base, 32 × 512": "bert-base",
    "GPT-2 124M, 8 × 1024": "gpt2",
    "Llama 1.1B, 4 × 2048": "llama-1b",
    "T5-small, 32 × (512 + 128)": "t5-small",
    "ResNet-50, 64 × 224²": "resnet-50",
    "ResNet-50 channels_last": "resnet-50-cl",
    "ViT-B/16, 64 × 224²": "vit-b16",
    "ConvNeXt-T (timm), channels_last": "convnext-t",
}
ZOO_FRAMEWORKS = {"trainer": "Trainer", "accelerate": "Accelerate", "lightning": "Lightning"}


def _zoo(run: int) -> dict:
    return json.loads((PUBLISHED / f"models_nvidia-h100-80gb-hbm3_{run}.json").read_text())


def _zoo_cells(model: str, run: int = ZOO_RUN) -> list[str]:
    rows = {r["recipe"]: r for r in _zoo(run)["rows"] if r["model"] == model}

    def ratio(recipe: str, mark: str = "") -> str:
        row = rows.get(recipe)
        if row is None:
            return ""
        if row.get("check", "ok") != "ok":
            mark += "⁶"  # its loss check failed: footnote 6
        return f"{row['speedup_over_stock']:.3f}×{mark}" if "speedup_over_stock" in row else f"–{mark}"

    float8 = ratio("fp8-ampkernels")
    if float8 and "bf16-ampkernels-8bit" in rows:
        float8 += f"; 8-bit state {ratio('bf16-ampkernels-8bit')}"
    elif float8 and rows["fp8-ampkernels"].get("float8_layers", [None])[0] in (0, None):
        float8 += "⁴"  # no layer converted (or not an nn.Linear model): footnote 4
    graphed = ratio(
        "fp16-ampkernels-graphed", "⁵" if rows["fp16-ampkernels-graphed"].get("alternated") is False else ""
    )
    frameworks = [f"{label} {ratio(f'ampkernels-{name}')}" for name, label in ZOO_FRAMEWORKS.items()
                  if f"ampkernels-{name}" in rows]  # fmt: skip
    frameworks += [f"{label}, FP8 + 8-bit state, against bf16: {ratio(f'ampkernels-{name}-fp8-8bit')}"
                   for name, label in ZOO_FRAMEWORKS.items() if f"ampkernels-{name}-fp8-8bit" in rows]  # fmt: skip
    return [ratio("fp16-ampkernels"), graphed, ratio("bf16-ampkernels"), float8, "; ".join(frameworks)]


def test_model_zoo_table_is_one_published_run(readme):
    rows = _table(readme, "| model | fp16 eager | fp16 graphed | bf16 eager | FP8 |")
    assert set(rows) == set(ZOO_MODELS)
    for label, model in ZOO_MODELS.items():
        assert rows[label] == _zoo_cells(model), label
    assert {r["model"] for r in _zoo(ZOO_RUN)["rows"]} == set(ZOO_MODELS.values())  # the whole zoo in that run


def test_model_zoo_prose_quotes_the_published_json(readme):
    text = " ".join(readme.split())

    def speedup(run: int, model: str, recipe: str) -> float:
        return next(r for r in _zoo(run)["rows"] if r["model"] == model and r["recipe"] == recipe)["speedup_over_stock"]

    def geomean(recipe: str) -> float:
        ratios = [r["speedup_over_stock"] for r in _zoo(ZOO_RUN)["rows"] if r["recipe"] == recipe]
        return math.exp(sum(map(math.log, ratios)) / len(ratios))

    geomeans = f"fp16 eager {geomean('fp16-ampkernels'):.3f}×, fp16 graphed {geomean('fp16-ampkernels-graphed'):.3f}×, "
    assert geomeans + f"bf16 eager {geomean('bf16-ampkernels'):.3f}×" in text
    for model, earlier in (("resnet-50-cl", 4), ("convnext-t", 5)):
        now, then = speedup(ZOO_RUN, model, "fp16-ampkernels"), speedup(earlier, model, "fp16-ampkernels")
        assert f"{now:.3f}× here, {then:.3f}× in run {earlier}" in text, model
    trainer = f"Trainer {speedup(6, 'bert-base', 'ampkernels-trainer'):.3f}× and "
    assert trainer + f"{speedup(2, 'bert-base', 'ampkernels-trainer'):.3f}× (runs 6 and 2)" in text
    assert f"ResNet-50 channels_last bf16 {speedup(3, 'resnet-50-cl', 'bf16-ampkernels'):.3f}× (run 3)" in text
    assert f"ran in FP8 at {speedup(2, 'bert-base', 'fp8-ampkernels'):.2f}× (run 2)" in text
    trainer = speedup(ZOO_RUN, "llama-1b", "ampkernels-trainer-fp8-8bit")
    lightning = speedup(ZOO_RUN, "llama-1b", "ampkernels-lightning-fp8-8bit")
    assert f"through Trainer and Lightning: {trainer:.3f}× and {lightning:.3f}× of stock bf16" in text
    run = ZOO_RUN
    assert f"eager ResNet-50 is {speedup(run, 'resnet-50', 'fp16-ampkernels'):.3f}× stock (model zoo above)" in text
