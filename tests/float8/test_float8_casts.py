"""The FP8 casts (``ampkernels.float8.to_float8`` / ``to_float8_pair``) against ``reference.to_float8``, bit for bit.

Every kernel test runs each kernel backend that runs here (``KERNELS``): the native CUDA kernels on a GPU, and the
Triton kernels on a GPU or on the CPU under ``TRITON_INTERPRET=1`` (``tests/conftest.py``). Every
comparison is exact on both: data as uint8 codes, scale_inv / amax_out / found_inf as float32 bits. On a GPU the
kernels round with the hardware's ``cvt.rn.satfinite``; under the interpreter (whose own float8 conversion rounds
half up and turns NaN into a number) with the kernel's integer rounding, which the GPU tests also check against the
hardware (``float8_casts.SOFTWARE_ROUNDING``).
"""

from __future__ import annotations

import math

import pytest
import torch

from ampkernels import dispatch, reference
from ampkernels._constants import FLOAT8_DTYPES
from ampkernels.float8 import to_float8, to_float8_pair

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# On a GPU machine every test here runs on the GPU: marked so, for `pytest -m gpu`.
pytestmark = [pytest.mark.gpu] if DEV == "cuda" else []
TRITON_REASON = dispatch.why_not("to_float8", "triton", DEV)
needs_triton = pytest.mark.skipif(TRITON_REASON is not None, reason=str(TRITON_REASON))
gpu = pytest.mark.gpu
#: The kernel backends, each skipped where it cannot run (native: CUDA tensors in a CUDA build).
KERNELS = [
    pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=str(reason)))
    for name, reason in ((name, dispatch.why_not("to_float8", name, DEV)) for name in ("native", "triton"))
]
RUNNING_KERNELS = [name for name in ("native", "triton") if dispatch.why_not("to_float8", name, DEV) is None]

INPUTS = (torch.float32, torch.bfloat16, torch.float16)
# (granularity, transpose, pair)
PATHS = {
    "tensor": ("tensor", False, False),
    "tensor_t": ("tensor", True, False),
    "row": ("row", False, False),
    "row_t": ("row", True, False),
    "pair": ("tensor", False, True),
}


