"""Where a Float8Linear on the GPU departs from its emulation: each cast against the reference bit for bit, each of
the three products against the reference product, then forward + backward, for every recipe, at a small and a large
shape. Prints one line per check; the first mismatch is the place to look.

Run: ``python3 dev/float8/linear_probe.py`` (CUDA needed).
"""

from __future__ import annotations

import torch

from ampkernels import reference, scaled_matmul
from ampkernels.float8 import Float8Linear, to_float8, to_float8_pair

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bits_equal(ours: torch.Tensor, ref: torch.Tensor) -> str:
    if ours.shape != ref.shape or ours.dtype != ref.dtype:
        return f"MISMATCH shape/dtype {tuple(ours.shape)} {ours.dtype} vs {tuple(ref.shape)} {ref.dtype}"
    if ours.dtype in (E4M3, E5M2):
        ours, ref = ours.view(torch.uint8), ref.view(torch.uint8)
    differ = (ours != ref) & ~(torch.isnan(ours.float()) & torch.isnan(ref.float()))
    return "ok" if not bool(differ.any()) else f"MISMATCH {int(differ.sum())} of {ours.numel()} elements"


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def _casts(x: torch.Tensor, dtype) -> None:
    for name, ours, ref in (
        ("tensor", to_float8(x, dtype), reference.to_float8(x, dtype)),
        ("tensor.T", to_float8(x, dtype, transpose=True), reference.to_float8(x, dtype, transpose=True)),
        ("row", to_float8(x, dtype, "row"), reference.to_float8(x, dtype, "row")),
        ("row.T", to_float8(x, dtype, "row", transpose=True), reference.to_float8(x, dtype, "row", transpose=True)),
        ("pair", to_float8_pair(x, dtype), reference.to_float8_pair(x, dtype)),
    ):
        checks = ", ".join(_bits_equal(o, r) for o, r in zip(ours, ref))
        print(f"  cast {name:8s} {str(dtype):20s} {tuple(x.shape)} {x.dtype}: {checks}")


def _products(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> None:
    x8, xt8, sx = reference.to_float8_pair(x, E4M3)
    w8, wt8, sw = reference.to_float8_pair(w, E4M3)
    g8, gt8, sg = reference.to_float8_pair(g, E5M2)
    for name, a, b, sa, sb, out_dtype in (
        ("y = x w^T", x8, w8.t(), sx, sw, torch.bfloat16),
        ("gx = g w", g8, wt8.t(), sg, sw, torch.bfloat16),
        ("gw = g^T x", gt8, xt8.t(), sg, sx, torch.float32),
    ):
        ref = reference.scaled_matmul_float8(a, b, sa, sb, out_dtype=torch.float32)
        for backend in ("auto", "triton", "cublas", "wgmma"):
            try:
                ours = scaled_matmul(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype, backend=backend)
                line = f"rel err {_rel(ours, ref):.2e}, finite {bool(torch.isfinite(ours).all())}"
            except Exception as error:  # a backend that cannot run here says why
                line = f"{type(error).__name__}: {str(error)[:100]}"
            print(f"  product {name:11s} {backend:6s} {tuple(a.shape)}x{tuple(b.shape)}: {line}")


def _layer(recipe: str, m: int, k: int, n: int) -> None:
    torch.manual_seed(0)
    plain = torch.nn.Linear(k, n, device="cuda")
    layer = Float8Linear.from_linear(torch.nn.Linear(k, n, device="cuda"), recipe)
    layer.load_state_dict(plain.state_dict())
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    out.backward(g)
    ref_out = torch.nn.functional.linear(x64, plain.weight.double(), plain.bias.double())
    ref_out.backward(g.double())
    print(
        f"  layer {recipe:10s} {m}x{k}->{n}: out {_rel(out, ref_out):.3f}, grad_x {_rel(x.grad, x64.grad):.3f}, "
        f"grad_w {_rel(layer.weight.grad, g.double().t() @ x64.detach()):.3f}, "
        f"finite {all(bool(torch.isfinite(t).all()) for t in (out, x.grad, layer.weight.grad))}"
    )


def main() -> None:
    for m, k, n in ((512, 64, 256), (16384, 2048, 8192)):
        print(f"shape M={m} K={k} N={n}")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
        w = torch.randn(n, k, device="cuda") * 0.02
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
        _casts(x, E4M3)
        _casts(w, E4M3)
        _casts(g, E5M2)
        _products(x, w, g)
        for recipe in ("tensorwise", "rowwise", "delayed"):
            _layer(recipe, m, k, n)


if __name__ == "__main__":
    main()
