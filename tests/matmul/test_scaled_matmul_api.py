"""The public scaled_matmul API: bad input raises with the argument named, ScaledLinear is a drop-in nn.Linear."""

from __future__ import annotations

import pytest
import torch
from scaled_matmul_helpers import (
    _assert_accuracy,
    _need_triton,
    _ref64,
)

from ampkernels import reference
from ampkernels.scaled_matmul import ScaledLinear, scaled_matmul

# --------------------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------------------


def _bad_cases():
    a, b = torch.randn(8, 16).half(), torch.randn(16, 12).half()
    return {
        "inner dims": (lambda: scaled_matmul(a, torch.randn(15, 12).half(), 1.0), "'b'.*inner"),
        "dtypes": (lambda: scaled_matmul(a, b.bfloat16(), 1.0), "'b'.*dtype"),
        "devices": (lambda: scaled_matmul(a, b.to("meta"), 1.0), "'b'.*meta"),
        "fp32": (lambda: scaled_matmul(a.float(), b.float(), 1.0), "'a'.*float32"),
        "int": (lambda: scaled_matmul(a.long(), b.long(), 1.0, backend="torch"), "'a'.*int64"),
        "1-D a": (lambda: scaled_matmul(a[0], b, 1.0), "'a'"),
        "3-D b": (lambda: scaled_matmul(a, b[None], 1.0), "'b'"),
        "scale length M": (lambda: scaled_matmul(a, b, torch.ones(8)), "'scale'.*per row"),
        "scale full": (lambda: scaled_matmul(a, b, torch.ones(8, 12)), "'scale'"),
        "scale dtype": (lambda: scaled_matmul(a, b, torch.ones(12, dtype=torch.int32)), "'scale'.*floating"),
        "scale ndim": (lambda: scaled_matmul(a, b, torch.ones(1, 1, 12)), "'scale'.*dimensions"),
        "scale type": (lambda: scaled_matmul(a, b, "2"), "'scale'"),
        "bias shape": (lambda: scaled_matmul(a, b, 1.0, bias=torch.ones(8)), "'bias'"),
        "out shape": (lambda: scaled_matmul(a, b, 1.0, out=torch.empty(12, 8).half()), "'out'.*shape"),
        "out dtype": (
            lambda: scaled_matmul(a, b, 1.0, out_dtype=torch.float32, out=torch.empty(8, 12).half()),
            "dtype",
        ),
        "out layout": (lambda: scaled_matmul(a, b, 1.0, out=torch.empty(12, 8).half().t()), "'out'.*contiguous"),
        "out overlapping": (
            lambda: scaled_matmul(a, b, 1.0, out=torch.empty(12).half().expand(8, 12)),
            "'out'.*overlap",
        ),
        "out aliases a": (lambda: scaled_matmul(a, b[:, :8].contiguous(), 1.0, out=a[:, :8]), "'out'"),
        "out_dtype": (lambda: scaled_matmul(a, b, 1.0, out_dtype=torch.int32), "'out_dtype'"),
        "accumulate": (lambda: scaled_matmul(a, b, 1.0, accumulate=True), "'accumulate'"),
        "found_inf": (lambda: scaled_matmul(a, b, 1.0, found_inf=torch.zeros(1, dtype=torch.float16)), "'found_inf'"),
        "backend": (lambda: scaled_matmul(a, b, 1.0, backend="cublas"), "'backend'"),
        "wmma on cpu": (lambda: scaled_matmul(a, b, 1.0, backend="wmma"), "wmma"),
        "wgmma on cpu": (lambda: scaled_matmul(a, b, 1.0, backend="wgmma"), "wgmma"),
        "out + grad": (lambda: scaled_matmul(a.requires_grad_(), b, 1.0, out=torch.empty(8, 12).half()), "'out'.*grad"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_names_the_argument(case):
    call, pattern = _bad_cases()[case]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=pattern):
        call()


# --------------------------------------------------------------------------------------------------------------------
# ScaledLinear, backend choice
# --------------------------------------------------------------------------------------------------------------------


def test_scaled_linear_is_a_drop_in_linear():
    torch.manual_seed(13)
    stock = torch.nn.Linear(24, 12)
    torch.manual_seed(13)
    ours = ScaledLinear(24, 12)
    assert list(ours.state_dict()) == list(stock.state_dict()) == ["weight", "bias"]
    assert torch.equal(ours.weight, stock.weight) and torch.equal(ours.bias, stock.bias)
    ours.load_state_dict(stock.state_dict())
    x = torch.randn(3, 5, 24)
    torch.testing.assert_close(ours(x), stock(x))
    assert ScaledLinear(4, 3, bias=False).bias is None


@pytest.mark.parametrize("output_scale", [0.5, "per-feature"])
def test_scaled_linear_output_scale(device, output_scale):
    _need_triton(device)
    torch.manual_seed(14)
    if output_scale == "per-feature":
        output_scale = torch.rand(12, device=device) + 0.5
    layer = ScaledLinear(32, 12, device=device, output_scale=output_scale, backend="triton")
    assert list(layer.state_dict()) == ["weight", "bias"]
    x = torch.randn(4, 32, device=device)
    with torch.autocast(device, dtype=torch.float16):
        y = layer(x)
    assert y.dtype == torch.float16
    w16 = layer.weight.detach().half()
    expected = _ref64(x.half(), w16.t(), output_scale, layer.bias.detach())
    stock = (torch.nn.functional.linear(x.half(), w16, layer.bias.detach().half()) * output_scale).half()
    _assert_accuracy(y, stock, expected)
    y.float().sum().backward()
    assert layer.weight.grad.shape == (12, 32) and layer.bias.grad.shape == (12,)


def test_scaled_linear_output_scale_keeps_its_dtype_through_half():
    """model.half() converts floating buffers; a per-feature output_scale below half of float16's smallest
    subnormal (3e-8) would become 0, and so would the layer's output. It stays float32, moved with the module."""
    torch.manual_seed(15)
    layer = ScaledLinear(16, 8, bias=False, output_scale=torch.full((8,), 2e-8)).half()
    assert layer.output_scale.dtype == torch.float32 and layer.weight.dtype == torch.float16
    x = (torch.randn(4, 16) * 1000).half()
    y = layer(x)
    expected = (x.float() @ layer.weight.float().t()) * 2e-8  # ~1e-5: float16 holds it to ~0.5%
    assert y.abs().min() > 0
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=1e-7)
    assert layer.to("meta").output_scale.is_meta  # moved with the module


