"""SM clock and board power while cuBLAS and the WMMA kernel run back to back (8192^3 bf16, random operands).

Question: is the WMMA kernel held back by the power cap more than cuBLAS (mma.sync moves every operand through
registers, wgmma reads shared memory directly)? If it runs at a lower clock than cuBLAS, latency hiding is not
what limits it. python3 dev/wmma/clocks.py (GPU machine, after a build); samples nvidia-smi every 50 ms.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from ampkernels import _backend  # noqa: E402

_backend.native()
WMMA = torch.ops.ampkernels.scaled_matmul_wmma_


def sample_while(fn, seconds: float) -> tuple[float, list[tuple[float, float]]]:
    """Runs fn back to back for `seconds` while nvidia-smi samples; returns ms per call and (MHz, W) samples."""
    query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(query, stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    start.record()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    end.record()
    end.synchronize()
    smi.terminate()
    out, _ = smi.communicate()
    samples = []
    for line in out.strip().splitlines():
        try:
            mhz, watts = (float(x) for x in line.split(","))
            samples.append((mhz, watts))
        except ValueError:
            pass
    return start.elapsed_time(end) / calls, samples[6:-2]  # drop the idle lead-in and the tail


def main() -> None:
    n = 8192
    a = torch.randn(n, n, device="cuda").bfloat16()
    b = torch.randn(n, n, device="cuda").bfloat16()
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    scale = torch.ones((), device="cuda")
    print(subprocess.run(["nvidia-smi", "-q", "-d", "POWER,CLOCK"], capture_output=True, text=True).stdout[-2500:])
    cases = {
        "cuBLAS mm": lambda: torch.mm(a, b, out=out),
        "WMMA auto": lambda: WMMA(a, b, scale, 1, 1.0, None, out, False, None),
    }
    for name, fn in cases.items():
        ms, samples = sample_while(fn, 3.0)
        mhz = statistics.median(s[0] for s in samples) if samples else float("nan")
        watts = statistics.median(s[1] for s in samples) if samples else float("nan")
        tflops = 2 * n**3 / (ms * 1e-3) / 1e12
        print(
            f"{name:10s} {ms:7.3f} ms {tflops:6.0f} TFLOP/s  SM clock {mhz:6.0f} MHz  power {watts:5.0f} W"
            f"  ({len(samples)} samples; {tflops / mhz * 1e3:.1f} GFLOP/s per MHz)"
        )


if __name__ == "__main__":
    main()
