"""ampkernels.scaled_matmul under autograd, autocast, torch.library.opcheck and torch.compile."""

from __future__ import annotations

import pytest
import torch
from scaled_matmul_helpers import (
    LOW,
    SCALE_KINDS,
    _need_triton,
    _operand,
    _ref64,
    _rel_err,
    _scale,
    _stock,
)

from ampkernels.scaled_matmul import scaled_matmul

# --------------------------------------------------------------------------------------------------------------------
# Autograd, autocast, torch.library
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_kind", SCALE_KINDS)
def test_gradcheck_reference_fp64(scale_kind):
    torch.manual_seed(9)
    a = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True)
    scale = _scale(scale_kind, 5, 6, "cpu", batch=(2,))
    if isinstance(scale, torch.Tensor):
        scale = scale.double().requires_grad_()
    inputs = (a, b, bias) + ((scale,) if isinstance(scale, torch.Tensor) else ())

    def fn(a, b, bias, *maybe_scale):
        return scaled_matmul(a, b, maybe_scale[0] if maybe_scale else scale, bias=bias, backend="torch")

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("scale_kind", ["float", "tensor0d", "row", "col"])
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_backward_matches_reference(device, dtype, scale_kind):
    """Grads of a, b (and bias, scale) through the Triton kernels vs float64, bounded by stock autograd's error."""
    _need_triton(device)
    torch.manual_seed(10)
    M, K, N = 48, 40, 56
    a0, b0 = _operand(M, K, dtype, device, False), _operand(K, N, dtype, device, True)
    bias0 = torch.randn(N, device=device)
    scale0 = _scale(scale_kind, M, N, device)
    grad = torch.randn(M, N, device=device).to(dtype)
    tensor_scale = isinstance(scale0, torch.Tensor)

    def grads(fn, cast):
        a, b, bias = a0.to(cast).requires_grad_(), b0.to(cast).requires_grad_(), bias0.to(cast).requires_grad_()
        scale = scale0.to(cast).requires_grad_() if tensor_scale else scale0
        fn(a, b, scale, bias).backward(grad.to(cast))
        return [a.grad, b.grad, bias.grad] + ([scale.grad] if tensor_scale else [])

    expected = grads(lambda a, b, s, bias: _ref64(a, b, s, bias), torch.float64)
    stock = grads(lambda a, b, s, bias: _stock(a, b, s, bias, dtype), dtype)
    ours = grads(lambda a, b, s, bias: scaled_matmul(a, b, s, bias=bias, backend="triton"), dtype)
    for name, mine, theirs, ref in zip(["a", "b", "bias", "scale"], ours, stock, expected):
        assert mine.shape == ref.shape and mine.dtype == theirs.dtype, name
        ours_err, stock_err = _rel_err(mine, ref), _rel_err(theirs, ref)
        slack = 1e-6
        assert ours_err <= 3.0 * stock_err + slack, f"grad {name}: {ours_err:.3e} vs stock {stock_err:.3e}"


@pytest.mark.parametrize("cast", LOW, ids=["fp16", "bf16"])
def test_autocast_casts_operands_only(device, cast):
    _need_triton(device)
    torch.manual_seed(11)
    a, b = torch.randn(20, 32, device=device), torch.randn(32, 24, device=device)
    scale = torch.rand(24, device=device) + 0.5
    with torch.autocast(device, dtype=cast):
        result = scaled_matmul(a, b.t().contiguous().t(), scale, backend="triton")
        result32 = scaled_matmul(a, b, scale, out_dtype=torch.float32, backend="triton")
        stock = torch.mm(a, b)
    assert result.dtype == cast == stock.dtype and result32.dtype == torch.float32
    assert scale.dtype == torch.float32
    expected = scaled_matmul(a.to(cast), b.to(cast), scale, backend="triton")
    assert torch.equal(result, expected)
    assert _rel_err(result32, _ref64(a.to(cast), b.to(cast), scale)) < 1e-5


def test_autocast_backward_reaches_fp32_leaves(device):
    _need_triton(device)
    a = torch.randn(16, 32, device=device, requires_grad=True)
    b = torch.randn(32, 8, device=device, requires_grad=True)
    with torch.autocast(device, dtype=torch.float16):
        scaled_matmul(a, b, 2.0, backend="triton").float().sum().backward()
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    torch.testing.assert_close(a.grad, 2.0 * b.detach().half().float().sum(1).expand(16, 32), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck(device, backend):
    if backend == "triton":
        _need_triton(device)
    torch.manual_seed(12)
    a, b = torch.randn(16, 24, device=device).half(), torch.randn(24, 8, device=device).half()
    scale, bias = torch.rand(16, device=device), torch.randn(8, device=device)
    out, flag = torch.empty(16, 8, device=device), torch.zeros(1, device=device)
    torch.library.opcheck(torch.ops.ampkernels.scaled_mm_, (a, b, scale, 2, 1.5, bias, out, False, flag, backend))
    torch.library.opcheck(
        torch.ops.ampkernels.scaled_mm,
        (a.requires_grad_(), b, scale, 2, 1.5, bias, torch.float32, True, backend),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def test_torch_compile_traces_the_op():
    a, b = torch.randn(16, 24).half(), torch.randn(24, 8).half()
    scale = torch.tensor(0.5)
    compiled = torch.compile(
        lambda a, b, s: scaled_matmul(a, b, s, backend="torch") + 1, backend="eager", fullgraph=True
    )
    torch.testing.assert_close(compiled(a, b, scale), scaled_matmul(a, b, scale, backend="torch") + 1)
