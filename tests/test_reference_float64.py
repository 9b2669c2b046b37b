"""The references of the fused ops (:mod:`ampkernels.reference`) against float64 formulas written out here, on the
CPU: RMSNorm, SiLU·up and rotary embedding (forward, and backward through autograd against the derivatives by hand),
the FP8 casts (scales, rounding, saturation, non-finite values) and ``scaled_matmul`` (16-bit, float32, float64 and
float8 operands).

Every other test compares the kernels with these references, so a wrong reference would move the target of all of
them: here each is held to a bound that any correct float32 computation meets (:func:`_bound`), or to exact equality
where the specified math is exact (the FP8 casts).
"""

from __future__ import annotations

import math

import pytest
import torch

from ampkernels import reference

F32 = torch.finfo(torch.float32).eps
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: mantissa bits, smallest normal exponent, largest finite value of each float8 format (OCP FP8).
FLOAT8_FORMATS = {E4M3: (3, -6, 448.0), E5M2: (2, -14, 57344.0)}


def _err(value: torch.Tensor, exact: torch.Tensor) -> float:
    """Relative error in the max norm against a float64 result."""
    return float((value.detach().double() - exact).abs().max() / exact.abs().max().clamp_min(1e-300))


def _bound(*dtypes: torch.dtype, float32_ulps: float = 8.0) -> float:
    """What a correct float32 computation rounded to ``dtypes`` reaches in :func:`_err`: at most two roundings to the
    lowest-precision dtype involved (half an ulp each) and ``float32_ulps`` float32 ulps of arithmetic."""
    return 2 * max(torch.finfo(d).eps for d in dtypes) + float32_ulps * F32


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------------------------------


def _rms_norm64(x, w, g, eps):
    """y = x * r * w with r = (mean(x^2) + eps)^-1/2 over the last dimension, and its derivatives by hand:
    dx = r * g * w - r^3 / D * x * sum(g * w * x), dw = sum over rows of g * x * r."""
    x, w, g = x.double(), w.double(), g.double()
    D = x.shape[-1]
    r = 1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) / D + eps)
    y = x * r * w
    gw = g * w
    dx = r * gw - r**3 / D * x * (gw * x).sum(-1, keepdim=True)
    dw = (g * x * r).reshape(-1, D).sum(0)
    return y, dx, dw


@pytest.mark.parametrize("eps", [1e-5, 1e-2])
@pytest.mark.parametrize("magnitude", [3.0, 0.01], ids=["x~3", "x~0.01"])  # 0.01: eps is a tenth of mean(x^2)
@pytest.mark.parametrize(
    "dtypes",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
     (torch.float16, torch.float16)],
    ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""),
)  # fmt: skip
def test_rms_norm_and_its_gradients(dtypes, magnitude, eps):
    gen = _generator(0)
    x = (torch.randn(3, 5, 67, generator=gen) * magnitude).to(dtypes[0]).requires_grad_()
    w = (1.0 + 0.3 * torch.randn(67, generator=gen)).to(dtypes[1]).requires_grad_()
    y = reference.rms_norm(x, w, eps)
    assert y.dtype == torch.promote_types(*dtypes)
    g = torch.randn(y.shape, generator=gen).to(y.dtype)
    y.backward(g)
    y64, dx64, dw64 = _rms_norm64(x.detach(), w.detach(), g, eps)
    for what, value, exact in (("out", y, y64), ("grad_x", x.grad, dx64), ("grad_weight", w.grad, dw64)):
        assert _err(value, exact) <= _bound(*dtypes), (what, _err(value, exact))


# --------------------------------------------------------------------------------------------------------------------
# SiLU * up
# --------------------------------------------------------------------------------------------------------------------


def _silu_mul64(gate, up, g):
    """out = gate * s * up with s = 1 / (1 + exp(-gate)); d/dgate = g * up * s * (1 + gate * (1 - s)),
    d/dup = g * gate * s."""
    gate, up, g = gate.double(), up.double(), g.double()
    s = 1.0 / (1.0 + torch.exp(-gate))
    return gate * s * up, g * up * s * (1.0 + gate * (1.0 - s)), g * gate * s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_silu_mul_and_its_gradients(dtype):
    gen = _generator(1)
    gate = (torch.randn(4, 129, generator=gen) * 4).to(dtype).requires_grad_()
    up = torch.randn(4, 129, generator=gen).to(dtype).requires_grad_()
    out = reference.silu_mul(gate, up)
    assert out.dtype == dtype
    g = torch.randn(out.shape, generator=gen).to(dtype)
    out.backward(g)
    exact = _silu_mul64(gate.detach(), up.detach(), g)
    for what, value, e in zip(("out", "grad_gate", "grad_up"), (out, gate.grad, up.grad), exact):
        assert _err(value, e) <= _bound(dtype), (what, _err(value, e))


