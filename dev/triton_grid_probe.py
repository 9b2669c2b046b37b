"""The Triton multi-tensor unscale kernel with one program per chunk (its launch since session 6, as the CUDA
kernels) against the persistent grid it had before (8 programs per SM, each looping over chunks): Llama-1B set,
fp32, write and read-only, torch's copy_ as the ceiling, one process.
python3 dev/triton_grid_probe.py (GPU machine; no build needed)."""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.getcwd())
from ampkernels import ops  # noqa: E402
from ampkernels.triton import multi_tensor, num_sms  # noqa: E402
from benchmarks.param_sets import llama_1b_shapes  # noqa: E402

ONE_PER_CHUNK = multi_tensor._num_programs


def persistent(device: torch.device, chunks: int) -> int:
    return min(chunks, num_sms(device) * 8)


def main() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(s, device="cuda") for s in llama_1b_shapes()]
    nbytes = 4 * sum(g.numel() for g in grads)
    src, dst = torch.randn(2**28, device="cuda"), torch.empty(2**28, device="cuda")
    scale, found = torch.ones((), device="cuda"), torch.zeros((), device="cuda")

    def run(write: bool, grid) -> None:
        multi_tensor._num_programs = grid
        ops.unscale_reduce_(grads, scale, found, write=write, norm_type=None if write else 2.0, backend="triton")

    cases = {"torch copy_ 1 GiB": (lambda: dst.copy_(src), 2 * 4 * 2**28)}
    for write in (True, False):
        for name, cap in (("persistent", persistent), ("one per chunk", ONE_PER_CHUNK)):
            label = f"{'write' if write else 'read-only + norm'}, {name}"
            cases[label] = (lambda w=write, c=cap: run(w, c), nbytes * (2 if write else 1))
    for fn, _ in cases.values():
        fn()
    torch.cuda.synchronize()
    times = {k: [] for k in cases}
    for _ in range(7):
        for k, (fn, _) in cases.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                fn()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) / 5)
    copy_gbs = cases["torch copy_ 1 GiB"][1] / statistics.median(times["torch copy_ 1 GiB"]) / 1e6
    for k, (_, moved) in cases.items():
        ms = statistics.median(times[k])
        gbs = moved / ms / 1e6
        print(f"{k:40s} {ms:7.3f} ms {gbs:6.0f} GB/s {100 * gbs / copy_gbs:5.1f}% of copy")
    multi_tensor._num_programs = ONE_PER_CHUNK


if __name__ == "__main__":
    main()
