"""Where the time of ``linear_cross_entropy`` goes on a GPU, by chunk size: loss + backward of the head alone (bf16,
16k tokens), its peak memory above the inputs, and the parts of one chunk timed alone (the logits GEMM, the Triton
loss kernel, the two gradient GEMMs with the float32 weight-gradient accumulation).

    python dev/loss/chunk_probe.py [--chunks 1024,2048,4096] [--backend triton]

Prints one line per shape and chunk size; the floors beside them: the three GEMMs' FLOPs at the bf16 rate measured
here on a [tokens, hidden] x [hidden, vocab] GEMM, and the kernel's 6 bytes per logit at the copy bandwidth measured
here.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import ampkernels
from ampkernels import dispatch
from ampkernels.loss import cross_entropy as lce

SHAPES = ((16384, 2048, 32000), (16384, 2048, 128256), (16384, 4096, 128256))


def _ms(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def _peak_gib(fn) -> float:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def _rates() -> tuple[float, float]:
    """(bf16 GEMM TFLOP/s on an 8192 x 2048 x 32000 problem, copy GB/s of a 2 GiB bf16 tensor)."""
    a = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(32000, 2048, device="cuda", dtype=torch.bfloat16)
    gemm_ms = _ms(lambda: a @ b.t())
    x = torch.empty(2**30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_ms = _ms(lambda: y.copy_(x))
    return 2 * 8192 * 2048 * 32000 / gemm_ms / 1e9, 2 * x.numel() * 2 / copy_ms / 1e6


def _parts(h, w, t, chunk: int) -> tuple[float, float, float, float]:
    """ms of one chunk's logits GEMM, loss kernel, grad_hidden GEMM and float32-accumulating grad_weight GEMM."""
    kernel = dispatch.triton_module("linear_cross_entropy")
    hc, tc, w = h[:chunk].detach(), t[:chunk], w.detach()
    logits = torch.empty(chunk, w.shape[0], device="cuda", dtype=torch.bfloat16)
    losses = torch.empty(chunk, device="cuda")
    ones = torch.ones((), device="cuda").expand(chunk)
    grad_w = torch.zeros(w.shape, device="cuda")
    grad_h = torch.empty_like(hc)
    return (
        _ms(lambda: torch.mm(hc, w.t(), out=logits)),
        _ms(lambda: kernel.cross_entropy_chunk_(logits, tc, ones, losses, -100, 0.0, 0.0)),
        _ms(lambda: torch.mm(logits, w, out=grad_h)),
        _ms(lambda: torch.addmm(grad_w, logits.t(), hc, out_dtype=torch.float32)),
    )


def _shape(tokens: int, hidden: int, vocab: int, chunks: list[int], backend: str, tflops: float, gbps: float):
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=gen) / hidden**0.5).bfloat16().requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    gemm_floor = 3 * 2 * tokens * hidden * vocab / tflops / 1e9
    kernel_floor = 6 * tokens * vocab / gbps / 1e6
    rule = lce.chunk_tokens
    print(
        f"{tokens} x {hidden} -> {vocab}: floor {gemm_floor:.1f} ms GEMMs + {kernel_floor:.1f} ms kernel; "
        f"the rule's chunk: {rule(tokens, vocab, hidden, 2)} tokens"
    )

    def step():
        h.grad = w.grad = None
        ampkernels.linear_cross_entropy(h, w, t, backend=backend).backward()

    for chunk in chunks:
        lce.chunk_tokens = lambda *_, chunk=chunk: chunk
        try:
            total = _ms(step, repeats=5)
            peak = _peak_gib(step)
        finally:
            lce.chunk_tokens = rule
        forward, rows, grad_hidden, grad_weight = _parts(h, w, t, chunk)
        n = -(-tokens // chunk)
        print(
            f"  chunk {chunk:5d}: {total:6.1f} ms, peak {peak:5.2f} GiB | per chunk x{n}: logits GEMM {forward:.2f}, "
            f"kernel {rows:.2f}, grad_hidden GEMM {grad_hidden:.2f}, grad_weight GEMM (float32 accumulation) "
            f"{grad_weight:.2f} -> {n * (forward + rows + grad_hidden + grad_weight):.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", default="1024,2048,4096,8192")
    parser.add_argument("--backend", default="triton")
    args = parser.parse_args()
    tflops, gbps = _rates()
    print(f"{torch.cuda.get_device_name()}: bf16 GEMM {tflops:.0f} TFLOP/s, copy {gbps:.0f} GB/s")
    for shape in SHAPES:
        _shape(*shape, [int(c) for c in args.chunks.split(",")], args.backend, tflops, gbps)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
