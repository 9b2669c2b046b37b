"""scaled_matmul on float8 operands: every backend against ``reference.scaled_matmul_float8``, the accuracy rule
against ``torch._scaled_mm``, the amax/found_inf epilogue, layouts, odd and empty shapes, errors naming the
argument, "auto", the call cache, the torch.library op (opcheck, torch.compile).

Accuracy rule: ‖ours − ref64‖ / ‖ref64‖ ≤ 2 × the same error of ``torch._scaled_mm`` on the same fp8 inputs (+ a
tiny eps); ``ref64`` is the float64 product of the fp8 values, written here. Where the stock result is the reference
itself (on the CPU, and the torch backend), its own error against ``ref64`` is bounded too (:func:`_bound`), so that
a wrong reference fails instead of loosening the rule. On CPU, ``torch._scaled_mm`` is torch's
CPU kernel and Triton runs in its interpreter, where fp8 ``tl.dot`` works (the kernel upcasts to fp32: exact
products); the same tests run on the GPU with the real kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
from scaled_matmul_helpers import _rel_err

from ampkernels import dispatch, reference
from ampkernels.matmul import api as sm_api
from ampkernels.matmul import backends as sm_backends
from ampkernels.matmul import launch as sm_dispatch
from ampkernels.matmul import tuning
from ampkernels.scaled_matmul import scaled_matmul

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
PAIR_IDS = ["e4m3xe4m3", "e5m2xe4m3", "e4m3xe5m2"]
BACKENDS = ["torch", "cublas", "triton", "wgmma", "auto"]


def _need(backend: str, device: str) -> None:
    reason = dispatch.why_not("scaled_matmul_float8", backend, torch.device(device))
    if reason is not None:
        pytest.skip(reason)


def _fp8(rows: int, cols: int, dtype, device, transposed: bool = False) -> torch.Tensor:
    """Random normal data cast to ``dtype`` (never all zero); ``transposed``: a column-major view."""
    if transposed:
        return torch.randn(cols, rows, device=device).to(dtype).t()
    return torch.randn(rows, cols, device=device).to(dtype)


def _operands(M: int, N: int, K: int, pair, device, a_t: bool = False, b_row: bool = False):
    """a [M, K] (row-major, or a column-major view), b [K, N] (column-major: w8.t(), or row-major)."""
    a = _fp8(M, K, pair[0], device, a_t)
    b = _fp8(K, N, pair[1], device, not b_row)
    return a, b


def _factors(granularity: str, M: int, N: int, device, batch: tuple[int, ...] = ()):
    if granularity == "tensor":
        return torch.tensor(0.75, device=device), torch.tensor(1.5, device=device)
    return torch.rand(*batch, M, 1, device=device) + 0.5, torch.rand(1, N, device=device) + 0.5


def _ref64(a, b, scale_a, scale_b, scale=None, bias=None, old=None):
    return _ref64_from(a.double() @ b.double(), scale_a, scale_b, scale, bias, old)


def _ref64_from(v, scale_a, scale_b, scale=None, bias=None, old=None):
    if scale_a is not None:
        v = v * scale_a.double().reshape(-1, 1)
    if scale_b is not None:
        v = v * scale_b.double().reshape(1, -1)
    if scale is not None:
        v = v * (scale.double() if isinstance(scale, torch.Tensor) else scale)
    if bias is not None:
        v = v + bias.double()
    return v if old is None else old.double() + v


def _stock(a, b, scale_a, scale_b, scale=None, bias=None, out_dtype=torch.bfloat16):
    """What stock PyTorch computes from these fp8 operands, the error the rule compares against. On CUDA: cuBLAS's
    fp8 product (``torch._scaled_mm`` with unit factors, fp32 out), then the factors, scale and bias in float64 and
    the rounding to ``out_dtype``. Hopper's tensor cores accumulate fp8 products with fewer bits than fp32 (measured
    ~1e-4 relative, against ~3e-8 for the exact fp32 reference), which every fp8 backend shares. Where cuBLAS refuses
    the shape, and on the CPU: the reference."""
    K, N = b.shape
    if a.device.type != "cuda" or K % 16 or N % 16:
        return reference.scaled_matmul_float8(a, b, scale_a, scale_b, scale, bias=bias, out_dtype=out_dtype)
    one = torch.ones((), device=a.device)
    product = torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), one, one, out_dtype=torch.float32)
    return _ref64_from(product.double(), scale_a, scale_b, scale, bias).to(out_dtype)


def _bound(out_dtype: torch.dtype, K: int, device) -> float:
    """The largest ``_rel_err`` against float64 that a correct product reaches: its float32 value rounded once to
    ``out_dtype`` (half an ulp per element, so at most ``eps / 2`` in the norm), plus the float32 sum over K (products
    of fp8 values are exact in float32; K roundings of the running sum are within K float32 ulps), plus on CUDA the
    fp8 tensor cores' shorter accumulator (~1e-4 measured, see _stock; 1e-3 allowed)."""
    f32 = torch.finfo(torch.float32).eps
    return torch.finfo(out_dtype).eps / 2 + K * f32 + (1e-3 if torch.device(device).type == "cuda" else 0.0)


