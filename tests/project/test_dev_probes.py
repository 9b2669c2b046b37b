"""The probes in dev/ use only public entry points and still import (the CUDA ones still compile), so that they
cannot rot unseen."""

from __future__ import annotations

import ast
import builtins
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

DEV = Path(__file__).resolve().parents[2] / "dev"
PROBES = sorted(DEV.rglob("*.py"))
SCRIPTS = sorted(DEV.rglob("*.sh"))
CUDA_PROBES = sorted(DEV.rglob("*.cu"))
# The extension module itself registers torch.ops.ampkernels.*; everything else private is off limits.
ALLOWED_PRIVATE = {"ampkernels._C"}


def _imported_modules(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_there_are_probes():
    assert PROBES and SCRIPTS


@pytest.mark.parametrize("path", PROBES, ids=lambda p: str(p.relative_to(DEV)))
def test_probe_uses_only_public_names(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    private = [
        name
        for name in _imported_modules(tree)
        if name.startswith("ampkernels")
        and name not in ALLOWED_PRIVATE
        and (any(part.startswith("_") for part in name.split(".")) or ".triton" in name)
    ]
    assert not private, f"{path.relative_to(DEV)} imports internals {private}"


@pytest.mark.parametrize("path", PROBES, ids=lambda p: str(p.relative_to(DEV)))
def test_probe_imports(path: Path, monkeypatch):
    """Every probe imports, keeps its work under ``if __name__ == "__main__"``, and the functions that block calls
    are the module's own callables (an entry point renamed without its call fails here, not on the GPU)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    guards = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert len(guards) == 1, f'{path.relative_to(DEV)}: no `if __name__ == "__main__":` block'
    called = {c.func.id for c in ast.walk(guards[0]) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    monkeypatch.chdir(DEV.parent)
    spec = importlib.util.spec_from_file_location(f"dev_probe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    own = {name for name in called if not hasattr(builtins, name)}
    missing = [name for name in own if not callable(getattr(module, name, None))]
    assert not missing, f"{path.relative_to(DEV)} calls {missing} under __main__, which it does not define"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(DEV)))
def test_shell_probe_parses(path: Path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", CUDA_PROBES, ids=lambda p: str(p.relative_to(DEV)))
def test_cuda_probe_compiles(path: Path, tmp_path: Path):
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = Path(CUDA_HOME or "/nonexistent") / "bin" / "nvcc"
    if not nvcc.is_file():
        pytest.skip("no CUDA toolkit (CUDA_HOME)")
    # Compile only (sm_90a: the GPU the probes are run on); a probe needs no torch headers.
    command = [str(nvcc), "-std=c++17", "-O3", "-arch=sm_90a", "-c", str(path), "-o", str(tmp_path / "probe.o")]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


def test_index_lists_every_probe():
    index = (DEV / "README.md").read_text()
    probes = PROBES + SCRIPTS + CUDA_PROBES
    missing = [str(p.relative_to(DEV)) for p in probes if str(p.relative_to(DEV)) not in index]
    assert not missing, f"dev/README.md does not list {missing}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
