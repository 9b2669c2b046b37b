"""ampkernels.scaled_matmul against a float64 reference, with torch's own low-precision error as the yardstick.

Accuracy rule: ‖ours − ref64‖ / ‖ref64‖ ≤ 2 × the same error of the stock path ``(a @ b) * scale + bias`` computed
by torch in the low-precision dtype (+ a tiny eps). On CPU the Triton kernels run under TRITON_INTERPRET=1, whose
bf16 casts truncate instead of rounding: there a bf16 *output* gets a 3x bound and one bf16 ulp (2^-7) of slack.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import ampkernels
from ampkernels import reference
from ampkernels.scaled_matmul import ScaledLinear, scaled_matmul

# The package attribute `ampkernels.scaled_matmul` is the function; the module is reached by its import path.
sm_module = importlib.import_module("ampkernels.scaled_matmul")

LOW = [torch.float16, torch.bfloat16]
SCALE_KINDS = ["none", "float", "tensor0d", "row", "col"]
LAYOUTS = ["nn", "nt", "tn", "tt"]  # a, b stored row-major (n) or as a transposed view (t)
# K = 13: not a multiple of 8; 48x33x64 "nt": TMA-aligned operands with an output whose rows are not (pointer store).
SMALL_SHAPES = [(1, 1, 1), (17, 33, 65), (64, 64, 64), (40, 24, 13), (48, 33, 64)]
GPU_SHAPES = [(123, 4097, 511), (256, 512, 1024)]


def _backends(device: str) -> list[str]:
    """Every backend that runs on ``device`` (Triton on CPU only under the interpreter, i.e. without a GPU)."""
    # "auto" runs one of these per problem: its own tests are below (test_auto_*).
    return [n for n in sm_module.BACKENDS if n != "auto" and sm_module.why_not(n, torch.device(device)) is None]


def _need_triton(device: str) -> None:
    reason = sm_module.why_not("triton", torch.device(device))
    if reason is not None:
        pytest.skip(reason)


def _interpreted(device: str, backend: str) -> bool:
    return device == "cpu" and backend == "triton"


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


def _assert_accuracy(ours, stock, ref, *, interpreted_bf16_out: bool):
    factor, eps = (3.0, 2.0**-7) if interpreted_bf16_out else (2.0, 1e-6)
    ours_err, stock_err = _rel_err(ours, ref), _rel_err(stock, ref)
    assert ours_err <= factor * stock_err + eps, f"error {ours_err:.3e} vs stock {stock_err:.3e}"


def _check(a, b, scale, *, bias=None, out_dtype=None, backend, device):
    out_dtype = out_dtype or a.dtype
    M, N = a.shape[0], b.shape[1]
    poisoned = torch.full((M, N), float("nan"), dtype=out_dtype, device=device)  # every element must be written
    flag = torch.zeros(1, device=device)
    result = scaled_matmul(a, b, scale, bias=bias, out=poisoned, found_inf=flag, backend=backend)
    assert result is poisoned and result.dtype == out_dtype
    assert flag.item() == 0.0, "found_inf set on finite outputs"
    _assert_accuracy(
        result,
        _stock(a, b, scale, bias, out_dtype),
        _ref64(a, b, scale, bias),
        interpreted_bf16_out=_interpreted(device, backend) and out_dtype == torch.bfloat16,
    )


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
        _assert_accuracy(result, _stock(a, b, scale, None, a.dtype), _ref64(a, b, scale), interpreted_bf16_out=False)


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
    from ampkernels.triton import scaled_matmul as triton_sm

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
    from ampkernels.triton import scaled_matmul as triton_sm

    if not triton_sm.interpreting():
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
        _assert_accuracy(
            out, stock, expected, interpreted_bf16_out=_interpreted(device, backend) and out_dtype == torch.bfloat16
        )


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
        slack = 2.0**-7 if device == "cpu" and dtype == torch.bfloat16 else 1e-6  # interpreter truncation
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
    _assert_accuracy(y, stock, expected, interpreted_bf16_out=False)
    y.float().sum().backward()
    assert layer.weight.grad.shape == (12, 32) and layer.bias.grad.shape == (12,)


def test_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    assert sm_module.select_backend(cpu) == "torch"
    monkeypatch.setenv("AMPKERNELS_SCALED_MATMUL_BACKEND", "torch")
    assert sm_module.select_backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv("AMPKERNELS_SCALED_MATMUL_BACKEND", "no-such-backend")
    with pytest.raises(ValueError, match="'backend'"):
        sm_module.select_backend(cpu)
    monkeypatch.delenv("AMPKERNELS_SCALED_MATMUL_BACKEND")
    with pytest.raises(RuntimeError, match="wmma"):
        sm_module.select_backend(cpu, "wmma")
    with pytest.raises(RuntimeError, match="wgmma"):
        sm_module.select_backend(cpu, "wgmma")
    assert ampkernels.scaled_matmul is scaled_matmul and ampkernels.ScaledLinear is ScaledLinear


def test_wgmma_needs_a_build_for_9_0a(monkeypatch):
    # The wgmma kernel exists only in sm_90a code: a build without 9.0a in TORCH_CUDA_ARCH_LIST must say so (and the
    # default order then moves on to WMMA) before anything asks the GPU.
    if sm_module._wgmma_op() is None:
        pytest.skip("ampkernels._C is not built")

    class BuiltForSm90:
        cuda_arch_list = "8.0;9.0"
        wgmma_built = False

    monkeypatch.setattr(sm_module._backend, "native", lambda: BuiltForSm90)
    reason = sm_module.why_not("wgmma", torch.device("cuda"))
    assert reason is not None and "9.0a" in reason, reason


def _problem(M: int, N: int, K: int) -> tuple:
    """auto_backend's arguments for an M x N x K bf16 problem; only metadata is read (expanded 1-element tensors)."""
    a = torch.empty(1, dtype=torch.bfloat16).expand(M, K)
    b = torch.empty(1, dtype=torch.bfloat16).expand(K, N)
    out = torch.empty(1, dtype=torch.bfloat16).expand(M, N)
    return (a, b, None, sm_module.SCALE_NONE, 1.0, None, out, False, None)