def _data(shape, dtype=torch.float32, seed=0, device=DEV):
    """Random values whose rows span 2^-24 .. 2^12 (tensorwise, the small rows land in the float8 subnormals), a few
    exact zeros and one all-zero row; never all zero."""
    gen = torch.Generator().manual_seed(seed)
    rows = shape[-2] if len(shape) > 1 else 1
    x = torch.randn(shape, generator=gen)
    magnitudes = 2.0 ** torch.randint(-24, 12, (rows, 1), generator=gen).float()
    x = (x.reshape(-1, rows, shape[-1]) * magnitudes).reshape(shape) if len(shape) > 1 else x * magnitudes[0]
    x.view(-1)[:: max(1, x.numel() // 7)] = 0.0
    if len(shape) > 1 and rows > 2:
        x.reshape(-1, rows, shape[-1])[:, 1] = 0.0
    return x.to(dtype).to(device)


def _rows(x, granularity, transpose):
    K = x.shape[-1]
    return (K if transpose else math.prod(x.shape[:-1])) if granularity == "row" else None


def _state(x, granularity, transpose, seed=1):
    """(amax_out, found_inf) with a random previous amax (some rows above the new amax, some below)."""
    rows = _rows(x, granularity, transpose)
    gen = torch.Generator().manual_seed(seed)
    finite_amax = x.float().abs().nan_to_num(0.0, 0.0, 0.0).amax().cpu()
    prev = torch.rand((rows, 1) if rows else (), generator=gen) * finite_amax * 1.5
    return prev.to(x.device), torch.zeros(1, device=x.device)


def _scale_for(x, granularity, transpose, dtype, seed=2):
    """A delayed scale: the current one times 0.5..4 (so that some values saturate)."""
    amax = reference.float8_amax(x, granularity, transpose)
    gen = torch.Generator().manual_seed(seed)
    factor = (0.5 + 3.5 * torch.rand(amax.shape, generator=gen)).to(x.device)
    return reference.float8_scale(amax, dtype) * factor


def _bits(t):
    """float8 codes as uint8; float32 as int32 bits, every NaN as one pattern (torch's NaN payloads vary)."""
    if t.dtype in FLOAT8_DTYPES:
        return t.view(torch.uint8)
    return t.contiguous().nan_to_num(float("nan")).view(torch.int32).masked_fill(t.isnan(), -1)


def assert_same(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, expected.shape)
    assert actual.is_contiguous()
    a, e = _bits(actual), _bits(expected)
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (
        f"{bad.shape[0]} of {a.numel()} differ, first at {bad[0].tolist()}: {a[tuple(bad[0])]} vs {e[tuple(bad[0])]}"
    )


def _run(path, x, dtype, delayed, backend, record=True):
    granularity, transpose, pair = PATHS[path]
    scale = _scale_for(x, granularity, transpose, dtype) if delayed else None
    amax_out, found_inf = _state(x, granularity, transpose) if record else (None, None)
    kw = dict(scale=scale, amax_out=amax_out, found_inf=found_inf)
    if pair:
        ours = to_float8_pair(x, dtype, backend=backend, **kw)
    else:
        ours = to_float8(x, dtype, granularity, transpose=transpose, backend=backend, **kw)
    return ours, amax_out, found_inf


def _check(path, x, dtype, delayed=False, record=True, backend="triton"):
    """The kernel backend's cast equals the reference (same inputs, same previous state), every output bit for
    bit."""
    ours, amax, flag = _run(path, x, dtype, delayed, backend, record)
    ref, ref_amax, ref_flag = _run(path, x, dtype, delayed, "torch", record)
    for a, e in zip(ours, ref):
        assert_same(a, e)
    if record:
        assert_same(amax, ref_amax)
        assert_same(flag, ref_flag)
    return ours, amax, flag


# --------------------------------------------------------------------------------------------------------------------
# The reference itself
# --------------------------------------------------------------------------------------------------------------------


def test_reference_matches_the_unfused_torch_recipe():
    x = _data((64, 96), torch.bfloat16, device="cpu")
    amax = x.float().abs().amax()
    scale = 448.0 / amax
    expected = (x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    data, scale_inv = reference.to_float8(x)
    assert_same(data, expected)
    assert_same(scale_inv, torch.reciprocal(scale))


def test_backend_choice():
    assert dispatch.BACKENDS["to_float8"] == ("native", "triton", "torch")
    assert dispatch.VARIABLES["to_float8"] == "AMPKERNELS_FLOAT8_BACKEND"
    assert dispatch.select("to_float8", "cpu") == "torch"
    assert "CUDA tensors only" in dispatch.why_not("to_float8", "native", "cpu")
    if torch.cuda.is_available() and RUNNING_KERNELS:
        assert dispatch.select("to_float8", "cuda") == RUNNING_KERNELS[0]


def test_native_where_it_cannot_run_leaves_the_casts_on_their_default(monkeypatch):
    """AMPKERNELS_BACKEND=native takes the native casts where they run (CUDA tensors) and leaves the rest on their
    default; AMPKERNELS_FLOAT8_BACKEND=native asks for them (an error where they cannot run) and leaves the fused
    kernels, which have no native version, on theirs."""
    monkeypatch.delenv("AMPKERNELS_FLOAT8_BACKEND", raising=False)
    monkeypatch.setenv("AMPKERNELS_BACKEND", "native")
    assert dispatch.select("to_float8", "cpu") == "torch"
    monkeypatch.setenv("AMPKERNELS_FLOAT8_BACKEND", "native")
    with pytest.raises(RuntimeError, match="AMPKERNELS_FLOAT8_BACKEND.*CUDA tensors only"):
        dispatch.select("to_float8", "cpu")
    assert dispatch.select("float8_fused", "cpu") == "torch"
    monkeypatch.setenv("AMPKERNELS_FLOAT8_BACKEND", "wgmma")
    with pytest.raises(ValueError, match="AMPKERNELS_FLOAT8_BACKEND.*native/triton/torch"):
        dispatch.select("to_float8", "cpu")


# --------------------------------------------------------------------------------------------------------------------
# The kernels against the reference
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("in_dtype", INPUTS, ids=str)
@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("shape", [(333, 129), (48, 96), (256, 64)], ids=str)
def test_every_path_bitwise(shape, path, delayed, dtype, in_dtype, backend):
    """(48, 96) and (256, 64): rows whose stores vectorize, where the H200 once wrote fp32 pairs wrong."""
    _check(path, _data(shape, in_dtype), dtype, delayed, backend=backend)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (2, 3, 17), (64, 64), (1, 300), (300, 1)], ids=str)
@pytest.mark.parametrize("path", list(PATHS))
def test_odd_shapes(path, shape, backend):
    _check(path, _data(shape, torch.bfloat16, seed=3), torch.float8_e4m3fn, backend=backend)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
def test_long_rows_walk_the_row_in_blocks(delayed, backend):
    """Rows longer than one rowwise block (Triton's ROW_ELEMENTS) or than the native kernels keep in registers (a
    warp per row up to 256 vectors, then a block per row up to 1024): 4500 fits a block, 20000 is read twice for
    current scaling."""
    _check("row", _data((3, 4500), torch.float16, seed=4), torch.float8_e5m2, delayed, backend=backend)
    _check("row", _data((3, 20000), torch.float16, seed=4), torch.float8_e5m2, delayed, backend=backend)


@pytest.mark.skipif(DEV != "cuda", reason="the limit is the GPU's grid (the interpreter has none)")
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("path", ["tensor", "row_t"])
def test_strided_rows_longer_than_a_grid_dimension(path, backend):
    """A strided x (x.T of a [K, 2] tensor: its rows do not vectorize) with K = 8.4M: the amax pass over its columns
    takes more column blocks (native 262,500 of 32 elements, Triton 65,625 of 128) than a grid's second dimension's
    65,535; per tensor and per column of x (the rowwise cast of x.T)."""
    x = _data((8_400_000, 2), torch.bfloat16, seed=9).t()
    _check(path, x, torch.float8_e4m3fn, backend=backend)


@needs_triton
@pytest.mark.parametrize("path", list(PATHS))
def test_triton_launches_on_the_device_of_x(path, monkeypatch):
    """Triton launches on the current CUDA device: the casts make x's device current first, as the native casts do
    with a CUDA guard (x on cuda:1 while cuda:0 is current was cast from cuda:0)."""
    import ampkernels._runtime

    guarded = []
    real = ampkernels._runtime.device_guard
    monkeypatch.setattr(ampkernels._runtime, "device_guard", lambda device: guarded.append(device) or real(device))
    x = _data((33, 40), torch.bfloat16, seed=8)
    _run(path, x, torch.float8_e4m3fn, False, "triton")
    assert guarded == [x.device]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize("path", list(PATHS))
def test_x_on_a_device_that_is_not_current(path, delayed):
    x = _data((333, 129), torch.bfloat16, seed=8, device="cuda:1")
    with torch.cuda.device(0):
        _check(path, x, torch.float8_e4m3fn, delayed, backend="triton")


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize("path", list(PATHS))
def test_without_amax_out_or_found_inf(path, delayed, backend):
    _check(path, _data((65, 70), seed=5), torch.float8_e4m3fn, delayed, record=False, backend=backend)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("layout", ["transposed", "sliced", "permuted_3d"])
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize("path", list(PATHS))
def test_non_contiguous_inputs(path, delayed, layout, backend):
    base = _data((4, 70, 96), torch.bfloat16, seed=6)
    x = {"transposed": base[0].t(), "sliced": base[1, :, ::3], "permuted_3d": base.permute(1, 0, 2)}[layout]
    assert not x.is_contiguous()
    _check(path, x, torch.float8_e4m3fn, delayed, backend=backend)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
@pytest.mark.parametrize("path", list(PATHS))
def test_inf_and_nan(path, dtype, delayed, backend):
    """Non-finite elements become NaN, the scale of their tensor (or row) is 1.0 under current scaling, found_inf is
    set and the amax is not recorded (tensorwise; per row only for the rows that hold them)."""
    x = _data((70, 45), torch.float32, seed=7)
    x[5, 3] = float("inf")
    x[20, 44] = float("nan")
    x[69, 0] = -float("inf")
    x[33, 7] = float("nan")
    (*outs,), amax, flag = _check(path, x, dtype, delayed, backend=backend)
    assert flag.item() == 1.0
    assert outs[0].float().isnan().sum().item() == 4


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("path", list(PATHS))
def test_all_zero_tensor(path, backend):
    """amax 0: the floor gives a large finite scale; every code 0."""
    x = torch.zeros(40, 50, device=DEV, dtype=torch.bfloat16)
    (*outs,), amax, flag = _check(path, x, torch.float8_e4m3fn, backend=backend)
    assert flag.item() == 0.0 and torch.isfinite(outs[-1]).all()


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
def test_rounding_ties_subnormals_and_saturation(dtype, backend):
    """Through the cast with scale 1: every float8 value, the midpoints between neighbours (ties: to even), the
    float32 values just either side of them, values beyond the largest finite one (saturate), signed zeros."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    values = codes[torch.isfinite(codes)].unique()
    mids = (values[1:] + values[:-1]) / 2
    top = reference.float8_max(dtype)
    x = torch.cat(
        [
            values,
            mids,
            torch.nextafter(mids, torch.full_like(mids, float("inf"))),
            torch.nextafter(mids, torch.full_like(mids, -float("inf"))),
            torch.tensor([top * 1.0625, top * 2, 3e38, -3e38, 0.0, -0.0, 1e-30, -1e-30]),
        ]
    )
    x = x.reshape(1, -1).to(DEV)
    one = torch.ones((), device=DEV)
    data, _ = to_float8(x, dtype, scale=one, backend=backend)
    assert_same(data, reference.to_float8(x, dtype, scale=one)[0])


# --------------------------------------------------------------------------------------------------------------------
# The record: amax_out and found_inf
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [*KERNELS, "torch"])
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
def test_amax_out_keeps_the_max_and_skips_non_finite(delayed, backend):
    x = _data((30, 40), seed=8)
    amax = x.abs().amax()
    scale = reference.float8_scale(amax, torch.float8_e4m3fn) if delayed else None
    higher = (amax * 2).reshape(1)
    lower = torch.zeros(1, device=DEV)
    for prev, expected in ((higher, amax * 2), (lower, amax)):
        amax_out = prev.clone()
        to_float8(x, scale=scale, amax_out=amax_out, backend=backend)
        assert_same(amax_out, expected.reshape(1))
    x[3, 3] = float("inf")
    amax_out, found_inf = lower.clone(), torch.zeros(1, device=DEV)
    to_float8(x, scale=scale, amax_out=amax_out, found_inf=found_inf, backend=backend)
    assert amax_out.item() == 0.0 and found_inf.item() == 1.0


@pytest.mark.parametrize("backend", [*KERNELS, "torch"])
@pytest.mark.parametrize("path", list(PATHS))
def test_found_inf_is_never_cleared(path, backend):
    granularity, transpose, pair = PATHS[path]
    x = _data((20, 24), seed=9)
    found_inf = torch.ones(1, device=DEV)
    if pair:
        to_float8_pair(x, found_inf=found_inf, backend=backend)
    else:
        to_float8(x, granularity=granularity, transpose=transpose, found_inf=found_inf, backend=backend)
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_rowwise_records_per_row(granularity, backend):
    x = _data((12, 33), seed=10)
    x[4, 1] = float("nan")
    _check("row", x, torch.float8_e4m3fn, backend=backend)
    amax_out = torch.zeros(12, 1, device=DEV)
    to_float8(x, granularity="row", amax_out=amax_out, backend=backend)
    expected = x.abs().amax(dim=1, keepdim=True)
    expected[4] = 0.0
    assert_same(amax_out, expected)


@pytest.mark.parametrize("backend", ["torch", *KERNELS])
@pytest.mark.parametrize("transpose", [False, True])
def test_rowwise_amax_out_of_shape_r_records_like_r_by_1(transpose, backend):
    """The checks accept a rowwise ``amax_out`` (and ``scale``) of shape [R] as well as [R, 1]: each backend records
    into it what it records into an [R, 1] one (the reference once broadcast the [R] record against its [R, 1]
    amax and failed)."""
    x = _data((12, 40), torch.bfloat16, seed=13)
    x[4, 1] = float("nan")
    R = _rows(x, "row", transpose)
    prev = torch.rand(R, 1, generator=torch.Generator().manual_seed(3)).to(DEV) * 2.0**10
    flat, column = prev.reshape(R).clone(), prev.clone()
    for delayed in (False, True):
        scale = _scale_for(x, "row", transpose, torch.float8_e4m3fn) if delayed else None
        got = to_float8(x, granularity="row", transpose=transpose, scale=scale, amax_out=flat, backend=backend)
        want = to_float8(x, granularity="row", transpose=transpose, scale=scale, amax_out=column, backend="torch")
        for a, e in zip(got, want):
            assert_same(a, e)
        assert_same(flat, column.reshape(R))
    assert not torch.equal(column, prev)  # (the records moved)


# --------------------------------------------------------------------------------------------------------------------
# Consistency between the entry points
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("transpose", [False, True])
def test_delayed_with_the_current_scale_equals_current(granularity, transpose, backend):
    x = _data((50, 77), torch.bfloat16, seed=11)
    scale = reference.float8_scale(reference.float8_amax(x, granularity, transpose), torch.float8_e4m3fn)
    current = to_float8(x, granularity=granularity, transpose=transpose, backend=backend)
    delayed = to_float8(x, granularity=granularity, transpose=transpose, scale=scale, backend=backend)
    for a, b in zip(current, delayed):
        assert_same(a, b)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
def test_pair_equals_two_single_casts(delayed, backend):
    x = _data((90, 61), torch.float16, seed=12)
    scale = _scale_for(x, "tensor", False, torch.float8_e5m2) if delayed else None
    data, data_t, scale_inv = to_float8_pair(x, torch.float8_e5m2, scale=scale, backend=backend)
    single, single_inv = to_float8(x, torch.float8_e5m2, scale=scale, backend=backend)
    single_t, _ = to_float8(x, torch.float8_e5m2, scale=scale, transpose=True, backend=backend)
    assert_same(data, single)
    assert_same(data_t, single_t)
    assert_same(scale_inv, single_inv)
    assert_same(data_t, data.t().contiguous())


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0)], ids=str)
@pytest.mark.parametrize("path", list(PATHS))
def test_empty_tensors(path, shape):
    """Nothing to cast: the amax is 0 (the floor's scale), recorded as such."""
    backend = "triton" if TRITON_REASON is None else "torch"
    granularity, transpose, pair = PATHS[path]
    x = torch.empty(shape, device=DEV)
    rows = _rows(x, granularity, transpose)
    results = []
    for name in (backend, "torch"):
        amax_out = torch.full((rows, 1) if rows is not None else (), -1.0, device=DEV)
        kw = dict(amax_out=amax_out, backend=name)
        outs = to_float8_pair(x, **kw) if pair else to_float8(x, granularity=granularity, transpose=transpose, **kw)
        results.append((*outs, amax_out))
    for a, e in zip(*results):
        assert_same(a, e)


def test_dequantizes_to_x():
    x = _data((16, 32), torch.float32, device="cpu")
    data, scale_inv = to_float8(x)
    torch.testing.assert_close(data.float() * scale_inv, x, rtol=2**-3, atol=1e-30 + x.abs().amax().item() * 2**-9)


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(x=torch.ones(3, 4, dtype=torch.int32)), "x"),
        (dict(x=torch.ones(3, 4).to(torch.float8_e4m3fn)), "x"),
        (dict(x=torch.tensor(1.0)), "x"),
        (dict(x=torch.ones(4), transpose=True), "x"),
        (dict(dtype=torch.bfloat16), "dtype"),
        (dict(granularity="column"), "granularity"),
        (dict(scale=torch.ones(2)), "scale"),
        (dict(scale=torch.ones(1, dtype=torch.float16)), "scale"),
        (dict(scale=torch.ones(4), granularity="row"), "scale"),
        (dict(scale=torch.ones(4, 1), granularity="row", transpose=True, x=torch.ones(3, 5)), "scale"),
        (dict(amax_out=torch.ones(2)), "amax_out"),
        (dict(amax_out=torch.ones(1, dtype=torch.float64)), "amax_out"),
        (dict(amax_out=torch.ones(2, 3)[:, :1], granularity="row", x=torch.ones(2, 4)), "amax_out"),
        (dict(found_inf=torch.zeros(2)), "found_inf"),
        (dict(found_inf=torch.zeros(1, dtype=torch.int32)), "found_inf"),
        (dict(amax_out=torch.zeros(1, requires_grad=True)), "amax_out"),
        (dict(found_inf=torch.zeros(1, requires_grad=True)), "found_inf"),
        (dict(backend="wgmma"), "backend"),
    ],
)
def test_errors_name_the_argument(kwargs, argument):
    kwargs = dict(kwargs)
    x = kwargs.pop("x", torch.ones(3, 4))
    with pytest.raises(ValueError, match=f"argument '{argument}'") as error:
        to_float8(x, **kwargs)
    assert "to_float8" in str(error.value)


