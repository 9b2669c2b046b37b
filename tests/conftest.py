"""Shared pytest setup for ampkernels.

- Without a CUDA device, Triton kernels run in the interpreter: ``TRITON_INTERPRET=1`` is set here, before any test
  module (and so before anything that imports triton) is imported.
- ``@pytest.mark.gpu`` marks tests that need a CUDA device; they are skipped, with the reason, when there is none.
- ``import ampkernels`` finds the source tree also under plain ``pytest`` (which, unlike ``python -m pytest``, does
  not put the repository root on ``sys.path``) when the package is not installed.
- A test that takes a ``device`` argument runs once per entry of ``DEVICES`` (``"cpu"``, plus ``"cuda"`` when a
  CUDA device is present; the ``cuda`` case carries the ``gpu`` mark so that ``-m gpu`` / ``-m "not gpu"`` select it).
- ``matmul_tuning``: sets switches of ``ampkernels.matmul.tuning`` (forced tile configurations, ``TUNE``) for one
  test, in Python and in the extension, and puts the old values back after it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("ampkernels") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: Devices every device-parametrised test runs on.
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])

NO_CUDA_REASON = "needs a CUDA device (torch.cuda.is_available() is False)"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when torch.cuda.is_available() is False")


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize(
            "device", [pytest.param(d, marks=[pytest.mark.gpu] if d == "cuda" else []) for d in DEVICES]
        )


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
        pytest.skip(NO_CUDA_REASON)


@pytest.fixture
def devices() -> list[str]:
    """The devices available here: ``["cpu"]`` plus ``"cuda"`` when a CUDA device is present."""
    return list(DEVICES)


@pytest.fixture
def fresh_caches():
    """Forgets scaled_matmul's cached signatures, "auto" choices and launchers around the test, and empties the
    measurement logs, so that a test reads only its own entries."""
    from ampkernels import dispatch as ampkernels_dispatch
    from ampkernels.matmul import api as sm_api
    from ampkernels.matmul import launch as sm_dispatch

    def clear():
        sm_api.clear_caches()
        sm_dispatch.AUTO_LOG.clear()
        triton_sm = ampkernels_dispatch.triton_module("scaled_matmul")
        if triton_sm is not None:
            triton_sm.TUNING_LOG.clear()

    clear()
    yield
    clear()


@pytest.fixture
def matmul_tuning():
    """Sets switches of ``ampkernels.matmul.tuning`` for one test and hands them to the extension:
    ``matmul_tuning(WGMMA_BN=192)``. The values from before the test come back, in Python and in the extension,
    after it (monkeypatch.setattr alone would leave the extension's copy of a native switch behind)."""
    from ampkernels.matmul import tuning

    names = ("TUNE", "WMMA_TILE", "WGMMA_BN")
    saved = {name: getattr(tuning, name) for name in names}

    def set_switches(**switches):
        unknown = set(switches) - set(names)
        if unknown:
            raise AttributeError(f"ampkernels.matmul.tuning has no switch {sorted(unknown)}")
        for name, value in switches.items():
            setattr(tuning, name, value)
        tuning.apply()

    yield set_switches
    for name, value in saved.items():
        setattr(tuning, name, value)
    tuning.apply()
