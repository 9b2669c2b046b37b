"""The Triton scaled_matmul tuner: candidate configs, the shared-memory estimate, timing in turns, stream-K."""

from __future__ import annotations

import pytest
import torch
from scaled_matmul_helpers import (  # noqa: F401  (fresh_caches is a fixture)
    LOW,
    _assert_accuracy,
    _need_triton,
    _operand,
    _ref64,
    _rel_err,
    _stock,
    _triton_module,
)

from ampkernels.scaled_matmul import scaled_matmul


def test_candidates_fit_in_shared_memory():
    """The tuner's shared-memory estimate keeps what compiled on the H200 and drops what did not: 128x256x64 with 4
    stages fits only with a 16-bit output stored in halves (192 KB ring + 32 KB), with 3 stages any output."""
    triton_sm = _triton_module()
    if triton_sm is None:
        pytest.skip("triton is not usable")
    fits = lambda cfg, out_bytes: triton_sm._shared_bytes(cfg, out_bytes) <= triton_sm.HOPPER_SHARED_BYTES  # noqa: E731
    four = triton_sm.Config(128, 256, 64, 4, 8, epilogue_split=2)
    three = triton_sm.Config(128, 256, 64, 3, 8, epilogue_split=2)
    assert fits(four, 2) and not fits(four, 4)
    assert not fits(triton_sm.Config(128, 256, 64, 4, 8), 2)
    assert fits(three, 2) and fits(three, 4)
    for cfg in triton_sm.HOPPER_TMA_CONFIGS + triton_sm.HOPPER_IDLE_TAIL_CONFIGS:
        assert fits(cfg, 2), cfg.describe()


# What Triton 3.6 allocates for sm_90 (dev/matmul/NOTES.md, compiled offline; a row-major a, the output
# stored through TMA): config, output bytes, accumulate, bytes. A flattened loop that accumulates loads the previous
# output ahead into a second piece; on the H200 three flattened candidates failed with OutOfResources for fp32 +=.
TRITON_36_SHARED_BYTES = [
    ((128, 128, 64, 4, 8, 1, True), 4, True, 262184),
    ((128, 128, 64, 4, 8, 1, True), 4, False, 196768),
    ((128, 128, 64, 5, 8, 1, True), 4, True, 294968),
    ((128, 128, 64, 5, 8, 1, True), 4, False, 229536),
    ((128, 256, 64, 3, 8, 2, True), 4, True, 279576),
    ((128, 256, 64, 3, 8, 2, True), 2, False, 180280),
    ((128, 128, 64, 5, 8, 1, False), 4, True, 229416),
    ((128, 256, 64, 4, 8, 2, False), 2, False, 229408),
    ((128, 256, 64, 4, 8, 2, False), 4, True, 262176),
    ((128, 128, 64, 6, 8, 1, True), 2, False, 229536),
]


@pytest.mark.parametrize("shape, out_bytes, accumulate, allocated", TRITON_36_SHARED_BYTES)
def test_shared_memory_estimate_bounds_what_triton_allocates(shape, out_bytes, accumulate, allocated):
    """Never below what Triton allocates (a kept candidate would fail to compile), at most the barrier margin above,
    and so the same verdict on the 227 KB limit."""
    triton_sm = _triton_module()
    if triton_sm is None:
        pytest.skip("triton is not usable")
    block_m, block_n, block_k, stages, warps, split, flatten = shape
    cfg = triton_sm.Config(block_m, block_n, block_k, stages, warps, epilogue_split=split, flatten=flatten)
    estimate = triton_sm._shared_bytes(cfg, out_bytes, accumulate)
    assert allocated <= estimate <= allocated + triton_sm._BARRIER_BYTES
    limit = triton_sm.HOPPER_SHARED_BYTES
    assert (estimate <= limit) == (allocated <= limit)


def test_candidates_leave_out_flattened_loops_that_accumulate_in_fp32():
    triton_sm = _triton_module()
    if triton_sm is None:
        pytest.skip("triton is not usable")
    out = torch.empty(3072, 768)  # fp32, stored through TMA
    plan = triton_sm.Plan("tma", a_col=True, b_col=False, out_tma=True)
    plain = triton_sm._candidates(plan, out, 3072, 768)
    accumulating = triton_sm._candidates(plan, out, 3072, 768, accumulate=True)
    assert any(cfg.flatten for cfg in plain)
    assert accumulating == tuple(cfg for cfg in plain if not cfg.flatten)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_every_candidate_config_on_gpu(dtype):
    """Each config the tuner may pick (including the few-tile ones) computes the same function."""
    triton_sm = _triton_module()
    if triton_sm is None or not torch.cuda.is_available():
        pytest.skip("needs triton on a GPU")
    torch.manual_seed(26)
    M, N, K = 300, 520, 264
    a, b = _operand(M, K, dtype, "cuda", True), _operand(K, N, dtype, "cuda", True)
    scale, bias = torch.rand(N, device="cuda") + 0.5, torch.randn(N, device="cuda")
    expected = _ref64(a, b, scale, bias)
    configs = (
        triton_sm.HOPPER_TMA_CONFIGS
        + triton_sm.HOPPER_FEW_TILES_CONFIGS
        + triton_sm.HOPPER_STREAM_K_CONFIGS
        + triton_sm.HOPPER_IDLE_TAIL_CONFIGS
        + triton_sm.POINTER_CONFIGS
    )
    for cfg in configs:
        for force in (None, "pointer"):
            out = torch.full((M, N), float("nan"), device="cuda")
            flag = torch.zeros(1, device="cuda")
            triton_sm.scaled_mm_(a, b, scale, 3, 1.0, bias, out, False, flag, config=cfg, force=force)
            assert _rel_err(out, expected) < 1e-5, cfg.describe()
            assert flag.item() == 0.0


