"""Which backend scaled_matmul runs: the choice and its overrides, why one cannot run, "auto" (timed once per
signature, never while capturing), CUDA graph captures."""

from __future__ import annotations

import pytest
import torch
from scaled_matmul_helpers import (  # noqa: F401  (fresh_caches is a fixture)
    _assert_accuracy,
    _check,
    _need_triton,
    _operand,
    _ref64,
    _stock,
    _triton_module,
)

import ampkernels
from ampkernels import dispatch
from ampkernels._constants import SCALE_NONE
from ampkernels.matmul import api as sm_api
from ampkernels.matmul import launch as sm_dispatch
from ampkernels.matmul import tuning
from ampkernels.scaled_matmul import ScaledLinear, scaled_matmul


def test_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    assert sm_api.select_backend(cpu) == "torch"
    monkeypatch.setenv("AMPKERNELS_SCALED_MATMUL_BACKEND", "torch")
    assert sm_api.select_backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv("AMPKERNELS_SCALED_MATMUL_BACKEND", "no-such-backend")
    with pytest.raises(ValueError, match="AMPKERNELS_SCALED_MATMUL_BACKEND.*auto/triton/wgmma/wmma/cublas/torch"):
        sm_api.select_backend(cpu)
    monkeypatch.delenv("AMPKERNELS_SCALED_MATMUL_BACKEND")
    with pytest.raises(RuntimeError, match="wmma"):
        sm_api.select_backend(cpu, "wmma")
    with pytest.raises(RuntimeError, match="wgmma"):
        sm_api.select_backend(cpu, "wgmma")
    assert ampkernels.scaled_matmul is scaled_matmul and ampkernels.ScaledLinear is ScaledLinear


def test_wgmma_needs_a_build_for_9_0a(monkeypatch):
    # The wgmma kernel exists only in sm_90a code: a build without 9.0a in TORCH_CUDA_ARCH_LIST must say so (and the
    # default order then moves on to WMMA) before anything asks the GPU.
    if dispatch.native_op("scaled_matmul_wgmma_") is None:
        pytest.skip("ampkernels._C is not built")

    class BuiltForSm90:
        cuda_arch_list = "8.0;9.0"
        wgmma_built = False

    monkeypatch.setattr(dispatch, "native", lambda: BuiltForSm90)
    reason = dispatch.why_not("scaled_matmul", "wgmma", torch.device("cuda"))
    assert reason is not None and "9.0a" in reason, reason


def _problem(M: int, N: int, K: int) -> tuple:
    """auto_backend's arguments for an M x N x K bf16 problem; only metadata is read (expanded 1-element tensors)."""
    a = torch.empty(1, dtype=torch.bfloat16).expand(M, K)
    b = torch.empty(1, dtype=torch.bfloat16).expand(K, N)
    out = torch.empty(1, dtype=torch.bfloat16).expand(M, N)
    return (a, b, None, SCALE_NONE, 1.0, None, out, False, None)


def test_auto_times_once_per_signature_and_never_while_capturing(monkeypatch, fresh_caches):
    """'auto' with two candidates: Triton below AUTO_MIN_MACS; above it the timed winner, timed once per signature;
    inside a CUDA graph capture the untimed rule, remembered nowhere; with tuning.TUNE False the untimed rule."""
    pytest.importorskip("triton")
    assert _triton_module() is not None
    timed = []

    def time_auto(candidates, key, args):
        timed.append(key)
        return "wgmma"

    monkeypatch.setattr(dispatch, "auto_candidates", lambda device, op="scaled_matmul": ("triton", "wgmma"))
    monkeypatch.setattr(sm_dispatch, "_time_auto", time_auto)
    monkeypatch.setattr(sm_dispatch, "num_sms", lambda device: 132)
    monkeypatch.setattr(dispatch, "triton_interpreting", lambda: False)  # tuning is off under the interpreter
    assert sm_api.select_backend(torch.device("cuda")) == "auto"

    assert sm_dispatch.auto_backend(*_problem(1024, 1024, 1024)) == "triton"  # 2^30 < AUTO_MIN_MACS: not timed
    narrow, wide = _problem(3072, 768, 8192), _problem(8192, 8192, 8192)
    monkeypatch.setattr(sm_dispatch, "capturing", lambda: True)
    assert sm_dispatch.auto_backend(*narrow) == "wgmma"  # 72 tiles of 128x256: fewer than 2 waves of 132 SMs
    assert sm_dispatch.auto_backend(*wide) == "triton"  # 2048 tiles
    assert not timed and not sm_dispatch._AUTO

    monkeypatch.setattr(sm_dispatch, "capturing", lambda: False)
    assert sm_dispatch.auto_backend(*wide) == "wgmma"  # the (fake) timing's winner, over the untimed rule
    assert sm_dispatch.auto_backend(*wide) == "wgmma"
    assert len(timed) == 1
    transposed = list(wide)
    transposed[1] = wide[1].t().contiguous().t()  # same shapes, b column-major: a signature of its own
    sm_dispatch.auto_backend(*transposed)
    assert len(timed) == 2

    monkeypatch.setattr(tuning, "TUNE", False)
    assert sm_dispatch.auto_backend(*narrow) == "wgmma"
    assert sm_dispatch.auto_backend(*_problem(8192, 4096, 4096)) == "triton"
    assert len(timed) == 2


