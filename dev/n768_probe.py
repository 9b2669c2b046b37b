"""The N=768 transformer shapes, where the Triton kernel trails cuBLAS (0.68-0.84x in the benchmark): every candidate
tiling in one process, against torch.mm, with and without an L2 flush between runs.

Questions:
1. Stream-K column by column (the default when every tile is shared) against all tiles in one sequence.
   (Answered earlier, variants since removed: 132, 128 or 120 programs made no difference on 3072x768x8192,
   0.0741-0.0760 ms; the 0.113 ms seen once came from the tuner's JIT launches.)
2. Which 128x128 pipeline (4 or 5 stages, flattened tile loop) serves 8192x768 best (384 tiles: 2.9 waves)?
3. (--proxy) Where do stream-K's 0.073 ms on 3072x768x8192 go, against ~0.046 predicted from the plain kernel's rate
   per SM (72 tiles of 128 k-steps in 0.085 ms, shared by 132 programs: 69.8 k-steps each)? The same work without a
   shared tile: 132 whole tiles of 70 k-steps (5632x768x4480, a read column-major as in grad-wt), and stream-K with
   every flag already raised (no program waits; the sums are wrong, the time is what waiting costs).

python3 dev/n768_probe.py [--proxy]   (GPU machine, after the build; PYTHONPATH=repository root)
"""

from __future__ import annotations

import statistics
import sys

import torch
import triton.testing

from ampkernels.triton import scaled_matmul as sm

# (M, N, K, layout): the benchmark's N=768 cases (fwd: b = W.T view; grad-wt: a = dy.T view).
SHAPES = [(3072, 768, 8192, "grad-wt"), (8192, 768, 3072, "grad-in"), (8192, 768, 3072, "fwd")]
VARIANTS = [
    ("128x256 s3 split2", sm.Config(128, 256, 64, 3, 8, epilogue_split=2), False),
    ("128x256 s3 split2 flat", sm.Config(128, 256, 64, 3, 8, epilogue_split=2, flatten=True), False),
    ("128x128 s4", sm.Config(128, 128, 64, 4, 8), False),
    ("128x128 s4 flat", sm.Config(128, 128, 64, 4, 8, flatten=True), False),
    ("128x128 s5", sm.Config(128, 128, 64, 5, 8), False),
    ("128x128 s5 flat", sm.Config(128, 128, 64, 5, 8, flatten=True), False),
    ("streamk 128x256 s3 split2", sm.Config(128, 256, 64, 3, 8, epilogue_split=2, stream_k=True), False),
    ("streamk 128x256 s3 split2, one sequence", sm.Config(128, 256, 64, 3, 8, epilogue_split=2, stream_k=True), True),
    ("streamk 128x128 s4", sm.Config(128, 128, 64, 4, 8, stream_k=True), False),
    ("streamk 128x128 s4, one sequence", sm.Config(128, 128, 64, 4, 8, stream_k=True), True),
]


def operands(M, N, K, layout):
    a = torch.randn(K, M, device="cuda").bfloat16().t() if layout == "grad-wt" else torch.randn(M, K, device="cuda")
    b = torch.randn(N, K, device="cuda").bfloat16().t() if layout == "fwd" else torch.randn(K, N, device="cuda")
    return a.bfloat16(), b.bfloat16()


def launcher(p, plan, cfg, one_sequence):
    """The benchmark's launcher; ``one_sequence``: stream-K over all tiles in one sequence, not column by column."""
    run = sm._Launcher(p, plan, cfg, direct=False)
    if one_sequence and run.stream_k_columns > 1:
        names = sm._scaled_mm_tma_kernel.arg_names
        tail = list(run.tail)
        tail[names.index("STREAM_K_COLUMNS") - names.index("M")] = 1
        run.tail = tuple(tail)
    return run


def back_to_back(fn, reps=200):
    """Median ms per call of `reps` launches between two events (no flush: L2 keeps the operands)."""
    fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def proxy() -> None:
    """Question 3: stream-K's cost over the same k-steps run as whole tiles, and the cost of its waits."""
    plain = sm.Config(128, 256, 64, 3, 8, epilogue_split=2)
    stream = sm.Config(128, 256, 64, 3, 8, epilogue_split=2, stream_k=True)
    for M, N, K, cfg, no_wait in (
        (3072, 768, 8192, plain, False),
        (3072, 768, 8192, stream, False),  # column by column
        (3072, 768, 8192, stream, True),
        (5632, 768, 4480, plain, False),
    ):
        a, b = operands(M, N, K, "grad-wt")
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        p = sm.Problem(a, b, None, 0, 1.0, None, out, False, None)
        run = sm._Launcher(p, sm.plan_for(a, b, out), cfg, direct=False)
        if no_wait:
            flags_at = sm._scaled_mm_tma_kernel.arg_names.index("flags_ptr")
            raised = torch.ones(run.grid[0], dtype=torch.int32, device="cuda")

            def fn(run=run, a=a, b=b, out=out, raised=raised, flags_at=flags_at):
                values = list(run.args(a, b, None, 1.0, None, out, None))
                values[flags_at] = raised
                sm._ensure_allocator()
                run.kernel[run.grid](*values, **run.options)

        else:
            fn = lambda run=run, a=a, b=b, out=out: run(a, b, None, 1.0, None, out, None)  # noqa: E731
        fn()
        flushed = triton.testing.do_bench(fn, warmup=10, rep=50)
        mm = triton.testing.do_bench(lambda a=a, b=b: torch.mm(a, b), warmup=10, rep=50)
        tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
        print(
            f"proxy {M}x{N}x{K} {cfg.describe():40s} {'no waits' if no_wait else '':8s} {tiles:3d} tiles "
            f"{flushed:.4f} ms ({2 * M * N * K / flushed / 1e9:4.0f} TFLOP/s), cuBLAS {mm:.4f} ms"
        )


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, "triton", triton.__version__)
    if "--proxy" in sys.argv:
        proxy()
        return
    for M, N, K, layout in SHAPES:
        a, b = operands(M, N, K, layout)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ b.float()
        flops = 2 * M * N * K
        rows = [("cuBLAS torch.mm", lambda a=a, b=b: torch.mm(a, b))]
        p = sm.Problem(a, b, None, 0, 1.0, None, out, False, None)
        plan = sm.plan_for(a, b, out)
        for name, cfg, one_sequence in VARIANTS:
            run = launcher(p, plan, cfg, one_sequence)
            rows.append((name, lambda run=run, a=a, b=b, out=out: run(a, b, None, 1.0, None, out, None)))
        for name, fn in rows:
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                print(f"{M}x{N}x{K} {layout:8s} {name:34s} failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            err = "" if name.startswith("cuBLAS") else f"rel err {((out.float() - ref).norm() / ref.norm()).item():.1e}"
            flushed = triton.testing.do_bench(fn, warmup=10, rep=50)
            warm = back_to_back(fn)
            print(
                f"{M}x{N}x{K} {layout:8s} {name:34s} flushed {flushed:.4f} ms ({flops / flushed / 1e9:4.0f} TFLOP/s)"
                f"  back-to-back {warm:.4f} ms  {err}"
            )


if __name__ == "__main__":
    main()