def test_silu_mul_promotes_mixed_dtypes():
    gate = torch.randn(8, 16, generator=_generator(2)).bfloat16()
    up = torch.randn(8, 16, generator=_generator(3))
    out = reference.silu_mul(gate, up)
    assert out.dtype == torch.float32
    assert _err(out, _silu_mul64(gate, up, up)[0]) <= 8 * F32


# --------------------------------------------------------------------------------------------------------------------
# Rotary embedding
# --------------------------------------------------------------------------------------------------------------------


def _rotary64(x, g, base):
    """Half-split RoPE: at position t (dimension -2) the pair (x_i, x_{i+D/2}) turns by the angle
    a = t * base^(-i / (D/2)): (x_i cos a - x_{i+D/2} sin a, x_i sin a + x_{i+D/2} cos a). The gradient turns the
    incoming one back by -a."""
    T, D = x.shape[-2], x.shape[-1]
    half = D // 2
    i = torch.arange(half, dtype=torch.float64)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * base ** (-i / half)
    cos, sin = torch.cos(angle), torch.sin(angle)
    x, g = x.double(), g.double()
    x1, x2, g1, g2 = x[..., :half], x[..., half:], g[..., :half], g[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    grad = torch.cat((g1 * cos + g2 * sin, -g1 * sin + g2 * cos), dim=-1)
    return out, grad


def test_rotary_turns_a_pair_counterclockwise_by_t_radians():
    """By hand: D = 2 (one pair, frequency 1), the unit vector (1, 0) at position t becomes (cos t, sin t), and (0, 1)
    becomes (-sin t, cos t)."""
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    out = reference.rotary_embedding(x)
    expected = [[1.0, 0.0], [-math.sin(1.0), math.cos(1.0)], [math.cos(2.0), math.sin(2.0)]]
    expected.append([-math.sin(3.0), math.cos(3.0)])
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("base", [10000.0, 500.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 24, 16), (21, 18)], ids=str)
def test_rotary_embedding_and_its_gradient(shape, dtype, base):
    gen = _generator(4)
    x = (torch.randn(shape, generator=gen) * 2).to(dtype).requires_grad_()
    out = reference.rotary_embedding(x, base)
    assert out.dtype == dtype and out.shape == x.shape
    g = torch.randn(shape, generator=gen).to(dtype)
    out.backward(g)
    out64, grad64 = _rotary64(x.detach(), g, base)
    bound = _bound(dtype, float32_ulps=8 + shape[-2])  # float32 angles t * theta: off by up to t ulps
    assert _err(out, out64) <= bound, _err(out, out64)
    assert _err(x.grad, grad64) <= bound, _err(x.grad, grad64)


def test_rotary_tables():
    cos, sin = reference.rotary_tables(37, 8, 10000.0)
    angle = torch.arange(37, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(8, dtype=torch.float64) / 8)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (37, 8)
    assert (cos.double() - torch.cos(angle)).abs().max() <= 45 * F32
    assert (sin.double() - torch.sin(angle)).abs().max() <= 45 * F32


# --------------------------------------------------------------------------------------------------------------------
# FP8 casts
# --------------------------------------------------------------------------------------------------------------------


