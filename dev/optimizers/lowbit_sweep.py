"""Sweep the Triton blockwise Adam kernel's launch configuration (blocks per tile, warps, pipeline stages, blocks
per work item) over the Llama-3.2-1B-shaped set, one AdamW step per state option, against the copy bandwidth and
torch's fused AdamW measured in the same run.

    python3 dev/optimizers/lowbit_sweep.py [--shrink N] [--steps N] [--only NAME]

Each line: the option, the configuration (tile blocks / warps / stages / item blocks / register cap), ms per step
(CUDA events around ``--steps`` steps), bytes moved per parameter and % of copy bandwidth. The kernel's launch table
is set before each optimizer is built (the work items are built with the table).
"""

from __future__ import annotations

import argparse

import torch

import ampkernels.triton.blockwise as blockwise
from ampkernels import FusedAdamW
from benchmarks.param_sets import PARAM_SETS
from dev.optimizers.lowbit_probe import copy_gbs, moved_bytes

OPTIONS = {
    "8-bit": (torch.float32, dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit")),
    "4-bit": (torch.float32, dict(exp_avg_dtype="4bit", exp_avg_sq_dtype="4bit")),
    "bf16 + SR": (torch.bfloat16, dict(stochastic_rounding=True)),
    "bf16 + SR + 8-bit": (
        torch.bfloat16,
        dict(stochastic_rounding=True, exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit"),
    ),
}
# (tile blocks, warps, stages, item blocks, register cap) per option.
GRID = {
    "8-bit": [(4, 4, 3, 128, None), (4, 4, 3, 128, 48), (4, 4, 1, 128, 40), (4, 4, 2, 128, 48), (8, 4, 2, 128, None)],
    "4-bit": [(4, 4, 1, 128, None), (4, 4, 1, 128, 48), (4, 4, 1, 128, 40), (4, 4, 3, 128, 48), (8, 4, 1, 128, 56)],
    "bf16 + SR": [(8, 4, 1, 128, None), (8, 4, 1, 128, 48)],
    "bf16 + SR + 8-bit": [(4, 4, 1, 128, None), (4, 4, 1, 128, 56), (4, 4, 1, 128, 48)],
}


def time_steps(opt, steps: int) -> float:
    for _ in range(3):
        opt.step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        opt.step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def make_params(dtype, shrink, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = []
    for s in PARAM_SETS["llama-3.2-1b"](shrink):
        p = torch.nn.Parameter((torch.randn(s, device="cuda", generator=gen) * 0.02).to(dtype))
        p.grad = (torch.randn(s, device="cuda", generator=gen) * 1e-3).to(dtype)
        params.append(p)
    return params


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shrink", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    gbs = copy_gbs()
    print(f"{torch.cuda.get_device_name()}: copy {gbs:.0f} GB/s (read + write)")
    for dtype in (torch.float32, torch.bfloat16):
        params = make_params(dtype, args.shrink)
        ms = time_steps(torch.optim.AdamW(params, lr=1e-3, fused=True), args.steps)
        print(f"torch AdamW(fused=True) {str(dtype):15s} {ms:7.3f} ms")
        del params
    for name, (dtype, kw) in OPTIONS.items():
        if args.only and args.only != name:
            continue
        params = make_params(dtype, args.shrink)
        for nb, warps, stages, item, maxnreg in GRID[name]:
            blockwise.ITEM_BLOCKS = item
            for kind in blockwise.LAUNCH_CONFIGS:
                blockwise.LAUNCH_CONFIGS[kind] = (nb, warps, stages, maxnreg)
            opt = FusedAdamW(params, lr=1e-3, backend="triton", **kw)
            try:
                ms = time_steps(opt, args.steps)
            except Exception as exc:  # a configuration Triton cannot compile (shared memory, registers)
                print(
                    f"{name:18s} {nb:3d} {warps} {stages} {item:4d} {maxnreg}  failed: {type(exc).__name__}: {exc}"[
                        :200
                    ]
                )
                continue
            n = sum(p.numel() for p in params)
            nbytes = moved_bytes(params, opt)
            print(
                f"{name:18s} {nb:3d} {warps} {stages} {item:4d} {maxnreg} {ms:7.3f} ms  {nbytes / n:5.2f} B/param  "
                f"{nbytes / ms / 1e6 / gbs:5.1%} of copy"
            )
            del opt
        del params
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
