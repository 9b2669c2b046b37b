"""Times variants of the in-place unscale kernel (dev/unscale_probe.cu) against torch's copy_ and in-place mul_ in
one process, on the Llama-1B gradient set (fp32, 5 GB) and on one 1 GiB tensor (the benchmark's copy size).

python3 dev/unscale_probe.py   (GPU machine; needs nvcc on PATH or CUDA_HOME). Prints GB/s (bytes read + written)
and % of copy_ measured in the same run; medians of interleaved rounds.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import statistics
import subprocess
import sys
from typing import NamedTuple

import torch

sys.path.insert(0, os.getcwd())
from benchmarks.param_sets import llama_1b_shapes  # noqa: E402


class Variant(NamedTuple):
    name: str
    kernel: int  # case of unscale_probe() in dev/unscale_probe.cu
    chunk: int  # elements per chunk of the table
    blocks_per_sm: int = 0  # 0: what is resident (a persistent grid); -1: one block per chunk


VARIANTS = [
    Variant("16K unroll4 (extension)", 0, 16384),
    Variant("16K unroll4, streaming stores", 1, 16384),
    Variant("16K unroll4, streaming loads+stores", 2, 16384),
    Variant("16K unroll8", 3, 16384),
    Variant("4K unroll4 (one trip a chunk)", 4, 4096),
    Variant("4K unroll4, streaming stores", 5, 4096),
    Variant("16K unroll4, no block barrier", 6, 16384),
    Variant("64K unroll4", 7, 65536),
    Variant("16K unroll4, .lu loads, .cg stores", 8, 16384),
    Variant("2K unroll2", 9, 2048),
    Variant("16K unroll8, 40 registers", 10, 16384),
    Variant("16K unroll4, 32 registers (8 blocks/SM)", 11, 16384),
    Variant("16K unroll16", 12, 16384),
    Variant("16K unroll4 pipelined", 13, 16384),
    Variant("16K unroll8 pipelined", 14, 16384),
    Variant("16K unroll8, 48 registers", 15, 16384),
    Variant("16K unroll8, streaming stores", 16, 16384),
    Variant("16K unroll4, one block a chunk", 0, 16384, -1),
    Variant("16K unroll8, one block a chunk", 3, 16384, -1),
    Variant("16K unroll4 lean (unchecked full trips)", 17, 16384),
    Variant("16K unroll8 lean", 18, 16384),
    Variant("16K unroll8 lean, 40 registers", 19, 16384),
    Variant("16K unroll16 lean", 20, 16384),
    Variant("16K unroll4 lean, 32 registers", 21, 16384),
    Variant("16K unroll16 lean, 3 blocks/SM", 22, 16384),
    Variant("16K unroll8 lean 40 registers, one block a chunk", 19, 16384, -1),
    Variant("16K unroll4 lean 32 registers, one block a chunk", 21, 16384, -1),
    Variant("16K unroll8 lean, one block a chunk", 18, 16384, -1),
    Variant("16K unroll16, one block a chunk", 12, 16384, -1),
    Variant("read-only 16K unroll4 (extension)", 23, 16384),
    Variant("read-only 16K unroll4, one block a chunk", 23, 16384, -1),
    Variant("read-only 16K unroll8, one block a chunk", 24, 16384, -1),
    Variant("read-only 16K unroll8 lean 40 registers", 25, 16384),
    Variant("read-only 16K unroll8 lean 40 registers, one block a chunk", 25, 16384, -1),
]


def build() -> ctypes.CDLL:
    home = os.environ.get("CUDA_HOME")
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    lib = "/tmp/unscale_probe.so"
    cmd = [nvcc, "-O3", "-arch=sm_90", "-shared", "-Xcompiler", "-fPIC", "-o", lib, "dev/unscale_probe.cu"]
    subprocess.run(cmd, check=True)
    dll = ctypes.CDLL(lib)
    dll.unscale_probe.restype = ctypes.c_int
    dll.unscale_probe.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 2
    dll.unscale_probe.argtypes += [ctypes.c_int, ctypes.c_void_p]
    return dll


def table(tensors: list[torch.Tensor], chunk: int) -> dict[str, torch.Tensor]:
    addrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    numels = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    per = [(t.numel() + chunk - 1) // chunk for t in tensors]
    chunk_tensor = torch.repeat_interleave(torch.arange(len(tensors)), torch.tensor(per))
    chunk_start = torch.cat([torch.arange(n) * chunk for n in per])
    out = dict(addrs=addrs, numels=numels, chunk_tensor=chunk_tensor, chunk_start=chunk_start)
    out = {k: v.cuda() for k, v in out.items()}
    out["partials"] = torch.zeros(len(chunk_tensor), device="cuda")
    return out


def launch(dll: ctypes.CDLL, stream: ctypes.c_void_p, v: Variant, t: dict[str, torch.Tensor], scale) -> None:
    args = [t[k].data_ptr() for k in ("addrs", "numels", "chunk_tensor", "chunk_start")]
    n = len(t["chunk_tensor"])
    rc = dll.unscale_probe(v.kernel, *args, n, scale.data_ptr(), t["partials"].data_ptr(), v.blocks_per_sm, stream)
    assert rc > 0, f"{v.name}: launch failed"


def timed_rounds(fns: dict[str, callable], rounds: int = 7, iters: int = 10) -> dict[str, float]:
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / iters)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    dll = build()
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    scale = torch.ones((), device="cuda")
    torch.manual_seed(0)
    sets = {
        "llama-1b": [torch.randn(s, device="cuda") for s in llama_1b_shapes()],
        "1 GiB": [torch.randn(2**28, device="cuda")],
    }
    src, dst = torch.randn(2**28, device="cuda"), torch.empty(2**28, device="cuda")
    for set_name, grads in sets.items():
        run_set(dll, stream, scale, set_name, grads, src, dst)
    check(dll, stream)
    print("all variants exact")


def run_set(dll, stream, scale, set_name, grads, src, dst) -> None:
    nbytes = 8 * sum(g.numel() for g in grads)
    fns = {"torch copy_ 1 GiB (the benchmark's ceiling)": lambda: dst.copy_(src)}
    if len(grads) == 1:
        fns["torch mul_(1.0) in place"] = lambda: grads[0].mul_(1.0)
    else:
        fns["torch _foreach_mul_(1.0)"] = lambda: torch._foreach_mul_(grads, 1.0)
    found = torch.zeros((), device="cuda")
    fns["stock unscale (_amp_foreach_non_finite_check_and_unscale_)"] = lambda: (
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, scale)
    )
    tables = {v.chunk: table(grads, v.chunk) for v in VARIANTS}
    for v in VARIANTS:
        fns[v.name] = lambda v=v: launch(dll, stream, v, tables[v.chunk], scale)
    ms = timed_rounds(fns)
    copy_gbs = 2 * 4 * 2**28 / (ms[next(iter(fns))] * 1e-3) / 1e9
    print(f"\n== {set_name}: {len(grads)} tensors, {nbytes / 1e9:.2f} GB moved per pass; copy_ {copy_gbs:.0f} GB/s")
    for name, m in ms.items():
        moved = nbytes // 2 if name.startswith("read-only") else nbytes
        gbs = (2 * 4 * 2**28 if name.startswith("torch copy_") else moved) / (m * 1e-3) / 1e9
        print(f"{name:62s} {m:8.3f} ms {gbs:7.0f} GB/s {100 * gbs / copy_gbs:5.1f}% of copy")


def check(dll, stream) -> None:
    """Correctness of every variant: one pass with a scale of 2 halves a known tensor exactly."""
    two = torch.full((), 2.0, device="cuda")
    for i, v in enumerate(VARIANTS):
        if v.name.startswith("read-only"):
            continue
        probe = [torch.randn(12345 + 7 * i, device="cuda"), torch.randn(3 * 2**16 + 5, device="cuda")]
        want = [p / 2 for p in probe]
        launch(dll, stream, v, table(probe, v.chunk), two)
        assert all(torch.equal(p, w) for p, w in zip(probe, want)), f"{v.name}: wrong"


if __name__ == "__main__":
    main()
