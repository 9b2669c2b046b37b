"""The host-time caches of scaled_matmul: the per-signature call cache, Triton launchers, the direct launch, device-
side TMA descriptors."""

from __future__ import annotations

import pytest
import torch
from scaled_matmul_helpers import (  # noqa: F401  (fresh_caches is a fixture)
    LOW,
    _check,
    _need_triton,
    _operand,
    _ref64,
    _rel_err,
    _triton_module,
)

from ampkernels.matmul import api as sm_api
from ampkernels.matmul import launch as sm_dispatch
from ampkernels.scaled_matmul import scaled_matmul


def test_cache_is_keyed_by_strides_and_dtype(device, fresh_caches):
    """Same shapes, other strides or dtype: a new signature (and a correct result), never the cached launch."""
    _need_triton(device)
    torch.manual_seed(20)
    for dtype in LOW:
        a = _operand(40, 32, dtype, device, False)
        for transposed in (False, True, False):
            b = _operand(32, 24, dtype, device, transposed)
            _check(a, b, 0.5, backend="triton", device=device)
    keys = list(sm_api._CALLS)
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
    assert 0 < len(sm_api._CALLS) <= 5


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
        monkeypatch.setattr(triton_sm, "TMA_DESCRIPTORS", mode)
        sm_api.clear_caches()
        if mode == "device" and not triton_sm.device_descriptors():
            continue
        results[mode] = scaled_matmul(a, b, scale, out_dtype=torch.float32, backend="triton")
        (launcher,) = triton_sm._LAUNCHERS.values()
        if launcher.kind == "tma":
            assert launcher.device_desc == (mode == "device")
    for result in results.values():
        assert _rel_err(result, _ref64(a, b, scale)) < 1e-5


def test_descriptor_switch_rejects_other_values(monkeypatch):
    triton_sm = _triton_module()
    if triton_sm is None:
        pytest.skip("triton is not usable")
    monkeypatch.setattr(triton_sm, "TMA_DESCRIPTORS", "hots")
    with pytest.raises(ValueError, match=r"scaled_matmul\.TMA_DESCRIPTORS: expected 'device' or 'host', got 'hots'"):
        triton_sm.device_descriptors()


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
    monkeypatch.setattr(triton_sm, "DIRECT_LAUNCH", True)
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
    monkeypatch.setattr(triton_sm, "DIRECT_LAUNCH", False)
    assert triton_sm._direct_runner(object(), (1,)) is None


def test_measurement_logs_are_bounded():
    """What "auto" and the Triton tuner measured is kept for the benchmark, but only the latest entries: a process
    with dynamic shapes would otherwise grow the logs without bound."""
    assert sm_dispatch.AUTO_LOG.maxlen is not None
    triton_sm = _triton_module()
    if triton_sm is not None:
        assert triton_sm.TUNING_LOG.maxlen is not None
    for _ in range(sm_dispatch.AUTO_LOG.maxlen + 5):
        sm_dispatch.AUTO_LOG.append({})
    assert len(sm_dispatch.AUTO_LOG) == sm_dispatch.AUTO_LOG.maxlen
    sm_dispatch.AUTO_LOG.clear()