def test_pair_errors_name_the_argument():
    with pytest.raises(ValueError, match="to_float8_pair: argument 'x'"):
        to_float8_pair(torch.ones(4))
    with pytest.raises(ValueError, match="to_float8_pair: argument 'scale'"):
        to_float8_pair(torch.ones(4, 4), scale=torch.ones(4, 1))
    with pytest.raises(TypeError, match="to_float8: argument 'scale'"):
        to_float8(torch.ones(4, 4), scale=2.0)


@gpu
def test_wrong_device_names_the_argument():
    x = torch.ones(4, 4, device="cuda")
    for name in ("scale", "amax_out", "found_inf"):
        with pytest.raises(ValueError, match=f"argument '{name}'.*cuda"):
            to_float8(x, **{name: torch.ones(1)})


# --------------------------------------------------------------------------------------------------------------------
# Registration: opcheck, torch.compile, CUDA graphs
# --------------------------------------------------------------------------------------------------------------------


def _op_backends():
    return ["torch", *RUNNING_KERNELS]


@pytest.mark.parametrize("backend", _op_backends())
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize("path", list(PATHS))
def test_opcheck(path, delayed, backend):
    granularity, transpose, pair = PATHS[path]
    x = _data((9, 14), seed=13)
    scale = _scale_for(x, granularity, transpose, torch.float8_e4m3fn).reshape(-1) if delayed else None
    amax_out, found_inf = _state(x, granularity, transpose)
    if pair:
        args = (x, torch.float8_e4m3fn, scale, amax_out.reshape(-1), found_inf, backend)
        torch.library.opcheck(torch.ops.ampkernels.to_float8_pair.default, args)
    else:
        args = (x, torch.float8_e4m3fn, granularity, scale, amax_out, transpose, found_inf, backend)
        torch.library.opcheck(torch.ops.ampkernels.to_float8.default, args)