def test_auto_times_once_per_signature_and_never_while_capturing(monkeypatch, fresh_caches):
    """'auto' with two candidates: Triton below AUTO_MIN_MACS; above it the timed winner, timed once per signature;
    inside a CUDA graph capture the untimed rule, remembered nowhere; with AMPKERNELS_TUNE=0 the untimed rule."""
    if _triton_module() is None:
        pytest.skip("triton is not installed")
    timed = []

    def time_auto(candidates, key, args):
        timed.append(key)
        return "wgmma"

    monkeypatch.setattr(sm_module, "_auto_candidates", lambda device: ("triton", "wgmma"))
    monkeypatch.setattr(sm_module, "_time_auto", time_auto)
    monkeypatch.setattr(sm_module, "num_sms", lambda device: 132)
    monkeypatch.setattr(_triton_module(), "interpreting", lambda: False)  # tuning is off under the interpreter
    assert sm_module.select_backend(torch.device("cuda")) == "auto"

    assert sm_module.auto_backend(*_problem(1024, 1024, 1024)) == "triton"  # 2^30 < AUTO_MIN_MACS: not timed
    narrow, wide = _problem(3072, 768, 8192), _problem(8192, 8192, 8192)
    monkeypatch.setattr(sm_module, "capturing", lambda: True)
    assert sm_module.auto_backend(*narrow) == "wgmma"  # 72 tiles of 128x256: fewer than 2 waves of 132 SMs
    assert sm_module.auto_backend(*wide) == "triton"  # 2048 tiles
    assert not timed and not sm_module._AUTO

    monkeypatch.setattr(sm_module, "capturing", lambda: False)
    assert sm_module.auto_backend(*wide) == "wgmma"  # the (fake) timing's winner, over the untimed rule
    assert sm_module.auto_backend(*wide) == "wgmma"
    assert len(timed) == 1
    transposed = list(wide)
    transposed[1] = wide[1].t().contiguous().t()  # same shapes, b column-major: a signature of its own
    sm_module.auto_backend(*transposed)
    assert len(timed) == 2

    monkeypatch.setenv("AMPKERNELS_TUNE", "0")
    assert sm_module.auto_backend(*narrow) == "wgmma"
    assert sm_module.auto_backend(*_problem(8192, 4096, 4096)) == "triton"
    assert len(timed) == 2


def test_auto_runs_the_only_candidate(device, fresh_caches):
    """Where only Triton runs (no wgmma: a CPU under the interpreter, or a GPU other than Hopper), 'auto' is Triton:
    the same result, through the checked and the cached path."""
    if sm_module.why_not("auto", torch.device(device)) is not None:
        pytest.skip(sm_module.why_not("auto", torch.device(device)))
    torch.manual_seed(31)
    a, b = _operand(40, 32, torch.float16, device, False), _operand(32, 24, torch.float16, device, True)
    for _ in range(2):
        _check(a, b, torch.tensor(0.5, device=device), backend="auto", device=device)
    if sm_module._auto_candidates(torch.device(device)) == ("triton",):
        assert [entry.backend for entry in sm_module._CALLS.values()] == ["triton"]


