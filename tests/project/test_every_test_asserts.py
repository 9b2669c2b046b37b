"""Every test function in tests/ asserts something: an ``assert``, ``pytest.raises``/``warns``/``fail``, a
``torch.testing.assert_*`` or other ``assert*`` call, ``opcheck``, or a call to a helper of tests/ that does one of
these (followed through helpers that call helpers). A test without any passes whatever the code does."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ASSERTING_CALLS = {"raises", "warns", "fail", "deprecated_call", "opcheck"}


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def unasserting_tests(root: Path = TESTS) -> list[str]:
    """``file:line: name`` of each test function under ``root`` that asserts nothing (see the module docstring)."""
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in sorted(root.rglob("*.py"))}
    helpers: dict[str, list[ast.AST]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                helpers.setdefault(node.name, []).append(node)
    known: dict[int, bool] = {}

    def asserts(function: ast.AST, seen: frozenset = frozenset()) -> bool:
        if id(function) in known:
            return known[id(function)]
        if id(function) in seen:
            return False
        result = False
        for node in ast.walk(function):
            if isinstance(node, ast.Assert):
                result = True
            elif isinstance(node, ast.Call) and (name := _called_name(node)) is not None:
                result = (
                    name in ASSERTING_CALLS
                    or name.lstrip("_").startswith("assert")
                    or any(asserts(helper, seen | {id(function)}) for helper in helpers.get(name, ()))
                )
            if result:
                break
        known[id(function)] = result
        return result

    found = []
    for path, tree in trees.items():
        for node in tree.body:
            functions = [node]
            if isinstance(node, ast.ClassDef):
                functions = node.body
            for function in functions:
                if (
                    isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and function.name.startswith("test")
                    and not asserts(function)
                ):
                    found.append(f"{path.name}:{function.lineno}: {function.name}")
    return found


def test_every_test_function_asserts_something():
    assert unasserting_tests() == []


def test_the_scan_finds_a_test_without_an_assertion(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\nimport torch\n\n"
        "def _check(x):\n    assert x\n\n"
        "def _indirect(x):\n    _check(x)\n\n"
        "def test_plain():\n    assert 1\n\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n\n"
        "def test_close():\n    torch.testing.assert_close(torch.ones(1), torch.ones(1))\n\n"
        "def test_through_helpers():\n    _indirect(1)\n\n"
        "def test_nothing():\n    torch.ones(1) + 1\n\n"
        "class TestGroup:\n    def test_method_nothing(self):\n        pass\n"
    )
    found = [entry.split(": ")[1] for entry in unasserting_tests(tmp_path)]
    assert found == ["test_nothing", "test_method_nothing"]
