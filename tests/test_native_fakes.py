"""Every op the native extension registers has a fake implementation (registered by its family with
``ampkernels._native_fakes.native_fake``), and the list of ops there is the list registered."""

from __future__ import annotations

import math

import pytest
import torch

from ampkernels import _native_fakes, dispatch
from ampkernels._constants import NO_CLIP, NormKind

pytestmark = pytest.mark.skipif(dispatch.native() is None, reason="native extension not available")

# The schemas each family's TORCH_LIBRARY_FRAGMENT registers (csrc/scaler/scaler_ops.cpp,
# csrc/matmul/scaled_matmul_ops.cpp, csrc/float8/float8_ops.cpp).
SCHEMAS = {
    "unscale_reduce_": "ampkernels::unscale_reduce_(Tensor(a!)[] tensors, Tensor scale, Tensor(b!) found_inf, "
    "Tensor? factor, bool write, int norm_kind, bool per_tensor, float max_norm) -> (Tensor, Tensor, Tensor)",
    "update_scale_": "ampkernels::update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, "
    "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, "
    "int hysteresis, float min_scale, float max_scale, Tensor(d!)? counters, Tensor(e!)? history) -> ()",
    "scaled_matmul_wmma_": "ampkernels::scaled_matmul_wmma_(Tensor a, Tensor b, Tensor? scale, int scale_mode, "
    "float alpha, Tensor? bias, Tensor(a!) out, bool accumulate, Tensor(b!)? found_inf) -> ()",
    "scaled_matmul_wgmma_": "ampkernels::scaled_matmul_wgmma_(Tensor a, Tensor b, Tensor? scale, int scale_mode, "
    "float alpha, Tensor? bias, Tensor(a!) out, bool accumulate, Tensor(b!)? found_inf) -> ()",
    "scaled_matmul_fp8_wgmma_": "ampkernels::scaled_matmul_fp8_wgmma_(Tensor a, Tensor b, Tensor? scale_a, "
    "Tensor? scale_b, Tensor? scale, int scale_mode, float alpha, Tensor? bias, Tensor(a!) out, bool accumulate, "
    "Tensor(b!)? found_inf, Tensor(c!)? amax_out) -> ()",
    "to_float8_native": "ampkernels::to_float8_native(Tensor x, ScalarType dtype, bool per_row, bool write_data, "
    "bool write_t, Tensor? scale, Tensor(a!)? amax_out, Tensor(b!)? found_inf, Tensor? amax_scratch) "
    "-> (Tensor, Tensor, Tensor)",
}


def _native_op_names() -> set[str]:
    """Ops in the ampkernels namespace registered from C++ (the Python-defined ones have a Python kernel)."""
    names = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("ampkernels::") and qualified.split("::", 1)[1] in SCHEMAS:
            names.add(qualified.split("::", 1)[1])
    return names


def test_the_native_ops_are_the_listed_ones_with_their_schemas():
    assert set(_native_fakes.NATIVE_OPS) == set(SCHEMAS) == _native_op_names()
    assert set(_native_fakes.FAKES) == set(SCHEMAS)  # each family registered its ops' fakes on import


def test_a_fake_for_an_unlisted_op_is_refused():
    with pytest.raises(ValueError, match="'no_such_op_' is not in NATIVE_OPS"):
        _native_fakes.native_fake("no_such_op_")(lambda: None)
    for name, schema in SCHEMAS.items():
        assert str(getattr(torch.ops.ampkernels, name).default._schema) == schema


def test_removed_optimizer_ops_are_gone():
    for name in ("fused_adam_", "fused_sgd_"):
        assert not hasattr(torch.ops.ampkernels, name)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_native_op_has_a_fake(name):
    op = getattr(torch.ops.ampkernels, name).default
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta") or torch._library.utils.has_fake_kernel(op)


