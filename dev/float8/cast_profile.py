"""Where the time of one FP8 cast goes: host or device, and which kernel. For each cast of the benchmark
(``benchmarks/float8_casts.py``) and shape: the eager loop (device time of back-to-back calls, as the benchmark
measures it), the same calls replayed from a CUDA graph (device time alone), the host time per call, and the
kernels with their device time from the profiler. A loop much slower than its replay is host-bound.

Run: ``python3 dev/float8/cast_profile.py`` (CUDA needed).
"""

from __future__ import annotations

import time

import torch

from ampkernels.float8 import to_float8, to_float8_pair

SHAPES = (
    (16384, 2048, torch.bfloat16),
    (8192, 8192, torch.bfloat16),
    (16384, 8192, torch.bfloat16),
    (2048, 2048, torch.bfloat16),
    (8192, 2048, torch.float32),
)
CALLS = 50


def _variants(x: torch.Tensor) -> dict:
    scale = torch.full((), 448.0, device=x.device) / x.abs().amax().float()
    amax_out = torch.zeros((), device=x.device)
    found_inf = torch.zeros(1, device=x.device)
    return {
        "tensor": lambda: to_float8(x),
        "delayed": lambda: to_float8(x, scale=scale, amax_out=amax_out, found_inf=found_inf),
        "row": lambda: to_float8(x, granularity="row"),
        "transpose": lambda: to_float8(x, transpose=True),
        "transpose delayed": lambda: to_float8(x, scale=scale, amax_out=amax_out, found_inf=found_inf, transpose=True),
        "pair": lambda: to_float8_pair(x),
        "pair delayed": lambda: to_float8_pair(x, scale=scale, amax_out=amax_out, found_inf=found_inf),
        "pair e5m2": lambda: to_float8_pair(x, torch.float8_e5m2),
    }


def _loop_ms(fn) -> tuple[float, float]:
    """(device ms per call, host ms per call) of CALLS back-to-back calls."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(CALLS):
        fn()
    end.record()
    host = (time.perf_counter() - t0) * 1e3 / CALLS
    end.synchronize()
    return start.elapsed_time(end) / CALLS, host


def _graph_ms(fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (3 * CALLS)


def _kernels(fn) -> list[tuple[str, float]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.key, e.self_device_time_total / 10e3) for e in sorted(events, key=lambda e: -e.self_device_time_total)]


def _copy_bytes_per_s() -> float:
    """Bytes read + written per second by a graph-replayed copy of 1 GiB: the ceiling the floors below use.
    An elementwise kernel, not ``copy_``: captured in a graph, a same-dtype ``copy_`` becomes a memcpy node, which
    moved 2.44 TB/s on an H100 where the kernel moves 3.0."""
    src = torch.empty(2**28, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(300):  # ~0.2 s of copies first, so that the clocks are up
        torch.mul(src, 1.0, out=dst)
    ms = _graph_ms(lambda: torch.mul(src, 1.0, out=dst))
    return 2 * 2**30 / (ms * 1e-3)


def main() -> None:
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}")
    copy = _copy_bytes_per_s()
    torch.cuda.empty_cache()
    print(f"copy: {copy / 1e9:.0f} GB/s (read + write of 1 GiB, graph replay)")
    for M, K, dtype in SHAPES:
        x = torch.randn(M, K, device="cuda").mul_(3.0).to(dtype)
        floor_ms = x.numel() * (x.element_size() + 1) / copy * 1e3  # read x + write fp8 at the copy's rate
        print(f"== {M}x{K} {dtype} (one-pass floor at the copy's rate: {floor_ms:.4f} ms)")
        for name, fn in _variants(x).items():
            for _ in range(3):
                fn()
            loop_ms, host_ms = _loop_ms(fn)
            graph_ms = _graph_ms(fn)
            kernels = ", ".join(f"{k[:48]} {ms * 1e3:.1f}us" for k, ms in _kernels(fn))
            times = f"loop {loop_ms:.4f} ms  graph {graph_ms:.4f} ms ({graph_ms / floor_ms:.2f}x floor)"
            print(f"  {name:17s} {times}  host {host_ms * 1e3:6.1f} us | {kernels}")
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
