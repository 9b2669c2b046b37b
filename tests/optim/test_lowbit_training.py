"""Low-precision Adam state in a real training run: 300 steps of a tiny Llama on a task with a known loss floor.

The model (benchmarks.models.tiny_llama: vocab 128, dim 64, 2 blocks, ffn 256) learns the synthetic Markov chain of
benchmarks.lm_task (floor 1.208 nats, 4.85 at the start) with ampkernels.FusedAdamW at the default backend (on a CPU
without the native extension: the torch reference), lr 3e-3 with 30 warm-up steps and a cosine to 3e-4, batch 16 x 32
tokens. Every configuration sees the same initial weights and the same batches; the final loss is the mean of the
last 10 steps' losses. Every weight matrix of this model has >= 4096 elements, so the quantized formats cover all of
them (embedding, attention, MLP, head) and only the RMSNorm weights keep float32 moments.

Measured here (the torch reference on a CPU), final loss and gap to fp32, and in parentheses the range over this
and three other seeds of model, data and chain:

    fp32 params, fp32 moments      1.2657             (empirical floor of those 10 batches: 1.2072)
    fp32 params, 8-bit moments     1.2640   -0.13%    (-0.13 .. -0.02%)
    fp32 params, 4-bit moments     1.2573   -0.66%    (-0.79 .. -0.41%)
    bf16 params, stochastic round  1.2656   -0.00%    (-0.01 .. +0.03%)
    bf16 params, round to nearest  1.3089   +3.42%    (+3.10 .. +3.42%)

Round to nearest loses the updates smaller than half an ulp of the bfloat16 weight once the learning rate decays
(at a constant 3e-3 its gap is 0.6%; at 1e-2 it vanishes); stochastic rounding keeps them in expectation. That gap,
three times the 1% tolerance, is what makes the tolerance meaningful, so it is asserted too.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from tolerances import TRAINING_LOSS_RTOL

from ampkernels import FusedAdamW
from benchmarks.lm_task import make_task, train, warmup_cosine
from benchmarks.models import tiny_llama

VOCAB = 128
STEPS = 300
BATCH = 16
SEQ = 32
LR = 3e-3
WARMUP = 30
TASK_SEED = 0
MODEL_SEED = 0
DATA_SEED = 1
ROUNDING_SEED = 7
LAST = 10  # the final loss: the mean over the last LAST steps
TOLERANCE = TRAINING_LOSS_RTOL

CONFIGS = {
    "fp32": (torch.float32, {}),
    "8bit": (torch.float32, dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)),
    "4bit": (torch.float32, dict(exp_avg_dtype="4bit", exp_avg_sq_dtype="4bit")),
    "bf16_sr": (
        torch.bfloat16,
        dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, stochastic_rounding=True),
    ),
    "bf16_nearest": (
        torch.bfloat16,
        dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, stochastic_rounding=False),
    ),
}

_RUNS: dict[str, dict] = {}


def _run(name: str) -> dict:
    """One configuration's run (cached for the module: each configuration trains once)."""
    if name not in _RUNS:
        dtype, options = CONFIGS[name]
        torch.manual_seed(MODEL_SEED)
        model = tiny_llama(vocab=VOCAB).to(dtype)
        opt = FusedAdamW(model.parameters(), lr=LR, weight_decay=0.0, seed=ROUNDING_SEED, **options)
        task = make_task(VOCAB, TASK_SEED)
        # NOTE: one thread. With torch's default two on a loaded 2-core machine, 50 steps took 60 s instead of 1.3 s
        # (the intra-op workers wait for cores); the model is too small to gain from a second one anyway.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            start = time.perf_counter()
            losses = train(model, opt, task, STEPS, BATCH, SEQ, "cpu", DATA_SEED, schedule=warmup_cosine(STEPS, WARMUP))
            seconds = time.perf_counter() - start
        finally:
            torch.set_num_threads(threads)
        final = sum(losses[-LAST:]) / LAST
        state = {
            n: {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
            for n, p in model.named_parameters()
        }
        _RUNS[name] = dict(losses=losses, final=final, seconds=seconds, model=model, state=state, task=task)
        base = _RUNS.get("fp32", {}).get("final")
        gap = f", {100 * (final / base - 1):+.2f}% against fp32" if base else ""
        print(f"\n{name}: loss {losses[0]:.4f} -> {final:.4f}{gap} (floor {task.entropy_floor():.4f}), {seconds:.1f} s")
    return _RUNS[name]


def _gap(name: str) -> float:
    return _run(name)["final"] / _run("fp32")["final"] - 1


def _check_trained(name: str) -> dict:
    run = _run(name)
    losses = run["losses"]
    assert all(math.isfinite(x) for x in losses), (
        f"{name}: non-finite loss at step {next(i for i, x in enumerate(losses) if not math.isfinite(x))}"
    )
    assert abs(losses[0] - math.log(VOCAB)) < 0.1, f"{name}: initial loss {losses[0]:.4f}, not near ln(vocab)"
    # From 4.85 to ~1.27: a run that learned nothing, or diverged, stays far above 3 * floor.
    assert run["final"] < 3 * run["task"].entropy_floor(), f"{name}: final loss {run['final']:.4f}"
    return run


def _last_batches_floor(task) -> float:
    """The chain's own loss on the batches of the last LAST steps (the same batches every configuration saw)."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    batches = [task.batch(BATCH, SEQ, gen) for _ in range(STEPS)]
    return sum(task.optimal_loss(*b) for b in batches[-LAST:]) / LAST


def test_task_floor_is_the_chains_entropy():
    task = make_task(VOCAB, TASK_SEED)
    inputs, targets = task.batch(64, 256, torch.Generator().manual_seed(3))
    # 16384 targets, per-token loss standard deviation ~0.8 nats: the mean is within ~0.006 of the expectation.
    assert task.optimal_loss(inputs, targets) == pytest.approx(task.entropy_floor(), abs=0.03)
    assert task.entropy_floor() == pytest.approx(-sum(p * math.log(p) for p in (0.5, 0.25, 0.15, 0.1)), rel=1e-12)
    assert (targets[:, :-1] == inputs[:, 1:]).all()  # targets are the inputs shifted by one


def test_fp32_baseline_converges_near_the_floor():
    run = _check_trained("fp32")
    floor = _last_batches_floor(run["task"])
    print(f"fp32: {run['final']:.4f} against the chain's {floor:.4f} on the same batches")
    # Measured 0.059 nats above the chain's own loss on those batches (4.85 at the start).
    assert run["final"] - floor < 0.1


def test_8bit_moments_within_1_percent():
    run = _check_trained("8bit")
    quantized = [n for n, s in run["state"].items() if s["exp_avg"].dtype == torch.uint8]
    assert "embed.weight" in quantized and "blocks.0.attn.q.weight" in quantized and "head.weight" in quantized
    for name in quantized:
        p = dict(run["model"].named_parameters())[name]
        state = run["state"][name]
        assert state["exp_avg"].shape == p.shape and state["exp_avg_sq"].dtype == torch.uint8
        assert state["exp_avg_scale"].shape == (*p.shape[:-1], -(-p.shape[-1] // 128))
    for name, state in run["state"].items():
        if name.endswith("norm.weight"):  # 1-D: float32 moments
            assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    assert abs(_gap("8bit")) < TOLERANCE, f"8-bit moments: {100 * _gap('8bit'):+.2f}% against fp32"


def test_bf16_stochastic_rounding_within_1_percent():
    run = _check_trained("bf16_sr")
    assert all(p.dtype == torch.bfloat16 for p in run["model"].parameters())
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in run["state"].values())
    assert "master_param" not in run["state"]["head.weight"]
    assert abs(_gap("bf16_sr")) < TOLERANCE, f"bf16 + stochastic rounding: {100 * _gap('bf16_sr'):+.2f}% against fp32"


def test_bf16_round_to_nearest_falls_behind():
    _check_trained("bf16_nearest")
    gap, gap_sr = _gap("bf16_nearest"), _gap("bf16_sr")
    print(f"bf16 round to nearest: {100 * gap:+.2f}%, stochastic rounding {100 * gap_sr:+.2f}% against fp32")
    # Measured +3.1 .. +3.4% over four seeds: outside the tolerance stochastic rounding meets.
    assert gap > TOLERANCE and gap > gap_sr + TOLERANCE


def test_4bit_moments_train():
    run = _check_trained("4bit")
    state = run["state"]["blocks.0.mlp.gate.weight"]
    p = run["model"].blocks[0].mlp.gate.weight
    assert state["exp_avg"].dtype == torch.uint8 and state["exp_avg"].shape == (*p.shape[:-1], (p.shape[-1] + 1) // 2)
    # Measured -0.8 .. -0.4% against fp32 (four seeds); asserted loosely, as the issue asks only that it trains.
    assert abs(_gap("4bit")) < 0.05, f"4-bit moments: {100 * _gap('4bit'):+.2f}% against fp32"