def _close_to_reference(ours, expected, device, backend):
    """Against the exact fp32 reference: bit-level agreement on the CPU; on CUDA within the fp8 tensor cores'
    accumulation error (see _stock), ~1e-4 relative, checked at 5e-4 of the result's norm."""
    if device == "cpu" or backend == "torch":
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-4)
    else:
        assert _rel_err(ours, expected.double()) < 5e-4


def _assert_within_twice(ours, stock, ref, bound: float):
    """The rule: at most twice the stock path's error against the float64 reference (+ a tiny eps), with the stock
    path's own error within ``bound`` (:func:`_bound`)."""
    ours_err, stock_err = _rel_err(ours, ref), _rel_err(stock, ref)
    assert stock_err <= bound, f"stock's error {stock_err:.3e} against float64 exceeds {bound:.3e}"
    assert ours_err <= 2.0 * stock_err + 1e-6, f"error {ours_err:.3e} vs {stock_err:.3e}"


def _interpreted(device: str, backend: str) -> bool:
    """Triton in the interpreter: "triton", and "auto" where it picks Triton (a CPU has no wgmma)."""
    return device == "cpu" and backend in ("triton", "auto")


def _assert_amax(amax_out, old: float, out):
    expected = max(old, out.float().abs().max().item()) if out.numel() else old
    assert amax_out.item() == expected, (amax_out.item(), expected)