@pytest.mark.parametrize("backend", ["", "native", "cuBLAS", "Triton"])
def test_unknown_backend_names_the_valid_choices(backend):
    a = b = torch.ones(4, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="argument 'backend'.*auto/triton/wgmma/wmma/cublas/torch"):
        scaled_matmul(a, b, backend=backend)
    with pytest.raises(ValueError, match="argument 'backend'.*auto/triton/wgmma/wmma/cublas/torch"):
        ScaledLinear(4, 4, backend=backend, dtype=torch.float16)(a)


@pytest.mark.parametrize("warm", [False, True], ids=["checked", "cached"])
def test_out_requiring_grad_raises_instead_of_dropping_the_gradient(warm):
    """Writing into an `out` that requires grad would cut it from its graph without a word: refused, on the checked
    path and on the per-signature fast path alike (like torch's out= ops)."""
    torch.manual_seed(40)
    a, b = torch.randn(8, 16).half(), torch.randn(16, 4).half()
    y = torch.zeros(8, 4, dtype=torch.float16)
    if warm:
        scaled_matmul(a, b, 0.5, out=y)  # the signature is now cached
    y.requires_grad_(True)
    with pytest.raises(ValueError, match="argument 'out'.*requires grad"):
        scaled_matmul(a, b, 0.5, out=y)
    with pytest.raises(ValueError, match="argument 'out'.*requires grad"):
        scaled_matmul(a, b, 0.5, out=y, accumulate=True)
    with torch.no_grad():
        scaled_matmul(a, b, 0.5, out=y)  # no graph to cut: allowed, as torch allows it
    torch.testing.assert_close(y.detach(), reference.scaled_matmul(a, b, 0.5), rtol=2e-3, atol=1e-3)


