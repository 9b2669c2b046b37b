"""The scaler's ops and FusedGradScaler used carelessly: each misuse gets one behaviour on every backend (native,
Triton, torch) — stock's where stock has one, else a clear error that names the argument or key, raised before
anything is written or loaded.

The ``device`` argument is parametrized by conftest.py (cpu, and cuda when present).
"""

from __future__ import annotations

import re

import pytest
import torch
from grad_scaler_common import Stock, drive, key_pattern

from ampkernels import FusedGradScaler, FusedSGD, dispatch, ops

BACKENDS = ["native", "triton", "torch"]

# The native op's and the native gradient table's messages: every backend gives them, word for word.
OP_SHARED = (
    "ampkernels: argument 'tensors': elements {} and {} share memory (the same tensor twice, or overlapping views) "
    "and would be unscaled twice; pass each tensor once, or write=False"
)
TABLE_SHARED = (
    "ampkernels: argument 'params': parameters {} and {} have gradients that share memory (the same gradient tensor "
    "twice: one parameter twice, or a shared .grad; or overlapping views of one buffer); each gradient must belong "
    "to one parameter"
)
TABLE_EXPANDED = (
    "ampkernels: argument 'params': parameter {} has a gradient whose elements share memory (an expanded tensor?), "
    "which cannot be unscaled in place; give it a gradient of its own (.clone())"
)


def _skip_unless_runs(backend: str, device: str, op: str = "unscale_reduce_") -> None:
    reason = dispatch.why_not(op, backend, device)
    if reason is not None:
        pytest.skip(reason)


def _scalar(value: float, device) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=device)


def _randn(n: int, device, seed: int, scale: float = 64.0) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).to(device)


# ---- a tensor reached twice ----


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("views", ["same tensor", "overlapping views"])
def test_unscale_refuses_tensors_that_share_memory_on_every_backend(device, backend, views):
    """The torch backend unscaled a tensor listed twice twice; native and Triton refused it (with different
    exception types and words)."""
    _skip_unless_runs(backend, device)
    buf = _randn(300, device, 0)
    before = buf.clone()
    other = _randn(7, device, 1)
    tensors = [other, buf, buf] if views == "same tensor" else [other, buf[:200], buf[150:]]
    with pytest.raises(ValueError, match=re.escape(OP_SHARED.format(1, 2))):
        ops.unscale_reduce_(tensors, _scalar(4.0, device), _scalar(0.0, device), backend=backend)
    assert torch.equal(buf, before), "the refused call wrote"
    assert torch.equal(other, _randn(7, device, 1)), "the refused call wrote"
    # Read-only, the same list is fine: each entry's norm.
    res = ops.unscale_reduce_(
        tensors,
        _scalar(4.0, device),
        _scalar(0.0, device),
        write=False,
        norm_type=2.0,
        per_tensor=True,
        backend=backend,
    )
    want = torch.stack([torch.linalg.vector_norm(t.double() / 4.0).float() for t in tensors])
    torch.testing.assert_close(res.per_tensor_norms, want, rtol=1e-6, atol=0)
    assert torch.equal(buf, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unscale_writes_a_strided_view_of_a_listed_tensor_once(device, backend):
    """A non-dense view is read through a copy taken before anything is written (native and Triton did; torch read
    the view after unscaling the tensor under it, so its elements were unscaled twice)."""
    _skip_unless_runs(backend, device)
    base = _randn(64, device, 2)
    expected = base / 4.0  # exact: a power of two
    ops.unscale_reduce_([base, base[::2]], _scalar(4.0, device), _scalar(0.0, device), backend=backend)
    assert torch.equal(base, expected)


def _scaler_with_grads(device, backend, grads):
    params = [torch.nn.Parameter(_randn(g.shape[0], device, 10 + i)) for i, g in enumerate(grads)]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    scaler = FusedGradScaler(device, init_scale=4.0, backend=backend)
    scaler.scale(torch.ones((), device=device))
    return params, scaler


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("action", ["unscale_", "clip_grad_norm_", "step (fused optimizer)"])
def test_scaler_refuses_a_gradient_shared_by_two_parameters_on_every_backend(device, backend, action):
    """torch's backend unscaled a .grad shared by two parameters twice (and counted it twice in the norm); the native
    gradient table refuses it in every pass."""
    _skip_unless_runs(backend, device)
    g = _randn(40, device, 3)
    before = g.clone()
    params, scaler = _scaler_with_grads(device, backend, [_randn(9, device, 4), g, g])
    values = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match=re.escape(TABLE_SHARED.format(1, 2))):
        if action == "unscale_":
            scaler.unscale_(torch.optim.SGD(params, lr=0.1))
        elif action == "clip_grad_norm_":
            scaler.clip_grad_norm_(torch.optim.SGD(params, lr=0.1), max_norm=1.0)
        else:
            scaler.step(FusedSGD(params, lr=0.1, backend="torch"))
    assert torch.equal(g, before), "the refused call wrote the gradient"
    assert all(torch.equal(p.detach(), v) for p, v in zip(params, values, strict=True)), "a parameter stepped"


