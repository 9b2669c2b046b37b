"""Triton multi-tensor kernels against ``ampkernels.reference``.

Runs on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1`` (``tests/conftest.py`` sets it when there is no
GPU). Outputs are compared bitwise on both (under the interpreter, whose own bfloat16 casts truncate, the kernels
round bfloat16 by integer arithmetic: ``optimizers_kernels._rounded``).
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch

pytest.importorskip("triton")

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs a CUDA device or TRITON_INTERPRET=1", allow_module_level=True)

from ampkernels import dispatch, reference

mt = importlib.import_module("ampkernels.scaler.triton.multi_tensor")  # after the skips: it imports triton

INTERPRETED = dispatch.triton_interpreting()
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set and there is no GPU", allow_module_level=True)

DEV = "cpu" if INTERPRETED else "cuda"
# On a GPU machine every test here runs on the GPU: marked so, for `pytest -m gpu`.
pytestmark = [pytest.mark.gpu] if DEV == "cuda" else []
CHUNK = mt.CHUNK
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64

MIXED = [
    ((CHUNK - 1,), F32),
    ((256, 256), F16),  # exactly CHUNK
    ((CHUNK + 1,), BF16),
    ((1,), F32),
    ((0,), F16),
    ((3, 7), F64),
    ((1000,), F16),
    ((CHUNK + 1,), F32),
]


def make(spec, seed=0, scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in spec:
        x = torch.randn(shape, generator=gen, dtype=F64) * scale
        out.append(x.to(dtype).to(DEV))
    return out


def clones(tensors):
    return [t.clone() for t in tensors]


def scalar(v, dtype=F32):
    return torch.full((1,), v, dtype=dtype, device=DEV)


def poison_allocator():
    # Freed NaN blocks of assorted sizes tend to come back for the kernels' outputs and partials (caching allocator
    # size classes on CUDA, malloc bins on CPU): a slot the kernels fail to write then shows up as NaN.
    blocks = [torch.full((n,), math.nan, device=DEV) for n in (1, 2, 16, 128, 1024, 8192)]
    del blocks


def assert_same(out, ref):
    """Bitwise equal, NaN == NaN whatever its sign and payload (torch's CPU bfloat16 NaN is always 0x7FC0, the
    interpreter-side rounding keeps the float32 NaN's sign)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    nan = torch.isnan(out)
    assert torch.equal(nan, torch.isnan(ref)), (out, ref)
    out, ref = out.masked_fill(nan, 0.0), ref.masked_fill(nan, 0.0)
    bits = {F64: torch.int64, F32: torch.int32, F16: torch.int16, BF16: torch.int16}[out.dtype]
    assert torch.equal(out.view(bits), ref.view(bits)), (out, ref)


def assert_norm_close(out, ref):
    assert out.dtype == F32
    # Norms of the values as stored; the kernels sum in float32 in another order than the reference.
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=0, equal_nan=True)


def run_both(spec, scale_value, *, seed=0, data=None, found_start=0.0, **kw):
    """Run the kernel and the reference on equal data; returns (tensors, ref tensors, found, ref found, out, ref)."""
    ts = data if data is not None else make(spec, seed)
    rs = clones(ts)
    scale = scalar(scale_value)
    found, rfound = scalar(found_start), scalar(found_start)
    poison_allocator()
    out = mt.unscale_reduce_(ts, scale, found, **kw)
    kw.pop("max_norm", None)
    kw.pop("coef_out", None)
    ref = reference.unscale_reduce_(rs, scale, rfound, **kw)
    return ts, rs, found, rfound, out, ref


@pytest.mark.parametrize("scale_value", [65536.0, 2.0**-10, 3000.7, 1.0])
def test_unscale_values_and_l2_norms(scale_value):
    ts, rs, found, rfound, (norm, per), (rnorm, rper) = run_both(MIXED, scale_value, norm_type=2.0, per_tensor=True)
    for t, r in zip(ts, rs, strict=True):
        assert_same(t, r)
    assert found.item() == 0.0 and rfound.item() == 0.0
    assert norm.shape == () and per.shape == (len(MIXED),)
    assert_norm_close(norm, rnorm)
    assert_norm_close(per, rper)
    assert per[4].item() == 0.0  # the zero-size tensor


def test_inf_norm_per_tensor():
    ts, rs, found, _, (norm, per), (rnorm, rper) = run_both(MIXED, 1024.0, seed=1, norm_type=math.inf, per_tensor=True)
    for t, r in zip(ts, rs, strict=True):
        assert_same(t, r)
    assert_norm_close(norm, rnorm)
    assert_norm_close(per, rper)
    assert found.item() == 0.0