def test_time_in_turns_alternates_and_averages(monkeypatch):
    """The timing the tuner and "auto" share: two passes, the second reversed, means per key (do_bench faked)."""
    triton_testing = pytest.importorskip("triton.testing")
    from ampkernels._runtime import time_in_turns

    order, ms = [], {"a": [1.0, 2.0], "b": [5.0, 4.0]}
    monkeypatch.setattr(triton_testing, "do_bench", lambda fn, warmup, rep: fn())
    runs = {key: (lambda key=key: order.append(key) or ms[key][order.count(key) - 1]) for key in ms}
    assert time_in_turns(runs) == {"a": 1.5, "b": 4.5}
    assert order == ["a", "b", "b", "a"]


def test_tuner_times_every_candidate_that_compiles(monkeypatch, fresh_caches):
    """_tune hands each candidate's launcher, bound to scratch outputs, to time_in_turns and keeps the fastest (the
    launchers run here, through the interpreter on a CPU; timing itself is faked: it needs a GPU)."""
    _need_triton("cpu" if not torch.cuda.is_available() else "cuda")
    triton_sm = _triton_module()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(35)
    a, b = _operand(40, 32, torch.float16, device, False), _operand(32, 24, torch.float16, device, True)
    out = torch.full((40, 24), float("nan"), dtype=torch.float32, device=device)
    p = triton_sm.Problem(a, b, None, 0, 0.5, None, out, False, None)
    plan = triton_sm.plan_for(a, b, out)
    candidates = triton_sm._candidates(plan, out, 40, 24)
    slowest_first = {cfg: float(len(candidates) - i) for i, cfg in enumerate(candidates)}
    seen = {}

    def time_in_turns(runs):
        for cfg, run in runs.items():
            run()
            seen[cfg] = True
        return {cfg: slowest_first[cfg] for cfg in runs}

    monkeypatch.setattr(triton_sm, "time_in_turns", time_in_turns)
    monkeypatch.setattr(triton_sm, "TUNING_LOG", [])
    assert triton_sm._tune(p, plan, ("key",)) == candidates[-1]
    assert set(seen) == set(candidates)
    assert torch.isnan(out).all()  # the caller's output untouched: candidates run on scratch
    assert triton_sm.TUNING_LOG[-1]["best"] == candidates[-1].describe()


@pytest.mark.gpu
def test_tuning_times_every_candidate_and_keeps_the_fastest(monkeypatch, fresh_caches):
    """The tuner (normally for problems of 2^30 multiply-adds and more) times each candidate through the direct
    launcher, records the timings, and the call then runs the fastest config correctly."""
    triton_sm = _triton_module()
    if triton_sm is None or not torch.cuda.is_available():
        pytest.skip("needs triton on a GPU")
    monkeypatch.setattr(triton_sm, "TUNE_MIN_MACS", 0)
    monkeypatch.setattr(triton_sm, "_TUNED", {})
    monkeypatch.setattr(triton_sm, "TUNING_LOG", [])
    torch.manual_seed(27)
    a, b = _operand(300, 264, torch.bfloat16, "cuda", False), _operand(264, 520, torch.bfloat16, "cuda", True)
    scale = torch.tensor(0.5, device="cuda")
    out = scaled_matmul(a, b, scale, backend="triton")
    (entry,) = triton_sm.TUNING_LOG
    plan = triton_sm.plan_for(a, b, out)
    candidates = triton_sm._candidates(plan, out, 300, 520)
    assert sorted(entry["ms"]) == sorted(c.describe() for c in candidates)
    assert all(ms > 0 for ms in entry["ms"].values())
    assert entry["best"] == min(entry["ms"], key=entry["ms"].get)
    _assert_accuracy(out, _stock(a, b, scale, None, out.dtype), _ref64(a, b, scale))


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K", [(300, 520, 264), (2200, 2100, 520)], ids=["all-shared", "shared-and-whole"])
def test_stream_k_on_gpu_is_correct_and_deterministic(M, N, K):
    """Stream-K configs with fewer tiles than SMs (every tile cut across programs) and with a partial last wave
    (its tiles shared, the rest whole): accumulate, column scale, bias; the same bits on a second run; an overflow
    sets found_inf."""
    triton_sm = _triton_module()
    if triton_sm is None or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs triton on a GPU with TMA (sm_90+)")
    torch.manual_seed(M)
    a, b = _operand(M, K, torch.bfloat16, "cuda", False), _operand(K, N, torch.bfloat16, "cuda", True)
    scale, bias = torch.rand(N, device="cuda") + 0.5, torch.randn(N, device="cuda")
    old = torch.randn(M, N, device="cuda")
    expected = _ref64(a, b, scale, bias, old)
    for cfg in triton_sm.HOPPER_STREAM_K_CONFIGS:
        runs = []
        for _ in range(2):
            out, flag = old.clone(), torch.zeros(1, device="cuda")
            triton_sm.scaled_mm_(a, b, scale, 3, 1.0, bias, out, True, flag, config=cfg)
            assert _rel_err(out, expected) < 1e-5, cfg.describe()
            assert flag.item() == 0.0, cfg.describe()
            runs.append(out)
        assert torch.equal(runs[0], runs[1]), f"{cfg.describe()}: two runs differ"
        out, flag = torch.empty(M, N, device="cuda", dtype=torch.float16), torch.zeros(1, device="cuda")
        triton_sm.scaled_mm_(a, b, torch.full((N,), 6e4, device="cuda"), 3, 1.0, None, out, False, flag, config=cfg)
        assert flag.item() == 1.0, f"{cfg.describe()}: overflow to fp16 not flagged"
