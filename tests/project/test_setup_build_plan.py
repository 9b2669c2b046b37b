"""setup.py's build decision (plan_build): CPU kernels only without a visible GPU unless CUDA is asked for
(TORCH_CUDA_ARCH_LIST or AMPKERNELS_FORCE_CUDA=1); with a GPU, its architectures (Hopper as 9.0a); AMPKERNELS_NO_CUDA
wins over everything; and the message says what is built and roughly how long it takes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOLKIT = "/usr/local/cuda-13.0"


@pytest.fixture(scope="module")
def setup_module_namespace():
    """setup.py's functions, loaded without building anything."""
    saved_setup, saved_env = setuptools.setup, os.environ.get("AMPKERNELS_NO_NATIVE")
    setuptools.setup = lambda **kwargs: None
    os.environ["AMPKERNELS_NO_NATIVE"] = "1"
    try:
        namespace = {"__file__": str(ROOT / "setup.py"), "__name__": "ampkernels_setup"}
        exec(compile((ROOT / "setup.py").read_text(), str(ROOT / "setup.py"), "exec"), namespace)
    finally:
        setuptools.setup = saved_setup
        if saved_env is None:
            os.environ.pop("AMPKERNELS_NO_NATIVE")
        else:
            os.environ["AMPKERNELS_NO_NATIVE"] = saved_env
    return namespace


@pytest.fixture(scope="module")
def plan_build(setup_module_namespace):
    return setup_module_namespace["plan_build"]


def test_no_gpu_builds_cpu_only_and_says_how_to_ask_for_cuda(plan_build):
    plan = plan_build({}, "13.0", [], TOOLKIT, jobs=2)
    assert not plan.cuda and plan.arch_list is None and plan.error is None
    assert "CPU kernels only" in plan.message and "no GPU visible" in plan.message
    assert "AMPKERNELS_FORCE_CUDA=1" in plan.message and "TORCH_CUDA_ARCH_LIST" in plan.message
    assert "2 min with 2 parallel jobs" in plan.message  # 4.5 core-minutes on 2 jobs


def test_gpu_query_failure_counts_as_no_gpu(plan_build):
    plan = plan_build({}, "13.0", [], TOOLKIT, jobs=2, gpu_error="RuntimeError: no driver")
    assert not plan.cuda and "RuntimeError: no driver" in plan.message


def test_arch_list_set_builds_cuda_for_that_list(plan_build):
    plan = plan_build({"TORCH_CUDA_ARCH_LIST": " 8.0;9.0a "}, "13.0", [], TOOLKIT, jobs=16)
    assert plan.cuda and plan.arch_list == "8.0;9.0a" and plan.error is None
    assert "sm_80, sm_90a" in plan.message and "2 architectures" in plan.message
    assert "1 min with 16 parallel jobs" in plan.message  # (4.5 + 2 * 9.5) / 16 = 1.5, rounded


def test_arch_list_wins_over_the_gpus_present(plan_build):
    plan = plan_build({"TORCH_CUDA_ARCH_LIST": "8.6+PTX"}, "13.0", [(9, 0)], TOOLKIT, jobs=2)
    assert plan.cuda and plan.arch_list == "8.6+PTX" and "sm_86+PTX" in plan.message


@pytest.mark.parametrize(
    ("cuda", "expected"),
    [("13.0", "7.5;8.0;8.6;8.9;9.0a"), ("12.8", "7.0;7.5;8.0;8.6;8.9;9.0a"), ("11.8", "7.0;7.5;8.0;8.6;8.9;9.0")],
)
def test_force_builds_the_default_list(plan_build, cuda, expected):
    for value in ("1", "true", "ON"):
        plan = plan_build({"AMPKERNELS_FORCE_CUDA": value}, cuda, [], TOOLKIT, jobs=2)
        assert plan.cuda and plan.arch_list == expected, value
    assert f"{len(expected.split(';'))} architectures" in plan.message


def test_force_and_arch_list_together_take_the_list(plan_build):
    env = {"AMPKERNELS_FORCE_CUDA": "1", "TORCH_CUDA_ARCH_LIST": "9.0a"}
    plan = plan_build(env, "13.0", [], TOOLKIT, jobs=2)
    assert plan.cuda and plan.arch_list == "9.0a" and "1 architecture:" in plan.message
    assert "7 min with 2 parallel jobs" in plan.message  # (4.5 + 9.5) / 2


def test_force_off_values_do_not_force(plan_build):
    for value in ("0", "", "no", "false"):
        assert not plan_build({"AMPKERNELS_FORCE_CUDA": value}, "13.0", [], TOOLKIT, jobs=2).cuda, value


@pytest.mark.parametrize(
    ("gpus", "cuda", "expected"),
    [
        ([(9, 0)], "13.0", "9.0a"),
        ([(9, 0)], "11.8", "9.0"),  # no arch-specific target before CUDA 12
        ([(8, 0)], "13.0", "8.0"),
        ([(9, 0), (8, 6), (9, 0)], "13.0", "8.6;9.0a"),
        ([(12, 0), (8, 9)], "13.0", "8.9;12.0"),  # ordered by capability, not as strings
    ],
)
def test_gpus_present_build_their_architectures(plan_build, gpus, cuda, expected):
    plan = plan_build({}, cuda, gpus, TOOLKIT, jobs=16)
    assert plan.cuda and plan.arch_list == expected and "GPUs visible" in plan.message