def test_scaled_linear_refuses_an_unknown_backend_at_construction():
    """A float32 input runs on "torch" whatever backend was asked: a typo must not wait for the first bf16 input."""
    with pytest.raises(ValueError, match="argument 'backend'.*'tirton'"):
        ScaledLinear(24, 12, backend="tirton")
    assert ScaledLinear(24, 12, backend="torch").backend == "torch"


def test_scaled_linear_takes_1d_input_like_linear():
    """nn.Linear maps an unbatched [in_features] input to [out_features]; so does the drop-in."""
    torch.manual_seed(41)
    stock = torch.nn.Linear(24, 12)
    ours = ScaledLinear(24, 12, output_scale=torch.rand(12) + 0.5)
    ours.load_state_dict(stock.state_dict())
    x = torch.randn(24)
    y = ours(x)
    assert y.shape == stock(x).shape == (12,)
    expected = torch.nn.functional.linear(x, stock.weight) * ours.output_scale + stock.bias
    torch.testing.assert_close(y, expected.detach())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = ours(x)
    assert y16.shape == (12,) and y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), y, rtol=3e-2, atol=3e-2)


def test_autocast_leaves_float64_operands_alone_like_mm():
    """Autocast casts only eligible operands (floating point, not float64), as for aten::mm: a float64 product
    under autocast stays float64 (scaled_matmul with backend='torch', and ScaledLinear.double() like nn.Linear)."""
    torch.manual_seed(42)
    a, b = torch.randn(6, 20, dtype=torch.float64), torch.randn(20, 5, dtype=torch.float64)
    scale = torch.rand(5, dtype=torch.float64) + 0.5
    stock = torch.nn.Linear(20, 5).double()
    ours = ScaledLinear(20, 5).double()
    ours.load_state_dict(stock.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(a, b).dtype == torch.float64
        y = scaled_matmul(a, b, scale, backend="torch")
        y_linear, y_stock = ours(a), stock(a)
    assert y.dtype == torch.float64 and y_linear.dtype == y_stock.dtype == torch.float64
    torch.testing.assert_close(y, (a @ b) * scale)
    torch.testing.assert_close(y_linear, y_stock)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cached_call_reads_a_strided_bias_like_the_checked_one(device, bias_dtype):
    """The checks make a strided bias contiguous; the per-signature fast path must not hand the caller's strided
    view to the kernel (which reads bias[n] at bias_ptr + n): every call of a signature gives the first's result."""
    _need_triton(device)
    torch.manual_seed(43)
    a, b = torch.randn(8, 16, device=device).bfloat16(), torch.randn(16, 12, device=device).bfloat16()
    bias = torch.randn(12, 2, device=device).to(bias_dtype)[:, 0]  # one column of a packed [N, 2] parameter
    assert not bias.is_contiguous()
    results = [scaled_matmul(a, b, 0.5, bias=bias, backend="triton") for _ in range(3)]  # checked, then cached
    torch.testing.assert_close(results[0], reference.scaled_matmul(a, b, 0.5, bias=bias), rtol=2**-7, atol=1e-2)
    for result in results[1:]:
        assert torch.equal(result, results[0])


@pytest.mark.parametrize("float8", [False, True], ids=["bf16", "float8"])
def test_torch_compile_fullgraph_with_out(float8):
    """out=/accumulate= (weight-gradient accumulation) traces without a graph break: the checks that read data
    pointers run in eager only (fake tensors have none)."""
    torch.manual_seed(44)
    if float8:
        a = torch.randn(2, 8, 32).to(torch.float8_e4m3fn)
        b = torch.randn(16, 32).to(torch.float8_e4m3fn).t()
        kwargs = {"scale_a": torch.rand(2, 8, 1) + 0.5}
    else:
        a, b, kwargs = torch.randn(2, 8, 32).bfloat16(), torch.randn(32, 16).bfloat16(), {}

    def step(a, b, out):
        scaled_matmul(a, b, 0.5, out=out, accumulate=True, backend="torch", **kwargs)
        return out * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    start = torch.randn(2, 8, 16)
    got, expected = start.clone(), start.clone()
    got_twice = compiled(a, b, got)
    expected_twice = step(a, b, expected)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_twice, expected_twice)
    assert not torch.equal(got, start)
