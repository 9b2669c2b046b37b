"""No function of the package runs over 80 lines without the reason written above it: a comment starting
"(Over 80 lines:" just before its first decorator or its ``def``."""

import ast
from pathlib import Path

import ampkernels

PACKAGE = Path(ampkernels.__file__).parent
LIMIT = 80
REASON = "(Over 80 lines:"


def _long_functions_without_a_reason(root: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            length = node.end_lineno - node.lineno + 1
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            above = "\n".join(lines[max(first - 4, 0) : first - 1])
            if length > LIMIT and REASON not in above:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.name} ({length} lines)")
    return found


def test_every_long_function_says_why():
    assert not _long_functions_without_a_reason(), "\n".join(_long_functions_without_a_reason())


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT + 1))
    (tmp_path / "long.py").write_text(f"def long_one():\n{body}\n\n\n# {REASON} a reason.)\ndef excused():\n{body}\n")
    assert _long_functions_without_a_reason(tmp_path) == ["long.py:1: long_one (82 lines)"]
