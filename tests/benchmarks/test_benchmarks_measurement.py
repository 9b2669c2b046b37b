"""What the benchmarks time and count: the bytes behind their floors, the stock baselines they compare with, what
each timed call does, and what the CPU summary and the command line say. All on the CPU."""

import importlib

import pytest
import torch


def test_in_place_clip_floor_counts_the_norm_pass_and_the_write_pass():
    """Clipping in place needs the total norm before any gradient can be written: a read-only pass over the grads
    (4 B/param) and then the unscale + clip pass (read + write, 8 B/param). A floor of 8 B/param counts one pass
    and puts every in-place clip at >= 1.5x its "floor" however good it is."""
    from benchmarks import bench_grad_scaler

    read_only, read_write = 4, 8
    assert bench_grad_scaler.STOCK_CLIP.floor_bytes_per_param == read_only + read_write
    assert bench_grad_scaler.FUSED_CLIP.floor_bytes_per_param == read_only + read_write
    assert bench_grad_scaler.FUSED_CLIP_DEFERRED.floor_bytes_per_param == read_only  # the clip itself is deferred
    assert bench_grad_scaler.FUSED_UNSCALE.floor_bytes_per_param == read_write  # check + unscale: one pass


def test_rms_norm_is_timed_against_torchs_own_rms_norm():
    """torch has an RMSNorm op (``F.rms_norm`` / ``nn.RMSNorm``, one fused kernel each way on CUDA): the stock row
    of the fused-producer table is that op, not a chain of elementwise ops that no torch user needs to write."""
    from torch.profiler import profile

    from benchmarks import float8_fused

    cases = [case for case in float8_fused._cases(torch.device("cpu"), small=True) if case["op"] == "rms_norm"]
    assert [case["pass_"] for case in cases] == ["forward", "forward + backward"]
    for case in cases:
        with profile() as prof:
            case["torch"]()
        assert "aten::rms_norm" in {event.key for event in prof.key_averages()}, case["pass_"]


def test_layer_step_times_one_forward_and_backward_without_accumulating_the_input_grad():
    """The layer-size table times forward + backward of one layer; the gradient of its input goes to the layer
    below in a model. Accumulating it into ``x.grad`` at every call adds an elementwise read-modify-write of the
    whole [tokens, K] input to every timed step (bf16 and fp8 alike), which pulls every ratio towards 1."""
    from benchmarks.bench_float8 import _layer_step

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(16, 32, dtype=torch.bfloat16)
    step = _layer_step(layer, x, grad)
    step()
    first = x.grad.clone()
    step()
    assert torch.equal(x.grad, first)


def test_scaled_matmul_cpu_summary_names_the_backend_the_library_runs_there():
    """On the CPU ``scaled_matmul`` runs its torch reference (``select_backend``), not the Triton interpreter: the
    summary line of a CPU run speaks of the former, not of a 0.00x interpreter figure."""
    from benchmarks import bench_scaled_matmul

    module = importlib.import_module("ampkernels.scaled_matmul")
    default = module.select_backend(torch.device("cpu"))
    assert default == "torch"  # the REFERENCE variant of the benchmark: scaled_matmul(..., backend="torch")
    rows = [
        {"dtype": "bfloat16", "implementation": name, "vs_cublas_mm": ratio, "vs_cublas_then_scale": ratio}
        for name, ratio in (
            (bench_scaled_matmul.CUBLAS, 1.0),
            (bench_scaled_matmul.CUBLAS_SCALE, 0.9),
            (bench_scaled_matmul.REFERENCE, 0.6),
            (bench_scaled_matmul.TRITON, 0.001),
        )
    ]
    document = {"mode": "cpu-small", "summary": bench_scaled_matmul._summary(rows)}
    (line,) = bench_scaled_matmul.summary(document)
    assert line.startswith(bench_scaled_matmul.LABELS[bench_scaled_matmul.REFERENCE]), line
    assert "0.60x" in line


def test_runner_runs_each_named_set_once():
    """``--sets bert-base,bert-base`` times the set once: twice would put duplicate rows in the JSON and its table
    (and the later one over the earlier one in the per-set summaries and plots)."""
    pytest.importorskip("tqdm")
    from benchmarks.__main__ import parse_args

    assert parse_args(["--sets", "bert-base,many-small,bert-base"]).sets == ["bert-base", "many-small"]


def test_graphed_step_is_also_compared_with_the_stock_step_graphed():
    """torch's GradScaler syncs with the host only for an optimizer that is not fused, so the stock step with
    ``AdamW(fused=True, capturable=True)`` can be captured too. The graphed ampkernels step is reported against it
    as well as against stock eager: the graph's own gain is not ampkernels'."""
    from benchmarks import bench_training

    assert "stock-fused-graphed" in bench_training.RECIPES
    (group,) = bench_training._optimizer("stock-fused-graphed", [torch.nn.Parameter(torch.ones(2))]).param_groups
    assert group["fused"] and group["capturable"]
    rows = [
        {"model": "m", "recipe": recipe, "step_ms": ms, "speedup_over_stock_fused": 10.0 / ms}
        for recipe, ms in (("stock-fused", 10.0), ("stock-fused-graphed", 4.0), ("ampkernels-graphed", 2.0))
    ]
    rows[2]["speedup_over_stock_fused_graphed"] = 2.0
    (line,) = bench_training.summary({"mode": "gpu", "rows": rows, "numerics": {}})
    assert "graphed 5.00x" in line and "graphed vs stock graphed (4 ms) 2.00x" in line, line