# --------------------------------------------------------------------------------------------------------------------
# Every backend, the whole epilogue
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_backend_matches_the_reference(device, backend, pair, granularity, out_dtype, fresh_caches):
    """scale + bias + out_dtype + found_inf + amax_out, into a poisoned ``out``: within 2x the error of what stock
    computes against float64 (``_stock``: torch._scaled_mm on CUDA, the reference on the CPU; the torch backend: bit
    for bit the reference), amax exactly that of the stored output, found_inf untouched on finite data."""
    _need(backend, device)
    torch.manual_seed(1)
    M, N, K = 48, 64, 96
    a, b = _operands(M, N, K, pair, device)
    scale_a, scale_b = _factors(granularity, M, N, device)
    scale, bias = torch.tensor(0.5, device=device), torch.randn(N, device=device)
    out = torch.full((M, N), float("nan"), dtype=out_dtype, device=device)
    flag, amax = torch.zeros(1, device=device), torch.full((1,), 0.25, device=device)
    result = scaled_matmul(
        a, b, scale, scale_a=scale_a, scale_b=scale_b, bias=bias, out=out, found_inf=flag, amax_out=amax,
        backend=backend,
    )  # fmt: skip
    assert result is out
    expected = reference.scaled_matmul_float8(a, b, scale_a, scale_b, scale, bias=bias, out_dtype=out_dtype)
    if backend == "torch":
        assert torch.equal(out, expected)
    ref = _ref64(a, b, scale_a, scale_b, scale, bias)
    stock = _stock(a, b, scale_a, scale_b, scale, bias, out_dtype)
    _assert_within_twice(out, stock, ref, _bound(out_dtype, K, device))
    assert flag.item() == 0.0
    _assert_amax(amax, 0.25, out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulate_tensorwise_product_into_fp32(device, backend, fresh_caches):
    """The fused loss's FP8 weight gradient: ``out += (a @ b) * scale_a * scale_b`` with one scale per operand, no
    scale, bias or amax (cuBLAS's own epilogue scales it, then one add)."""
    _need(backend, device)
    torch.manual_seed(3)
    a = torch.randn(48, 64, device=device).to(E5M2)
    b = _fp8(64, 32, E4M3, device, transposed=True)
    scale_a, scale_b = torch.tensor([0.75], device=device), torch.tensor([1.5], device=device)
    old = torch.randn(48, 32, device=device)
    out = old.clone()
    scaled_matmul(a, b, scale_a=scale_a, scale_b=scale_b, out=out, accumulate=True, backend=backend)
    expected = reference.scaled_matmul_float8(
        a, b, scale_a, scale_b, None, out_dtype=torch.float32, out=old.clone(), accumulate=True
    )
    _close_to_reference(out, expected, device, backend)
    exact = _ref64(a, b, scale_a, scale_b, 1.0, old=old)
    assert _rel_err(out, exact) <= _bound(torch.float32, 64, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulate_into_fp32(device, backend, fresh_caches):
    """Weight-gradient accumulation: ``out += (a @ b) * scale_a * scale_b`` in fp32, batch dims on a (rowwise
    factors of shape a.shape[:-1] + (1,)), a float scale."""
    _need(backend, device)
    torch.manual_seed(2)
    a = torch.randn(2, 24, 64, device=device).to(E5M2)
    b = _fp8(64, 32, E4M3, device, transposed=True)
    scale_a, scale_b = torch.rand(2, 24, 1, device=device) + 0.5, torch.rand(32, device=device) + 0.5
    old = torch.randn(2, 24, 32, device=device)
    out, amax = old.clone(), torch.zeros(1, device=device)
    scaled_matmul(
        a, b, 0.25, scale_a=scale_a, scale_b=scale_b, out=out, accumulate=True, amax_out=amax, backend=backend
    )
    expected = reference.scaled_matmul_float8(
        a.reshape(48, 64), b, scale_a.reshape(48, 1), scale_b, 0.25, out_dtype=torch.float32,
        out=old.clone().reshape(48, 32), accumulate=True,
    )  # fmt: skip
    _close_to_reference(out.reshape(48, 32), expected, device, backend)
    exact = _ref64(a.reshape(48, 64), b, scale_a.reshape(48, 1), scale_b, 0.25, old=old.reshape(48, 32))
    assert _rel_err(expected, exact) <= _bound(torch.float32, 64, "cpu")  # the reference itself
    assert _rel_err(out.reshape(48, 32), exact) <= _bound(torch.float32, 64, device)
    _assert_amax(amax, 0.0, out)


# --------------------------------------------------------------------------------------------------------------------
# The accuracy rule against torch._scaled_mm
# --------------------------------------------------------------------------------------------------------------------


def _gpu_shapes(device: str) -> list[tuple[int, int, int]]:
    return [(256, 512, 1024), (1000, 768, 3072)] if device == "cuda" else [(64, 32, 128)]


@pytest.mark.parametrize("backend", ["triton", "wgmma", "auto", "cublas"])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("pair", PAIRS[:2], ids=PAIR_IDS[:2])
def test_error_at_most_twice_scaled_mm(device, backend, granularity, pair, fresh_caches):
    """Our GEMM's error against float64 on the same fp8 inputs is at most 2x torch._scaled_mm's (bf16 output)."""
    _need(backend, device)
    torch.manual_seed(3)
    for M, N, K in _gpu_shapes(device):
        a, b = _operands(M, N, K, pair, device)
        scale_a, scale_b = _factors(granularity, M, N, device)
        ours = scaled_matmul(a, b, scale_a=scale_a, scale_b=scale_b, backend=backend)
        assert ours.dtype == torch.bfloat16
        if granularity == "tensor":
            stock = torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)
        else:
            stock = torch._scaled_mm(a, b, scale_a, scale_b.reshape(1, N), out_dtype=torch.bfloat16)
        _assert_within_twice(ours, stock, _ref64(a, b, scale_a, scale_b), _bound(torch.bfloat16, K, device))


# --------------------------------------------------------------------------------------------------------------------
# Layouts, odd and empty shapes
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["a col-major", "b row-major", "a sliced rows", "both"])
def test_other_layouts(device, backend, layout, fresh_caches):
    """Layouts other than a row-major / b column-major are copied to it first: the same values."""
    _need(backend, device)
    torch.manual_seed(4)
    M, N, K = 32, 48, 64
    a, b = _operands(
        M, N, K, (E4M3, E4M3), device, a_t=layout in ("a col-major", "both"), b_row=layout != "a sliced rows"
    )
    if layout == "a sliced rows":
        a = _fp8(M, 2 * K, E4M3, device)[:, K:]  # leading stride 2K, base offset K bytes
    scale_a, scale_b = _factors("row", M, N, device)
    ours = scaled_matmul(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32, backend=backend)
    expected = reference.scaled_matmul_float8(a, b, scale_a, scale_b, out_dtype=torch.float32)
    _close_to_reference(ours, expected, device, backend)
    exact = _ref64(a, b, scale_a, scale_b)
    assert _rel_err(expected, exact) <= _bound(torch.float32, K, "cpu")  # the reference itself
    assert _rel_err(ours, exact) <= _bound(torch.float32, K, device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(17, 33, 13), (1, 1, 1), (5, 16, 48), (33, 17, 16)])
