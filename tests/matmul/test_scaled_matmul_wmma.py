"""Tests of the native ops ``ampkernels::scaled_matmul_wmma_`` (csrc/matmul/wmma.cuh) and
``ampkernels::scaled_matmul_wgmma_`` (csrc/matmul/wgmma.cuh, sm_90a only), which share a contract.

GPU tests compare against a float64 reference, ``alpha * scale * (a.double() @ b.double()) + bias (+ out_old)``, and
allow at most twice the error of torch computing the same thing in the low-precision dtype. Outputs are poisoned
with NaN first, so an element the kernel never wrote fails. The argument checks run before the device check, so
they are tested on CPU tensors without a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from ampkernels import dispatch

_C = dispatch.native()  # importing ampkernels._C registers its ops


def _op(name: str):
    try:
        return getattr(torch.ops.ampkernels, name)
    except (AttributeError, RuntimeError):
        return None


OPS = {"wmma": _op("scaled_matmul_wmma_"), "wgmma": _op("scaled_matmul_wgmma_")}
HAS_CUDA = torch.cuda.is_available()
HAS_BF16 = HAS_CUDA and torch.cuda.get_device_capability()[0] >= 8
# The wgmma kernel runs on compute capability 9.0 only, and only in a build for 9.0a.
WGMMA_RUNS = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0) and getattr(_C, "wgmma_built", False)


def _skip_unless_built(name: str):
    return pytest.mark.skipif(OPS[name] is None, reason="ampkernels._C is not built (or was built without this op)")


# Every op for the argument checks (CPU), the ops that can run here for the GPU tests.
ALL_OPS = [pytest.param(name, marks=_skip_unless_built(name)) for name in OPS]
GPU_OPS = [
    pytest.param("wmma", marks=_skip_unless_built("wmma")),
    pytest.param(
        "wgmma",
        marks=[_skip_unless_built("wgmma"), pytest.mark.skipif(HAS_CUDA and not WGMMA_RUNS, reason="needs sm_90a")],
    ),
]

IN_DTYPES = [
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(HAS_CUDA and not HAS_BF16, reason="bf16 needs sm_80")),
]
OUT_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
LAYOUTS = [(True, True), (True, False), (False, True), (False, False)]  # (a row-major, b row-major)
# Forced configurations the launchers know (ampkernels.matmul.tuning): WMMA_TILE (csrc/matmul/wmma.cu) and
# WGMMA_BN (csrc/matmul/scaled_matmul.h).
TILES = [("WMMA_TILE", t) for t in ["128x128x32w4", "128x128x64w4", "128x128x64w4db", "portable"]]
WGMMA_WIDTHS = [("WGMMA_BN", w) for w in [128, 192, 256]]


def matrix(rows: int, cols: int, dtype, row_major: bool = True, device="cuda", scale: float = 1.0) -> torch.Tensor:
    """Random [rows, cols] matrix stored row- or column-major (never zeros)."""
    if row_major:
        return (torch.randn(rows, cols, device=device) * scale).to(dtype)
    return (torch.randn(cols, rows, device=device) * scale).to(dtype).t()


def scale_tensor(mode: int, M: int, N: int, device="cuda") -> torch.Tensor | None:
    shape = {0: None, 1: (1,), 2: (M,), 3: (N,)}[mode]
    return None if shape is None else torch.rand(shape, device=device) + 0.5


def effective_scale(mode: int, scale, alpha: float, M: int, N: int) -> torch.Tensor:
    """alpha * scale as a float64 tensor that broadcasts over [M, N]."""
    if mode == 0:
        return torch.tensor(alpha, dtype=torch.float64, device="cuda")
    s = scale.double() * alpha
    if mode == 1:
        return s.reshape(())
    return s.reshape(M, 1) if mode == 2 else s.reshape(1, N)


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (x.double() - ref).norm().item()
    norm = ref.norm().item()
    return diff / norm if norm > 0 else diff


def run_and_check(op, a, b, *, mode=1, alpha=1.0, bias_dtype=None, out_dtype=None, accumulate=False, found_inf=None):
    """Runs the op on poisoned (or random, to accumulate into) `out` and checks it against the float64 reference."""
    M, K = a.shape
    N = b.shape[1]
    out_dtype = out_dtype or a.dtype
    scale = scale_tensor(mode, M, N)
    bias = None if bias_dtype is None else torch.randn(N, device="cuda").to(bias_dtype)
    if accumulate:
        out = torch.randn(M, N, device="cuda").to(out_dtype)
    else:
        out = torch.full((M, N), math.nan, device="cuda", dtype=out_dtype)
    old = out.clone()
    OPS[op](a, b, scale, mode, alpha, bias, out, accumulate, found_inf)

    s = effective_scale(mode, scale, alpha, M, N)
    ref = (a.double() @ b.double()) * s
    low = (a @ b) * s.to(a.dtype)  # torch in the low-precision dtype
    if bias is not None:
        ref = ref + bias.double()
        low = low + bias.to(a.dtype)
    low = low.to(out_dtype)
    if accumulate:
        ref = ref + old.double()
        low = old + low
    assert not out.isnan().any(), "NaN in the output: an element was not written (or was computed wrong)"
    err, torch_err = rel_error(out, ref), rel_error(low, ref)
    assert err <= 2 * torch_err + 1e-7, f"relative error {err:.3g} > 2 x torch's {torch_err:.3g}"
    return out


# --------------------------------------------------------------------------------------------------------------------
# GPU: numerics
# --------------------------------------------------------------------------------------------------------------------

SHAPES = [
    (1, 1, 1),
    (17, 33, 65),
    (123, 4097, 511),
    (64, 100, 37),  # K not a multiple of 8
    (256, 512, 128),  # aligned, whole tiles
    (300, 264, 200),  # 16-byte rows but partial tiles on every side
    (200, 8, 520),
    (2100, 2400, 330),  # more tiles than SMs (persistent kernels take several), k-tiles wrap the wgmma ring
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["rr", "rc", "cr", "cc"])
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", GPU_OPS)
@pytest.mark.gpu
def test_shapes_and_layouts(op, shape, dtype, layout):
    M, N, K = shape
    a = matrix(M, K, dtype, layout[0])
    b = matrix(K, N, dtype, layout[1])
    run_and_check(op, a, b, mode=1, alpha=0.75)


@pytest.mark.parametrize(
    "op,tile",
    [("wmma", t) for t in TILES] + [("wgmma", w) for w in WGMMA_WIDTHS],
    ids=lambda x: str(x[1]) if isinstance(x, tuple) else x,
)
@pytest.mark.parametrize("layout", LAYOUTS, ids=["rr", "rc", "cr", "cc"])
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.gpu
def test_every_tile_configuration(op, tile, layout, dtype, matmul_tuning):
    if OPS[op] is None or (op == "wgmma" and not WGMMA_RUNS):
        pytest.skip(f"{op} cannot run here")
    # The launchers read the forced configuration on every launch (set for the probes in dev/matmul/).
    name, value = tile
    matmul_tuning(**{name: value})
    a = matrix(390, 264, dtype, layout[0])
    b = matrix(264, 520, dtype, layout[1])
    run_and_check(op, a, b, mode=3, bias_dtype=torch.float32, out_dtype=torch.float32, accumulate=True)
    run_and_check(op, matrix(130, 72, dtype, layout[0]), matrix(72, 136, dtype, layout[1]), mode=2)
    if op == "wgmma":
        # 2-3 tiles per block, more k-tiles (16) than stages (4-6): the ring wraps several times a tile, its barrier
        # phases carry over from tile to tile (a schedule that got this wrong passed every smaller shape here and
        # hung on this one). The K tail; the tile-wide scale takes the branch-free epilogue.
        run_and_check(op, matrix(2100, 1000, dtype, layout[0]), matrix(1000, 2400, dtype, layout[1]), mode=1)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("shape", [(130, 260, 72), (33, 47, 19)], ids=["aligned", "odd"])
@pytest.mark.parametrize("op", GPU_OPS)
@pytest.mark.gpu
def test_scale_modes(op, mode, dtype, shape):
    M, N, K = shape
    run_and_check(op, matrix(M, K, dtype), matrix(K, N, dtype), mode=mode, alpha=1.5)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("bias", ["none", "float32", "input"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("op", GPU_OPS)
@pytest.mark.gpu
def test_bias_out_dtype_accumulate(op, dtype, out_dtype, bias, accumulate):
    bias_dtype = {"none": None, "float32": torch.float32, "input": dtype}[bias]
    for M, N, K in [(96, 136, 48), (37, 29, 41)]:
        run_and_check(
            op,
            matrix(M, K, dtype),
            matrix(K, N, dtype, row_major=False),
            mode=2,
            bias_dtype=bias_dtype,
            out_dtype=out_dtype,
            accumulate=accumulate,
        )


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("op", GPU_OPS)
@pytest.mark.gpu
def test_views_unaligned_and_padded(op, dtype):
    # A misaligned start (2 bytes into the storage) takes the scalar path (wgmma: the WMMA kernel, TMA needs 16-byte
    # alignment); a padded row stride (ld 64, K 37) the 16-byte path with partial chunks (wgmma: TMA, K tail zeros).
    big = torch.randn(150, 66, device="cuda").to(dtype)
    a = big[:, 1:38]  # [150, 37], stride (66, 1), offset 1 element
    b = matrix(37, 90, dtype)
    run_and_check(op, a, b)
    padded = torch.randn(150, 64, device="cuda").to(dtype)[:, :37]
    b_pad = torch.randn(48, 96, device="cuda").to(dtype)[:37, :90]
    run_and_check(op, padded, b_pad, out_dtype=torch.float32)
    run_and_check(op, padded, torch.randn(96, 48, device="cuda").to(dtype)[:90, :37].t())  # b column-major, ld 48


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("op", GPU_OPS)
@pytest.mark.gpu
def test_empty_dims(op, dtype):
    kernel = OPS[op]
    # M = 0 or N = 0: nothing to do. K = 0: out = bias (+ out_old).
    for M, N in [(0, 16), (16, 0), (0, 0)]:
        out = torch.empty(M, N, device="cuda", dtype=dtype)
        kernel(matrix(M, 8, dtype), matrix(8, N, dtype), None, 0, 1.0, None, out, False, None)
    a, b = torch.empty(20, 0, device="cuda", dtype=dtype), torch.empty(0, 30, device="cuda", dtype=dtype)
    bias = torch.randn(30, device="cuda")
    out = torch.full((20, 30), math.nan, device="cuda")
    kernel(a, b, None, 0, 2.0, bias, out, False, None)
    assert torch.equal(out, bias.expand(20, 30))
    out = torch.full((20, 30), math.nan, device="cuda", dtype=torch.float16)
    kernel(a, b, None, 0, 2.0, None, out, False, None)
    assert torch.equal(out, torch.zeros_like(out))
    old = torch.randn(20, 30, device="cuda")
    out = old.clone()
    kernel(a, b, None, 0, 2.0, bias, out, True, None)
    assert torch.equal(out, old + bias)


def _kernels_launched(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.skipif(not WGMMA_RUNS or OPS["wgmma"] is None, reason="needs sm_90a")
def test_wgmma_runs_its_own_kernel_and_falls_back_only_where_tma_cannot_read():
    # The wgmma op is only worth having if it really runs wgmma: TMA-readable operands launch its kernel; an operand
    # 2 bytes off 16-byte alignment, and K == 0, go to the WMMA kernel (same results, checked above).
    a, b = matrix(256, 128, torch.bfloat16), matrix(128, 512, torch.bfloat16)
    out = torch.empty(256, 512, device="cuda")
    names = _kernels_launched(lambda: OPS["wgmma"](a, b, None, 0, 1.0, None, out, False, None))
    assert any("scaled_matmul_wgmma_kernel" in n for n in names), names
    assert not any("scaled_matmul_wmma_kernel" in n for n in names), names
    shifted = torch.randn(256, 129, device="cuda").to(torch.bfloat16)[:, 1:]  # [256, 128], 2 bytes off alignment
    names = _kernels_launched(lambda: OPS["wgmma"](shifted, b, None, 0, 1.0, None, out, False, None))
    assert any("scaled_matmul_wmma_kernel" in n for n in names), names


@pytest.mark.skipif(_C is None or not hasattr(_C, "wgmma_schedule"), reason="ampkernels._C is not built")
def test_wgmma_schedule(matmul_tuning):
    # (tile width, grid) on the H200's 132 SMs; a host function, so it runs on any machine.
    matmul_tuning(WGMMA_BN=None)
    schedule = _C.wgmma_schedule
    assert schedule(8192, 8192, 132) == (256, 132)  # 2048 tiles of 256: 15.5 waves
    assert schedule(4096, 4096, 132) == (256, 132)
    assert schedule(8192, 768, 132) == (192, 132)  # 256 tiles of 192: 1.94 waves (256: 192 tiles, 1.45)
    assert schedule(3072, 768, 132) == (192, 96)  # 72 tiles of 256, 96 of 192, 144 of 128 (two waves)
    assert schedule(100, 100, 132) == (128, 1)  # one tile whatever the width: the narrowest wastes least
    assert schedule(3072, 768, 64) == (192, 64)  # two waves of 192 beat two of 256 and three of 128
    matmul_tuning(WGMMA_BN=256)
    assert schedule(3072, 768, 132) == (256, 72)
    with pytest.raises(ValueError, match="WGMMA_BN"):  # not a width the kernel has: refused, the last one kept
        matmul_tuning(WGMMA_BN=160)
    assert schedule(3072, 768, 132) == (256, 72)
    matmul_tuning(WGMMA_BN=None)
    assert schedule(3072, 768, 132) == (192, 96)


# --------------------------------------------------------------------------------------------------------------------
# GPU: found_inf
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("shape", [(256, 512, 128), (65, 33, 17)], ids=["aligned", "odd"])
@pytest.mark.parametrize("op", GPU_OPS)
@pytest.mark.gpu
def test_found_inf(op, dtype, shape):
    kernel = OPS[op]
    M, N, K = shape
    a, b = matrix(M, K, dtype), matrix(K, N, dtype)
    found = torch.zeros(1, device="cuda")
    run_and_check(op, a, b, found_inf=found)
    assert found.item() == 0.0, "set on a finite output"

    # One element overflows fp16 when stored (finite in fp32): found; the same product stored in fp32: not found.
    a_big, b_big = a.clone(), b.clone()
    a_big[M // 2].fill_(1.0)
    b_big[:, N - 1].fill_(1.0)
    s = torch.tensor([1e5 / K], device="cuda")  # out[M//2, N-1] = 1e5 > 65504
    out = torch.empty(M, N, device="cuda", dtype=torch.float16)
    kernel(a_big, b_big, s, 1, 1.0, None, out, False, found)
    assert found.item() == 1.0 and out[M // 2, N - 1].isinf()
    found.zero_()
    out32 = torch.empty(M, N, device="cuda")
    kernel(a_big, b_big, s, 1, 1.0, None, out32, False, found)
    assert found.item() == 0.0 and out32.isfinite().all()

    # A NaN input anywhere: found. Never cleared by a later finite call.
    a_nan = a.clone()
    a_nan[M - 1, K - 1] = math.nan
    kernel(a_nan, b, None, 0, 1.0, None, torch.empty(M, N, device="cuda"), False, found)
    assert found.item() == 1.0
    kernel(a, b, None, 0, 1.0, None, torch.empty(M, N, device="cuda"), False, found)
    assert found.item() == 1.0, "found_inf was cleared"

    # Non-finite from accumulate (out_old inf) and from the scale.
    found.zero_()
    out = torch.randn(M, N, device="cuda")
    out[0, 0] = math.inf
    kernel(a, b, None, 0, 1.0, None, out, True, found)
    assert found.item() == 1.0
    found.zero_()
    kernel(a, b, torch.tensor([math.inf], device="cuda"), 1, 1.0, None, torch.empty(M, N, device="cuda"), False, found)
    assert found.item() == 1.0


# --------------------------------------------------------------------------------------------------------------------
# Argument checks (CPU tensors: the checks run before the device check) and registration
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ALL_OPS)
def test_schema(op):
    schema = str(OPS[op].default._schema)
    assert schema == (
        f"ampkernels::scaled_matmul_{op}_(Tensor a, Tensor b, Tensor? scale, int scale_mode, float alpha, "
        "Tensor? bias, Tensor(a!) out, bool accumulate, Tensor(b!)? found_inf) -> ()"
    )


def _cpu_args(**over):
    M, N, K = 6, 5, 4
    args = dict(
        a=torch.randn(M, K).half(),
        b=torch.randn(K, N).half(),
        scale=torch.ones(1),
        scale_mode=1,
        alpha=1.0,
        bias=torch.randn(N),
        out=torch.empty(M, N),
        accumulate=False,
        found_inf=torch.zeros(1),
    )
    args.update(over)
    return args


_A = torch.randn(6, 4).half()
BAD = [
    ("a", dict(a=torch.randn(2, 6, 4).half()), "expected a 2-D tensor"),
    ("a", dict(a=torch.randn(6, 4), b=torch.randn(4, 5)), "expected float16 or bfloat16"),
    ("b", dict(b=torch.randn(4, 5).bfloat16()), "expected the dtype of 'a'"),
    ("b", dict(b=torch.randn(3, 5).half()), "expected 4 rows"),
    ("a", dict(a=torch.randn(12, 8).half()[::2, ::2]), "row-major"),
    ("scale_mode", dict(scale_mode=4), "expected 0"),
    ("scale", dict(scale_mode=0), "expected None"),
    ("scale", dict(scale=None), "got None"),
    ("scale", dict(scale=torch.ones(1).half()), "expected float32"),
    ("scale", dict(scale=torch.ones(2)), "expected 1 element"),
    ("scale", dict(scale_mode=2, scale=torch.ones(5)), "expected a 1-D tensor of 6 elements"),
    ("scale", dict(scale_mode=3, scale=torch.ones(6)), "expected a 1-D tensor of 5 elements"),
    ("scale", dict(scale_mode=3, scale=torch.ones(10)[::2]), "contiguous"),
    ("bias", dict(bias=torch.randn(6)), "expected a 1-D tensor of 5 elements"),
    ("bias", dict(bias=torch.randn(5).double()), "expected float32 or the dtype of 'a'"),
    ("bias", dict(bias=torch.randn(5).bfloat16()), "expected float32 or the dtype of 'a'"),
    ("out", dict(out=torch.empty(5, 6)), "expected shape [6, 5]"),
    ("out", dict(out=torch.empty(6, 5).double()), "expected float32, float16 or bfloat16"),
    ("out", dict(out=torch.empty(5, 6).t()), "row-major contiguous"),
    ("out", dict(a=_A, b=torch.randn(4, 4).half(), bias=None, out=_A[:, :4]), "must not overlap 'a'"),
    ("found_inf", dict(found_inf=torch.zeros(2)), "1-element"),
    ("found_inf", dict(found_inf=torch.zeros(1).half()), "float32"),
    ("a", dict(), "runs on CUDA tensors"),  # everything valid, but on the CPU
]


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("arg,over,msg", BAD, ids=[f"{i}-{x[0]}" for i, x in enumerate(BAD)])
def test_bad_arguments(op, arg, over, msg):
    with pytest.raises(RuntimeError) as info:
        OPS[op](**_cpu_args(**over))
    text = str(info.value)
    assert f"argument '{arg}'" in text and msg in text, text


@pytest.mark.parametrize("op", GPU_OPS)
@pytest.mark.gpu
def test_bad_devices(op):
    args = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in _cpu_args().items()}
    for name in ["b", "scale", "bias", "out", "found_inf"]:
        bad = dict(args, **{name: args[name].cpu()})
        with pytest.raises(RuntimeError, match=f"argument '{name}'.*expected a tensor on cuda"):
            OPS[op](**bad)
