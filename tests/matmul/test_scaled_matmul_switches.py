"""The tuning and debug switches of scaled_matmul (ampkernels.matmul.tuning): module attributes, checked, handed to the
extension by clear_caches() / apply(); only TUNE starts from the environment, read once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ampkernels import dispatch
from ampkernels.matmul import clear_caches, tuning

_C = dispatch.native()
needs_native = pytest.mark.skipif(_C is None, reason="ampkernels._C is not built")
ROOT = Path(__file__).resolve().parents[2]


@needs_native
def test_clear_caches_hands_the_native_switches_to_the_extension(matmul_tuning):
    matmul_tuning()  # the fixture restores them afterwards
    tuning.WMMA_TILE, tuning.WGMMA_BN = "128x128x64w4db", 192
    clear_caches()
    assert _C._matmul_tuning() == ("128x128x64w4db", 192)
    assert _C.wgmma_schedule(8192, 8192, 132) == (192, 132)  # forced: the launcher's own choice is 256
    tuning.WMMA_TILE, tuning.WGMMA_BN = "auto", None
    tuning.apply()
    assert _C._matmul_tuning() == ("auto", 0)
    assert _C.wgmma_schedule(8192, 8192, 132) == (256, 132)


@needs_native
@pytest.mark.parametrize("tile", tuning.WMMA_TILES)
def test_every_wmma_tile_name_is_one_the_extension_knows(tile, matmul_tuning):
    matmul_tuning(WMMA_TILE=tile)
    assert _C._matmul_tuning() == (tile, 0)


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("WMMA_TILE", "128x128x32", r"tuning\.WMMA_TILE: expected one of auto, .*portable, got '128x128x32'"),
        ("WGMMA_BN", 160, r"tuning\.WGMMA_BN: expected None .* 128, 192, 256, got 160"),
        ("WGMMA_BN", "256", r"tuning\.WGMMA_BN: .* got '256'"),
    ],
)
def test_a_value_the_kernels_lack_is_refused_naming_the_attribute(name, value, message, matmul_tuning):
    before = _C._matmul_tuning() if _C is not None else None
    with pytest.raises(ValueError, match=message):
        matmul_tuning(**{name: value})
    if _C is not None:
        assert _C._matmul_tuning() == before  # nothing handed over


@needs_native
def test_the_extension_checks_too():
    with pytest.raises(ValueError, match="unknown WMMA tile configuration 'big'"):
        _C._set_matmul_tuning("big", 0)
    with pytest.raises(ValueError, match="no tile width 160"):
        _C._set_matmul_tuning("auto", 160)
    assert _C._matmul_tuning() == ("auto", 0)


def test_tune_must_be_a_bool(monkeypatch):
    monkeypatch.setattr(tuning, "TUNE", "0")
    with pytest.raises(TypeError, match=r"tuning\.TUNE: expected True or False, got '0'"):
        tuning.timing_enabled()
    monkeypatch.setattr(tuning, "TUNE", False)
    assert tuning.timing_enabled() is False


@pytest.mark.parametrize("value, expected", [(None, True), ("1", True), ("0", False)])
def test_tune_starts_from_the_environment_read_once(value, expected):
    """AMPKERNELS_TUNE is read when ampkernels is imported; changing the variable later changes nothing."""
    env = {k: v for k, v in os.environ.items() if k != "AMPKERNELS_TUNE"}
    if value is not None:
        env["AMPKERNELS_TUNE"] = value
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    code = (
        "import os, ampkernels\n"
        "from ampkernels.matmul import tuning\n"
        "first = tuning.TUNE\n"
        "os.environ['AMPKERNELS_TUNE'] = '1' if first is False else '0'\n"
        "print(first, tuning.timing_enabled())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [str(expected), str(expected)]


def test_no_debug_switch_is_read_from_the_environment():
    """The forced configurations are not environment variables any more: the launchers read nothing of the kind."""
    sources = [*(ROOT / "ampkernels").rglob("*.py"), *(ROOT / "csrc").rglob("*.c*"), *(ROOT / "csrc").rglob("*.h")]
    assert sources
    for gone in ("WMMA_TILE", "WGMMA_BN", "SCALED_MATMUL_TMA_DESC", "TRITON_DIRECT_LAUNCH"):
        readers = [str(p.relative_to(ROOT)) for p in sources if f"AMPKERNELS_{gone}" in p.read_text()]
        assert not readers, (gone, readers)
        assert f"AMPKERNELS_{gone}" not in dispatch.ENVIRONMENT
