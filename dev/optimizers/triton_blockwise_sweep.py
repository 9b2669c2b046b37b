"""Sweep the Triton blockwise Adam step's launch constants (ampkernels.triton.blockwise: TILE_BLOCKS, NUM_WARPS
and NUM_WARPS_Q4, PROGRAMS_PER_SM) on the Llama-3.2-1B-shaped set, for 8-bit and 4-bit moments and bfloat16 +
stochastic rounding.

    python3 dev/optimizers/triton_blockwise_sweep.py [--shrink N]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from ampkernels import FusedAdamW
from ampkernels.triton import blockwise

CONFIGS = {
    "8-bit": (torch.float32, dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit")),
    "4-bit": (torch.float32, dict(exp_avg_dtype="4bit", exp_avg_sq_dtype="4bit")),
    "bf16 + SR": (torch.bfloat16, dict(stochastic_rounding=True)),
}


def shapes(shrink: int) -> list[tuple[int, ...]]:
    hidden, inter, kv, vocab = 2048 // shrink, 8192 // shrink, 512 // shrink, 32000 // shrink
    out = [(vocab, hidden)]
    for _ in range(16):
        out += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]
        out += [(inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]
    return out + [(hidden,), (vocab, hidden)]


def time_step(opt, steps: int = 15) -> float:
    for _ in range(3):
        opt.step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        opt.step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shrink", type=int, default=1)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (dtype, options) in CONFIGS.items():
        params = []
        for s in shapes(args.shrink):
            p = torch.nn.Parameter((torch.randn(s, device="cuda", generator=gen) * 0.02).to(dtype))
            p.grad = (torch.randn(s, device="cuda", generator=gen) * 1e-3).to(dtype)
            params.append(p)
        results = []
        for tile, warps, per_sm in itertools.product((8, 16, 32), (4, 8), (None, 4, 8)):
            blockwise.TILE_BLOCKS, blockwise.PROGRAMS_PER_SM = tile, per_sm
            blockwise.NUM_WARPS = blockwise.NUM_WARPS_Q4 = warps
            try:
                ms = time_step(FusedAdamW(params, lr=1e-3, backend="triton", **options))
            except Exception as exc:  # e.g. out of shared memory or registers for a large tile
                print(f"{name}: TILE_BLOCKS={tile} NUM_WARPS={warps} PROGRAMS_PER_SM={per_sm}: {type(exc).__name__}")
                continue
            results.append((ms, tile, warps, per_sm))
            print(f"{name}: TILE_BLOCKS={tile:2d} NUM_WARPS={warps} PROGRAMS_PER_SM={per_sm}: {ms:.3f} ms", flush=True)
        best = min(results)
        print(
            f"== {name}: best {best[0]:.3f} ms at TILE_BLOCKS={best[1]} NUM_WARPS={best[2]} PROGRAMS_PER_SM={best[3]}"
        )
        del params
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
