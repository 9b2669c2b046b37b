"""Time one AdamW step with each state option on a Llama-3.2-1B-shaped set (147 tensors, 1,104M params) and
compare it to the bytes it must move.

    python3 dev/optimizers/lowbit_probe.py [--shrink N] [--steps N]

Bytes per parameter, per option, are counted from the state the optimizer really holds (tensors that keep float32
moments, the 1-D norms, are counted as such); % of copy is against a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch

from ampkernels import FusedAdamW
from benchmarks.param_sets import PARAM_SETS

CONFIGS = {
    "torch fused fp32": (torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
    "FusedAdamW fp32": (torch.float32, lambda ps: FusedAdamW(ps, lr=1e-3)),
    "FusedAdamW 8-bit": (
        torch.float32,
        lambda ps: FusedAdamW(ps, lr=1e-3, exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit"),
    ),
    "FusedAdamW 4-bit": (
        torch.float32,
        lambda ps: FusedAdamW(ps, lr=1e-3, exp_avg_dtype="4bit", exp_avg_sq_dtype="4bit"),
    ),
    "FusedAdamW bf16 moments": (
        torch.float32,
        lambda ps: FusedAdamW(ps, lr=1e-3, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    ),
    "torch fused bf16": (torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
    "FusedAdamW bf16 + master": (torch.bfloat16, lambda ps: FusedAdamW(ps, lr=1e-3, master_weights=True)),
    "FusedAdamW bf16 + SR": (torch.bfloat16, lambda ps: FusedAdamW(ps, lr=1e-3, stochastic_rounding=True)),
    "FusedAdamW bf16 + SR + 8-bit": (
        torch.bfloat16,
        lambda ps: FusedAdamW(ps, lr=1e-3, stochastic_rounding=True, exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit"),
    ),
}


KEYS = ("lr", "exp_avg_dtype", "exp_avg_sq_dtype", "stochastic_rounding", "master_weights")


def moved_bytes(params, opt) -> int:
    """Parameter read + write, gradient read, and every state tensor (but the step count) read + written."""
    total = 0
    for p in params:
        total += 2 * p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size()
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and key != "step":
                total += 2 * value.numel() * value.element_size()
    return total


def copy_gbs(nbytes: int = 1 << 31) -> float:
    src = torch.empty(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * 20 / (start.elapsed_time(end) * 1e-3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shrink", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", default="")
    parser.add_argument("--backend", default=None, help="native or triton (default: the best available)")
    args = parser.parse_args()
    gbs = copy_gbs()
    print(f"{torch.cuda.get_device_name()}: copy {gbs:.0f} GB/s (read + write)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (dtype, make) in CONFIGS.items():
        if args.only and args.only not in name:
            continue
        params = []
        for s in PARAM_SETS["llama-3.2-1b"](args.shrink):
            p = torch.nn.Parameter((torch.randn(s, device="cuda", generator=gen) * 0.02).to(dtype))
            p.grad = (torch.randn(s, device="cuda", generator=gen) * 1e-3).to(dtype)
            params.append(p)
        opt = make(params)
        if args.backend and isinstance(opt, FusedAdamW):
            opt = type(opt)(params, backend=args.backend, **{k: v for k, v in opt.defaults.items() if k in KEYS})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        for _ in range(3):
            opt.step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        for _ in range(args.steps):
            opt.step()
        end.record()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
        ms = start.elapsed_time(end) / args.steps
        n = sum(p.numel() for p in params)
        nbytes = moved_bytes(params, opt)
        state = sum(
            v.numel() * v.element_size()
            for p in params
            for k, v in opt.state[p].items()
            if isinstance(v, torch.Tensor) and k != "step"
        )
        print(
            f"{name:30s} {ms:7.3f} ms (wall {wall:7.3f})  {nbytes / n:5.2f} B/param moved  "
            f"{nbytes / ms / 1e6:6.0f} GB/s = {nbytes / ms / 1e6 / gbs:5.1%} of copy  state {state / n:5.2f} B/param  "
            f"first step {first * 1e3:7.1f} ms"
        )
        del opt, params
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