NATIVE_OP = dispatch.native_op("to_float8_native")
needs_native_op = pytest.mark.skipif(NATIVE_OP is None, reason="ampkernels._C without to_float8_native")


@needs_native_op
@pytest.mark.parametrize(
    "change, argument",
    [
        (dict(x=torch.ones(3, 4, dtype=torch.int32)), "x"),
        (dict(x=torch.ones(3, 4, 2)), "x"),
        (dict(x=torch.ones(0, 4)), "x"),
        (dict(dtype=torch.float16), "dtype"),
        (dict(write_data=False, write_t=False), "write_data"),
        (dict(per_row=True, write_t=True), "per_row"),
        (dict(scale=torch.ones(2)), "scale"),
        (dict(scale=torch.ones(3, 2)[:, 0], per_row=True), "scale"),
        (dict(amax_out=torch.ones(1, dtype=torch.float64)), "amax_out"),
        (dict(found_inf=torch.ones(2)), "found_inf"),
        (dict(amax_scratch=torch.zeros(3, dtype=torch.int32), per_row=True), "amax_scratch"),
        (dict(amax_scratch=torch.zeros(4, dtype=torch.int32)), "amax_scratch"),
    ],
)
def test_native_op_errors_name_the_argument(change, argument):
    """The op's own checks (for callers of torch.ops.ampkernels.to_float8_native), testable on the CPU."""
    args = dict(x=torch.ones(3, 4), dtype=torch.float8_e4m3fn, per_row=False, write_data=True, write_t=False)
    args.update(scale=None, amax_out=None, found_inf=None, amax_scratch=None)
    args.update(change)
    with pytest.raises(RuntimeError, match=f"argument '{argument}'"):
        NATIVE_OP(*args.values())


