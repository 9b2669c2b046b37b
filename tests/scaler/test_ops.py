"""The multi-tensor ops (``ampkernels.ops``) on every backend against ``ampkernels.reference``.

The ``device`` argument is parametrized by conftest.py (cpu, and cuda when present).

Backends: ``native`` (CPU C++ on CPU tensors, CUDA C++ on CUDA tensors), ``triton`` (CUDA, or the interpreter on
CPU), ``torch`` (the reference itself, checked against hand-written expectations).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import ampkernels
from ampkernels import dispatch, ops, reference
from ampkernels._constants import NO_CLIP, NormKind, norm_kind

BACKENDS = ["native", "triton", "torch"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Chunk sizes of the native (16384) and Triton (65536) tables: just below, at and above each.
CHUNK_EDGES = [16383, 16384, 16385, 65535, 65536, 65537]


def _skip_unless_runs(backend: str, device: str) -> None:
    reason = dispatch.why_not("unscale_reduce_", backend, device)
    if reason is not None:
        pytest.skip(reason)


def _random_tensors(sizes, dtypes, device, scale=64.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        dt = dtypes[i % len(dtypes)]
        out.append((torch.randn(n, generator=gen) * scale).to(dt).to(device))
    return out


def _scalar(value, device):
    return torch.full((1,), value, dtype=torch.float32, device=device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [65536.0, 3.0])  # a power of two, and one whose reciprocal rounds
def test_unscale_matches_reference_bitwise(device, backend, scale):
    _skip_unless_runs(backend, device)
    sizes = [1, 7, 1000] + CHUNK_EDGES[:3] + ([65537] if backend != "torch" else [])
    tensors = _random_tensors(sizes, DTYPES, device)
    expected = [t.clone() for t in tensors]
    found, found_ref = _scalar(0.0, device), _scalar(0.0, device)
    res = ops.unscale_reduce_(tensors, _scalar(scale, device), found, norm_type=2.0, per_tensor=True, backend=backend)
    ref_norm, ref_each = reference.unscale_reduce_(
        expected, _scalar(scale, device), found_ref, norm_type=2.0, per_tensor=True
    )
    for got, want in zip(tensors, expected):
        assert torch.equal(got, want), (got - want).abs().max()  # (bf16 too: the interpreter's kernels round)
    assert found.item() == 0.0
    # Norms of the values as stored, summed in another order than the reference.
    torch.testing.assert_close(res.norm, ref_norm, rtol=1e-5, atol=0)
    torch.testing.assert_close(res.per_tensor_norms, ref_each, rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_found_anywhere(device, backend, where, bad):
    _skip_unless_runs(backend, device)
    tensors = _random_tensors([300, 16385, 5, 40000], DTYPES, device, seed=1)
    t, idx = {"first": (0, 0), "middle": (1, 16384), "last": (3, 39999)}[where]
    tensors[t][idx] = bad
    before = [x.clone() for x in tensors]
    found = _scalar(0.0, device)
    ops.unscale_reduce_(tensors, _scalar(4.0, device), found, write=False, backend=backend)
    assert found.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(tensors, before) if a.isfinite().all())  # read-only
    found_again = _scalar(0.0, device)
    ops.unscale_reduce_(tensors, _scalar(4.0, device), found_again, backend=backend)
    assert found_again.item() == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_found_inf_is_never_cleared(device, backend):
    _skip_unless_runs(backend, device)
    found = _scalar(1.0, device)
    ops.unscale_reduce_(_random_tensors([100], DTYPES, device), _scalar(2.0, device), found, backend=backend)
    assert found.item() == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_only_pass_leaves_tensors_bitwise_unchanged(device, backend):
    _skip_unless_runs(backend, device)
    tensors = _random_tensors([5000, 16384, 3], DTYPES, device, seed=2)
    before = [t.clone() for t in tensors]
    found = _scalar(0.0, device)
    res = ops.check_and_norm(tensors, _scalar(1024.0, device), found, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    ref_norm, _ = reference.unscale_reduce_(
        before, _scalar(1024.0, device), _scalar(0.0, device), write=False, norm_type=2.0
    )
    torch.testing.assert_close(res.norm, ref_norm, rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inf_norm_factor_and_clip_coefficient(device, backend):
    _skip_unless_runs(backend, device)
    tensors = _random_tensors([777, 20000], [torch.float32, torch.float16], device, seed=3)
    expected = [t.clone() for t in tensors]
    factor = _scalar(0.25, device)
    res = ops.unscale_reduce_(
        tensors,
        _scalar(8.0, device),
        _scalar(0.0, device),
        factor=factor,
        norm_type=math.inf,
        per_tensor=True,
        max_norm=1.0,
        backend=backend,
    )
    ref_norm, ref_each = reference.unscale_reduce_(
        expected, _scalar(8.0, device), _scalar(0.0, device), factor=factor, norm_type=math.inf, per_tensor=True
    )
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected))
    torch.testing.assert_close(res.norm, ref_norm)
    torch.testing.assert_close(res.per_tensor_norms, ref_each)
    torch.testing.assert_close(res.clip_coef, reference.clip_coef(ref_norm, 1.0))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_norm", [-1.0, -0.5, math.nan])
def test_negative_or_nan_max_norm_is_refused_on_every_backend(device, backend, max_norm):
    """The native op took a negative max_norm for "no coefficient" and returned an empty clip_coef, where the other
    backends returned a negative one (NaN for NaN): the wrapper refuses both, naming the argument, as
    FusedGradScaler.clip_grad_norm_ does."""
    _skip_unless_runs(backend, device)
    tensors = [torch.ones(4, device=device)]
    with pytest.raises(ValueError, match="'max_norm': must be >= 0"):
        ops.unscale_reduce_(
            tensors, _scalar(1.0, device), _scalar(0.0, device), norm_type=2.0, max_norm=max_norm, backend=backend
        )
    assert torch.equal(tensors[0], torch.ones(4, device=device))  # refused before anything ran
    for edge, coef in ((0.0, 0.0), (math.inf, 1.0)):  # the edges still run, alike on every backend
        res = ops.unscale_reduce_(
            tensors, _scalar(1.0, device), _scalar(0.0, device), norm_type=2.0, max_norm=edge, backend=backend
        )
        assert res.clip_coef.shape == () and res.clip_coef.item() == coef


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_many_tensors_and_float64(device, backend):
    _skip_unless_runs(backend, device)
    n = 3000 if device == "cpu" else 10000  # past the stock launch table (~110 tensors), and past one chunk table
    tensors = _random_tensors([int(s) for s in torch.randint(0, 300, (n,))], DTYPES + [torch.float64], device, seed=4)
    tensors[-1].view(-1)[-1:] = math.nan if tensors[-1].numel() else 0.0
    expected = [t.clone() for t in tensors]
    found, found_ref = _scalar(0.0, device), _scalar(0.0, device)
    res = ops.unscale_reduce_(tensors, _scalar(512.0, device), found, norm_type=2.0, backend=backend)
    reference.unscale_reduce_(expected, _scalar(512.0, device), found_ref, norm_type=2.0)
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected) if a.isfinite().all())
    assert found.item() == found_ref.item()
    assert res.norm is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_list_and_zero_size_tensors(device, backend):
    _skip_unless_runs(backend, device)
    found = _scalar(0.0, device)
    res = ops.unscale_reduce_([], _scalar(2.0, device), found, norm_type=2.0, per_tensor=True, backend=backend)
    assert res.norm.item() == 0.0 and res.per_tensor_norms.numel() == 0 and found.item() == 0.0
    tensors = [torch.empty(0, device=device), torch.full((3,), 4.0, device=device)]
    res = ops.unscale_reduce_(tensors, _scalar(2.0, device), found, norm_type=2.0, per_tensor=True, backend=backend)
    assert res.per_tensor_norms.tolist() == [0.0, pytest.approx(math.sqrt(12.0), rel=1e-6)]
    assert tensors[1].tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_dense_views_are_staged_and_written_back(device, backend):
    _skip_unless_runs(backend, device)
    base = torch.randn(64, 64, device=device) * 10
    view = base[:, ::2]  # not dense: every other column
    expected = base.clone()
    expected[:, ::2] = expected[:, ::2] / 4
    found = _scalar(0.0, device)
    res = ops.unscale_reduce_([view], _scalar(4.0, device), found, norm_type=2.0, backend=backend)
    assert torch.equal(base, expected)
    torch.testing.assert_close(res.norm, (expected[:, ::2].double().norm()).float(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_expanded_tensor_is_refused_before_anything_is_written(device, backend):
    """Written in place, an expanded tensor would have one element unscaled once per view of it; every backend
    refuses it before it has unscaled the tensors before it."""
    _skip_unless_runs(backend, device)
    first = torch.full((4,), 8.0, device=device)
    expanded = torch.full((1,), 8.0, device=device).expand(4)
    found = _scalar(0.0, device)
    with pytest.raises((ValueError, RuntimeError), match="element 1 has elements that share memory"):
        ops.unscale_reduce_([first, expanded], _scalar(2.0, device), found, backend=backend)
    assert first.tolist() == [8.0] * 4 and expanded.tolist() == [8.0] * 4
    ops.unscale_reduce_([first, expanded], _scalar(2.0, device), found, write=False, backend=backend)


def test_bad_input_names_the_argument(device):
    _skip_unless_runs("native", device)
    t = [torch.randn(10, device=device)]
    with pytest.raises((RuntimeError, ValueError), match="scale"):
        ops.unscale_reduce_(t, torch.ones(2, device=device), _scalar(0.0, device), backend="native")
    with pytest.raises((RuntimeError, ValueError), match="found_inf"):
        ops.unscale_reduce_(
            t, _scalar(1.0, device), torch.zeros(1, dtype=torch.float64, device=device), backend="native"
        )
    with pytest.raises(TypeError, match="dtype"):  # (the wrapper's check, the same on every backend)
        ops.unscale_reduce_(
            [torch.randn(4, dtype=torch.complex64, device=device)],
            _scalar(1.0, device),
            _scalar(0.0, device),
            backend="native",
        )
    with pytest.raises(TypeError, match="dtype"):
        ops.unscale_reduce_(
            [torch.arange(4, device=device)], _scalar(1.0, device), _scalar(0.0, device), backend="native"
        )
    with pytest.raises(ValueError, match="norm_type"):
        ops.unscale_reduce_(t, _scalar(1.0, device), _scalar(0.0, device), norm_type=1.0, backend="native")


def test_norm_kind_of_each_norm_type():
    """torch's norm_type spellings map onto the kernels' NormKind and back; nothing else passes for a fused norm."""
    for norm_type, kind in ((None, NormKind.NONE), (2, NormKind.L2), (2.0, NormKind.L2), (math.inf, NormKind.INF)):
        assert norm_kind(norm_type) is kind
        assert norm_kind(kind.norm_type) is kind
    assert norm_kind(float("inf")) is NormKind.INF and norm_kind(torch.tensor(2.0)) is NormKind.L2
    for bad in (0.0, 1.0, 3.0, -math.inf, math.nan, True):
        with pytest.raises(ValueError, match=r"argument 'norm_type': the fused kernels compute 2 and inf norms"):
            norm_kind(bad)
    with pytest.raises(TypeError, match="argument 'p': expected None, 2.0 or inf, got str"):
        norm_kind("two", "p")


def test_list_op_table_cache_survives_reuse_and_sees_new_tensors():
    _skip_unless_runs("native", "cpu")
    tensors = [torch.full((100,), 8.0), torch.full((50,), 8.0)]
    found = _scalar(0.0, "cpu")
    ops.unscale_reduce_(tensors, _scalar(2.0, "cpu"), found, backend="native")
    ops.unscale_reduce_(tensors, _scalar(2.0, "cpu"), found, backend="native")  # cached table
    assert tensors[0][0].item() == 2.0
    other = [torch.full((100,), 8.0), torch.full((51,), 8.0)]  # new storage: a new table
    ops.unscale_reduce_(other, _scalar(2.0, "cpu"), found, backend="native")
    assert other[1].tolist() == [4.0] * 51 and tensors[0][0].item() == 2.0


def test_concurrent_calls_on_one_list_keep_their_own_norms(device):
    """A list's launch table is cached and shared by every call on that list. Its per-chunk scratch of partial norms
    was too: two calls in flight at once (two threads on the CPU, two streams on CUDA) folded each other's."""
    _skip_unless_runs("native", device)
    tensors = _random_tensors([16384 * 24 + 5] * 8, [torch.float32, torch.bfloat16], device)
    scales = (2.0, 3.0)

    def norms(scale):
        found = _scalar(0.0, device)
        r = ops.unscale_reduce_(tensors, _scalar(scale, device), found, write=False, norm_type=2.0, backend="native")
        return r.norm

    expected = {s: norms(s).clone() for s in scales}
    assert not torch.equal(expected[scales[0]], expected[scales[1]])
    rounds = 40
    if device == "cpu":
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            got = {s: pool.submit(lambda s=s: [norms(s) for _ in range(rounds)]) for s in scales}
            got = {s: f.result() for s, f in got.items()}
    else:
        streams = {s: torch.cuda.Stream() for s in scales}
        got = {s: [] for s in scales}
        torch.cuda.current_stream().synchronize()
        for _ in range(rounds):
            for s in scales:
                with torch.cuda.stream(streams[s]):
                    got[s].append(norms(s))
        torch.cuda.synchronize()
    for s in scales:
        mixed = [i for i, n in enumerate(got[s]) if not torch.equal(n, expected[s])]
        assert not mixed, f"scale {s}: rounds {mixed} got another call's norm"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hysteresis", [1, 2])