def _round_float8(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``v`` (float64, finite) rounded to the nearest value of the float8 format, ties to even, saturated at its
    largest finite value; float64. The spacing of the format at |v|: 2^(max(e, emin) - mantissa bits) where
    2^e <= |v| < 2^(e+1) (subnormals below 2^emin have the spacing of the smallest binade)."""
    mbits, emin, largest = FLOAT8_FORMATS[dtype]
    magnitude = v.abs()
    exponent = torch.frexp(magnitude).exponent.double() - 1  # |v| = m * 2^(exponent + 1), m in [0.5, 1)
    spacing = torch.pow(2.0, torch.clamp(exponent, min=emin) - mbits)
    rounded = torch.round(magnitude / spacing) * spacing  # torch.round: half to even; the division is exact
    return torch.sign(v) * torch.clamp(rounded, max=largest)


def _round_float32(v: torch.Tensor) -> torch.Tensor:
    return v.double().float().double()


def _wide_range(shape, seed: int) -> torch.Tensor:
    """Normal values times 2^u with u uniform in [-14, 4]: normal and subnormal float8 results, signs, ties."""
    gen = _generator(seed)
    return torch.randn(shape, generator=gen) * torch.pow(2.0, torch.randint(-14, 5, shape, generator=gen).float())


def test_float8_max_and_the_formats():
    assert reference.float8_max(E4M3) == 448.0 and reference.float8_max(E5M2) == 57344.0
    for dtype in (E4M3, E5M2):  # every code of the format is a fixed point of the formula
        codes = torch.arange(256, dtype=torch.uint8).view(dtype).double()
        finite = codes[torch.isfinite(codes)]
        assert torch.equal(_round_float8(finite, dtype), finite)


@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_float8_scale(dtype, margin):
    """float8_max / max(amax, 1e-12) / 2^margin, within the two float32 roundings of the specified computation; 1.0
    for a non-finite amax."""
    amax = torch.tensor([3.7, 1e-3, 5e4, 0.0, 1e-15, math.inf, math.nan])
    scale = reference.float8_scale(amax, dtype, margin)
    assert scale.dtype == torch.float32
    largest = FLOAT8_FORMATS[dtype][2]
    floor = torch.clamp(amax.double(), min=1e-12)
    expected = largest / floor / 2.0**margin
    finite = torch.isfinite(amax)
    relative = ((scale.double() - expected) / expected)[finite].abs().max()
    assert relative <= 2 * 2.0**-24, relative
    assert torch.equal(scale[~finite], torch.ones(2))


def _expected_cast(x: torch.Tensor, dtype: torch.dtype, scale32: torch.Tensor) -> torch.Tensor:
    """The specified cast: the float32 product x * scale (rounded to float32), saturated and rounded to the format;
    NaN where x is not finite."""
    v = _round_float32(x.double() * scale32.double())
    finite = torch.isfinite(v) & torch.isfinite(x)
    out = torch.full_like(v, math.nan)
    out[finite] = _round_float8(v[finite], dtype)
    return out


def _current_scale(amax64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The specified current scale in float32: fp32(fp32(1 / max(amax, 1e-12)) * float8_max)."""
    inverse = _round_float32(1.0 / torch.clamp(amax64, min=1e-12))
    return _round_float32(inverse * FLOAT8_FORMATS[dtype][2])


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_to_float8_current_scaling(dtype, granularity, transpose):
    """The scale from the amax of the tensor (or of each row of the written matrix), the data rounded to nearest even
    from the float32 product, bit for bit; the largest element lands on the format's largest value; the dequantized
    data is within half a float8 ulp of x (or the subnormal spacing)."""
    x = _wide_range((3, 9, 40), seed=5)
    data, scale_inv = reference.to_float8(x, dtype, granularity, transpose=transpose)
    rows = x.reshape(-1, 40).double()
    rows = rows.t() if transpose else rows
    assert data.dtype == dtype and data.shape == rows.shape and data.is_contiguous()
    amax = rows.abs().amax() if granularity == "tensor" else rows.abs().amax(dim=1, keepdim=True)
    scale = _current_scale(amax, dtype)
    assert scale_inv.shape == (() if granularity == "tensor" else (rows.shape[0], 1))
    assert ((scale_inv.double() * scale - 1).abs() <= 2.0**-24).all()  # 1 / scale, rounded once to float32
    assert torch.equal(data.double(), _expected_cast(rows, dtype, scale))
    mbits, emin, largest = FLOAT8_FORMATS[dtype]
    top = rows.abs() == amax
    assert (data.double().abs()[top] == largest).all()
    dequantized = data.double() * scale_inv.double()
    allowed = (2.0 ** -(mbits + 1) * rows.abs() + 2.0 ** (emin - mbits - 1) * scale_inv.double()) * (1 + 2**-20)
    assert ((dequantized - rows).abs() <= allowed).all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_to_float8_given_scale_saturates_and_flags(dtype):
    """A given (delayed) scale that pushes values past the format saturates them at ±its largest value instead of
    inf/NaN; an inf or NaN in x becomes NaN, sets found_inf and is not recorded in amax_out."""
    x = _wide_range((16, 24), seed=6)
    largest = FLOAT8_FORMATS[dtype][2]
    x[0, :4] = torch.tensor([1.0, -1.0, 1.01, -1.3]) * largest / 4  # scale 4: at and past the largest value
    scale = torch.tensor(4.0)
    amax_out, found_inf = torch.tensor(0.5), torch.zeros(1)
    data, scale_inv = reference.to_float8(x, dtype, scale=scale, amax_out=amax_out, found_inf=found_inf)
    assert scale_inv.item() == 0.25 and found_inf.item() == 0.0
    assert amax_out.item() == max(0.5, x.abs().max().item())
    assert torch.equal(data.double(), _expected_cast(x, dtype, scale))
    assert data[0, :4].double().tolist() == [largest, -largest, largest, -largest]
    x[3, 5], x[7, 1] = math.nan, -math.inf
    before = amax_out.clone()
    data, _ = reference.to_float8(x, dtype, scale=scale, amax_out=amax_out, found_inf=found_inf)
    assert data[3, 5].float().isnan() and data[7, 1].float().isnan()
    assert found_inf.item() == 1.0 and torch.equal(amax_out, before)
    finite = torch.isfinite(x)
    assert torch.equal(data.double()[finite], _expected_cast(x, dtype, scale)[finite])


def test_to_float8_rowwise_given_scales_and_the_pair():
    x = _wide_range((12, 32), seed=7)
    scales = torch.rand(12, 1, generator=_generator(8)) * 1e3 + 1.0
    data, scale_inv = reference.to_float8(x, E4M3, "row", scale=scales)
    assert torch.equal(data.double(), _expected_cast(x, E4M3, scales))
    assert torch.equal(scale_inv, torch.reciprocal(scales))
    data, data_t, scale_inv = reference.to_float8_pair(x, E5M2)
    scale = _current_scale(x.double().abs().amax(), E5M2)
    assert torch.equal(data.double(), _expected_cast(x, E5M2, scale))
    assert torch.equal(data_t.double(), _expected_cast(x, E5M2, scale).t()) and data_t.is_contiguous()


# --------------------------------------------------------------------------------------------------------------------
# scaled_matmul
# --------------------------------------------------------------------------------------------------------------------


def _rel_err(value: torch.Tensor, exact: torch.Tensor) -> float:
    """Relative error in the Frobenius norm."""
    return float((value.double() - exact).norm() / exact.norm())


def _matmul_bound(out_dtype: torch.dtype, K: int) -> float:
    """One rounding to ``out_dtype`` (half an ulp per element) and K float32 roundings of the sum (float64 operands:
    float64 ones); the 16-bit and float8 products are exact in float32."""
    accumulate = torch.finfo(torch.float64).eps if out_dtype == torch.float64 else F32
    return torch.finfo(out_dtype).eps / 2 + K * accumulate


@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor", "row", "column"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_scaled_matmul(dtype, scale_kind):
    """(a @ b) * (alpha * scale) + bias, added to out with accumulate; batched a."""
    gen = _generator(9)
    B, M, K, N = 2, 19, 45, 23
    a = torch.randn(B, M, K, generator=gen).to(dtype)
    b = torch.randn(K, N, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    old = torch.randn(B, M, N, generator=gen).to(dtype)
    scale = {
        "none": None,
        "float": 0.375,
        "tensor": torch.tensor(1.7),
        "row": torch.rand(B, M, 1, generator=gen) + 0.5,
        "column": torch.rand(N, generator=gen) + 0.5,
    }[scale_kind]
    out = old.clone()
    result = reference.scaled_matmul(a, b, scale, alpha=0.5, bias=bias, out=out, accumulate=True)
    assert result is out
    s = 1.0 if scale is None else (scale.double() if isinstance(scale, torch.Tensor) else scale)
    exact = old.double() + (a.double() @ b.double()) * (0.5 * s) + bias.double()
    assert _rel_err(out, exact) <= _matmul_bound(dtype, K), _rel_err(out, exact)
    plain = reference.scaled_matmul(a, b, scale, out_dtype=torch.float32)
    assert plain.dtype == torch.float32
    assert _rel_err(plain, (a.double() @ b.double()) * s) <= _matmul_bound(torch.float32, K)


def test_scaled_matmul_found_inf():
    a, b = torch.full((4, 8), 200.0).half(), torch.full((8, 4), 200.0).half()
    flag = torch.zeros(1)
    reference.scaled_matmul(a, b, 0.1, found_inf=flag)  # 32000: finite in float16
    assert flag.item() == 0.0
    reference.scaled_matmul(a, b, 1.0, found_inf=flag)  # 320000: inf in float16
    assert flag.item() == 1.0


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_scaled_matmul_float8(granularity, out_dtype):
    """(a @ b) * scale_a * scale_b * scale + bias, added to out with accumulate; the amax of the result as stored."""
    gen = _generator(10)
    M, K, N = 24, 64, 40
    a = torch.randn(M, K, generator=gen).to(E4M3)
    b = (torch.randn(N, K, generator=gen) * 8).to(E5M2).t()
    if granularity == "tensor":
        scale_a, scale_b = torch.tensor(0.75), torch.tensor(1.5)
    else:
        scale_a, scale_b = torch.rand(M, 1, generator=gen) + 0.5, torch.rand(1, N, generator=gen) + 0.5
    bias = torch.randn(N, generator=gen)
    old = torch.randn(M, N, generator=gen).to(out_dtype)
    amax = torch.tensor([0.25])
    out = old.clone()
    reference.scaled_matmul_float8(
        a, b, scale_a, scale_b, 0.5, bias=bias, out_dtype=out_dtype, out=out, accumulate=True, amax_out=amax
    )
    exact = old.double() + (a.double() @ b.double()) * scale_a.double() * scale_b.double() * 0.5 + bias.double()
    assert _rel_err(out, exact) <= _matmul_bound(out_dtype, K), _rel_err(out, exact)
    assert amax.item() == max(0.25, out.double().abs().max().item())
