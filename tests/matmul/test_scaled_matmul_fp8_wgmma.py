"""Tests of the native op ``ampkernels::scaled_matmul_fp8_wgmma_`` (csrc/matmul/wgmma_fp8.cuh, sm_90a only).

GPU tests compare against a float64 reference of ``ampkernels.reference.scaled_matmul_float8`` on float8 operands made
by ``reference.to_float8``, and allow at most twice the error of ``torch._scaled_mm`` on the same operands (zero-padded
to its multiples of 16, its fp32 product then finished in float64 and rounded to the output dtype like ours).
``torch._scaled_mm`` with ``use_fast_accum=True`` accumulates in the tensor cores as this kernel does; its error with
the default (promoted) accumulation is printed beside it. Outputs are poisoned with NaN first, so an element the kernel
never wrote fails; amax_out is compared exactly with the max of |out| as stored. The argument checks run before the
device check, so they are tested on CPU tensors without a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from ampkernels import dispatch, reference
from ampkernels.matmul.launch import fast_accumulation_ok

_C = dispatch.native()  # importing ampkernels._C registers its ops


def _op():
    try:
        return torch.ops.ampkernels.scaled_matmul_fp8_wgmma_
    except (AttributeError, RuntimeError):
        return None


OP = _op()
HAS_CUDA = torch.cuda.is_available()
RUNS = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0) and getattr(_C, "wgmma_built", False)

needs_op = pytest.mark.skipif(OP is None, reason="ampkernels._C is not built (or was built without this op)")
# Without CUDA the `gpu` mark skips (tests/conftest.py); with another GPU, or a build without 9.0a, this does.
GPU_MARKS = (
    needs_op,
    pytest.mark.gpu,
    pytest.mark.skipif(HAS_CUDA and not RUNS, reason="needs an sm_90 GPU and a build for 9.0a"),
)


def gpu_test(fn):
    for mark in GPU_MARKS:
        fn = mark(fn)
    return fn


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
WIDTHS = [128, 192, 256]  # ampkernels.matmul.tuning.WGMMA_BN (csrc/matmul/scaled_matmul.h)
SHAPES = [
    (256, 512, 128),  # whole tiles, one k-tile
    (300, 296, 208),  # edge tiles, K tail, N % 8 == 0 (the packed epilogue)
    (65, 33, 48),  # N % 8 != 0 (the fp32 epilogue), one partial tile
    (128, 256, 16),  # K smaller than a k-tile
    (512, 384, 4096),  # deep K
    (2100, 2400, 1024),  # several tiles per block, the ring wraps
]


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


def operands(M, N, K, dtype_a=E4M3, dtype_b=E4M3, granularity="tensor"):
    """(a [M, K] row-major, b [K, N] column-major, scale_a, scale_b): to_float8 of random normal tensors; the scales are
    the dequantization factors (0-d, or [M, 1] / [N, 1] with granularity "row")."""
    x = torch.randn(M, K, device="cuda") * 3
    w = torch.randn(N, K, device="cuda") * 0.02
    a, scale_a = reference.to_float8(x, dtype_a, granularity)
    wt, scale_b = reference.to_float8(w, dtype_b, granularity)
    return a, wt.t(), scale_a, scale_b


def scale_of(mode, M, N):
    shape = {0: None, 1: (1,), 2: (M,), 3: (N,)}[mode]
    return None if shape is None else torch.rand(shape, device="cuda") + 0.5


def finish64(v, M, N, *, scale_a, scale_b, scale, mode, alpha, bias, old):
    """The reference's epilogue in float64 on the product v [M, N] (float64)."""
    if scale_a is not None:
        v = v * scale_a.double().reshape(-1, 1)
    if scale_b is not None:
        v = v * scale_b.double().reshape(1, -1)
    if mode == 1:
        v = v * scale.double().reshape(())
    elif mode == 2:
        v = v * scale.double().reshape(M, 1)
    elif mode == 3:
        v = v * scale.double().reshape(1, N)
    v = v * alpha
    if bias is not None:
        v = v + bias.double()
    if old is not None:
        v = v + old.double()
    return v


