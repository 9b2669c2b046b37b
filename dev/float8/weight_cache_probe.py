"""What keeping the FP8 weight casts across micro-batches saves: the benchmarks' Llama-style stack (FP8 tensorwise,
FusedAdamW) trained with 1 and with 4 micro-batches per optimizer step, the weight-cast cache on and off in turns
(``ampkernels.float8.weight_casts.ENABLED``), ms per optimizer step (median of the rounds) and peak memory.

    python3 dev/float8/weight_cache_probe.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

import ampkernels
from ampkernels.float8 import convert_to_float8, weight_casts
from benchmarks.models import LLAMA_STACK, LlamaStack

MICRO_BATCH = (2, 2048)


def _step(model, optimizer, tokens, micro_batches: int):
    def step():
        optimizer.zero_grad(set_to_none=True)
        for i in range(micro_batches):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens[i])
            F.cross_entropy(logits.float().flatten(0, 1), tokens[i].flatten()).backward()
        optimizer.step()

    return step


def _time(step, steps: int = 5) -> float:
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaStack(**LLAMA_STACK, fused=True)
    convert_to_float8(model, "tensorwise")
    optimizer = ampkernels.FusedAdamW(model.parameters(), lr=1e-5)
    tokens = torch.randint(LLAMA_STACK["vocab"], (4, *MICRO_BATCH), device="cuda")
    for micro_batches in (1, 4):
        step = _step(model, optimizer, tokens, micro_batches)
        times = {True: [], False: []}
        peaks = {}
        for _ in range(args.rounds):
            for enabled in (True, False):
                weight_casts.ENABLED = enabled
                torch.cuda.reset_peak_memory_stats()
                times[enabled].append(_time(step))
                peaks[enabled] = torch.cuda.max_memory_allocated() / 2**30
        weight_casts.ENABLED = True
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(f"{micro_batches} micro-batch(es) of {MICRO_BATCH[0]} x {MICRO_BATCH[1]} tokens per step: cache on "
              f"{on:.1f} ms (peak {peaks[True]:.1f} GiB), off {off:.1f} ms (peak {peaks[False]:.1f} GiB): "
              f"{off / on:.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