@pytest.mark.parametrize("backend", BACKENDS)
def test_scaler_refuses_an_expanded_gradient_naming_the_parameter_on_every_backend(device, backend):
    """The Python backends named the gradient's place in the list of gradients (element 1), not the parameter."""
    _skip_unless_runs(backend, device)
    params, scaler = _scaler_with_grads(
        device, backend, [_randn(5, device, 5), _randn(5, device, 6), torch.full((1,), 8.0, device=device).expand(5)]
    )
    params[0].grad = None
    before = params[1].grad.clone()
    with pytest.raises(RuntimeError, match=re.escape(TABLE_EXPANDED.format(2))):
        scaler.unscale_(torch.optim.SGD(params, lr=0.1))
    assert torch.equal(params[1].grad, before), "the refused call unscaled parameter 1's gradient"


# ---- tensors the op must not write, and tensors it cannot read ----


@pytest.mark.parametrize("backend", BACKENDS)
def test_unscale_refuses_to_write_a_tensor_that_requires_grad(device, backend):
    """native and Triton wrote into a leaf that requires grad, outside autograd; torch refused it with autograd's
    error, which names no argument. Under torch.no_grad() every backend writes it (as torch's in-place ops do)."""
    _skip_unless_runs(backend, device)
    first = _randn(6, device, 7)
    leaf = _randn(6, device, 8).requires_grad_()
    with pytest.raises(RuntimeError, match=re.escape("ampkernels: argument 'tensors': element 1 requires grad")):
        ops.unscale_reduce_([first, leaf], _scalar(4.0, device), _scalar(0.0, device), backend=backend)
    assert torch.equal(first, _randn(6, device, 7)), "the refused call wrote element 0"
    assert torch.equal(leaf.detach(), _randn(6, device, 8))
    res = ops.unscale_reduce_(
        [first, leaf], _scalar(4.0, device), _scalar(0.0, device), write=False, norm_type=2.0, backend=backend
    )
    assert res.norm is not None
    with torch.no_grad():
        ops.unscale_reduce_([first, leaf], _scalar(4.0, device), _scalar(0.0, device), backend=backend)
    assert torch.equal(leaf.detach(), _randn(6, device, 8) / 4.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unscale_refuses_a_found_inf_that_requires_grad(device, backend):
    _skip_unless_runs(backend, device)
    t = _randn(6, device, 9)
    found = _scalar(0.0, device).requires_grad_()
    for write in (True, False):  # found_inf is written either way
        with pytest.raises(RuntimeError, match=re.escape("ampkernels: argument 'found_inf': requires grad")):
            ops.unscale_reduce_([t], _scalar(4.0, device), found, write=write, backend=backend)
    assert torch.equal(t, _randn(6, device, 9))
    with torch.no_grad():
        t[0] = float("inf")
        ops.unscale_reduce_([t], _scalar(4.0, device), found, backend=backend)
    assert float(found.detach()) == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.complex64, torch.bool])
def test_unscale_refuses_a_non_float_tensor_with_one_error(device, backend, dtype):
    """native raised RuntimeError ("dtype Long"), Triton and torch TypeError ("dtype torch.int64")."""
    _skip_unless_runs(backend, device)
    first = _randn(6, device, 11)
    bad = torch.ones(4, device=device).to(dtype)
    message = (
        f"ampkernels: argument 'tensors': element 1 has dtype {dtype}; supported: float32, float16, bfloat16, float64"
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        ops.unscale_reduce_([first, bad], _scalar(4.0, device), _scalar(0.0, device), backend=backend)
    assert torch.equal(first, _randn(6, device, 11))


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_scale_refuses_a_scale_that_requires_grad(device, backend):
    _skip_unless_runs(backend, device, "update_scale_")
    scale = _scalar(4.0, device).requires_grad_()
    tracker = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match=re.escape("ampkernels: argument 'scale': requires grad")):
        ops.update_scale_(scale, tracker, _scalar(1.0, device), 2.0, 0.5, 3, backend=backend)
    assert float(scale) == 4.0 and int(tracker) == 0
    with torch.no_grad():
        ops.update_scale_(scale, tracker, _scalar(1.0, device), 2.0, 0.5, 3, backend=backend)
    assert float(scale) == 2.0


# ---- FusedGradScaler: counts beyond int32, trackers beyond their range, tensor arguments ----


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("interval", [2**31 - 1, 2**31, 2**40])
def test_scaler_takes_a_growth_interval_beyond_int32_as_stock_does(device, backend, interval):
    """FusedGradScaler(growth_interval=2**31) was accepted and every update() then raised; stock takes any int (its
    int32 growth tracker never reaches one beyond int32: the scale never grows)."""
    _skip_unless_runs(backend, device, "update_scale_")
    ours = FusedGradScaler(device, init_scale=8.0, growth_interval=interval, backend=backend)
    stock = Stock(device, init_scale=8.0, growth_interval=interval)
    assert drive(ours, device, "..o..") == drive(stock, device, "..o..")
    assert ours.state_dict() == stock.state_dict()
    assert ours.get_growth_interval() == interval


