"""The fused producers of FP8 inputs against torch (called by ``benchmarks/bench_float8.py``):
:func:`run_fused` times ``ampkernels.float8.rms_norm`` and ``silu_mul``, forward and forward + backward, on the
LlamaStack's shapes; :func:`report_fused` prints the table.

Bytes counted per row: what the op must move at least (the norm's rstd and weight are negligible):

| op | forward | backward |
|---|---|---|
| rms_norm, float32 x and weight (the stack's residual stream) | x read, out written | grad and x read, grad_x written |
| silu_mul, bfloat16 | gate and up read, out written | grad, gate and up read, grad_gate and grad_up written |
| rotary_embedding, bf16 q [B, heads, T, 128], a transposed view | q read, out written | grad read, grad_q written |

The torch rows are what a torch user runs, through autograd: for rms_norm torch's own ``F.rms_norm`` (one fused
kernel each way on CUDA; on the stack's fp32 residual stream the same function as ``benchmarks.models.RMSNorm``),
for the others, which torch has no op for, the stack's own code (``F.silu(gate) * up``, ``benchmarks.models.rotary``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from benchmarks.common import (
    CPU_CACHE_NOTE,
    check_cell,
    check_result,
    failure_lines,
    format_table,
    free_device_memory,
    time_interleaved,
)

TOKENS, CPU_TOKENS = 16384, 256
DIM, FFN = 2048, 8192
CPU_DIM, CPU_FFN = 128, 512
BATCH, HEAD_DIM = 8, 128


# What each torch row runs, recorded with it (the published table says which torch it was timed against).
NORM_CODE = "F.rms_norm"
SILU_CODE = "F.silu(gate) * up"
ROPE_CODE = "benchmarks.models.rotary"


def _torch_norm(x, weight):
    return F.rms_norm(x, (x.shape[-1],), weight, 1e-5)


def _cases(device: torch.device, small: bool) -> list[dict[str, Any]]:
    from ampkernels.float8 import rms_norm, rotary_embedding, silu_mul
    from benchmarks.models import rotary

    tokens, dim, ffn = (CPU_TOKENS, CPU_DIM, CPU_FFN) if small else (TOKENS, DIM, FFN)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, dim, device=device, generator=gen).requires_grad_()
    weight = (1.0 + 0.1 * torch.randn(dim, device=device, generator=gen)).requires_grad_()
    grad_norm = torch.randn(tokens, dim, device=device, generator=gen)
    gate = torch.randn(tokens, ffn, device=device, generator=gen).bfloat16().requires_grad_()
    up = torch.randn(tokens, ffn, device=device, generator=gen).bfloat16().requires_grad_()
    grad_h = torch.randn(tokens, ffn, device=device, generator=gen).bfloat16()
    n_norm, n_h = tokens * dim, tokens * ffn
    heads = dim // HEAD_DIM
    q = torch.randn(BATCH, tokens // BATCH, heads, HEAD_DIM, device=device, generator=gen).bfloat16()
    q = q.transpose(1, 2).requires_grad_()  # [B, heads, T, head_dim] as the attention reads it
    grad_q = torch.randn(q.shape, device=device, generator=gen).bfloat16()

    def forward_backward(fn, grad, *inputs):
        def run():
            for t in inputs:
                t.grad = None
            fn().backward(grad)

        return run

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()

        return run

    def verify(torch_fn, ours_fn, exact_fn, inputs, grad):
        """For the check: [(what, ours, torch's, float64)] of the forward output and, given ``grad``, the inputs'
        gradients."""

        def results(fn, leaves):
            out = fn(*leaves)
            if grad is None:
                return [out.detach()]
            return [out.detach(), *torch.autograd.grad(out, leaves, grad.to(out.dtype))]

        exact_leaves = [t.detach().double().requires_grad_() for t in inputs]
        names = ["output"] + ([f"grad of input {i}" for i in range(len(inputs))] if grad is not None else [])
        triples = zip(results(ours_fn, inputs), results(torch_fn, inputs), results(exact_fn, exact_leaves))
        return [(name, *values) for name, values in zip(names, triples, strict=True)]

    def rope_exact(t):
        half, positions = t.shape[-1] // 2, t.shape[-2]
        inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64, device=t.device) / half)
        angles = torch.arange(positions, dtype=torch.float64, device=t.device)[:, None] * inv_freq
        cos, sin = angles.cos(), angles.sin()
        t1, t2 = t[..., :half], t[..., half:]
        return torch.cat((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1)

    norm_args = (_torch_norm, rms_norm, _torch_norm, (x, weight))
    silu_args = (lambda g, u: F.silu(g) * u, silu_mul, lambda g, u: F.silu(g) * u, (gate, up))
    rope_args = (rotary, rotary_embedding, rope_exact, (q,))
    norm_torch, norm_ours = (lambda: _torch_norm(x, weight)), (lambda: rms_norm(x, weight))
    silu_torch, silu_ours = (lambda: F.silu(gate) * up), (lambda: silu_mul(gate, up))
    rope_torch, rope_ours = (lambda: rotary(q)), (lambda: rotary_embedding(q))
    return [
        dict(op="rms_norm", shape=f"{tokens}x{dim} fp32", pass_="forward", bytes=n_norm * 8, torch_code=NORM_CODE,
             torch=no_grad(norm_torch), ours=no_grad(norm_ours), verify=lambda: verify(*norm_args, None)),
        dict(op="rms_norm", shape=f"{tokens}x{dim} fp32", pass_="forward + backward", bytes=n_norm * 8 + n_norm * 12,
             torch_code=NORM_CODE, torch=forward_backward(norm_torch, grad_norm, x, weight),
             ours=forward_backward(norm_ours, grad_norm, x, weight), verify=lambda: verify(*norm_args, grad_norm)),
        dict(op="silu_mul", shape=f"{tokens}x{ffn} bf16", pass_="forward", bytes=n_h * 6, torch_code=SILU_CODE,
             torch=no_grad(silu_torch), ours=no_grad(silu_ours), verify=lambda: verify(*silu_args, None)),
        dict(op="silu_mul", shape=f"{tokens}x{ffn} bf16", pass_="forward + backward", bytes=n_h * 6 + n_h * 10,
             torch_code=SILU_CODE, torch=forward_backward(silu_torch, grad_h, gate, up),
             ours=forward_backward(silu_ours, grad_h, gate, up), verify=lambda: verify(*silu_args, grad_h)),
        dict(op="rotary_embedding", shape=f"{list(q.shape)} bf16", pass_="forward", bytes=n_norm * 4,
             torch_code=ROPE_CODE, torch=no_grad(rope_torch), ours=no_grad(rope_ours),
             verify=lambda: verify(*rope_args, None)),
        dict(op="rotary_embedding", shape=f"{list(q.shape)} bf16", pass_="forward + backward", bytes=n_norm * 8,
             torch_code=ROPE_CODE, torch=forward_backward(rope_torch, grad_q, q),
             ours=forward_backward(rope_ours, grad_q, q), verify=lambda: verify(*rope_args, grad_q)),
    ]  # fmt: skip


#: tests/float8/test_float8_fused.py (_check_error): ours' error against float64 (max norm, relative to the largest
#: element) within twice torch's, or one ulp of the output's dtype where torch's is below that.
CHECK_NOTE = (
    "check, after the timed loops: the output (and for forward + backward the inputs' gradients) of ampkernels and "
    "of the torch code against float64, the error (max norm, relative to the largest element) of ampkernels' within "
    "twice torch's or one ulp of the dtype, as tests/float8/test_float8_fused.py requires"
)


def _max_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return float((value.double() - exact.detach()).abs().max() / exact.detach().abs().max().clamp_min(1e-30))


def _check(case: dict[str, Any]) -> tuple[dict[str, float], str]:
    """(ours' and torch's largest error, the check) of one case."""
    problems, worst = [], {"ours": 0.0, "torch": 0.0}
    for what, ours, stock, exact in case["verify"]():
        ours_error, torch_error = _max_error(ours, exact), _max_error(stock, exact)
        worst = {"ours": max(worst["ours"], ours_error), "torch": max(worst["torch"], torch_error)}
        allowed = max(2 * torch_error, torch.finfo(ours.dtype).eps)
        if not ours_error <= allowed:
            problems.append(f"{what}: error {ours_error:.3e} against float64, torch's {torch_error:.3e}")
    return worst, check_result(problems)


def run_fused(ctx) -> list[dict[str, Any]]:
    """One row per (op, pass): ms of plain torch and of ampkernels (device time on a GPU), the bytes floor, GB/s and
    % of copy of ampkernels, the speedup."""
    from ampkernels import dispatch

    backend = dispatch.select("float8_fused", ctx.device)
    rows = []
    for case in _cases(ctx.device, ctx.cpu_small):
        timings = time_interleaved({"torch": case["torch"], "ours": case["ours"]}, ctx.device, ctx.repeats,
                                   ctx.target_loop_s)  # fmt: skip
        ms = {key: t.median_device_ms or t.median_wall_ms for key, t in timings.items()}
        errors, check = _check(case)
        gbs = case["bytes"] / (ms["ours"] * 1e-3) / 1e9
        rows.append(
            {
                "op": case["op"],
                "shape": case["shape"],
                "pass": case["pass_"],
                "torch_code": case["torch_code"],
                "bytes": case["bytes"],
                "torch_ms": ms["torch"],
                "ms": ms["ours"],
                "gbs": gbs,
                "pct_of_copy": 100.0 * gbs / ctx.copy_bandwidth_gbs,
                "speedup_over_torch": ms["torch"] / ms["ours"],
                "on_gpu": not ctx.cpu_small,
                "backend": backend,
                "max_error_vs_fp64": errors,
                "check": check,
            }
        )
    free_device_memory(ctx.device)
    return rows


def report_fused(rows: list[dict[str, Any]]) -> str:
    on_gpu = bool(rows) and rows[0]["on_gpu"]
    headers = ["op", "shape", "pass", "torch ms", "ampkernels ms", "GB/s"] + (["% copy"] if on_gpu else [])
    headers += ["vs torch", "check"]
    table = []
    for r in rows:
        cells = [r["op"], r["shape"], r["pass"], f"{r['torch_ms']:.4f}", f"{r['ms']:.4f}", f"{r['gbs']:.0f}"]
        if on_gpu:
            cells.append(f"{r['pct_of_copy']:.0f}%")
        table.append([*cells, f"{r['speedup_over_torch']:.2f}x", check_cell(r)])
    notes = ["GB/s and % copy: ampkernels' time against the bytes the op must move (module docstring)"]
    if rows:
        notes.append(f"ampkernels backend: {rows[-1]['backend']}")
    if not on_gpu:
        notes.append(CPU_CACHE_NOTE)
    notes.append(CHECK_NOTE)
    title = "Fused RMSNorm, SiLU-up and RoPE against torch's F.rms_norm and the model's plain torch (autograd)"
    table_text = format_table(headers, table, "lll" + "r" * (len(headers) - 4) + "l")
    return "\n".join([title, table_text, *failure_lines(rows), *[f"note: {n}" for n in notes]])