def test_no_cuda_wins_over_everything(plan_build):
    env = {"AMPKERNELS_NO_CUDA": "1", "AMPKERNELS_FORCE_CUDA": "1", "TORCH_CUDA_ARCH_LIST": "9.0a"}
    plan = plan_build(env, "13.0", [(9, 0)], TOOLKIT, jobs=2)
    assert not plan.cuda and plan.error is None and "AMPKERNELS_NO_CUDA=1" in plan.message


def test_cpu_torch(plan_build):
    plan = plan_build({"TORCH_CUDA_ARCH_LIST": "9.0a"}, None, [], None, jobs=2)
    assert not plan.cuda and plan.error is None and "CPU build" in plan.message
    plan = plan_build({"AMPKERNELS_FORCE_CUDA": "1"}, None, [], None, jobs=2)
    assert plan.error is not None and "AMPKERNELS_FORCE_CUDA=1" in plan.error and "CPU build" in plan.error


def test_no_toolkit(plan_build):
    plan = plan_build({}, "13.0", [(9, 0)], None, jobs=2)  # a GPU, no toolkit: CPU kernels, and why
    assert not plan.cuda and plan.error is None and "CUDA_HOME" in plan.message
    plan = plan_build({"TORCH_CUDA_ARCH_LIST": "9.0a"}, "13.0", [], None, jobs=2)
    assert not plan.cuda and plan.error is None and "TORCH_CUDA_ARCH_LIST" in plan.message
    plan = plan_build({"AMPKERNELS_FORCE_CUDA": "1"}, "13.0", [], None, jobs=2)  # asked for by force: stop
    assert plan.error is not None and "CUDA_HOME" in plan.error


def test_arch_names(setup_module_namespace):
    names = setup_module_namespace["arch_names"]
    assert names("7.5;8.0 9.0a;;8.6+PTX") == ["sm_75", "sm_80", "sm_90a", "sm_86+PTX"]
    assert names("10.0a") == ["sm_100a"]


def test_visible_gpus_survives_a_raising_torch(setup_module_namespace):
    class Cuda:
        @staticmethod
        def is_available():
            raise RuntimeError("driver too old")

    class Torch:
        class version:
            cuda = "13.0"

        cuda = Cuda

    gpus, error = setup_module_namespace["_visible_gpus"](Torch)
    assert gpus == [] and "driver too old" in error


def test_setup_prints_its_plan_to_stderr():
    """The real setup.py, without building: ``--version`` runs the planning and prints it."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CUDA_ARCH_LIST", "AMPKERNELS_FORCE_CUDA")}
    env["AMPKERNELS_NO_CUDA"] = "1"
    env["MAX_JOBS"] = "3"
    out = subprocess.run(
        [sys.executable, "setup.py", "--version"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0.1.0"
    assert "ampkernels: building the CPU kernels only (AMPKERNELS_NO_CUDA=1; roughly 2 min with 3" in out.stderr


def _extension(monkeypatch, env: dict[str, str]):
    """The extension setup.py would build under ``env`` (loaded with setuptools.setup stubbed: nothing compiles)."""
    # setup.py writes TORCH_CUDA_ARCH_LIST and CUDA_HOME: setenv first, so that monkeypatch restores them (unset too)
    for name in ("AMPKERNELS_NO_NATIVE", "AMPKERNELS_NO_CUDA", "AMPKERNELS_FORCE_CUDA", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("CUDA_HOME", os.environ.get("CUDA_HOME", ""))
    if not os.environ["CUDA_HOME"]:
        monkeypatch.delenv("CUDA_HOME")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # setup.py sets CUDA_HOME before it imports torch.utils.cpp_extension, which reads it once, at import: imported
    # earlier by another test without CUDA_HOME, it would hold its own guess. Imported afresh here, and put back after.
    monkeypatch.delitem(sys.modules, "torch.utils.cpp_extension", raising=False)
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    namespace = {"__file__": str(ROOT / "setup.py"), "__name__": "ampkernels_setup"}
    exec(compile((ROOT / "setup.py").read_text(), str(ROOT / "setup.py"), "exec"), namespace)
    (ext,) = captured["ext_modules"]
    return ext, namespace


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU default")
def test_the_plan_decides_the_extension(monkeypatch, capfd):
    """The wiring from plan_build to the extension: without a GPU and without a request, no .cu source is compiled;
    forced (where torch is a CUDA build and a toolkit is found), every .cu source, for the default list, which the
    build records in AMPK_CUDA_ARCH_LIST. What setup.py wrote into the environment is taken back after."""
    before = {k: os.environ.get(k) for k in ("TORCH_CUDA_ARCH_LIST", "CUDA_HOME")}
    with monkeypatch.context() as patch:
        ext, namespace = _extension(patch, {})
        assert ext.sources and not any(s.endswith(".cu") for s in ext.sources)
        assert "building the CPU kernels only (no GPU visible" in capfd.readouterr().err
        cuda_build = torch.version.cuda is not None and namespace["find_cuda_home"]() is not None
    if cuda_build:
        with monkeypatch.context() as patch:
            ext, namespace = _extension(patch, {"AMPKERNELS_FORCE_CUDA": "1"})
            expected = namespace["_default_arch_list"](torch.version.cuda)
            assert any(s.endswith(".cu") for s in ext.sources)
            assert f'-DAMPK_CUDA_ARCH_LIST="{expected}"' in ext.extra_compile_args["nvcc"]
            assert os.environ["TORCH_CUDA_ARCH_LIST"] == expected
            assert "building the CPU kernels and the CUDA kernels for sm_" in capfd.readouterr().err
    assert {k: os.environ.get(k) for k in before} == before
    if not cuda_build:
        pytest.skip("the forced CUDA build needs a CUDA build of torch and a CUDA toolkit (the CPU half passed)")
