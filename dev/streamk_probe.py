"""Why does the stream-K variant of the Triton TMA kernel run slower than predicted? (H200, first measurement:
3072x768x8192 bf16 0.0816 ms against 0.0853 for the plain kernel, predicted ~0.05 from 69.8 of 128 k-steps per
program; 8192^3, almost all whole tiles, 1.605 against 1.417 ms.)

For each shape: the plain and the stream-K config, and the stream-K kernel with no tile shared (its whole-tile loop
alone); registers and spills of each compiled kernel.  python3 dev/streamk_probe.py   (GPU machine)
"""

import torch
import triton.testing

from ampkernels.triton import scaled_matmul as sm

SHAPES = [(3072, 768, 8192), (8192, 768, 3072), (8192, 8192, 8192)]


def main() -> None:
    plain = sm.Config(128, 256, 64, 3, 8, epilogue_split=2)
    stream = sm.Config(128, 256, 64, 3, 8, epilogue_split=2, stream_k=True)
    for M, N, K in SHAPES:
        a = torch.randn(M, K, device="cuda").bfloat16()
        b = torch.randn(K, N, device="cuda").bfloat16()
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        p = sm.Problem(a, b, None, 0, 1.0, None, out, False, None)
        plan = sm.plan_for(a, b, out)
        for name, cfg, no_sharing in (("plain", plain, False), ("stream-k", stream, False),
                                      ("stream-k, no tile shared", stream, True)):  # fmt: skip
            launcher = sm._Launcher(p, plan, cfg, direct=False)
            if no_sharing:
                tail = list(launcher.tail)
                tail[4] = 0  # stream_k_tiles: every tile whole, through the stream-K kernel's own loop
                launcher.tail = tuple(tail)
            args = launcher.args(a, b, None, 1.0, None, out, None)
            if launcher.device_desc:
                sm._ensure_allocator()
            compiled = launcher.kernel[launcher.grid](*args, **launcher.options)
            ms = triton.testing.do_bench(lambda f=launcher, x=(a, b, None, 1.0, None, out, None): f(*x))
            ref = (a.float() @ b.float()).bfloat16()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            print(
                f"{M}x{N}x{K} {name:26s} {ms:.4f} ms  {2 * M * N * K / ms / 1e9:6.0f} TFLOP/s  "
                f"regs {getattr(compiled, 'n_regs', '?')} spills {getattr(compiled, 'n_spills', '?')} "
                f"shared {compiled.metadata.shared if hasattr(compiled, 'metadata') else '?'}  "
                f"sk tiles {launcher.tail[4]}  rel err {err:.1e}"
            )


if __name__ == "__main__":
    main()
