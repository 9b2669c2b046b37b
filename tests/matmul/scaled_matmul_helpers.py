"""What the scaled_matmul tests share: shapes, operands, the float64 reference, the accuracy rule.

Accuracy rule: ‖ours − ref64‖ / ‖ref64‖ ≤ 2 × the same error of the stock path ``(a @ b) * scale + bias`` computed
by torch in the low-precision dtype (+ a tiny eps). On CPU the Triton kernels run under TRITON_INTERPRET=1 (their
bf16 outputs rounded to nearest there too, by integer arithmetic: the interpreter's own casts truncate).
"""

from __future__ import annotations

import pytest
import torch

from ampkernels import dispatch
from ampkernels.scaled_matmul import scaled_matmul

LOW = [torch.float16, torch.bfloat16]
SCALE_KINDS = ["none", "float", "tensor0d", "row", "col"]
LAYOUTS = ["nn", "nt", "tn", "tt"]  # a, b stored row-major (n) or as a transposed view (t)
# K = 13: not a multiple of 8; 48x33x64 "nt": TMA-aligned operands with an output whose rows are not (pointer store).
SMALL_SHAPES = [(1, 1, 1), (17, 33, 65), (64, 64, 64), (40, 24, 13), (48, 33, 64)]
GPU_SHAPES = [(123, 4097, 511), (256, 512, 1024)]


def _backends(device: str) -> list[str]:
    """Every backend that runs on ``device`` (Triton on CPU only under the interpreter, i.e. without a GPU)."""
    # "auto" runs one of these per problem: its own tests are below (test_auto_*).
    return [
        n
        for n in dispatch.BACKENDS["scaled_matmul"]
        if n != "auto" and dispatch.why_not("scaled_matmul", n, device) is None
    ]


def _need_triton(device: str) -> None:
    reason = dispatch.why_not("scaled_matmul", "triton", torch.device(device))
    if reason is not None:
        pytest.skip(reason)


def _operand(rows: int, cols: int, dtype, device, transposed: bool, magnitude: float = 1.0) -> torch.Tensor:
    """[rows, cols] random (never zero-filled); ``transposed``: a column-major view of a [cols, rows] tensor."""
    if transposed:
        return (torch.randn(cols, rows, device=device) * magnitude).to(dtype).t()
    return (torch.randn(rows, cols, device=device) * magnitude).to(dtype)


def _scale(kind: str, M: int, N: int, device, batch: tuple[int, ...] = ()):
    if kind == "none":
        return None
    if kind == "float":
        return 0.37
    if kind == "tensor0d":
        return torch.tensor(1.7, device=device)
    if kind == "row":
        return torch.rand(*batch, M, 1, device=device) + 0.5
    return torch.rand(N, device=device) + 0.5


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    denominator = ref.norm().item()
    return (x.double() - ref).norm().item() / (denominator if denominator > 0 else 1.0)


def _ref64(a, b, scale, bias=None, old=None):
    v = a.double() @ b.double()
    if scale is not None:
        v = v * (scale.double() if isinstance(scale, torch.Tensor) else scale)
    if bias is not None:
        v = v + bias.double()
    return v if old is None else old.double() + v


def _stock(a, b, scale, bias, out_dtype):
    """What torch does in the low-precision dtype, unfused."""
    v = a @ b
    if scale is not None:
        v = v * scale
    if bias is not None:
        v = v + bias.to(v.dtype)
    return v.to(out_dtype)


def _assert_accuracy(ours, stock, ref):
    ours_err, stock_err = _rel_err(ours, ref), _rel_err(stock, ref)
    assert ours_err <= 2.0 * stock_err + 1e-6, f"error {ours_err:.3e} vs stock {stock_err:.3e}"


def _check(a, b, scale, *, bias=None, out_dtype=None, backend, device):
    out_dtype = out_dtype or a.dtype
    M, N = a.shape[0], b.shape[1]
    poisoned = torch.full((M, N), float("nan"), dtype=out_dtype, device=device)  # every element must be written
    flag = torch.zeros(1, device=device)
    result = scaled_matmul(a, b, scale, bias=bias, out=poisoned, found_inf=flag, backend=backend)
    assert result is poisoned and result.dtype == out_dtype
    assert flag.item() == 0.0, "found_inf set on finite outputs"
    _assert_accuracy(result, _stock(a, b, scale, bias, out_dtype), _ref64(a, b, scale, bias))


def _triton_module():
    return dispatch.triton_module("scaled_matmul")
