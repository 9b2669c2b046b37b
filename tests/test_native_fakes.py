"""Every op the native extension registers has a fake implementation (ampkernels/_native_fakes.py), and the list
of ops there is the list registered."""

from __future__ import annotations

import pytest
import torch

from ampkernels import _native_fakes, dispatch

pytestmark = pytest.mark.skipif(dispatch.native() is None, reason="native extension not available")

# The schemas each family's TORCH_LIBRARY_FRAGMENT registers (csrc/scaler/scaler_ops.cpp,
# csrc/matmul/scaled_matmul_ops.cpp, csrc/float8/float8_ops.cpp).
SCHEMAS = {
    "unscale_reduce_": "ampkernels::unscale_reduce_(Tensor(a!)[] tensors, Tensor scale, Tensor(b!) found_inf, "
    "Tensor? factor, bool write, float norm_type, bool per_tensor, float max_norm) -> (Tensor, Tensor, Tensor)",
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
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(64, 32, dtype=torch.float16, device="cpu")
        b = torch.empty(32, 48, dtype=torch.float16, device="cpu")
        out = torch.empty(64, 48, dtype=torch.float32, device="cpu")
        for name in ("scaled_matmul_wmma_", "scaled_matmul_wgmma_"):
            getattr(torch.ops.ampkernels, name)(a, b, None, 0, 1.0, None, out, False, None)
        a8 = torch.empty(64, 32, dtype=torch.float8_e4m3fn, device="cpu")
        b8 = torch.empty(48, 32, dtype=torch.float8_e4m3fn, device="cpu").t()
        amax = torch.zeros(1, dtype=torch.float32, device="cpu")
        torch.ops.ampkernels.scaled_matmul_fp8_wgmma_(a8, b8, None, None, None, 0, 1.0, None, out, False, None, amax)
