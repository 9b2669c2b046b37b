"""FP8 training in a real run: 300 steps of a tiny Llama on the synthetic next-token task, every recipe against bf16.

The model (benchmarks.models.tiny_llama: vocab 128, dim 64, 2 blocks, ffn 256) learns the Markov chain of
benchmarks.lm_task (loss floor 1.208 nats, ln 128 = 4.85 at the start) under bf16 autocast, with fp32 parameters and
ampkernels.FusedAdamW (lr 3e-3, 30 warm-up steps, cosine to 3e-4, batch 16 x 32 tokens). The FP8 runs convert every
Linear (q, k, v, o, gate, up, down and the head; ``min_features=0``: the layers are far below the size where FP8
pays, which is not what this test is about). Every run sees the same initial weights and batches; the final loss is
the mean of the last 10 steps' losses. The bar: each recipe within 1% of bf16, no NaN at any step. The last recipe is
the benchmark's fastest FP8 step: tensorwise layers on the fused norms, RoPE and SiLU·up, with the head's loss fused.

On a CPU the casts and products are ampkernels' torch references (the same math as the GPU kernels; the GEMMs in
float32 there, so only the FP8 rounding differs from bf16); on a GPU, the default backends.
"""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import TRAINING_LOSS_RTOL

from ampkernels import FusedAdamW
from ampkernels.float8 import Float8Linear, convert_to_float8
from benchmarks.lm_task import make_task, train, warmup_cosine
from benchmarks.models import tiny_llama

VOCAB, STEPS, BATCH, SEQ, LR, WARMUP = 128, 300, 16, 32, 3e-3, 30
TASK_SEED, MODEL_SEED, DATA_SEED = 0, 0, 1
LAST = 10
TOLERANCE = TRAINING_LOSS_RTOL
RECIPES = ("tensorwise", "rowwise", "delayed")
# The FP8 stack of the benchmark's fastest step: tensorwise layers, the fused norms, RoPE and SiLU·up, and the head's
# loss fused (ampkernels.linear_cross_entropy: no logits formed).
EVERYTHING = "tensorwise+fused+fused loss"

_RUNS: dict[tuple, dict] = {}


def _run(recipe: str | None, device: str) -> dict:
    key = (recipe, device)
    if key not in _RUNS:
        torch.manual_seed(MODEL_SEED)
        model = tiny_llama(vocab=VOCAB, fused=recipe == EVERYTHING).to(device)
        if recipe is not None:
            convert_to_float8(model, recipe.partition("+")[0], min_features=0)
        opt = FusedAdamW(model.parameters(), lr=LR, weight_decay=0.0)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # see tests/optim/test_lowbit_training.py: one thread is faster on a loaded 2-core CPU
        try:
            losses = train(
                model,
                opt,
                make_task(VOCAB, TASK_SEED),
                STEPS,
                BATCH,
                SEQ,
                device,
                DATA_SEED,
                autocast_dtype=torch.bfloat16,
                schedule=warmup_cosine(STEPS, WARMUP),
                fused_loss=recipe == EVERYTHING,
            )
        finally:
            torch.set_num_threads(threads)
        final = sum(losses[-LAST:]) / LAST
        _RUNS[key] = dict(losses=losses, final=final, model=model)
        base = _RUNS.get((None, device), {}).get("final")
        gap = f", {100 * (final / base - 1):+.2f}% against bf16" if base else ""
        print(f"\n{recipe or 'bf16'} on {device}: loss {losses[0]:.4f} -> {final:.4f}{gap}")
    return _RUNS[key]


@pytest.mark.parametrize("recipe", [*RECIPES, EVERYTHING])
def test_float8_recipe_within_1_percent_of_bf16(recipe, device):
    base = _run(None, device)
    run = _run(recipe, device)
    losses = run["losses"]
    bad = [i for i, x in enumerate(losses) if not math.isfinite(x)]
    assert not bad, f"{recipe}: non-finite loss at step {bad[0]}"
    converted = [n for n, m in run["model"].named_modules() if isinstance(m, Float8Linear)]
    assert len(converted) == 2 * 7 + 1  # q, k, v, o, gate, up, down per block, and the head
    assert base["final"] < 1.5 * make_task(VOCAB, TASK_SEED).entropy_floor()  # bf16 learned the chain
    gap = run["final"] / base["final"] - 1
    assert abs(gap) < TOLERANCE, f"{recipe}: final loss {run['final']:.4f}, {100 * gap:+.2f}% against bf16"