def test_triton_capture_error_names_the_warm_up(monkeypatch, fresh_caches):
    """A Triton kernel that must be loaded inside a capture fails there (the driver forbids it): the error says to
    run the call once before capturing, instead of Triton's bare driver error."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _need_triton(device)
    triton_sm = _triton_module()
    a, b = _operand(40, 32, torch.float16, device, False), _operand(32, 24, torch.float16, device, False)
    out = torch.empty(40, 24, dtype=torch.float16, device=device)
    launcher = triton_sm.launcher_for(a, b, None, 0, None, out, False, None)

    class LoadsInCapture:
        def __getitem__(self, grid):
            def launch(*args, **options):
                raise RuntimeError("Triton Error [CUDA]: operation not permitted when stream is capturing")

            return launch

    launcher.runner, launcher.kernel = None, LoadsInCapture()
    monkeypatch.setattr(triton_sm, "capturing", lambda: True)
    with pytest.raises(RuntimeError, match="run the call once before capturing"):
        launcher(a, b, None, 1.0, None, out, None)


def _need_auto_on_gpu() -> None:
    if not torch.cuda.is_available() or len(sm_module._auto_candidates(torch.device("cuda"))) < 2:
        pytest.skip("'auto' chooses only where both Triton and the wgmma kernel run (Hopper, a build with 9.0a)")


@pytest.mark.gpu
def test_auto_on_gpu_runs_the_faster_and_times_on_scratch(fresh_caches):
    """On Hopper the default is 'auto'. A problem above AUTO_MIN_MACS is timed on both kernels once, on scratch
    outputs: the caller's accumulating `out` receives exactly one product, bit for bit the winner's."""
    _need_auto_on_gpu()
    assert sm_module.select_backend(torch.device("cuda")) == "auto"
    torch.manual_seed(32)
    M, N, K = 3072, 768, 8192  # grad-weight: dy.T @ x, a column-major view
    a, b = _operand(M, K, torch.bfloat16, "cuda", True), _operand(K, N, torch.bfloat16, "cuda", False)
    scale = torch.tensor(0.75, device="cuda")
    old = torch.randn(M, N, device="cuda")
    out, flag = old.clone(), torch.zeros(1, device="cuda")
    logged = len(sm_module.AUTO_LOG)
    scaled_matmul(a, b, scale, out=out, accumulate=True, found_inf=flag)
    (entry,) = sm_module.AUTO_LOG[logged:]
    assert sorted(entry["ms"]) == ["triton", "wgmma"] and all(ms > 0 for ms in entry["ms"].values())
    assert entry["best"] == min(entry["ms"], key=entry["ms"].get)
    assert flag.item() == 0.0
    stock = old + _stock(a, b, scale, None, torch.float32)  # torch: a bf16 product, added in fp32
    _assert_accuracy(out, stock, _ref64(a, b, scale, None, old), interpreted_bf16_out=False)
    again = old.clone()
    scaled_matmul(a, b, scale, out=again, accumulate=True, found_inf=flag, backend=entry["best"])
    assert torch.equal(out, again)
    scaled_matmul(a, b, scale, out=again, accumulate=True, found_inf=flag)
    assert len(sm_module.AUTO_LOG) == logged + 1  # remembered


@pytest.mark.gpu
def test_auto_in_a_cuda_graph_capture(fresh_caches):
    """Captured before any eager call: the untimed rule (wgmma for this narrow shape), nothing timed or cached by
    the capture, and the replay computes the product of the new inputs. After an eager call (which times), a new
    capture replays the timed winner, bit for bit the eager result."""
    _need_auto_on_gpu()
    torch.manual_seed(33)
    M, N, K = 3200, 768, 8192  # x @ W.T
    a, b = _operand(M, K, torch.bfloat16, "cuda", False), _operand(K, N, torch.bfloat16, "cuda", True)
    scale = torch.tensor(0.5, device="cuda")
    logged = len(sm_module.AUTO_LOG)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = scaled_matmul(a, b, scale)
    assert len(sm_module.AUTO_LOG) == logged and not sm_module._AUTO and not sm_module._CALLS
    a.copy_(_operand(M, K, torch.bfloat16, "cuda", False))
    scale.fill_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    _assert_accuracy(out, _stock(a, b, scale, None, a.dtype), _ref64(a, b, scale), interpreted_bf16_out=False)

    eager = scaled_matmul(a, b, scale)
    assert len(sm_module.AUTO_LOG) == logged + 1
    timed_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(timed_graph):
        captured = scaled_matmul(a, b, scale)
    timed_graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
def test_triton_in_a_cuda_graph_capture_does_not_tune(monkeypatch, fresh_caches):
    """A problem first seen inside a capture runs the untuned heuristic config (tuning synchronizes) and is
    neither tuned nor cached there; the next eager call tunes it. Its kernel is loaded beforehand, since a capture
    forbids loading modules (test_triton_capture_error_names_the_warm_up covers the error otherwise)."""
    triton_sm = _triton_module()
    if triton_sm is None or not torch.cuda.is_available():
        pytest.skip("needs triton on a GPU")
    torch.manual_seed(34)
    M, N, K = 2048, 1024, 1040  # 2^31 multiply-adds: tuned when eager
    a, b = _operand(M, K, torch.float16, "cuda", False), _operand(K, N, torch.float16, "cuda", True)
    monkeypatch.setenv("AMPKERNELS_TUNE", "0")
    scaled_matmul(a, b, 0.5, backend="triton")  # compiles and loads the heuristic config's kernel
    sm_module.clear_caches()
    monkeypatch.delenv("AMPKERNELS_TUNE")
    tuned = dict(triton_sm._TUNED)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = scaled_matmul(a, b, 0.5, backend="triton")
    assert triton_sm._TUNED == tuned and not triton_sm._LAUNCHERS and not sm_module._CALLS
    a.copy_(_operand(M, K, torch.float16, "cuda", False))
    graph.replay()
    torch.cuda.synchronize()
    _assert_accuracy(out, _stock(a, b, 0.5, None, a.dtype), _ref64(a, b, 0.5), interpreted_bf16_out=False)
    scaled_matmul(a, b, 0.5, backend="triton")
    assert len(triton_sm._TUNED) == len(tuned) + 1


def test_info_reports_the_backend():
    from ampkernels import info

    text = info.report()
    assert "scaled_matmul" in text


def test_reference_matches_float64():
    torch.manual_seed(15)
    a, b = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    scale, bias = torch.rand(6, 1, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    out = torch.randn(6, 7, dtype=torch.float64)
    expected = out + (a @ b) * scale * 2.0 + bias
    reference.scaled_matmul(a, b, scale, alpha=2.0, bias=bias, out=out, accumulate=True)
    torch.testing.assert_close(out, expected)
    assert math.isclose(_rel_err(out, expected), 0.0, abs_tol=1e-15)


# --------------------------------------------------------------------------------------------------------------------
# Host-time caches: per-signature call cache, Triton launchers, direct launch, device-side descriptors
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_caches():
    sm_module.clear_caches()
    yield
    sm_module.clear_caches()


def _triton_module():
    return sm_module._load_triton()[0]


def test_cache_is_keyed_by_strides_and_dtype(device, fresh_caches):
    """Same shapes, other strides or dtype: a new signature (and a correct result), never the cached launch."""
    _need_triton(device)
    torch.manual_seed(20)
    for dtype in LOW:
        a = _operand(40, 32, dtype, device, False)
        for transposed in (False, True, False):
            b = _operand(32, 24, dtype, device, transposed)
            _check(a, b, 0.5, backend="triton", device=device)
    keys = list(sm_module._CALLS)
    assert len(keys) == 4  # (fp16, bf16) x (row-major b, transposed b); the repeated layout hit its entry
    assert len({(k[0], k[7]) for k in keys}) == 4  # (dtype, b strides) differ between the entries


def test_cached_call_uses_the_new_tensors(device, fresh_caches):
    """Same signature, new data every call: other out / scale / bias / found_inf tensors and Python floats."""
    _need_triton(device)
    torch.manual_seed(21)
    M, N, K = 48, 40, 32
    for step in range(3):
        a, b = _operand(M, K, torch.float16, device, False), _operand(K, N, torch.float16, device, True)
        scale = torch.rand(N, device=device) + 0.5 + step
        bias = torch.randn(N, device=device)
        _check(a, b, scale, bias=bias, out_dtype=torch.float32, backend="triton", device=device)
        _check(a, b, 0.25 * (step + 1), backend="triton", device=device)
        _check(a, b, torch.tensor(1.5 + step, device=device), backend="triton", device=device)
        result = scaled_matmul(a, b, 2.0 + step, backend="triton")  # out allocated by the cached path
        torch.testing.assert_close(result.float(), ((a.double() @ b.double()) * (2.0 + step)).float(), **_TOL16)
    assert 0 < len(sm_module._CALLS) <= 5


_TOL16 = dict(rtol=2e-3, atol=2e-3)


def test_cached_call_accumulates_and_flags(device, fresh_caches):
    _need_triton(device)
    torch.manual_seed(22)
    a, b = _operand(33, 64, torch.float16, device, False), _operand(64, 20, torch.float16, device, False)
    out = torch.randn(33, 20, device=device)
    expected = out.double().clone()
    flag = torch.zeros(1, device=device)
    for step in range(3):
        version = out._version
        scaled_matmul(a, b, 0.5 * step, out=out, accumulate=True, found_inf=flag, backend="triton")
        expected += (a.double() @ b.double()) * (0.5 * step)
        assert out._version > version  # version counter bumped like the custom op would
    assert _rel_err(out, expected) < 1e-5 and flag.item() == 0.0
    a_bad = a.clone()
    a_bad[3, 3] = float("inf")
    scaled_matmul(a_bad, b, 1.0, out=out, accumulate=True, found_inf=flag, backend="triton")
    assert flag.item() == 1.0


def test_cached_call_still_checks_overlap_and_autograd(device, fresh_caches):
    _need_triton(device)
    torch.manual_seed(23)
    storage = torch.randn(2, 16, 16, device=device).half()
    a, b = storage[0], _operand(16, 16, torch.float16, device, False)
    scaled_matmul(a, b, 1.0, out=storage[1], backend="triton")  # caches this signature
    with pytest.raises(ValueError, match="'out'.*overlap"):
        scaled_matmul(a, b, 1.0, out=storage[0], backend="triton")  # same metadata, aliases a
    # A cached no-grad signature does not swallow autograd.
    scaled_matmul(a, b, 3.0, backend="triton")
    a_leaf = a.detach().clone().requires_grad_()
    scaled_matmul(a_leaf, b, 3.0, backend="triton").float().sum().backward()
    torch.testing.assert_close(a_leaf.grad.float(), 3.0 * b.float().sum(1).expand(16, 16), **_TOL16)


def test_strided_scale_vector_is_read_correctly(device, fresh_caches):
    """A per-row scale that is a strided column of a bigger tensor (the kernels read scale contiguously)."""
    _need_triton(device)
    torch.manual_seed(24)
    a, b = _operand(24, 32, torch.float16, device, False), _operand(32, 16, torch.float16, device, False)
    rows = (torch.rand(24, 3, device=device) + 0.5)[:, 1:2]
    assert rows.stride() == (3, 1)
    for _ in range(2):
        result = scaled_matmul(a, b, rows, out_dtype=torch.float32, backend="triton")
        assert _rel_err(result, _ref64(a, b, rows)) < 1e-5


def test_host_and_device_descriptors_agree(device, monkeypatch, fresh_caches):
    """Both TMA descriptor paths (device-side: the default where triton has it; host: the fallback)."""
    _need_triton(device)
    triton_sm = _triton_module()
    torch.manual_seed(25)
    a, b = _operand(40, 64, torch.float16, device, True), _operand(64, 48, torch.float16, device, True)
    scale = torch.rand(48, device=device) + 0.5
    results = {}
    for mode in ("device", "host"):
        monkeypatch.setenv("AMPKERNELS_SCALED_MATMUL_TMA_DESC", mode)
        sm_module.clear_caches()
        if mode == "device" and not triton_sm.device_descriptors():
            continue
        results[mode] = scaled_matmul(a, b, scale, out_dtype=torch.float32, backend="triton")
        (launcher,) = triton_sm._LAUNCHERS.values()
        if launcher.kind == "tma":
            assert launcher.device_desc == (mode == "device")
    for result in results.values():
        assert _rel_err(result, _ref64(a, b, scale)) < 1e-5


def test_allocator_is_installed_per_thread():
    """Triton keeps its allocator in a ContextVar: a thread (autograd's device threads) starts without one."""
    pytest.importorskip("triton")
    triton_sm = _triton_module()
    if triton_sm is None or triton_sm._allocation is None:
        pytest.skip("no triton.runtime._allocation")
    import threading

    seen = []

    def body():
        triton_sm._ensure_allocator()
        seen.append(triton_sm._allocation._allocator.get())

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [triton_sm._scratch]


class _FakeCompiled:
    """Stands in for triton's CompiledKernel: ``compiled[grid](*args)`` records the launch."""

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class _FakeJit:
    def __init__(self, log, returns):
        self.log, self.returns = log, returns

    def __getitem__(self, grid):
        def run(*args, **options):
            self.log.append(("jit", grid, args))
            return self.returns

        return run


@pytest.mark.parametrize("compiled_ok", [True, False], ids=["direct", "fallback"])
def test_direct_launch_reuses_the_jit_arguments(monkeypatch, fresh_caches, compiled_ok):
    """The first launch goes through the JIT (compiles), later ones through the compiled kernel with the very same
    positional arguments; when the JIT returns no CompiledKernel (interpreter, API drift) every launch uses it."""
    triton_sm = _triton_module()
    if triton_sm is None:
        pytest.skip("triton is not usable")
    log = []
    alpha_index = {kind: kernel.arg_names.index("alpha") for kind, kernel in (
        ("pointer", triton_sm._scaled_mm_ptr_kernel), ("tma", triton_sm._scaled_mm_tma_kernel)
    )}  # fmt: skip
    monkeypatch.setenv("AMPKERNELS_TRITON_DIRECT_LAUNCH", "1")
    monkeypatch.setattr(triton_sm, "_CompiledKernel", _FakeCompiled)
    fake = _FakeJit(log, _FakeCompiled(log) if compiled_ok else None)
    monkeypatch.setattr(triton_sm, "_scaled_mm_tma_kernel", fake)
    monkeypatch.setattr(triton_sm, "_scaled_mm_ptr_kernel", fake)
    a, b = torch.randn(16, 32).half(), torch.randn(32, 8).half()
    for alpha in (1.0, 2.0, 3.0):
        out = torch.empty(16, 8)
        triton_sm.scaled_mm_(a, b, None, 0, alpha, None, out, False, None)
    kinds = [entry[0] for entry in log]
    assert kinds == (["jit", "direct", "direct"] if compiled_ok else ["jit", "jit", "jit"])
    grids = {tuple(entry[1]) + (1,) * (3 - len(entry[1])) for entry in log}
    assert len(grids) == 1  # the compiled launcher gets the JIT's grid padded to three dims
    first, later = log[0][2], log[2][2]
    assert len(first) == len(later)  # the same positional layout; only alpha and the tensors differ
    (launcher,) = triton_sm._LAUNCHERS.values()
    alpha_at = alpha_index[launcher.kind]  # after the pointers (TMA: descriptors, stream-K buffers)
    assert first[alpha_at] == 1.0
    assert later[alpha_at] == 3.0
    plain = (int, float, type(None))  # the constants (tensors and host descriptors change per call)
    assert [x for i, x in enumerate(first) if i != alpha_at and isinstance(x, plain)] == [
        x for i, x in enumerate(later) if i != alpha_at and isinstance(x, plain)
    ]


def test_direct_launch_can_be_disabled(monkeypatch):
    triton_sm = _triton_module()
    if triton_sm is None:
        pytest.skip("triton is not usable")
    monkeypatch.setenv("AMPKERNELS_TRITON_DIRECT_LAUNCH", "0")
    assert triton_sm._direct_runner(object(), (1,)) is None


def test_candidates_fit_in_shared_memory():
    """The tuner's shared-memory estimate keeps what compiled on the H200 and drops what did not: 128x256x64 with 4
    stages fits only with a 16-bit output stored in halves (192 KB ring + 32 KB), with 3 stages any output."""
    triton_sm = _triton_module()
    if triton_sm is None:
        pytest.skip("triton is not usable")
    fits = lambda cfg, out_bytes: triton_sm._shared_bytes(cfg, out_bytes) <= triton_sm.HOPPER_SHARED_BYTES  # noqa: E731
    four = triton_sm.Config(128, 256, 64, 4, 8, epilogue_split=2)
    three = triton_sm.Config(128, 256, 64, 3, 8, epilogue_split=2)
    assert fits(four, 2) and not fits(four, 4)
    assert not fits(triton_sm.Config(128, 256, 64, 4, 8), 2)
    assert fits(three, 2) and fits(three, 4)
    for cfg in triton_sm.HOPPER_TMA_CONFIGS + triton_sm.HOPPER_IDLE_TAIL_CONFIGS:
        assert fits(cfg, 2), cfg.describe()


# What Triton 3.6 allocates for sm_90 (dev/triton_shared_probe.py, compiled offline; a row-major a, the output
# stored through TMA): config, output bytes, accumulate, bytes. A flattened loop that accumulates loads the previous
# output ahead into a second piece; on the H200 three flattened candidates failed with OutOfResources for fp32 +=.
TRITON_36_SHARED_BYTES = [
    ((128, 128, 64, 4, 8, 1, True), 4, True, 262184),
    ((128, 128, 64, 4, 8, 1, True), 4, False, 196768),
    ((128, 128, 64, 5, 8, 1, True), 4, True, 294968),
    ((128, 128, 64, 5, 8, 1, True), 4, False, 229536),
    ((128, 256, 64, 3, 8, 2, True), 4, True, 279576),
    ((128, 256, 64, 3, 8, 2, True), 2, False, 180280),
    ((128, 128, 64, 5, 8, 1, False), 4, True, 229416),
    ((128, 256, 64, 4, 8, 2, False), 2, False, 229408),
    ((128, 256, 64, 4, 8, 2, False), 4, True, 262176),
    ((128, 128, 64, 6, 8, 1, True), 2, False, 229536),
]


@pytest.mark.parametrize("shape, out_bytes, accumulate, allocated", TRITON_36_SHARED_BYTES)
def test_shared_memory_estimate_bounds_what_triton_allocates(shape, out_bytes, accumulate, allocated):
    """Never below what Triton allocates (a kept candidate would fail to compile), at most the barrier margin above,
    and so the same verdict on the 227 KB limit."""
    triton_sm = _triton_module()
    if triton_sm is None:
        pytest.skip("triton is not usable")
    block_m, block_n, block_k, stages, warps, split, flatten = shape
    cfg = triton_sm.Config(block_m, block_n, block_k, stages, warps, epilogue_split=split, flatten=flatten)
    estimate = triton_sm._shared_bytes(cfg, out_bytes, accumulate)
    assert allocated <= estimate <= allocated + triton_sm._BARRIER_BYTES
    limit = triton_sm.HOPPER_SHARED_BYTES
    assert (estimate <= limit) == (allocated <= limit)


def test_candidates_leave_out_flattened_loops_that_accumulate_in_fp32():
    triton_sm = _triton_module()
    if triton_sm is None:
        pytest.skip("triton is not usable")
    out = torch.empty(3072, 768)  # fp32, stored through TMA
    plan = triton_sm.Plan("tma", a_col=True, b_col=False, out_tma=True)
    plain = triton_sm._candidates(plan, out, 3072, 768)
    accumulating = triton_sm._candidates(plan, out, 3072, 768, accumulate=True)
    assert any(cfg.flatten for cfg in plain)
    assert accumulating == tuple(cfg for cfg in plain if not cfg.flatten)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_every_candidate_config_on_gpu(dtype):
    """Each config the tuner may pick (including the few-tile ones) computes the same function."""
    triton_sm = _triton_module()
    if triton_sm is None or not torch.cuda.is_available():
        pytest.skip("needs triton on a GPU")
    torch.manual_seed(26)
    M, N, K = 300, 520, 264
    a, b = _operand(M, K, dtype, "cuda", True), _operand(K, N, dtype, "cuda", True)
    scale, bias = torch.rand(N, device="cuda") + 0.5, torch.randn(N, device="cuda")
    expected = _ref64(a, b, scale, bias)
    configs = (
        triton_sm.HOPPER_TMA_CONFIGS
        + triton_sm.HOPPER_FEW_TILES_CONFIGS
        + triton_sm.HOPPER_STREAM_K_CONFIGS
        + triton_sm.HOPPER_IDLE_TAIL_CONFIGS
        + triton_sm.POINTER_CONFIGS
    )
    for cfg in configs:
        for force in (None, "pointer"):
            out = torch.full((M, N), float("nan"), device="cuda")
            flag = torch.zeros(1, device="cuda")
            triton_sm.scaled_mm_(a, b, scale, 3, 1.0, bias, out, False, flag, config=cfg, force=force)
            assert _rel_err(out, expected) < 1e-5, cfg.describe()
            assert flag.item() == 0.0


def test_time_in_turns_alternates_and_averages(monkeypatch):
    """The timing the tuner and "auto" share: two passes, the second reversed, means per key (do_bench faked)."""
    triton_testing = pytest.importorskip("triton.testing")
    from ampkernels.triton import time_in_turns

    order, ms = [], {"a": [1.0, 2.0], "b": [5.0, 4.0]}
    monkeypatch.setattr(triton_testing, "do_bench", lambda fn, warmup, rep: fn())
    runs = {key: (lambda key=key: order.append(key) or ms[key][order.count(key) - 1]) for key in ms}
    assert time_in_turns(runs) == {"a": 1.5, "b": 4.5}
    assert order == ["a", "b", "b", "a"]


def test_tuner_times_every_candidate_that_compiles(monkeypatch, fresh_caches):
    """_tune hands each candidate's launcher, bound to scratch outputs, to time_in_turns and keeps the fastest (the
    launchers run here, through the interpreter on a CPU; timing itself is faked: it needs a GPU)."""
    _need_triton("cpu" if not torch.cuda.is_available() else "cuda")
    triton_sm = _triton_module()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(35)
    a, b = _operand(40, 32, torch.float16, device, False), _operand(32, 24, torch.float16, device, True)
    out = torch.full((40, 24), float("nan"), dtype=torch.float32, device=device)
    p = triton_sm.Problem(a, b, None, 0, 0.5, None, out, False, None)
    plan = triton_sm.plan_for(a, b, out)
    candidates = triton_sm._candidates(plan, out, 40, 24)
    slowest_first = {cfg: float(len(candidates) - i) for i, cfg in enumerate(candidates)}
    seen = {}

    def time_in_turns(runs):
        for cfg, run in runs.items():
            run()
            seen[cfg] = True
        return {cfg: slowest_first[cfg] for cfg in runs}

    monkeypatch.setattr(triton_sm, "time_in_turns", time_in_turns)
    monkeypatch.setattr(triton_sm, "TUNING_LOG", [])
    assert triton_sm._tune(p, plan, ("key",)) == candidates[-1]
    assert set(seen) == set(candidates)
    assert torch.isnan(out).all()  # the caller's output untouched: candidates run on scratch
    assert triton_sm.TUNING_LOG[-1]["best"] == candidates[-1].describe()


@pytest.mark.gpu
def test_tuning_times_every_candidate_and_keeps_the_fastest(monkeypatch, fresh_caches):
    """The tuner (normally for problems of 2^30 multiply-adds and more) times each candidate through the direct
    launcher, records the timings, and the call then runs the fastest config correctly."""
    triton_sm = _triton_module()
    if triton_sm is None or not torch.cuda.is_available():
        pytest.skip("needs triton on a GPU")
    monkeypatch.setattr(triton_sm, "TUNE_MIN_MACS", 0)
    monkeypatch.setattr(triton_sm, "_TUNED", {})
    monkeypatch.setattr(triton_sm, "TUNING_LOG", [])
    torch.manual_seed(27)
    a, b = _operand(300, 264, torch.bfloat16, "cuda", False), _operand(264, 520, torch.bfloat16, "cuda", True)
    scale = torch.tensor(0.5, device="cuda")
    out = scaled_matmul(a, b, scale, backend="triton")
    (entry,) = triton_sm.TUNING_LOG
    plan = triton_sm.plan_for(a, b, out)
    candidates = triton_sm._candidates(plan, out, 300, 520)
    assert sorted(entry["ms"]) == sorted(c.describe() for c in candidates)
    assert all(ms > 0 for ms in entry["ms"].values())
    assert entry["best"] == min(entry["ms"], key=entry["ms"].get)
    _assert_accuracy(out, _stock(a, b, scale, None, out.dtype), _ref64(a, b, scale), interpreted_bf16_out=False)


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K", [(300, 520, 264), (2200, 2100, 520)], ids=["all-shared", "shared-and-whole"])
def test_stream_k_on_gpu_is_correct_and_deterministic(M, N, K):
    """Stream-K configs with fewer tiles than SMs (every tile cut across programs) and with a partial last wave
    (its tiles shared, the rest whole): accumulate, column scale, bias; the same bits on a second run; an overflow
    sets found_inf."""
    triton_sm = _triton_module()
    if triton_sm is None or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs triton on a GPU with TMA (sm_90+)")
    torch.manual_seed(M)
    a, b = _operand(M, K, torch.bfloat16, "cuda", False), _operand(K, N, torch.bfloat16, "cuda", True)
    scale, bias = torch.rand(N, device="cuda") + 0.5, torch.randn(N, device="cuda")
    old = torch.randn(M, N, device="cuda")
    expected = _ref64(a, b, scale, bias, old)
    for cfg in triton_sm.HOPPER_STREAM_K_CONFIGS:
        runs = []
        for _ in range(2):
            out, flag = old.clone(), torch.zeros(1, device="cuda")
            triton_sm.scaled_mm_(a, b, scale, 3, 1.0, bias, out, True, flag, config=cfg)
            assert _rel_err(out, expected) < 1e-5, cfg.describe()
            assert flag.item() == 0.0, cfg.describe()
            runs.append(out)
        assert torch.equal(runs[0], runs[1]), f"{cfg.describe()}: two runs differ"
        out, flag = torch.empty(M, N, device="cuda", dtype=torch.float16), torch.zeros(1, device="cuda")
        triton_sm.scaled_mm_(a, b, torch.full((N,), 6e4, device="cuda"), 3, 1.0, None, out, False, flag, config=cfg)
        assert flag.item() == 1.0, f"{cfg.describe()}: overflow to fp16 not flagged"