def test_matmul_fakes_trace_under_fake_tensors():
    """Under fake tensors the in-place matmul ops return nothing and leave out and amax as they were (fake, same
    shape and dtype); their fakes refuse a wrong inner dimension as the ops do."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(64, 32, dtype=torch.float16, device="cpu")
        b = torch.empty(32, 48, dtype=torch.float16, device="cpu")
        out = torch.empty(64, 48, dtype=torch.float32, device="cpu")
        for name in ("scaled_matmul_wmma_", "scaled_matmul_wgmma_"):
            assert getattr(torch.ops.ampkernels, name)(a, b, None, 0, 1.0, None, out, False, None) is None
            with pytest.raises(RuntimeError, match="argument 'b': expected 32 rows, got 31"):
                getattr(torch.ops.ampkernels, name)(a, b[:31], None, 0, 1.0, None, out, False, None)
        a8 = torch.empty(64, 32, dtype=torch.float8_e4m3fn, device="cpu")
        b8 = torch.empty(48, 32, dtype=torch.float8_e4m3fn, device="cpu").t()
        amax = torch.zeros(1, dtype=torch.float32, device="cpu")
        op = torch.ops.ampkernels.scaled_matmul_fp8_wgmma_
        assert op(a8, b8, None, None, None, 0, 1.0, None, out, False, None, amax) is None
        with pytest.raises(RuntimeError, match="argument 'b': expected 32 rows, got 16"):
            op(a8, b8[:16], None, None, None, 0, 1.0, None, out, False, None, amax)
    for t, shape, dtype in ((out, (64, 48), torch.float32), (amax, (1,), torch.float32)):
        assert isinstance(t, FakeTensor) and t.shape == shape and t.dtype == dtype


# ---- the fakes refuse what the ops refuse ----


def _unscale(tensors, scale, found_inf, kind=NormKind.NONE, max_norm=1.0):
    return torch.ops.ampkernels.unscale_reduce_(tensors, scale, found_inf, None, True, int(kind), True, max_norm)


def _update(scale, growth_tracker, found_inf, hysteresis=1, counters=None, history=None):
    tracker = torch.ones(1, dtype=torch.int32, device=scale.device)
    return torch.ops.ampkernels.update_scale_(
        scale, growth_tracker, tracker, found_inf, 2.0, 0.5, 10, hysteresis, 0.0, 1e9, counters, history
    )


def _cast(x, dtype=torch.float8_e4m3fn, per_row=False, write_data=True, write_t=False, scale=None):
    return torch.ops.ampkernels.to_float8_native(x, dtype, per_row, write_data, write_t, scale, None, None, None)


def _mm(a, b, out, scale=None, scale_mode=0, bias=None):
    return torch.ops.ampkernels.scaled_matmul_wmma_(a, b, scale, scale_mode, 1.0, bias, out, False, None)


def _mm8(a, b, out, scale_a=None):
    return torch.ops.ampkernels.scaled_matmul_fp8_wgmma_(
        a, b, scale_a, None, None, 0, 1.0, None, out, False, None, None
    )


f32 = torch.float32
REFUSED = {
    # case: (argument, call(make): make(shape, dtype) builds each tensor on the device under test)
    "norm_kind 3": ("norm_kind", lambda t: _unscale([t(8, f32)], t(1, f32), t(1, f32), kind=3)),
    "norm_kind -1": ("norm_kind", lambda t: _unscale([t(8, f32)], t(1, f32), t(1, f32), kind=-1)),
    "max_norm -2": ("max_norm", lambda t: _unscale([t(8, f32)], t(1, f32), t(1, f32), NormKind.L2, -2.0)),
    "max_norm nan": ("max_norm", lambda t: _unscale([t(8, f32)], t(1, f32), t(1, f32), NormKind.L2, math.nan)),
    "int tensor": ("tensors", lambda t: _unscale([t(8, torch.int32)], t(1, f32), t(1, f32))),
    "scale of 2": ("scale", lambda t: _unscale([t(8, f32)], t(2, f32), t(1, f32))),
    "found_inf float64": ("found_inf", lambda t: _unscale([t(8, f32)], t(1, f32), t(1, torch.float64))),
    "update scale of 3": ("scale", lambda t: _update(t(3, f32), t(1, torch.int32), t(1, f32))),
    "update int64 tracker": ("growth_tracker", lambda t: _update(t(1, f32), t(1, torch.int64), t(1, f32))),
    "update hysteresis 2**32": ("hysteresis", lambda t: _update(t(1, f32), t(1, torch.int32), t(1, f32), 2**32)),
    "update history alone": (
        "history",
        lambda t: _update(t(1, f32), t(1, torch.int32), t(1, f32), history=t(4, f32)),
    ),
    "cast 3-D x": ("x", lambda t: _cast(t((2, 3, 4), f32))),
    "cast int x": ("x", lambda t: _cast(t((2, 3), torch.int32))),
    "cast empty x": ("x", lambda t: _cast(t((0, 3), f32))),
    "cast to float16": ("dtype", lambda t: _cast(t((2, 3), f32), dtype=torch.float16)),
    "cast nothing": ("write_data", lambda t: _cast(t((2, 3), f32), write_data=False)),
    "cast per-row pair": ("per_row", lambda t: _cast(t((2, 3), f32), per_row=True, write_t=True)),
    "cast scale of 3 rows": ("scale", lambda t: _cast(t((2, 3), f32), per_row=True, scale=t(3, f32))),
    "mm 3-D a": ("a", lambda t: _mm(t((2, 6, 4), torch.half), t((4, 5), torch.half), t((6, 5), f32))),
    "mm inner dims": ("b", lambda t: _mm(t((6, 4), torch.half), t((3, 5), torch.half), t((6, 5), f32))),
    "mm out shape": ("out", lambda t: _mm(t((6, 4), torch.half), t((4, 5), torch.half), t((5, 6), f32))),
    "mm scale mode 2": (
        "scale",
        lambda t: _mm(t((6, 4), torch.half), t((4, 5), torch.half), t((6, 5), f32), t(5, f32), 2),
    ),
    "fp8 K of 8": (
        "a",
        lambda t: _mm8(t((6, 8), torch.float8_e4m3fn), t((8, 5), torch.float8_e4m3fn), t((6, 5), f32)),
    ),
    "fp8 scale_a of 5": (
        "scale_a",
        lambda t: _mm8(t((6, 16), torch.float8_e4m3fn), t((5, 16), torch.float8_e4m3fn).t(), t((6, 5), f32), t(5, f32)),
    ),
}


def _maker(device):
    def make(shape, dtype):
        return torch.zeros(shape, dtype=torch.float32, device=device).to(dtype)

    return make


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_fakes_refuse_what_the_ops_refuse(case):
    """The op on CPU tensors and its fake (meta tensors, and fake tensors under torch.compile's FakeTensorMode) raise
    the same error for the same argument. The fakes checked nothing: a norm of an unknown kind, a float16 'float8' cast,
    and a ValueError for a 3-D x."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    arg, call = REFUSED[case]
    pattern = rf"ampkernels: argument '{arg}'"
    with pytest.raises(RuntimeError, match=pattern):
        call(_maker("cpu"))
    with pytest.raises(RuntimeError, match=pattern):
        call(_maker("meta"))
    with FakeTensorMode(), pytest.raises(RuntimeError, match=pattern):
        call(_maker("cpu"))


def test_fakes_accept_what_the_ops_accept():
    """The fakes' checks let valid calls through (meta tensors), with the outputs' shapes and dtypes."""
    make = _maker("meta")
    norm, each, coef = _unscale([make(8, f32), make((3, 2), torch.bfloat16)], make(1, f32), make(1, f32), NormKind.INF)
    assert (norm.shape, each.shape, coef.shape) == ((), (2,), ())
    norm, each, coef = _unscale([make(8, f32)], make(1, f32), make(1, f32), NormKind.L2, NO_CLIP)
    assert (norm.shape, each.shape, coef.shape) == ((), (1,), (0,))  # no clip: no coefficient
    _update(make(1, f32), make(1, torch.int32), make(1, f32), counters=make(2, torch.int64), history=make(4, f32))
    data, data_t, scale_inv = _cast(make((2, 3), torch.bfloat16), per_row=True, write_data=False, write_t=True)
    assert (data.shape, data_t.shape, data_t.dtype, scale_inv.shape) == ((0,), (3, 2), torch.float8_e4m3fn, (3, 1))
    _mm(make((6, 4), torch.half), make((4, 5), torch.half), make((6, 5), f32), make(6, f32), 2, make(5, torch.half))
    _mm8(make((6, 16), torch.float8_e4m3fn), make((5, 16), torch.float8_e4m3fn).t(), make((6, 5), f32), make(6, f32))