@needs_native_op
def test_native_op_on_cpu_tensors_says_where_it_runs():
    with pytest.raises(RuntimeError, match="CUDA tensors only"):
        NATIVE_OP(torch.ones(3, 4), torch.float8_e4m3fn, False, True, False, None, None, None, None)


@gpu
@needs_native_op
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize("path", list(PATHS))
def test_native_op_opcheck(path, delayed):
    granularity, transpose, pair = PATHS[path]
    x = _data((40, 48), seed=13)
    scale = _scale_for(x, granularity, transpose, torch.float8_e4m3fn).reshape(-1) if delayed else None
    amax_out, found_inf = _state(x, granularity, transpose)
    per_row = granularity == "row"
    args = (x, torch.float8_e4m3fn, per_row, pair or not transpose, pair or transpose, scale, amax_out.reshape(-1))
    # NOTE: test_schema is left out: it runs the op on fake float8 values, whose arithmetic CUDA lacks.
    torch.library.opcheck(
        NATIVE_OP.default, (*args, found_inf, None), test_utils=("test_faketensor", "test_autograd_registration")
    )


def test_torch_compile_fullgraph():
    """A compiled function calling the casts traces the custom ops (reference backend: the CPU)."""
    torch._dynamo.reset()

    def step(x, amax_out, found_inf):
        data, scale_inv = to_float8(x * 2, amax_out=amax_out, found_inf=found_inf, backend="torch")
        rows, rows_inv = to_float8(x, granularity="row", transpose=True, backend="torch")
        d, dt, pair_inv = to_float8_pair(x, torch.float8_e5m2, backend="torch")
        return data.float() * scale_inv, rows.float() * rows_inv, dt.float().t() * pair_inv

    x = _data((24, 40), device="cpu")
    x[2, 2] = float("inf")
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    amax_c, flag_c = torch.zeros(()), torch.zeros(1)
    amax_e, flag_e = torch.zeros(()), torch.zeros(1)
    for a, e in zip(compiled(x, amax_c, flag_c), step(x, amax_e, flag_e)):
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)
    assert flag_c.item() == 1.0 and amax_c.item() == amax_e.item() == 0.0