def test_odd_shapes(device, backend, shape, fresh_caches):
    """M, N, K not multiples of 16. cuBLAS needs K and N multiples of 16: on the GPU backend='cublas' refuses the
    others with the reason (and 'auto' leaves cuBLAS out for them); torch's CPU kernel takes any shape."""
    _need(backend, device)
    torch.manual_seed(5)
    M, N, K = shape
    a, b = _operands(M, N, K, (E4M3, E5M2), device)
    scale_a, scale_b = _factors("row", M, N, device)
    bias = torch.randn(N, device=device).to(torch.bfloat16)
    call = lambda: scaled_matmul(a, b, 2.0, scale_a=scale_a, scale_b=scale_b, bias=bias, backend=backend)  # noqa: E731
    refused = backend == "cublas" and sm_dispatch.cublas_refuses(K, N, torch.device(device))
    if refused or (backend == "wgmma" and K % 16):
        with pytest.raises(ValueError, match="'backend'.*multiples of 16"):
            call()
        return
    ours = call()
    ref = _ref64(a, b, scale_a, scale_b, 2.0, bias)
    _assert_within_twice(ours, _stock(a, b, scale_a, scale_b, 2.0, bias), ref, _bound(torch.bfloat16, K, device))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 16, 32), (16, 0, 32), (16, 32, 0)])
def test_empty_dims(device, backend, shape, fresh_caches):
    """M or N = 0: nothing written, flags untouched; K = 0: out = bias (+ old), amax of that."""
    _need(backend, device)
    M, N, K = shape
    a, b = _operands(M, N, K, (E4M3, E4M3), device)
    bias = torch.randn(N, device=device)
    old = torch.randn(M, N, device=device)
    out, flag, amax = old.clone(), torch.zeros(1, device=device), torch.zeros(1, device=device)
    scaled_matmul(a, b, bias=bias, out=out, accumulate=True, found_inf=flag, amax_out=amax, backend=backend)
    torch.testing.assert_close(out, old + bias)
    assert flag.item() == 0.0
    _assert_amax(amax, 0.0, out)


