"""Comparing Python code by its syntax tree: what ``fuse_modules`` proves a module's ``forward`` with."""

from __future__ import annotations

import ast
import inspect
import textwrap


def code_without_docstring(fn) -> str | None:
    """The syntax tree of ``fn``'s definition (its decorators, arguments and body, without its docstring) as a string,
    or None where its source cannot be read. Two functions with equal results compute the same thing whatever their
    names, comments, formatting and docstrings."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    definition = tree.body[0]
    if not isinstance(definition, ast.FunctionDef):
        return None
    body = definition.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    return ast.dump(ast.Module(body=[*definition.decorator_list, definition.args, *body], type_ignores=[]))