@gpu
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
def test_cuda_graph_capture(delayed, backend):
    x = _data((256, 384), torch.bfloat16, seed=14)
    scale = _scale_for(x, "tensor", False, torch.float8_e4m3fn) if delayed else None
    amax_out, found_inf = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")

    def casts():
        a = to_float8(x, scale=scale, amax_out=amax_out, found_inf=found_inf, backend=backend)
        b = to_float8(x, granularity="row", transpose=True, amax_out=None, backend=backend)
        c = to_float8_pair(x, scale=scale, backend=backend)
        return (*a, *b, *c)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        casts()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = casts()
    x.mul_(-3)
    x[0, 0] = float("nan")
    amax_out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    expected = casts()
    for a, e in zip(outs, expected):
        assert_same(a, e)
    assert found_inf.item() == 1.0 and amax_out.item() == 0.0


# --------------------------------------------------------------------------------------------------------------------
# GPU only: sizes and the hardware rounding
# --------------------------------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize("path", list(PATHS))
def test_large_bitwise(path, delayed, backend):
    """Sizes past one grid of persistent programs, K past one rowwise block; bf16 activations' shape."""
    for shape in ((4096, 4096), (3, 2048, 1000), (64, 12000), (2048, 40000)):
        _check(path, _data(shape, torch.bfloat16, seed=15), torch.float8_e4m3fn, delayed, backend=backend)