def test_update_scale_follows_reference(device, backend, hysteresis):
    _skip_unless_runs(backend, device)
    gen = torch.Generator().manual_seed(5)
    flags = (torch.rand(40, generator=gen) < 0.3).tolist()
    state = {}
    for impl in ("ops", "reference"):
        scale = _scalar(2.0**10, device)
        tracker = torch.zeros(1, dtype=torch.int32, device=device)
        hyst = torch.full((1,), hysteresis, dtype=torch.int32, device=device)
        counters = torch.zeros(2, dtype=torch.int64, device=device)
        history = torch.zeros(16, dtype=torch.float32, device=device)
        scales = []
        for f in flags:
            kwargs = dict(
                hysteresis=hysteresis,
                hysteresis_tracker=hyst,
                min_scale=2.0**8,
                max_scale=2.0**12,
                history=history,
                counters=counters,
            )
            args = (scale, tracker, _scalar(float(f), device), 2.0, 0.5, 3)
            if impl == "ops":
                ops.update_scale_(*args, backend=backend, **kwargs)
            else:
                reference.update_scale_(*args, **kwargs)
            scales.append(scale.item())
        state[impl] = (scales, tracker.item(), hyst.item(), counters.tolist(), history.tolist())
    assert state["ops"] == state["reference"]
    scales = state["ops"][0]
    assert min(scales) >= 2.0**8 and max(scales) <= 2.0**12
    assert state["ops"][3] == [len(flags), sum(flags)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_scale_defaults_equal_torch_amp_update_scale(device, backend):
    _skip_unless_runs(backend, device)
    gen = torch.Generator().manual_seed(6)
    flags = (torch.rand(60, generator=gen) < 0.2).tolist()
    ours = (_scalar(3.0 * 2**15, device), torch.zeros(1, dtype=torch.int32, device=device))
    stock = (_scalar(3.0 * 2**15, device), torch.zeros(1, dtype=torch.int32, device=device))
    for f in flags:
        ops.update_scale_(*ours, _scalar(float(f), device), 2.0, 0.5, 4, backend=backend)
        torch._amp_update_scale_(*stock, _scalar(float(f), device), 2.0, 0.5, 4)
        assert ours[0].item() == stock[0].item() and ours[1].item() == stock[1].item()


def test_scale_floor_replaces_underflow_to_zero():
    scale, tracker = _scalar(2.0**-125, "cpu"), torch.zeros(1, dtype=torch.int32)
    for _ in range(5):
        ops.update_scale_(scale, tracker, _scalar(1.0, "cpu"), 2.0, 0.5, 10)
    assert scale.item() == reference.FLOAT32_TINY


@pytest.mark.skipif(dispatch.native() is None, reason="native extension not built")
def test_opcheck_native_ops():
    tensors = [torch.randn(30) * 8, torch.randn(7).half()]
    args = (tensors, _scalar(2.0, "cpu"), _scalar(0.0, "cpu"), None, True, int(NormKind.L2), True, 1.0)
    torch.library.opcheck(
        torch.ops.ampkernels.unscale_reduce_.default, args, test_utils=("test_schema", "test_faketensor")
    )
    uargs = (
        _scalar(4.0, "cpu"),
        torch.zeros(1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        _scalar(0.0, "cpu"),
        2.0,
        0.5,
        3,
        1,
        1e-30,
        math.inf,
        None,
        None,
    )
    torch.library.opcheck(
        torch.ops.ampkernels.update_scale_.default, uargs, test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.skipif(dispatch.native() is None, reason="native extension not built")
def test_grad_table_is_reused_while_the_gradients_stay_and_rebuilt_when_they_move():
    params = [torch.nn.Parameter(torch.randn(n)) for n in (10, 20000, 3)]
    for p in params:
        p.grad = torch.randn_like(p) * 8
    table = dispatch.native().GradTable(params, "cpu")

    def unscale():
        table.unscale_reduce(_scalar(2.0, "cpu"), _scalar(0.0, "cpu"), None, True, NormKind.NONE, False, NO_CLIP)

    unscale()
    unscale()
    assert table.rebuilds == 1  # the same gradients: launch metadata built once
    params[1].grad = params[1].grad.view(-1)  # a new tensor on the same memory: still valid
    unscale()
    assert table.rebuilds == 1
    expected = params[0].grad.clone() / 2
    params[0].grad = params[0].grad.clone()  # new memory: must be seen, or the kernel would write the old memory
    unscale()
    assert table.rebuilds == 2 and torch.equal(params[0].grad, expected)
    params[2].grad = None  # a gradient disappears
    unscale()
    assert table.rebuilds == 3
    params[1].grad.set_(torch.randn(20000))  # the same tensor object on new memory
    expected = params[1].grad.clone() / 2
    unscale()
    assert table.rebuilds == 4 and torch.equal(params[1].grad, expected)
    params[0].grad = torch.randn(10, 2)[:, 0]  # strided: read through a contiguous copy, written back
    expected = params[0].grad.clone() / 2
    unscale()
    assert table.rebuilds == 5 and torch.equal(params[0].grad, expected)
    unscale()  # the same strided view again: the table stays, and the copy is refreshed from it
    assert table.rebuilds == 5 and torch.equal(params[0].grad, expected / 2)


@pytest.mark.skipif(dispatch.native() is None, reason="native extension not built")
def test_tables_list_every_address_their_kernels_use():
    """addresses() (what dev/graph_stale_addresses.py checks a captured graph against) names each tensor's memory."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 7)]
    for p in params:
        p.grad = torch.randn_like(p)
    grads = {p.grad.data_ptr() for p in params}
    table = dispatch.native().GradTable(params, "cpu")
    assert table.addresses() == []  # built on first use
    table.refresh()
    assert {a for role, a in table.addresses() if role == "grad"} == grads

    opt = ampkernels.FusedAdamW(params)
    opt.step()
    (bucket,) = opt._plans[0].buckets
    by_role: dict[str, set[int]] = {}
    for role, address in bucket.table.addresses():
        by_role.setdefault(role, set()).add(address)
    assert by_role["param"] == {p.data_ptr() for p in params}
    assert by_role["grad"] == grads
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert by_role[key] == {opt.state[p][key].data_ptr() for p in params}


@pytest.mark.skipif(dispatch.native() is None, reason="native extension not built")
@pytest.mark.skipif(not torch.backends.openmp.is_available(), reason="torch built without OpenMP")
def test_native_parallel_for_runs_on_torchs_intra_op_threads():
    # at::parallel_for is inline: built without -fopenmp, the extension's CPU kernels and gradient checks ran on one
    # thread whatever torch.set_num_threads said.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert dispatch.native().parallel_for_threads(8) == 2
        torch.set_num_threads(1)
        assert dispatch.native().parallel_for_threads(8) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_python_backends_check_every_argument_once(device, backend):
    """The public wrappers check the arguments for every backend (the Triton launch code checks nothing again);
    each error names the argument."""
    _skip_unless_runs(backend, device)
    ts = [torch.randn(10, device=device)]
    s, f = _scalar(2.0, device), _scalar(0.0, device)
    f64 = torch.float64
    unscale = functools.partial(ops.unscale_reduce_, backend=backend)
    cases = [
        (ValueError, "scale", lambda: unscale(ts, _scalar(2.0, device).to(f64), f)),
        (ValueError, "found_inf", lambda: unscale(ts, s, torch.zeros(2, device=device))),
        (ValueError, "factor", lambda: unscale(ts, s, f, factor=torch.ones(1, device="meta"))),
        (ValueError, "element 1", lambda: unscale([ts[0], torch.ones(3, device="meta")], s, f)),
        (TypeError, "element 0 .*complex", lambda: unscale([ts[0].to(torch.complex64)], s, f)),
        (TypeError, "element 1 .*int32", lambda: unscale([ts[0], ts[0].int()], s, f)),
        (TypeError, "'tensors'", lambda: unscale(ts[0], s, f)),
        (ValueError, "norm_type", lambda: unscale(ts, s, f, norm_type=1.0)),
        (ValueError, "norm_type", lambda: unscale(ts, s, f, norm_type=0.0)),  # torch's 0 counts non-zeros
        (ValueError, "norm_type", lambda: unscale(ts, s, f, norm_type=-math.inf)),
        (TypeError, "norm_type", lambda: unscale(ts, s, f, norm_type=[2.0])),
        (ValueError, "max_norm", lambda: unscale(ts, s, f, max_norm=1.0)),
        (TypeError, "max_norm", lambda: unscale(ts, s, f, norm_type=2.0, max_norm="1")),
    ]
    g = torch.zeros(1, dtype=torch.int32, device=device)
    i64 = torch.int64
    upd = functools.partial(ops.update_scale_, backend=backend)
    cases += [
        (ValueError, "growth_tracker", lambda: upd(s, torch.zeros(1, dtype=i64, device=device), f, 2.0, 0.5, 3)),
        (ValueError, "counters", lambda: upd(s, g, f, 2.0, 0.5, 3, counters=torch.zeros(3, dtype=i64, device=device))),
        (ValueError, "hysteresis_tracker", lambda: upd(s, g, f, 2.0, 0.5, 3, hysteresis=2)),
        (ValueError, "history", lambda: upd(s, g, f, 2.0, 0.5, 3, history=torch.zeros(4, device=device))),
        (ValueError, "growth_interval", lambda: upd(s, g, f, 2.0, 0.5, 0)),
        (TypeError, "growth_interval", lambda: upd(s, g, f, 2.0, 0.5, 2.5)),
        (TypeError, "backoff_factor", lambda: upd(s, g, f, 2.0, None, 3)),
        (ValueError, "found_inf", lambda: upd(s, g, torch.zeros(1, device="meta"), 2.0, 0.5, 3)),
    ]
    for error, pattern, call in cases:
        with pytest.raises(error, match=pattern):
            call()


@pytest.mark.parametrize("backend", ["", "native ", "cuda", "auto"])
def test_unknown_backend_names_the_argument_and_the_choices(backend):
    with pytest.raises(ValueError, match="argument 'backend'.*native/triton/torch"):
        ops.unscale_reduce_([], _scalar(1.0, "cpu"), _scalar(0.0, "cpu"), backend=backend)
    with pytest.raises(ValueError, match="argument 'backend'.*native/triton/torch"):
        ops.update_scale_(
            _scalar(1.0, "cpu"), torch.zeros(1, dtype=torch.int32), _scalar(0.0, "cpu"), 2.0, 0.5, 1, backend=backend
        )
