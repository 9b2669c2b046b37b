"""Does a matmul's measured speed depend on what ran just before it? (H200: the large products run at the 700 W cap.)

In one benchmark run our first variant measured 4-7% faster than the same kernels one or two turns
later (bf16 8192x4096x4096 fwd: 0.379 ms as "auto", which runs Triton or wgmma; 0.401 ms as "triton" and 0.399 ms as
"wgmma"). This prints, for
bf16 8192x4096x4096 (x @ W.T), per-launch times (CUDA events) over runs of `SECONDS` of one kernel, as medians per
100 ms window: after an idle pause, and right after another kernel's run. nvidia-smi samples SM clock and power
every 100 ms meanwhile (printed per segment).

python3 dev/matmul/power_probe.py   (GPU; ~25 s)
"""

from __future__ import annotations

import statistics
import subprocess
import time

import torch

from ampkernels import scaled_matmul

SECONDS = 1.5


def timeline(fn, seconds: float, est_ms: float) -> list[float]:
    """Launches fn back to back for ~seconds of GPU time; median ms per 100 ms window."""
    n = max(10, int(seconds * 1e3 / est_ms))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    t0 = events[0][0]
    windows: dict[int, list[float]] = {}
    for start, end in events:
        windows.setdefault(int(t0.elapsed_time(start) // 100), []).append(start.elapsed_time(end))
    return [statistics.median(v) for _, v in sorted(windows.items())]


def main() -> None:
    torch.manual_seed(0)
    a = torch.randn(8192, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, 4096, device="cuda").bfloat16()
    b = w.t()
    scale = torch.tensor(0.73, device="cuda")
    fns = {
        "cublas": lambda: torch.mm(a, b),
        "cublas_then_scale": lambda: torch.mm(a, b) * scale,
        "triton": lambda: scaled_matmul(a, b, scale, backend="triton"),
        "wgmma": lambda: scaled_matmul(a, b, scale, backend="wgmma"),
        "wmma": lambda: scaled_matmul(a, b, scale, backend="wmma"),
    }
    est = {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        est[name] = (time.perf_counter() - start) / 10 * 1e3
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader", "-lms", "100"],
        stdout=subprocess.PIPE,
        text=True,
    )
    sequences = [
        ["idle", "triton", "triton"],
        ["idle", "wmma", "triton"],
        ["idle", "cublas_then_scale", "triton"],
        ["idle", "cublas", "triton", "cublas"],
        ["idle", "triton", "wgmma", "triton"],
    ]
    for seq in sequences:
        print("== " + " -> ".join(seq))
        for name in seq:
            if name == "idle":
                torch.cuda.synchronize()
                time.sleep(2.0)
                continue
            t = time.strftime("%H:%M:%S")
            medians = timeline(fns[name], SECONDS, est[name])
            print(f"  {t} {name:18s} " + " ".join(f"{m:.3f}" for m in medians))
    smi.terminate()
    out = smi.communicate()[0].strip().splitlines()
    print("== nvidia-smi (timestamp, SM MHz, W), every 100 ms:")
    print("\n".join(out[:: max(1, len(out) // 120)]))


if __name__ == "__main__":
    main()