@pytest.mark.parametrize("norm_type", [None, 2.0, math.inf])
def test_read_only_leaves_tensors_unchanged(norm_type):
    ts = make(MIXED, seed=2)
    before = clones(ts)
    _, _, found, _, (norm, per), (rnorm, rper) = run_both(
        MIXED, 3000.7, data=ts, write=False, norm_type=norm_type, per_tensor=norm_type is not None
    )
    for t, b in zip(ts, before, strict=True):
        assert torch.equal(t, b)
    if norm_type is None:
        assert norm is None and per is None
    else:
        assert_norm_close(norm, rnorm)
        assert_norm_close(per, rper)
    assert found.item() == 0.0


@pytest.mark.parametrize("write", [True, False])
def test_factor(write):
    factor = scalar(0.37)
    ts, rs, _, _, (norm, per), (rnorm, rper) = run_both(
        MIXED, 65536.0, seed=3, factor=factor, write=write, norm_type=2.0, per_tensor=True
    )
    for t, r in zip(ts, rs, strict=True):
        assert_same(t, r)
    assert_norm_close(norm, rnorm)
    assert_norm_close(per, rper)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("max_norm", [1e-3, 1.0, 1e6])
def test_clip_coef(norm_type, max_norm):
    coef = torch.full((), math.nan, device=DEV)
    _, _, _, _, (norm, _), (rnorm, _) = run_both(
        MIXED, 8.0, seed=4, norm_type=norm_type, max_norm=max_norm, coef_out=coef
    )
    assert_norm_close(norm, rnorm)
    # Same float32 math as torch.nn.utils.clip_grad_norm_ given the kernel's own norm: bitwise.
    assert torch.equal(coef, reference.clip_coef(norm, max_norm))
    torch.testing.assert_close(coef, reference.clip_coef(rnorm, max_norm), rtol=2e-5, atol=0)


FLAG_SPEC = [((1000,), F32), ((0,), F16), ((CHUNK + 1,), BF16), ((300,), F64), ((77,), F16), ((500,), F32)]
POSITIONS = {
    "first": (0, 0),  # first element of the first tensor
    "middle": (2, 40000),  # inside the bfloat16 tensor in the middle of the list
    "tail": (2, CHUNK),  # the one-element last chunk of that tensor
    "last": (len(FLAG_SPEC) - 1, 499),  # last element of the last tensor
}


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", list(POSITIONS))
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_found_inf(value, where, norm_type):
    ts = make(FLAG_SPEC, seed=5)
    i, j = POSITIONS[where]
    ts[i].view(-1)[j] = value
    _, rs, found, rfound, (norm, per), (rnorm, rper) = run_both(
        None, 1024.0, data=ts, norm_type=norm_type, per_tensor=True
    )
    assert found.item() == 1.0 and rfound.item() == 1.0
    for t, r in zip(ts, rs, strict=True):
        assert_same(t, r)  # written like the reference, non-finite values included
    assert_norm_close(norm, rnorm)  # inf / NaN propagate like torch's sum / max
    assert_norm_close(per, rper)


def test_found_inf_never_cleared():
    _, _, found, rfound, _, _ = run_both(MIXED, 2.0, seed=6, found_start=1.0)
    assert found.item() == 1.0 and rfound.item() == 1.0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy reports the float32 overflow
def test_finite_extremes_not_flagged():
    # Overflow *after* unscaling (scale < 1) and float64 values beyond float32 range are finite inputs: no flag.
    spec = [((5,), F32), ((4,), F16), ((3,), F64), ((2,), BF16)]
    ts = make(spec, seed=7)
    ts[0][1] = 3.0e38
    ts[1][2] = 65504.0
    ts[2][0] = 1e300
    ts[3][1] = 3.0e38
    _, rs, found, rfound, (norm, _), (rnorm, _) = run_both(spec, 0.25, data=ts, norm_type=2.0)
    assert found.item() == 0.0 and rfound.item() == 0.0
    for t, r in zip(ts, rs, strict=True):
        assert_same(t, r)
    assert norm.item() == math.inf and rnorm.item() == math.inf


@pytest.mark.parametrize("numel", [1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 7])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_sizes(numel, dtype):
    if numel > CHUNK + 1 and dtype != F32 and INTERPRETED:
        pytest.skip("keeps the interpreter run short; float32 covers the size")
    ts, rs, found, _, (norm, per), (rnorm, rper) = run_both(
        [((numel,), dtype)], 3000.7, seed=numel, norm_type=2.0, per_tensor=True
    )
    assert_same(ts[0], rs[0])
    assert_norm_close(norm, rnorm)
    assert_norm_close(per, rper)
    assert found.item() == 0.0