def scaled_mm_product(a, b, fast_accum):
    """torch._scaled_mm's fp32 a @ b on the same operands, zero-padded to multiples of 16 (zeros add nothing)."""
    M, K = a.shape
    N = b.shape[1]
    M16, N16 = -(-M // 16) * 16, -(-N // 16) * 16
    a_pad = torch.zeros(M16, K, device="cuda", dtype=a.dtype)
    a_pad[:M] = a
    bt_pad = torch.zeros(N16, K, device="cuda", dtype=b.dtype)
    bt_pad[:N] = b.t()
    one = torch.ones((), device="cuda")
    out = torch._scaled_mm(a_pad, bt_pad.t(), one, one, out_dtype=torch.float32, use_fast_accum=fast_accum)
    return out[:M, :N].double()


def rel_error(x, ref) -> float:
    norm = ref.norm().item()
    diff = (x.double() - ref).norm().item()
    return diff / norm if norm > 0 else diff


def run_and_check(
    a,
    b,
    scale_a=None,
    scale_b=None,
    *,
    mode=0,
    alpha=1.0,
    bias_dtype=None,
    out_dtype=torch.bfloat16,
    accumulate=False,
    found_inf=None,
    amax_out=None,
    config="",
):
    """Runs the op on poisoned (or random, to accumulate into) `out` and checks it against the float64 reference and
    reference.scaled_matmul_float8; returns out."""
    M, K = a.shape
    N = b.shape[1]
    scale = scale_of(mode, M, N)
    bias = None if bias_dtype is None else torch.randn(N, device="cuda").to(bias_dtype)
    if accumulate:
        out = torch.randn(M, N, device="cuda").to(out_dtype)
    else:
        out = torch.full((M, N), math.nan, device="cuda", dtype=out_dtype)
    old = out.clone()
    amax_before = None if amax_out is None else amax_out.clone()
    OP(a, b, scale_a, scale_b, scale, mode, alpha, bias, out, accumulate, found_inf, amax_out)

    epi = dict(scale_a=scale_a, scale_b=scale_b, scale=scale, mode=mode, alpha=alpha, bias=bias)
    epi["old"] = old if accumulate else None
    ref = finish64(a.double() @ b.double(), M, N, **epi)
    low_fast = finish64(scaled_mm_product(a, b, True), M, N, **epi).to(out_dtype)
    low_default = finish64(scaled_mm_product(a, b, False), M, N, **epi).to(out_dtype)
    err, fast_err, default_err = rel_error(out, ref), rel_error(low_fast, ref), rel_error(low_default, ref)
    where = (
        f"[{config} {M}x{N}x{K} {a.dtype}x{b.dtype} -> {out_dtype}, mode {mode}, alpha {alpha}, bias {bias_dtype}, "
        f"accumulate {accumulate}, scale_a {None if scale_a is None else tuple(scale_a.shape)}, "
        f"scale_b {None if scale_b is None else tuple(scale_b.shape)}]"
    )
    print(f"{where}: rel. error {err:.3g}, torch._scaled_mm fast-accum {fast_err:.3g}, default {default_err:.3g}")
    assert not out.isnan().any(), f"{where}: NaN in the output: an element was not written (or computed wrong)"
    assert err <= 2 * fast_err + 1e-7, f"{where}: relative error {err:.3g} > 2 x torch._scaled_mm's {fast_err:.3g}"
    # Against torch._scaled_mm's default (promoted) accumulation only where "auto" offers this kernel: elsewhere
    # its fast accumulation is outside the rule (measured; ampkernels.matmul.launch.fast_accumulation_ok).
    if fast_accumulation_ok(K, out_dtype):
        assert err <= 2 * default_err + 1e-7, f"{where}: {err:.3g} > 2 x default-accumulation {default_err:.3g}"

    # The reference itself (fp32 math) agrees to the output's rounding.
    scale_arg = alpha if mode == 0 else _broadcast(scale, mode, M, N) * alpha
    want = reference.scaled_matmul_float8(
        a, b, scale_a, scale_b, scale_arg, bias=bias, out_dtype=out_dtype, out=old.clone() if accumulate else None,
        accumulate=accumulate,
    )  # fmt: skip
    assert rel_error(out, want.double()) <= 3 * fast_err + 1e-6, f"{where}: differs from reference.scaled_matmul_float8"
    if amax_out is not None:
        expected = torch.maximum(amax_before, out.float().abs().amax().reshape(1))
        assert torch.equal(amax_out, expected) or (amax_out.isnan().all() and expected.isnan().all()), (
            f"{where}: amax_out {amax_out.item()} != max(before, max |out|) = {expected.item()}"
        )
    return out


def _broadcast(scale, mode, M, N):
    if mode == 1:
        return scale.reshape(())
    return scale.reshape(M, 1) if mode == 2 else scale.reshape(1, N)


# --------------------------------------------------------------------------------------------------------------------
# GPU: products and epilogues
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@gpu_test
def test_shapes_widths_tensorwise(shape, width, out_dtype, matmul_tuning):
    matmul_tuning(WGMMA_BN=width)
    M, N, K = shape
    a, b, sa, sb = operands(M, N, K)
    run_and_check(a, b, sa, sb, out_dtype=out_dtype, config=f"BN {width}")


@pytest.mark.parametrize(
    "dtypes", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)], ids=["e4m3_e4m3", "e4m3_e5m2", "e5m2_e4m3"]
)
@pytest.mark.parametrize("shape", [(256, 512, 128), (300, 296, 208), (65, 33, 48)], ids=shape_id)
@pytest.mark.parametrize("width", WIDTHS)
@gpu_test
def test_operand_types(dtypes, shape, width, matmul_tuning):
    matmul_tuning(WGMMA_BN=width)
    M, N, K = shape
    a, b, sa, sb = operands(M, N, K, *dtypes)
    run_and_check(a, b, sa, sb, config=f"BN {width}")