# --------------------------------------------------------------------------------------------------------------------
# Non-finite values, the amax's NaN order
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("poison", ["nan in a", "inf bias", "fp16 overflow"])
def test_non_finite_sets_found_inf_and_amax(device, backend, poison, fresh_caches):
    """A NaN in an operand makes the amax NaN (as torch.maximum would); an inf output makes it inf; an fp16
    overflow in the cast counts as stored. found_inf is set in every case."""
    _need(backend, device)
    if poison == "nan in a" and _interpreted(device, backend):
        pytest.skip("the Triton interpreter converts fp8 NaN codes to finite values (e4m3fn 0x7f reads as 480)")
    torch.manual_seed(6)
    M, N, K = 32, 32, 64
    a, b = _operands(M, N, K, (E4M3, E4M3), device)
    bias = torch.zeros(N, device=device)
    out_dtype, scale = torch.bfloat16, 1.0
    if poison == "nan in a":
        a = a.clone()
        a[5, 7] = float("nan")
    elif poison == "inf bias":
        bias[3] = float("inf")
    else:
        out_dtype, scale = torch.float16, 1e6
    flag, amax = torch.zeros(1, device=device), torch.full((1,), 3.0, device=device)
    out = scaled_matmul(a, b, scale, bias=bias, out_dtype=out_dtype, found_inf=flag, amax_out=amax, backend=backend)
    assert flag.item() == 1.0
    if poison == "nan in a":
        assert math.isnan(amax.item())
    else:
        assert amax.item() == math.inf
    ref_amax = torch.full((1,), 3.0, device=device)
    reference.scaled_matmul_float8(a, b, None, None, scale, bias=bias, out_dtype=out_dtype, amax_out=ref_amax)
    assert torch.equal(amax.isnan(), ref_amax.isnan()) and (amax.isnan().item() or amax.item() == ref_amax.item())
    assert out.shape == (M, N)


@pytest.mark.parametrize("backend", ["triton", "torch", "cublas"])
def test_amax_keeps_a_larger_old_value(device, backend, fresh_caches):
    _need(backend, device)
    a, b = _operands(16, 16, 32, (E4M3, E4M3), device)
    amax = torch.full((1,), 1e30, device=device)
    scaled_matmul(a, b, amax_out=amax, backend=backend)
    assert amax.item() == torch.tensor(1e30).item()  # 1e30 rounded to float32


# --------------------------------------------------------------------------------------------------------------------
# 16-bit operands with amax_out
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_amax_out_with_16_bit_operands(device, backend, fresh_caches):
    """amax_out works with float16/bfloat16 operands too: in the Triton epilogue, after the launch elsewhere."""
    if dispatch.why_not("scaled_matmul", backend, torch.device(device)) is not None:
        pytest.skip(dispatch.why_not("scaled_matmul", backend, torch.device(device)))
    torch.manual_seed(7)
    a = torch.randn(40, 64, device=device).half()
    b = torch.randn(64, 24, device=device).half()
    amax = torch.zeros(1, device=device)
    out = scaled_matmul(a, b, 0.5, amax_out=amax, backend=backend)
    assert torch.equal(out, scaled_matmul(a, b, 0.5, backend=backend))
    _assert_amax(amax, 0.0, out)


# --------------------------------------------------------------------------------------------------------------------
# Errors name the argument
# --------------------------------------------------------------------------------------------------------------------


def _bad_cases():
    a, b = _fp8(8, 16, E4M3, "cpu"), _fp8(16, 12, E4M3, "cpu", transposed=True)
    a5, b5 = a.to(E5M2), b.to(E5M2)
    h = torch.randn(8, 16).half()
    one = torch.tensor(1.0)
    return {
        "e5m2 x e5m2": (lambda: scaled_matmul(a5, b5), "'b'.*e5m2"),
        "b 16-bit": (lambda: scaled_matmul(a, b.half()), "'b'.*float8"),
        "inner dims": (lambda: scaled_matmul(a, _fp8(15, 12, E4M3, "cpu")), "'b'.*inner"),
        "scale_a shape": (lambda: scaled_matmul(a, b, scale_a=torch.ones(8)), "'scale_a'.*shape"),
        "scale_a dtype": (lambda: scaled_matmul(a, b, scale_a=torch.ones(8, 1).double()), "'scale_a'.*float32"),
        "scale_a type": (lambda: scaled_matmul(a, b, scale_a=1.0), "'scale_a'"),
        "scale_b shape": (lambda: scaled_matmul(a, b, scale_b=torch.ones(12, 1)), "'scale_b'.*shape"),
        "scale_b device": (lambda: scaled_matmul(a, b, scale_b=torch.ones(1, device="meta")), "'scale_b'.*meta"),
        "scale_a with 16-bit": (lambda: scaled_matmul(h, h.t(), scale_a=one), "'scale_a'.*float8"),
        "scale_b with 16-bit": (lambda: scaled_matmul(h, h.t(), scale_b=one), "'scale_b'.*float8"),
        "amax_out dtype": (lambda: scaled_matmul(a, b, amax_out=torch.zeros(1).half()), "'amax_out'"),
        "amax_out shape": (lambda: scaled_matmul(a, b, amax_out=torch.zeros(2)), "'amax_out'"),
        "out_dtype": (lambda: scaled_matmul(a, b, out_dtype=E4M3), "'out_dtype'"),
        "out dtype": (lambda: scaled_matmul(a, b, out=torch.empty(8, 12)), None),  # fp32 out: allowed
        "out shape": (lambda: scaled_matmul(a, b, out=torch.empty(12, 8)), "'out'.*shape"),
        "accumulate": (lambda: scaled_matmul(a, b, accumulate=True), "'accumulate'"),
        "found_inf": (lambda: scaled_matmul(a, b, found_inf=torch.zeros(1).half()), "'found_inf'"),
        "bias grad": (lambda: scaled_matmul(a, b, bias=torch.zeros(12, requires_grad=True)), "'bias'.*grad"),
        "scale grad": (lambda: scaled_matmul(a, b, torch.ones((), requires_grad=True)), "'scale'.*grad"),
        "scale_a grad": (lambda: scaled_matmul(a, b, scale_a=torch.ones((), requires_grad=True)), "'scale_a'.*grad"),
        "wmma": (lambda: scaled_matmul(a, b, backend="wmma"), "'backend'.*auto/triton/wgmma/cublas/torch"),
        "cublas with 16-bit": (lambda: scaled_matmul(h, h.t(), backend="cublas"), "'backend'.*float8"),
        "out overlaps scale_a": (lambda: _out_overlapping_scale_a(a, b), "'out'.*overlaps argument 'scale_a'"),
    }