@pytest.mark.parametrize("backend", BACKENDS)
def test_scaler_loads_a_growth_interval_beyond_int32_as_stock_does(device, backend):
    _skip_unless_runs(backend, device, "update_scale_")
    sd = Stock(device, init_scale=8.0, growth_interval=3).state_dict()
    sd["growth_interval"] = 2**40
    ours, stock = FusedGradScaler(device, backend=backend), Stock(device)
    ours.load_state_dict(sd)
    stock.load_state_dict(sd)
    assert drive(ours, device, "...o...") == drive(stock, device, "...o...")
    assert ours.state_dict() == stock.state_dict()


def test_scaler_refuses_a_hysteresis_beyond_int32_at_construction():
    """Its tracker is an int32 tensor: hysteresis=2**31 was accepted and the first scale() or update() raised."""
    with pytest.raises(ValueError, match=key_pattern("hysteresis") + r".*2\*\*31"):
        FusedGradScaler("cpu", hysteresis=2**31)


def _warmed_up(device, **kw) -> FusedGradScaler:
    scaler = FusedGradScaler(device, **kw)
    drive(scaler, device, "..o.")
    return scaler


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("_growth_tracker", 2**40, "< growth_interval"),
        ("_growth_tracker", 2**31, "< growth_interval"),
        ("_growth_tracker", 7, "< growth_interval"),  # the scale would never grow again
        ("_growth_tracker", torch.tensor(2**40), "< growth_interval"),
        ("hysteresis", 2**31, "< 2**31"),
        ("_hysteresis_tracker", 4, "<= hysteresis"),  # ten overflows in a row then left the scale alone
        ("_hysteresis_tracker", 2**40, "<= hysteresis"),
    ],
)
def test_load_state_dict_checks_every_entry_before_loading_any(device, key, value, message):
    """_growth_tracker=2**40 raised an error that named no key, after the scale and the factors were loaded; a
    _hysteresis_tracker above hysteresis was loaded, after which no overflow backed off."""
    sd = _warmed_up(device, init_scale=2.0**9, growth_interval=7, growth_factor=4.0, hysteresis=3).state_dict()
    sd[key] = value
    scaler = _warmed_up(device, init_scale=8.0, growth_interval=11, hysteresis=2)
    before = scaler.state_dict()
    with pytest.raises(ValueError, match=key_pattern(key) + ".*" + re.escape(message)):
        scaler.load_state_dict(sd)
    assert scaler.state_dict() == before, "the refused load changed the scaler"
    assert drive(scaler, device, "o..") == drive(
        _warmed_up(device, init_scale=8.0, growth_interval=11, hysteresis=2), device, "o.."
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_saved_after_overflows_in_a_row_loads_and_continues(device, backend):
    """After more overflows in a row than hysteresis, the hysteresis tracker is below 0 (each further overflow backs
    off): the scaler's own state_dict was refused on load ("_hysteresis_tracker must be >= 0")."""
    _skip_unless_runs(backend, device, "update_scale_")
    source = FusedGradScaler(device, init_scale=2.0**12, hysteresis=2, growth_interval=4, backend=backend)
    drive(source, device, "ooo")
    copy = FusedGradScaler(device, hysteresis=2, backend=backend)
    copy.load_state_dict(source.state_dict())
    assert drive(copy, device, "o.o....o") == drive(source, device, "o.o....o")


@pytest.mark.parametrize(
    "init_scale",
    [
        torch.tensor(4.0),
        torch.tensor(4.0, dtype=torch.float64),
        torch.tensor(4),
        torch.tensor(4.0, dtype=torch.float16),
    ],
    ids=["float32", "float64", "int64", "float16"],
)
def test_scaler_takes_a_tensor_init_scale_as_stock_does(device, init_scale):
    """FusedGradScaler(init_scale=torch.tensor(4.)) raised ValueError; stock takes a 0-d tensor."""
    ours, stock = FusedGradScaler(device, init_scale=init_scale), Stock(device, init_scale=init_scale)
    assert drive(ours, device, ".o..") == drive(stock, device, ".o..")
    assert ours.state_dict() == stock.state_dict()


@pytest.mark.parametrize(
    "init_scale",
    [
        torch.tensor([4.0, 2.0]),
        torch.tensor(0.0),
        torch.tensor(float("nan")),
        torch.tensor(4.0, requires_grad=True),
        torch.tensor(True),
        torch.tensor(4.0 + 0j),
    ],
    ids=["two elements", "zero", "nan", "requires grad", "bool", "complex"],
)
def test_scaler_refuses_a_bad_tensor_init_scale_naming_it(init_scale):
    with pytest.raises(ValueError, match=key_pattern("init_scale")):
        FusedGradScaler("cpu", init_scale=init_scale)
