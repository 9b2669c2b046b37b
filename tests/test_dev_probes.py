"""The probes in dev/ use only public entry points and still import, so that they cannot rot unseen."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

DEV = Path(__file__).resolve().parent.parent / "dev"
PROBES = sorted(DEV.rglob("*.py"))
SCRIPTS = sorted(DEV.rglob("*.sh"))
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
        and (any(part.startswith("_") for part in name.split(".")) or name.startswith("ampkernels.triton"))
    ]
    assert not private, f"{path.relative_to(DEV)} imports internals {private}"


@pytest.mark.parametrize("path", PROBES, ids=lambda p: str(p.relative_to(DEV)))
def test_probe_imports(path: Path, monkeypatch):
    monkeypatch.chdir(DEV.parent)
    spec = importlib.util.spec_from_file_location(f"dev_probe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # every probe keeps its work under `if __name__ == "__main__"`


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(DEV)))
def test_shell_probe_parses(path: Path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_index_lists_every_probe():
    index = (DEV / "README.md").read_text()
    missing = [str(p.relative_to(DEV)) for p in PROBES + SCRIPTS if str(p.relative_to(DEV)) not in index]
    assert not missing, f"dev/README.md does not list {missing}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