@pytest.mark.parametrize("scales", ["none", "tensor", "row_a", "col_b", "row_col"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("shape", [(300, 296, 208), (65, 33, 48)], ids=shape_id)
@pytest.mark.parametrize("width", [128, 256])
@gpu_test
def test_dequantization_scales(scales, out_dtype, shape, width, matmul_tuning):
    """scale_a / scale_b: None, one element, per row of a, per column of b (both packed and fp32 epilogues)."""
    matmul_tuning(WGMMA_BN=width)
    M, N, K = shape
    a, b, sa_t, sb_t = operands(M, N, K)
    _, _, sa_r, sb_r = operands(M, N, K, granularity="row")
    sa_r, sb_r = sa_r * (torch.rand_like(sa_r) + 0.5), sb_r * (torch.rand_like(sb_r) + 0.5)  # factors that differ
    sa, sb = {
        "none": (None, None),
        "tensor": (sa_t, sb_t),
        "row_a": (sa_r, sb_t),
        "col_b": (sa_t, sb_r),
        "row_col": (sa_r, sb_r),
    }[scales]
    # Undequantized products reach ~1e5 (past fp16's range): alpha brings them back.
    alpha = 1e-4 if scales == "none" else 1.0
    run_and_check(a, b, sa, sb, alpha=alpha, out_dtype=out_dtype, config=f"BN {width} scales {scales}")


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("bias", [None, "fp32", "out"])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("shape", [(300, 296, 208), (65, 33, 48)], ids=shape_id)
@gpu_test
def test_epilogue_options(mode, bias, accumulate, out_dtype, shape):
    M, N, K = shape
    a, b, sa, sb = operands(M, N, K, granularity="row" if mode % 2 else "tensor")
    bias_dtype = {None: None, "fp32": torch.float32, "out": out_dtype}[bias]
    run_and_check(
        a, b, sa, sb, mode=mode, alpha=0.75, bias_dtype=bias_dtype, out_dtype=out_dtype, accumulate=accumulate,
        config="epilogue",
    )  # fmt: skip


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("shape", [(300, 296, 208), (65, 33, 48), (2100, 2400, 1024)], ids=shape_id)
@pytest.mark.parametrize("width", WIDTHS)
@gpu_test
def test_amax_out(out_dtype, shape, width, matmul_tuning):
    """amax_out = max(amax_out, max |out as stored|), exactly, in every epilogue path; never lowered."""
    matmul_tuning(WGMMA_BN=width)
    M, N, K = shape
    a, b, sa, sb = operands(M, N, K)
    cfg = f"BN {width} amax"
    run_and_check(a, b, sa, sb, out_dtype=out_dtype, amax_out=torch.zeros(1, device="cuda"), config=cfg)
    run_and_check(a, b, sa, sb, out_dtype=out_dtype, amax_out=torch.full((1,), 1e30, device="cuda"), config=cfg)
    run_and_check(a, b, sa, sb, out_dtype=out_dtype, amax_out=torch.full((1,), -1.0, device="cuda"), config=cfg)
    # The fp32 epilogue (bias, accumulate) and the per-column packed one.
    run_and_check(a, b, sa, sb, out_dtype=out_dtype, bias_dtype=torch.float32, accumulate=True,
                  amax_out=torch.zeros(1, device="cuda"), config=cfg)  # fmt: skip
    _, _, sa_r, sb_r = operands(M, N, K, granularity="row")
    run_and_check(a, b, sa_r, sb_r, out_dtype=out_dtype, amax_out=torch.zeros(1, device="cuda"), config=cfg)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("shape", [(256, 512, 128), (65, 33, 48)], ids=shape_id)
@gpu_test
def test_found_inf_and_non_finite_amax(out_dtype, shape):
    M, N, K = shape
    a, b, sa, sb = operands(M, N, K)
    found = torch.zeros(1, device="cuda")
    amax = torch.zeros(1, device="cuda")
    run_and_check(a, b, sa, sb, out_dtype=out_dtype, found_inf=found, amax_out=amax)
    assert found.item() == 0.0, "found_inf set on a finite output"

    # One output overflows the output dtype when stored: found, and amax_out is inf.
    scale = torch.full((1,), 1e6 if out_dtype == torch.float16 else 3e38, device="cuda")  # |out| ~ 0.7 before
    out = torch.empty(M, N, device="cuda", dtype=out_dtype)
    OP(a, b, sa, sb, scale, 1, 1.0, None, out, False, found, amax)
    assert found.item() == 1.0 and out.isinf().any() and amax.item() == math.inf, (found, amax)

    # A NaN operand: found, amax_out NaN (NaN-propagating, like torch.maximum), and it stays NaN.
    found.zero_()
    amax.zero_()
    a_nan = a.clone()
    a_nan.view(torch.uint8)[M - 1, K - 1] = 0x7F  # e4m3fn NaN
    OP(a_nan, b, sa, sb, None, 0, 1.0, None, torch.empty(M, N, device="cuda", dtype=out_dtype), False, found, amax)
    assert found.item() == 1.0 and amax.isnan().all(), (found, amax)
    OP(a, b, sa, sb, None, 0, 1.0, None, torch.empty(M, N, device="cuda", dtype=out_dtype), False, found, amax)
    assert found.item() == 1.0, "found_inf was cleared"
    assert amax.isnan().all(), "a NaN amax_out was replaced by a finite amax"


@pytest.mark.parametrize("shape", [(0, 64, 32), (64, 0, 32)], ids=shape_id)
@gpu_test
def test_empty_output(shape):
    M, N, K = shape
    a = torch.zeros(M, K, device="cuda", dtype=E4M3)
    b = torch.zeros(N, K, device="cuda", dtype=E4M3).t()
    out = torch.empty(M, N, device="cuda")
    amax = torch.full((1,), -1.0, device="cuda")
    OP(a, b, None, None, None, 0, 1.0, None, out, False, None, amax)
    assert amax.item() == -1.0  # nothing stored, nothing recorded (as the reference)


@gpu_test
def test_opcheck():
    M, N, K = 72, 40, 64
    a, b, sa, sb = operands(M, N, K)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    args = (a, b, sa, sb, torch.ones(1, device="cuda"), 1, 1.0, torch.randn(N, device="cuda"), out, False,
            torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda"))  # fmt: skip
    # test_schema compares the inputs around the call with arithmetic float8 lacks on CUDA too ("mul_cuda" not
    # implemented for Float8_e4m3fn, measured on the H200): the schema's mutations are covered by test_faketensor.
    torch.library.opcheck(OP.default, args, test_utils=("test_faketensor", "test_autograd_registration"))


# --------------------------------------------------------------------------------------------------------------------
# Argument checks (CPU tensors: the checks run before the device check) and registration
# --------------------------------------------------------------------------------------------------------------------


@needs_op
def test_schema():
    assert str(OP.default._schema) == (
        "ampkernels::scaled_matmul_fp8_wgmma_(Tensor a, Tensor b, Tensor? scale_a, Tensor? scale_b, Tensor? scale, "
        "int scale_mode, float alpha, Tensor? bias, Tensor(a!) out, bool accumulate, Tensor(b!)? found_inf, "
        "Tensor(c!)? amax_out) -> ()"
    )


M_, N_, K_ = 6, 5, 32


def _fp8(rows, cols, dtype=E4M3):
    return torch.randn(rows, cols).to(dtype)


def _cpu_args(**over):
    args = dict(
        a=_fp8(M_, K_),
        b=_fp8(N_, K_).t(),
        scale_a=torch.ones(()),
        scale_b=torch.ones(N_, 1),
        scale=torch.ones(1),
        scale_mode=1,
        alpha=1.0,
        bias=torch.randn(N_),
        out=torch.empty(M_, N_, dtype=torch.bfloat16),
        accumulate=False,
        found_inf=torch.zeros(1),
        amax_out=torch.zeros(1),
    )
    args.update(over)
    return args


_STORAGE = _fp8(1, 2 * M_ * N_ * K_).flatten()  # views at an odd byte offset
BAD = [
    ("a", dict(a=torch.randn(2, M_, K_).to(E4M3)), "expected a 2-D tensor"),
    ("b", dict(b=_fp8(K_, N_)[None]), "expected a 2-D tensor"),
    ("a", dict(a=torch.randn(M_, K_).half()), "expected float8_e4m3fn or float8_e5m2"),
    ("b", dict(b=torch.randn(N_, K_).bfloat16().t()), "expected float8_e4m3fn or float8_e5m2"),
    ("b", dict(a=_fp8(M_, K_, E5M2), b=_fp8(N_, K_, E5M2).t()), "float8_e5m2 x float8_e5m2 is not supported"),
    ("b", dict(b=_fp8(N_, 48).t()), "expected 32 rows"),
    ("a", dict(a=_fp8(M_, 24), b=_fp8(N_, 24).t()), "positive multiple of 16"),
    ("a", dict(a=_fp8(M_, 0), b=_fp8(N_, 0).t()), "positive multiple of 16"),
    ("a", dict(a=_fp8(K_, M_).t()), "expected a row-major [M, K] matrix"),
    ("a", dict(a=_fp8(M_, 40)[:, :K_]), "stride(0) >= K and a multiple of 16"),
    ("b", dict(b=_fp8(K_, N_)), "expected a column-major [K, N] matrix"),
    ("b", dict(b=_fp8(N_, 40)[:, :K_].t()), "expected a column-major [K, N] matrix"),
    ("a", dict(a=_STORAGE[1 : 1 + M_ * K_].view(M_, K_)), "16-byte-aligned data pointer"),
    ("b", dict(b=_STORAGE[1 : 1 + N_ * K_].view(N_, K_).t()), "16-byte-aligned data pointer"),
    ("scale_a", dict(scale_a=torch.ones(()).half()), "expected float32"),
    ("scale_a", dict(scale_a=torch.ones(M_ + 1)), "expected 1 element (tensorwise) or 6 (one per row of a)"),
    ("scale_a", dict(scale_a=torch.ones(2 * M_)[::2]), "contiguous"),
    ("scale_b", dict(scale_b=torch.ones(M_)), "expected 1 element (tensorwise) or 5 (one per column of b)"),
    ("scale_b", dict(scale_b=torch.ones(N_).double()), "expected float32"),
    ("scale_mode", dict(scale_mode=4), "expected 0"),
    ("scale", dict(scale_mode=0), "expected None"),
    ("scale", dict(scale=None), "got None"),
    ("scale", dict(scale=torch.ones(2)), "expected 1 element"),
    ("scale", dict(scale_mode=2, scale=torch.ones(N_)), "expected a 1-D tensor of 6 elements"),
    ("scale", dict(scale_mode=3, scale=torch.ones(M_)), "expected a 1-D tensor of 5 elements"),
    ("bias", dict(bias=torch.randn(M_)), "expected a 1-D tensor of 5 elements"),
    ("bias", dict(bias=torch.randn(N_).half()), "expected float32 or the dtype of 'out'"),
    ("out", dict(out=torch.empty(N_, M_)), "expected shape [6, 5]"),
    ("out", dict(out=torch.empty(M_, N_).double(), bias=None), "expected float32, float16 or bfloat16"),
    ("out", dict(out=torch.empty(N_, M_).t()), "row-major contiguous"),
    ("found_inf", dict(found_inf=torch.zeros(2)), "1-element"),
    ("amax_out", dict(amax_out=torch.zeros(2)), "1-element"),
    ("amax_out", dict(amax_out=torch.zeros(1).half()), "float32"),
    ("a", dict(), "runs on CUDA tensors"),  # everything valid, but on the CPU
]


@needs_op
@pytest.mark.parametrize("arg,over,msg", BAD, ids=[f"{i}-{x[0]}" for i, x in enumerate(BAD)])
def test_bad_arguments(arg, over, msg):
    with pytest.raises(RuntimeError) as info:
        OP(**_cpu_args(**over))
    text = str(info.value)
    assert f"argument '{arg}'" in text and msg in text, text


@needs_op
def test_valid_variants_reach_the_device_check():
    """Layouts and scales the checks accept: padded rows, no scales, per-row / per-column ones, e5m2 operands."""
    variants = [
        dict(a=_fp8(M_, K_ + 16)[:, :K_]),  # padded rows (stride 48)
        dict(b=_fp8(N_, K_ + 32)[:, :K_].t()),
        dict(scale_a=None, scale_b=None, scale=None, scale_mode=0, found_inf=None, amax_out=None),
        dict(scale_a=torch.ones(M_, 1), scale_b=torch.ones(N_)),
        dict(a=_fp8(M_, K_, E5M2)),
        dict(b=_fp8(N_, K_, E5M2).t()),
        dict(bias=torch.randn(N_).bfloat16()),  # the output's dtype
        dict(a=_fp8(1, K_), out=torch.empty(1, N_, dtype=torch.bfloat16), scale_a=torch.ones(1)),
    ]
    for over in variants:
        with pytest.raises(RuntimeError, match="argument 'a'.*runs on CUDA tensors"):
            OP(**_cpu_args(**over))


@gpu_test
def test_bad_devices():
    args = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in _cpu_args().items()}
    for name in ["b", "scale_a", "scale_b", "scale", "bias", "out", "found_inf", "amax_out"]:
        bad = dict(args, **{name: args[name].cpu()})
        with pytest.raises(RuntimeError, match=f"argument '{name}'.*expected a tensor on cuda"):
            OP(**bad)