def test_non_contiguous_dense_and_unaligned():
    base = torch.randn(2 * 3000 + 1, device=DEV)
    transposed = torch.randn(40, 70, device=DEV).t()  # dense, not contiguous
    unaligned = base[1:3001]  # data_ptr 4 bytes past a 16-byte boundary
    half_unaligned = torch.randn(1001, device=DEV).half()[3:]
    ts = [transposed, unaligned, half_unaligned, torch.randn(99, device=DEV)]
    table = mt.get_table(ts)
    assert False in table.group_aligned and True in table.group_aligned
    _, rs, _, _, (norm, per), (rnorm, rper) = run_both(None, 48.5, data=ts, norm_type=2.0, per_tensor=True)
    for t, r in zip(ts, rs, strict=True):
        assert_same(t, r)
    assert_norm_close(norm, rnorm)
    assert_norm_close(per, rper)


def test_many_small_tensors():
    gen = torch.Generator().manual_seed(8)
    sizes = torch.randint(0, 400, (300,), generator=gen).tolist()
    dtypes = [F32, F16, BF16]
    spec = [((n,), dtypes[k % 3]) for k, n in enumerate(sizes)]
    ts, rs, found, _, (norm, per), (rnorm, rper) = run_both(spec, 512.0, seed=9, norm_type=2.0, per_tensor=True)
    for t, r in zip(ts, rs, strict=True):
        assert_same(t, r)
    assert_norm_close(norm, rnorm)
    assert_norm_close(per, rper)
    assert found.item() == 0.0


def test_zero_size_only():
    ts = [torch.empty(0, device=DEV), torch.empty(0, 5, device=DEV, dtype=F16)]
    coef = torch.full((), math.nan, device=DEV)
    found = scalar(0.0)
    norm, per = mt.unscale_reduce_(ts, scalar(2.0), found, norm_type=2.0, per_tensor=True, max_norm=1.0, coef_out=coef)
    assert norm.item() == 0.0 and per.tolist() == [0.0, 0.0] and found.item() == 0.0
    assert torch.equal(coef, reference.clip_coef(norm, 1.0))


