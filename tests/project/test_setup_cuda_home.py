"""setup.py's CUDA toolkit detection (find_cuda_home): CUDA_HOME wins; else the toolkit of the nvcc on PATH,
followed through a wrapper script or a symbolic link; None when no toolkit is found that way."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import setuptools

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def find_cuda_home():
    """setup.py's function, loaded without building anything."""
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
    return namespace["find_cuda_home"]


def _toolkit(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime_api.h").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_bytes(b"\x7fELF fake binary")
    nvcc.chmod(0o755)
    return nvcc


def _which(path):
    return lambda name: str(path) if name == "nvcc" and path is not None else None


def test_cuda_home_set_wins(find_cuda_home, tmp_path):
    nvcc = _toolkit(tmp_path / "cuda-13.0")
    assert find_cuda_home({"CUDA_HOME": "/opt/cuda"}, _which(nvcc)) == "/opt/cuda"
    assert find_cuda_home({"CUDA_PATH": "/opt/cuda"}, _which(nvcc)) == "/opt/cuda"


def test_real_nvcc_on_path(find_cuda_home, tmp_path):
    nvcc = _toolkit(tmp_path / "cuda-13.0")
    assert find_cuda_home({}, _which(nvcc)) == str((tmp_path / "cuda-13.0").resolve())


def test_wrapper_script_is_followed(find_cuda_home, tmp_path):
    real = _toolkit(tmp_path / "cuda-13.0")
    wrapper = tmp_path / "local" / "bin" / "nvcc"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    assert find_cuda_home({}, _which(wrapper)) == str((tmp_path / "cuda-13.0").resolve())


def test_symlink_is_followed(find_cuda_home, tmp_path):
    real = _toolkit(tmp_path / "cuda-12.8")
    link = tmp_path / "bin" / "nvcc"
    link.parent.mkdir()
    link.symlink_to(real)
    assert find_cuda_home({}, _which(link)) == str((tmp_path / "cuda-12.8").resolve())


def test_no_toolkit_found(find_cuda_home, tmp_path):
    assert find_cuda_home({}, _which(None)) is None
    wrapper = tmp_path / "bin" / "nvcc"  # a wrapper naming no nvcc that exists, no include/ beside it
    wrapper.parent.mkdir()
    wrapper.write_text('#!/bin/sh\nexec /nonexistent/cuda/bin/nvcc "$@"\n')
    assert find_cuda_home({}, _which(wrapper)) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the shell wrapper form is a Linux layout")
def test_wrapper_naming_its_toolkit_in_quotes(find_cuda_home, tmp_path):
    real = _toolkit(tmp_path / "cuda")
    wrapper = tmp_path / "wrap" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/bash\nNVCC="{real}"\nexec "$NVCC" "$@"\n')
    assert find_cuda_home({}, _which(wrapper)) == str((tmp_path / "cuda").resolve())
