"""ampkernels.scaled_matmul against a float64 reference on every backend: shapes, layouts, scale modes, output dtypes,
bias, batched and strided operands, the Triton kernel variants, accumulation, non-finite flags, empty dimensions."""

from __future__ import annotations

import math

import pytest
import torch
from scaled_matmul_helpers import (
    GPU_SHAPES,
    LAYOUTS,
    LOW,
    SCALE_KINDS,
    SMALL_SHAPES,
    _assert_accuracy,
    _backends,
    _check,
    _need_triton,
    _operand,
    _ref64,
    _rel_err,
    _scale,
    _stock,
)

from ampkernels import dispatch, reference
from ampkernels.scaled_matmul import scaled_matmul

# --------------------------------------------------------------------------------------------------------------------
# Accuracy
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scale_kind", SCALE_KINDS)
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_matches_reference(device, dtype, shape, scale_kind, layout):
    torch.manual_seed(hash((shape, scale_kind, layout)) % 2**31)
    M, N, K = shape
    a = _operand(M, K, dtype, device, layout[0] == "t")
    b = _operand(K, N, dtype, device, layout[1] == "t")
    scale = _scale(scale_kind, M, N, device)
    for backend in _backends(device):
        _check(a, b, scale, backend=backend, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_large_shapes_on_gpu(dtype, shape, layout):
    torch.manual_seed(1)
    M, N, K = shape
    a = _operand(M, K, dtype, "cuda", layout[0] == "t")
    b = _operand(K, N, dtype, "cuda", layout[1] == "t")
    for backend in _backends("cuda"):
        for kind in ("tensor0d", "row", "col"):
            _check(a, b, _scale(kind, M, N, "cuda"), bias=torch.randn(N, device="cuda"), backend=backend, device="cuda")


@pytest.mark.parametrize("bias_dtype", [torch.float32, "same"])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_out_dtype_and_bias(device, dtype, out_dtype, bias_dtype):
    torch.manual_seed(2)
    a, b = _operand(33, 40, dtype, device, False), _operand(40, 48, dtype, device, True)
    bias = torch.randn(48, device=device).to(dtype if bias_dtype == "same" else bias_dtype)
    for backend in _backends(device):
        _check(
            a, b, torch.rand(48, device=device) + 0.5, bias=bias, out_dtype=out_dtype, backend=backend, device=device
        )


@pytest.mark.parametrize("scale_kind", ["tensor0d", "row", "col"])
def test_batched_a(device, scale_kind):
    torch.manual_seed(3)
    a = torch.randn(2, 3, 8, 24, device=device).to(torch.float16)
    b = torch.randn(24, 40, device=device).to(torch.float16)
    scale = _scale(scale_kind, 8, 40, device, batch=(2, 3))
    for backend in _backends(device):
        result = scaled_matmul(a, b, scale, backend=backend)
        assert result.shape == (2, 3, 8, 40)
        _assert_accuracy(result, _stock(a, b, scale, None, a.dtype), _ref64(a, b, scale))


def test_strided_and_misaligned_operands(device):
    """Views TMA cannot take (every other column, a 2-byte offset) run through the pointer kernel."""
    torch.manual_seed(4)
    wide = torch.randn(48, 80, device=device).to(torch.bfloat16)
    a = wide[:, ::2]  # [48, 40], column stride 2
    b = torch.randn(40 * 72 + 1, device=device).to(torch.bfloat16)[1:].view(40, 72)  # base offset by 2 bytes
    assert b.data_ptr() % 16 != 0
    for backend in _backends(device):
        _check(a, b, 2.0, bias=torch.randn(72, device=device), backend=backend, device=device)


@pytest.mark.parametrize(
    "config",
    [
        dict(block_m=32, block_n=64, block_k=32, epilogue_split=2),
        dict(block_m=32, block_n=32, block_k=16, flatten=True),
        dict(block_m=32, block_n=32, block_k=16, stream_k=True),
        dict(block_m=32, block_n=64, block_k=16, epilogue_split=2, stream_k=True),
    ],
    ids=["split-epilogue", "flatten", "stream-k", "stream-k-split-epilogue"],
)
@pytest.mark.parametrize("force", [None, "pointer"])
def test_triton_kernel_variants(device, config, force):
    """The config knobs the tuner picks between compute the same function (TMA store split in two, flattened
    persistent loop, stream-K, and the pointer kernel on operands that TMA could take)."""
    _need_triton(device)
    from ampkernels.matmul.triton import scaled_matmul as triton_sm

    if force is None and (config.get("epilogue_split", 1) > 1 or config.get("stream_k")) and device == "cuda":
        pytest.skip("tiny split-store and stream-K configs are for the interpreter; GPUs tune their own")
    torch.manual_seed(5)
    cfg = triton_sm.Config(num_stages=2, num_warps=4, group_m=2, **config)
    a, b = _operand(70, 64, torch.float16, device, False), _operand(64, 96, torch.float16, device, True)
    scale = torch.rand(70, device=device) + 0.5
    bias = torch.randn(96, device=device)
    old = torch.randn(70, 96, device=device)
    out = old.clone()
    flag = torch.zeros(1, device=device)
    triton_sm.scaled_mm_(a, b, scale, 2, 0.5, bias, out, True, flag, config=cfg, force=force)
    expected = _ref64(a, b, scale[:, None] * 0.5, bias, old)
    assert _rel_err(out, expected) < 1e-5
    assert flag.item() == 0.0


@pytest.mark.parametrize(
    "M, N, K, columns",
    [(40, 24, 80, 1), (70, 96, 64, 1), (33, 24, 200, 1), (32, 64, 200, 2), (40, 64, 72, 2)],
    ids=["all-tiles-shared", "one-tile-shared-then-whole", "one-tile-many-programs", "by-column", "by-column-2"],
)
def test_stream_k_hands_partial_tiles_between_programs(M, N, K, columns):
    """Stream-K under the interpreter (4 programs, 32x32x16 tiles): a tile's k-iterations cut across programs, the
    last one adding the others' partial sums, with every epilogue input (row scale, bias, accumulate, flag).
    40x24x80: 2 tiles of 5 k-steps over 4 programs (3+2+... ranges end inside tiles); 70x96x64: 9 tiles, the
    9th % 4 shared, the rest whole; 33x24x200: 2 tiles of 13 k-steps (shapes TMA can take: 16-byte row strides).
    By column: 32x64x200 has 2 tile columns of one tile (13 k-steps) each shared by 2 programs; 40x64x72 2 columns of
    2 tiles (5 k-steps), 2 programs each."""
    _need_triton("cpu")
    from ampkernels.matmul.triton import scaled_matmul as triton_sm

    if not dispatch.triton_interpreting():
        pytest.skip("the interpreter's program count is fixed at 4; GPUs run stream-K in test_every_candidate_config")
    torch.manual_seed(M + N + K)
    cfg = triton_sm.Config(32, 32, 16, 2, 4, group_m=2, stream_k=True)
    a, b = _operand(M, K, torch.float16, "cpu", False), _operand(K, N, torch.float16, "cpu", False)
    scale, bias = torch.rand(M) + 0.5, torch.randn(N)
    old = torch.randn(M, N)
    out = old.clone()
    flag = torch.zeros(1)
    plan = triton_sm.plan_for(a, b, out)
    assert plan.kind == "tma", "stream-K lives in the TMA kernel"
    problem = triton_sm.Problem(a, b, scale, 2, 1.5, bias, out, True, flag)
    assert triton_sm._Launcher(problem, plan, cfg, direct=False).stream_k_columns == columns
    triton_sm.scaled_mm_(a, b, scale, 2, 1.5, bias, out, True, flag, config=cfg)
    assert _rel_err(out, _ref64(a, b, scale[:, None] * 1.5, bias, old)) < 1e-5
    assert flag.item() == 0.0


# --------------------------------------------------------------------------------------------------------------------
# accumulate, found_inf, empty dims
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_accumulate(device, out_dtype):
    torch.manual_seed(6)
    a, b = _operand(50, 64, torch.bfloat16, device, True), _operand(64, 36, torch.bfloat16, device, False)
    bias = torch.randn(36, device=device)
    for backend in _backends(device):
        old = torch.randn(50, 36, device=device).to(out_dtype)
        out = old.clone()
        returned = scaled_matmul(a, b, 0.25, bias=bias, out=out, accumulate=True, backend=backend)
        assert returned is out
        expected = _ref64(a, b, 0.25, bias, old)
        stock = (old.float() + _stock(a, b, 0.25, bias, torch.float32)).to(out_dtype)
        _assert_accuracy(out, stock, expected)


def test_found_inf_on_fp16_overflow(device):
    """Products beyond 65504 overflow in the cast to fp16 (only in one tile): flagged; with fp32 output they are
    finite and not flagged; a set flag is never cleared."""
    torch.manual_seed(7)
    a, b = _operand(64, 64, torch.float16, device, False), _operand(64, 64, torch.float16, device, False)
    a[40:, :] *= 500.0
    b[:, 50:] *= 500.0  # rows >= 40 x columns >= 50: |a@b| ~ 500 * 500 * 8 > 65504
    for backend in _backends(device):
        flag = torch.zeros(1, device=device)
        result = scaled_matmul(a, b, 1.0, found_inf=flag, backend=backend)
        assert flag.item() == 1.0
        assert not torch.isfinite(result[40:, 50:]).all() and torch.isfinite(result[:40]).all()
        flag32 = torch.zeros(1, device=device)
        result32 = scaled_matmul(a, b, 1.0, out_dtype=torch.float32, found_inf=flag32, backend=backend)
        assert flag32.item() == 0.0 and torch.isfinite(result32).all()
        sticky = torch.ones((), device=device)
        scaled_matmul(a[:40], b, 1.0, found_inf=sticky, backend=backend)
        assert sticky.item() == 1.0


@pytest.mark.parametrize("where", ["first", "last", "middle"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_inputs_propagate_and_flag(device, where, value):
    torch.manual_seed(8)
    a, b = _operand(70, 48, torch.bfloat16, device, False), _operand(48, 66, torch.bfloat16, device, False)
    row = {"first": 0, "last": 69, "middle": 35}[where]
    a[row, 7] = value
    for backend in _backends(device):
        flag = torch.zeros(1, device=device)
        result = scaled_matmul(a, b, torch.tensor(0.5, device=device), found_inf=flag, backend=backend)
        assert flag.item() == 1.0
        assert not torch.isfinite(result[row]).any()
        others = torch.cat([result[:row], result[row + 1 :]])
        assert torch.isfinite(others).all()


@pytest.mark.parametrize("empty", ["M", "N", "K"])
def test_empty_dims(device, empty):
    M, N, K = (0 if empty == "M" else 9), (0 if empty == "N" else 10), (0 if empty == "K" else 11)
    a, b = torch.randn(M, K, device=device).half(), torch.randn(K, N, device=device).half()
    bias = torch.randn(N, device=device)
    for backend in _backends(device):
        flag = torch.zeros(1, device=device)
        result = scaled_matmul(a, b, 3.0, bias=bias, found_inf=flag, backend=backend)
        assert result.shape == (M, N) and flag.item() == 0.0
        torch.testing.assert_close(result, bias.half().expand(M, N))  # K == 0: scale * 0 + bias
        out = torch.randn(M, N, device=device)
        old = out.clone()
        scaled_matmul(a, b, 3.0, bias=bias, out=out, accumulate=True, backend=backend)
        torch.testing.assert_close(out, old + bias)


def test_reference_matches_float64():
    torch.manual_seed(15)
    a, b = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    scale, bias = torch.rand(6, 1, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    out = torch.randn(6, 7, dtype=torch.float64)
    expected = out + (a @ b) * scale * 2.0 + bias
    reference.scaled_matmul(a, b, scale, alpha=2.0, bias=bias, out=out, accumulate=True)
    torch.testing.assert_close(out, expected)
    assert math.isclose(_rel_err(out, expected), 0.0, abs_tol=1e-15)