def test_empty_list_launches_nothing(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("kernel launched for an empty list")

    for name in ("_unscale_reduce_kernel", "_finalize_kernel", "_per_tensor_norm_kernel"):
        monkeypatch.setattr(mt, name, NoLaunch())
    found = scalar(0.0)
    assert mt.unscale_reduce_([], scalar(2.0), found) == (None, None)
    coef = torch.full((), math.nan, device=DEV)
    norm, per = mt.unscale_reduce_(
        [], scalar(2.0), found, norm_type=math.inf, per_tensor=True, max_norm=2.0, coef_out=coef
    )
    assert norm.item() == 0.0 and per.shape == (0,) and found.item() == 0.0
    assert coef.item() == 1.0


def test_deterministic():
    ts = make(MIXED, seed=10)
    results = [
        mt.unscale_reduce_(ts, scalar(1.0), scalar(0.0), write=False, norm_type=2.0, per_tensor=True) for _ in range(2)
    ]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_table_layout():
    ts = make(MIXED, seed=11)
    table = mt.TensorTable(ts)
    n = len(ts)
    order = table.out_index.cpu().tolist()
    assert sorted(order) == list(range(n))
    assert table.signature == tuple((t.data_ptr(), t.numel(), t.dtype) for t in ts)
    assert table.addrs.cpu().tolist() == [ts[i].data_ptr() for i in order]
    assert table.numels.cpu().tolist() == [ts[i].numel() for i in order]
    chunks = [-(-ts[i].numel() // CHUNK) for i in order]
    fc = table.first_chunk.cpu().tolist()
    assert fc == [sum(chunks[:k]) for k in range(n + 1)] and table.num_chunks == fc[-1]
    expect_tensor = [k for k, c in enumerate(chunks) for _ in range(c)]
    expect_start = [j * CHUNK for c in chunks for j in range(c)]
    assert table.chunk_tensor.cpu().tolist() == expect_tensor
    assert table.chunk_start.cpu().tolist() == expect_start
    # Groups: contiguous, cover everything, one dtype each, caller's order inside a group.
    pos = 0
    for dtype, t0, t1, c0, c1 in table.groups:
        assert t0 == pos and c0 == fc[t0] and c1 == fc[t1]
        assert all(ts[i].dtype == dtype for i in order[t0:t1])
        assert order[t0:t1] == sorted(order[t0:t1])
        pos = t1
    assert pos == n
    for view in (table.addrs, table.numels, table.chunk_tensor, table.chunk_start, table.first_chunk, table.out_index):
        assert view.dtype == torch.int64 and view.device.type == DEV
        assert view.untyped_storage().data_ptr() == table.buffer.untyped_storage().data_ptr()


def test_table_cache():
    mt.clear_table_cache()
    ts = make([((10,), F32), ((20,), F16)], seed=12)
    mt.unscale_reduce_(ts, scalar(2.0), scalar(0.0))
    assert len(mt._TABLE_CACHE) == 1
    (table,) = mt._TABLE_CACHE.values()
    built = []
    orig_init = mt.TensorTable.__init__

    def counting_init(self, *args, **kwargs):
        built.append(1)
        orig_init(self, *args, **kwargs)

    mt.TensorTable.__init__ = counting_init
    try:
        mt.unscale_reduce_(ts, scalar(2.0), scalar(0.0), norm_type=2.0)
        assert built == [] and mt.get_table(ts) is table  # same tensors: no rebuild
        for k in range(12):  # new tensor lists evict old tables; at most 8 are kept
            mt.get_table(make([((k + 1,), F32)], seed=k))
        assert len(built) == 12 and len(mt._TABLE_CACHE) == 8
    finally:
        mt.TensorTable.__init__ = orig_init
        mt.clear_table_cache()


def _state(scale, hyst=None, hysteresis=1, history=0):
    s = {
        "scale": torch.full((1,), scale, dtype=F32, device=DEV),
        "growth_tracker": torch.zeros(1, dtype=torch.int32, device=DEV),
        "counters": torch.zeros(2, dtype=torch.int64, device=DEV),
    }
    if hyst:
        s["hysteresis_tracker"] = torch.full((1,), hysteresis, dtype=torch.int32, device=DEV)
    if history:
        s["history"] = torch.full((history,), math.nan, dtype=F32, device=DEV)
    return s


@pytest.mark.parametrize("hysteresis", [1, 2])
@pytest.mark.parametrize("factors", [(2.0, 0.5), (1.7, 0.3)])
def test_update_scale_sequence(hysteresis, factors):
    growth, backoff = factors
    gen = torch.Generator().manual_seed(13 + hysteresis)
    # A growth run up to max_scale, an overflow run down to min_scale, then random steps.
    found_seq = [False] * 27 + [True] * 12 + (torch.rand(45, generator=gen) < 0.35).tolist()
    kw = {"hysteresis": hysteresis, "min_scale": 1.0, "max_scale": 1000.0}
    mine = _state(24.0, hyst=True, hysteresis=hysteresis, history=7)
    ref = _state(24.0, hyst=True, hysteresis=hysteresis, history=7)
    hit_min = hit_max = False
    for step, f in enumerate(found_seq):
        found = scalar(float(f))
        mt.update_scale_(
            mine["scale"],
            mine["growth_tracker"],
            found,
            growth,
            backoff,
            3,
            **kw,
            hysteresis_tracker=mine["hysteresis_tracker"],
            counters=mine["counters"],
            history=mine["history"],
        )
        reference.update_scale_(
            ref["scale"],
            ref["growth_tracker"],
            found,
            growth,
            backoff,
            3,
            **kw,
            hysteresis_tracker=ref["hysteresis_tracker"],
            counters=ref["counters"],
            history=ref["history"],
        )
        for key in mine:
            assert torch.equal(mine[key].nan_to_num(-1.0), ref[key].nan_to_num(-1.0)), (step, key)
        hit_min |= mine["scale"].item() == 1.0
        hit_max |= mine["scale"].item() == 1000.0
    assert hit_min and hit_max  # the sequence exercises both bounds


def test_update_scale_defaults_match_torch():
    # Without hysteresis/bounds/telemetry this is torch._amp_update_scale_.
    gen = torch.Generator().manual_seed(14)
    mine, ref = _state(65536.0), _state(65536.0)
    for f in (torch.rand(40, generator=gen) < 0.3).tolist():
        found = scalar(float(f))
        mt.update_scale_(mine["scale"], mine["growth_tracker"], found, 2.0, 0.5, 3)
        torch._amp_update_scale_(ref["scale"], ref["growth_tracker"], found, 2.0, 0.5, 3)
        assert torch.equal(mine["scale"], ref["scale"])
        assert torch.equal(mine["growth_tracker"], ref["growth_tracker"])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_update_scale_edges():
    # Growth that overflows float32 keeps the scale; backoff is floored at min_scale (default 2^-126).
    big = _state(3.0e38)
    mt.update_scale_(big["scale"], big["growth_tracker"], scalar(0.0), 2.0, 0.5, 1)
    assert big["scale"].item() == torch.tensor(3.0e38).item() and big["growth_tracker"].item() == 0
    tiny = _state(reference.FLOAT32_TINY)
    mt.update_scale_(tiny["scale"], tiny["growth_tracker"], scalar(1.0), 2.0, 0.5, 1)
    assert tiny["scale"].item() == reference.FLOAT32_TINY
    nan_found = _state(8.0)  # a NaN found_inf counts as found
    mt.update_scale_(nan_found["scale"], nan_found["growth_tracker"], scalar(math.nan), 2.0, 0.5, 1)
    assert nan_found["scale"].item() == 4.0
    # Empty history with counters: counters still advance, nothing else written.
    st = _state(8.0)
    hist = torch.empty(0, device=DEV)
    mt.update_scale_(st["scale"], st["growth_tracker"], scalar(1.0), 2.0, 0.5, 1, counters=st["counters"], history=hist)
    assert st["counters"].tolist() == [1, 1]


def test_duplicate_tensors_refused_when_written():
    """The one check the launch code makes (its table finds the duplicates): unscaling one tensor twice would race.
    Argument checks are the public wrapper's (tests/scaler/test_ops.py)."""
    ts = make([((10,), F32)])
    with pytest.raises(ValueError, match="twice"):
        mt.unscale_reduce_([ts[0], ts[0]], scalar(2.0), scalar(0.0))
    norm, _ = mt.unscale_reduce_([ts[0], ts[0]], scalar(2.0), scalar(0.0), write=False, norm_type=2.0)
    assert_norm_close(norm, (ts[0].double().pow(2).sum() * 2).sqrt().float() / 2)


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("magnitude", [1e20, 1e-30, 1e200])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_float64_norms_accumulate_in_float64(magnitude, norm_type):
    """float64 gradients: squares of 1e20 (1e40) and of 1e-30 (1e-60) leave float32's range, so their norms must
    accumulate in float64 (the result is rounded to float32 once: 1e200 is inf there, as in the reference)."""
    gen = torch.Generator().manual_seed(3)
    values = (torch.rand(3 * CHUNK + 5, generator=gen, dtype=F64) + 0.5) * magnitude
    other = (torch.randn(77, generator=gen, dtype=F64) * magnitude).to(DEV)
    ts = [values.to(DEV), other, make([((100,), F32)])[0]]
    rs = clones(ts)
    out = mt.unscale_reduce_(ts, scalar(1.0), scalar(0.0), write=False, norm_type=norm_type, per_tensor=True)
    ref = reference.unscale_reduce_(rs, scalar(1.0), scalar(0.0), write=False, norm_type=norm_type, per_tensor=True)
    if magnitude < 1e100:
        assert bool(torch.isfinite(out[0])) and float(out[0]) > 0
    assert_norm_close(out[0], ref[0])
    assert_norm_close(out[1], ref[1])


@pytest.mark.parametrize(
    "views",
    [
        lambda buf: [buf[:100], buf[50:150]],  # partial overlap
        lambda buf: [buf[10:20], buf[:300], buf[400:]],  # one inside another, in the caller's order 0 and 1
        lambda buf: [buf[:64], buf.view(torch.float16)[100:140]],  # the same bytes as float32 and as float16
    ],
    ids=["partial", "nested", "reinterpreted"],
)
def test_overlapping_views_refused_when_written(views):
    """Views that share memory without being the same tensor (as the native op refuses them, before writing
    anything): written in place they would be unscaled twice (raced on a GPU) and counted twice in the norm."""
    buf = torch.randn(500, device=DEV)
    before = buf.clone()
    found = scalar(0.0)
    with pytest.raises(ValueError, match="share memory"):
        mt.unscale_reduce_(views(buf), scalar(2.0), found)
    assert torch.equal(buf, before) and found.item() == 0.0
    mt.unscale_reduce_(views(buf), scalar(2.0), found, write=False, norm_type=2.0)  # read-only: allowed
    mt.unscale_reduce_([buf[:100], buf[100:200]], scalar(2.0), found)  # adjacent, not overlapping
    assert torch.equal(buf[:200], before[:200] / 2) and torch.equal(buf[200:], before[200:])