def _out_overlapping_scale_a(a, b):
    out = torch.empty(8, 12)
    return scaled_matmul(a, b, scale_a=out[:, :1], out=out)


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_names_the_argument(case):
    call, pattern = _bad_cases()[case]
    if pattern is None:
        assert call().dtype == torch.float32
        return
    with pytest.raises((ValueError, TypeError, RuntimeError), match=pattern):
        call()


def test_float8_requires_grad_names_the_operand():
    a = torch.randn(8, 16).to(E4M3).requires_grad_()
    with pytest.raises(ValueError, match="'a'.*grad.*Float8Linear"):
        scaled_matmul(a, _fp8(16, 4, E4M3, "cpu"))
    with torch.no_grad():
        scaled_matmul(a, _fp8(16, 4, E4M3, "cpu"))


def test_autocast_leaves_float8_alone():
    a, b = _operands(8, 16, 32, (E4M3, E4M3), "cpu")
    plain = scaled_matmul(a, b, out_dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = scaled_matmul(a, b, out_dtype=torch.float32)
    assert torch.equal(plain, autocast)


# --------------------------------------------------------------------------------------------------------------------
# "auto", the call cache
# --------------------------------------------------------------------------------------------------------------------


def _problem(M: int, N: int, K: int) -> tuple:
    """float8_auto_backend's arguments (metadata only: expanded 1-element tensors)."""
    a = torch.empty(1, dtype=E4M3).expand(M, K)
    b = torch.empty(1, dtype=E4M3).expand(K, N)
    out = torch.empty(1, dtype=torch.bfloat16).expand(M, N)
    return (a, b, None, None, None, 0, 1.0, None, out, False, None, None)


def test_auto_times_once_per_signature(monkeypatch, fresh_caches):
    """Three candidates: the native two timed once per signature above AUTO_MIN_MACS (Triton only where neither
    takes the problem); below it, inside a capture and with tuning.TUNE False the untimed rule (cuBLAS where it takes
    the shape); cuBLAS left out where it refuses."""
    pytest.importorskip("triton")
    assert dispatch.triton_module("scaled_matmul") is not None
    timed = []

    def fastest(runs, key, device):
        timed.append(sorted(runs))
        return "wgmma"

    monkeypatch.setattr(dispatch, "auto_candidates", lambda device, op="scaled_matmul": ("triton", "wgmma", "cublas"))
    monkeypatch.setattr(sm_dispatch, "_fastest", fastest)
    monkeypatch.setattr(dispatch, "triton_interpreting", lambda: False)
    monkeypatch.setattr(sm_backends, "cublas_refuses", lambda K, N, device: None if K % 16 == 0 else "odd K")
    assert sm_dispatch.float8_auto_backend(*_problem(256, 256, 256)) == "cublas"  # small: untimed
    monkeypatch.setattr(sm_dispatch, "capturing", lambda: True)
    assert sm_dispatch.float8_auto_backend(*_problem(8192, 8192, 8192)) == "cublas"
    assert sm_dispatch.float8_auto_backend(*_problem(8192, 8192, 8191)) == "triton"  # cuBLAS and wgmma refuse K
    assert not timed
    monkeypatch.setattr(sm_dispatch, "capturing", lambda: False)
    assert sm_dispatch.float8_auto_backend(*_problem(8192, 8192, 8192)) == "wgmma"
    assert sm_dispatch.float8_auto_backend(*_problem(8192, 8192, 8192)) == "wgmma"
    assert timed == [["cublas", "wgmma"]]
    monkeypatch.setattr(tuning, "TUNE", False)
    assert sm_dispatch.float8_auto_backend(*_problem(8192, 4096, 4096)) == "cublas"
    assert len(timed) == 1


@pytest.mark.parametrize("backend", ["torch", "triton", "cublas"])
def test_cached_call_matches_the_checked_one(device, backend, fresh_caches):
    """The second call of a signature runs from the cache (no checks): the same bits, the flags updated, and an
    overlapping ``out`` still sent to the checked path's error."""
    _need(backend, device)
    torch.manual_seed(8)
    a = torch.randn(2, 8, 32, device=device).to(E4M3)
    b = _fp8(32, 16, E4M3, device, transposed=True)
    scale_a, scale_b = torch.rand(2, 8, 1, device=device) + 0.5, torch.tensor(2.0, device=device)
    results = []
    for _ in range(2):
        amax = torch.zeros(1, device=device)
        results.append(scaled_matmul(a, b, 0.5, scale_a=scale_a, scale_b=scale_b, amax_out=amax, backend=backend))
        _assert_amax(amax, 0.0, results[-1])
    assert len(sm_api._FLOAT8_CALLS) == 1
    assert torch.equal(results[0], results[1])
    out = torch.empty(2, 8, 16, device=device)
    scaled_matmul(a, b, scale_b=scale_b, out=out, backend=backend)
    with pytest.raises(ValueError, match="'out'.*overlaps argument 'scale_b'"):
        scaled_matmul(a, b, scale_b=out.view(-1)[:1], out=out, backend=backend)


# --------------------------------------------------------------------------------------------------------------------
# torch.library: opcheck, torch.compile
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_opcheck(granularity):
    torch.manual_seed(9)
    M, N, K = 8, 16, 32
    a, b = _operands(M, N, K, (E4M3, E4M3), "cpu")
    scale_a, scale_b = _factors(granularity, M, N, "cpu")
    if granularity == "row":
        scale_a, scale_b = scale_a.reshape(M), scale_b.reshape(N)
    out = torch.randn(M, N).to(torch.bfloat16)
    args = (a, b, scale_a, scale_b, torch.tensor(0.5), 1, 1.0, torch.randn(N), out, True, torch.zeros(1),
            torch.zeros(1), "torch")  # fmt: skip
    # test_schema compares the inputs around the call with arithmetic CPU float8 lacks ("mul_cpu_reduced_float")
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.ampkernels.scaled_mm_fp8_, args, test_utils=checks)


def test_torch_compile_fullgraph():
    torch.manual_seed(10)
    a, b = _operands(8, 16, 32, (E4M3, E4M3), "cpu")
    scale_a, scale_b = _factors("row", 8, 16, "cpu")

    def step(a, b, scale_a, scale_b, amax, flag):
        y = scaled_matmul(a, b, scale_a=scale_a, scale_b=scale_b, amax_out=amax, found_inf=flag, backend="torch")
        return y.float() * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    amax, flag = torch.zeros(1), torch.zeros(1)
    got = compiled(a, b, scale_a, scale_b, amax, flag)
    eager_amax = torch.zeros(1)
    expected = step(a, b, scale_a, scale_b, eager_amax, torch.zeros(1))
    assert torch.equal(got, expected)
    assert torch.equal(amax, eager_amax) and amax.item() > 0