def test_auto_runs_the_only_candidate(device, fresh_caches):
    """Where only Triton runs (no wgmma: a CPU under the interpreter, or a GPU other than Hopper), 'auto' is Triton:
    the same result, through the checked and the cached path."""
    if dispatch.why_not("scaled_matmul", "auto", torch.device(device)) is not None:
        pytest.skip(dispatch.why_not("scaled_matmul", "auto", torch.device(device)))
    torch.manual_seed(31)
    a, b = _operand(40, 32, torch.float16, device, False), _operand(32, 24, torch.float16, device, True)
    for _ in range(2):
        _check(a, b, torch.tensor(0.5, device=device), backend="auto", device=device)
    if dispatch.auto_candidates(torch.device(device)) == ("triton",):
        assert [entry.backend.name for entry in sm_api._CALLS.values()] == ["triton"]


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
    if not torch.cuda.is_available() or len(dispatch.auto_candidates(torch.device("cuda"))) < 2:
        pytest.skip("'auto' chooses only where both Triton and the wgmma kernel run (Hopper, a build with 9.0a)")


@pytest.mark.gpu
def test_auto_on_gpu_runs_the_faster_and_times_on_scratch(fresh_caches):
    """On Hopper the default is 'auto'. A problem above AUTO_MIN_MACS is timed on both kernels once, on scratch
    outputs: the caller's accumulating `out` receives exactly one product, bit for bit the winner's."""
    _need_auto_on_gpu()
    assert sm_api.select_backend(torch.device("cuda")) == "auto"
    torch.manual_seed(32)
    M, N, K = 3072, 768, 8192  # grad-weight: dy.T @ x, a column-major view
    a, b = _operand(M, K, torch.bfloat16, "cuda", True), _operand(K, N, torch.bfloat16, "cuda", False)
    scale = torch.tensor(0.75, device="cuda")
    old = torch.randn(M, N, device="cuda")
    out, flag = old.clone(), torch.zeros(1, device="cuda")
    logged = len(sm_dispatch.AUTO_LOG)
    scaled_matmul(a, b, scale, out=out, accumulate=True, found_inf=flag)
    (entry,) = list(sm_dispatch.AUTO_LOG)[logged:]
    assert sorted(entry["ms"]) == ["triton", "wgmma"] and all(ms > 0 for ms in entry["ms"].values())
    assert entry["best"] == min(entry["ms"], key=entry["ms"].get)
    assert flag.item() == 0.0
    stock = old + _stock(a, b, scale, None, torch.float32)  # torch: a bf16 product, added in fp32
    _assert_accuracy(out, stock, _ref64(a, b, scale, None, old))
    again = old.clone()
    scaled_matmul(a, b, scale, out=again, accumulate=True, found_inf=flag, backend=entry["best"])
    assert torch.equal(out, again)
    scaled_matmul(a, b, scale, out=again, accumulate=True, found_inf=flag)
    assert len(sm_dispatch.AUTO_LOG) == logged + 1  # remembered


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
    logged = len(sm_dispatch.AUTO_LOG)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = scaled_matmul(a, b, scale)
    assert len(sm_dispatch.AUTO_LOG) == logged and not sm_dispatch._AUTO and not sm_api._CALLS
    a.copy_(_operand(M, K, torch.bfloat16, "cuda", False))
    scale.fill_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    _assert_accuracy(out, _stock(a, b, scale, None, a.dtype), _ref64(a, b, scale))

    eager = scaled_matmul(a, b, scale)
    assert len(sm_dispatch.AUTO_LOG) == logged + 1
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
    monkeypatch.setattr(tuning, "TUNE", False)
    scaled_matmul(a, b, 0.5, backend="triton")  # compiles and loads the heuristic config's kernel
    sm_api.clear_caches()
    monkeypatch.setattr(tuning, "TUNE", True)
    tuned = dict(triton_sm._TUNED)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = scaled_matmul(a, b, 0.5, backend="triton")
    assert triton_sm._TUNED == tuned and not triton_sm._LAUNCHERS and not sm_api._CALLS
    a.copy_(_operand(M, K, torch.float16, "cuda", False))
    graph.replay()
    torch.cuda.synchronize()
    _assert_accuracy(out, _stock(a, b, 0.5, None, a.dtype), _ref64(a, b, 0.5))
    scaled_matmul(a, b, 0.5, backend="triton")
    assert len(triton_sm._TUNED) == len(tuned) + 1


def test_info_reports_the_backend():
    from ampkernels import info

    text = info.report()
    assert "scaled_matmul" in text


def test_triton_launches_on_the_device_of_the_operands(monkeypatch, fresh_caches):
    """Triton launches on the current CUDA device (and allocates its TMA scratch there): scaled_matmul makes the
    operands' device current first, as the native ops do with a CUDA guard (operands on cuda:1 while cuda:0 is
    current were multiplied from cuda:0)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _need_triton(device)
    import ampkernels._runtime

    guarded = []
    real = ampkernels._runtime.device_guard
    monkeypatch.setattr(ampkernels._runtime, "device_guard", lambda device: guarded.append(device) or real(device))
    a = torch.randn(32, 48, device=device).to(torch.bfloat16)
    b = torch.randn(48, 16, device=device).to(torch.bfloat16)
    scaled_matmul(a, b, backend="triton")
    assert guarded == [a.device]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_triton_on_a_device_that_is_not_current(fresh_caches):
    a = torch.randn(256, 128, device="cuda:1").to(torch.bfloat16)
    b = torch.randn(128, 192, device="cuda:1").to(torch.bfloat16)
    with torch.cuda.device(0):
        ours = scaled_matmul(a, b, backend="triton")
    torch.testing.assert_close(ours.float(), (a.float() @ b.float()), rtol=2e-2, atol=2e-2)