@gpu
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("where", ["first", "last", "middle"])
@pytest.mark.parametrize("path", ["tensor", "tensor_t", "pair"])
def test_current_scale_waits_for_the_whole_amax_pass(path, where, backend):
    """The cast after the amax pass (a programmatic dependent launch on sm_90+) must see every block's amax: one
    element 600x the rest, where the first, the last or a middle block of the pass reads it, moves every code."""
    x = torch.randn(8192, 1024, generator=torch.Generator().manual_seed(16)).to(torch.bfloat16).to(DEV)
    index = {"first": 0, "last": x.numel() - 1, "middle": x.numel() // 2 + 12345}[where]
    x.view(-1)[index] = 3072.0
    assert x.float().abs().max().item() == 3072.0 and (x.float().abs() > 10).sum().item() == 1
    _check(path, x, torch.float8_e4m3fn, backend=backend)


@gpu
@needs_triton
@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=str)
@pytest.mark.parametrize("path", list(PATHS))
def test_software_rounding_equals_the_hardware_on_gpu(monkeypatch, path, dtype):
    from ampkernels.float8.triton import casts as float8_casts

    x = _data((512, 300), torch.float32, seed=16)
    x[7, 7] = float("nan")
    hardware, _, _ = _run(path, x, dtype, False, "triton")
    monkeypatch.setattr(float8_casts, "SOFTWARE_ROUNDING", True)
    software, _, _ = _run(path, x, dtype, False, "triton")
    for a, b in zip(hardware, software):
        assert_same(a, b)
    _check(path, x, dtype)


def test_benchmark_helper_runs_on_the_cpu():
    from benchmarks.common import RunContext
    from benchmarks.float8_casts import VARIANTS, report_casts, run_casts

    ctx = RunContext(
        device=torch.device("cpu"),
        sets=[],
        shrink=1,
        repeats=1,
        target_loop_s=0.001,
        copy_bandwidth_gbs=10.0,
        progress=None,
    )
    rows = run_casts(ctx)
    assert [row["variant"] for row in rows] == list(VARIANTS)
    assert all(row["ms"] > 0 and row["bytes"] == 256 * 256 * (4 if row["variant"] == "pair" else 3) for row in rows)
    assert "vs torch" in report_casts(rows)
