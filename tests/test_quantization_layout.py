"""The shape of ``opfuse/quantization``: no function longer than 80 lines (``def`` to its last
line, by ``ast``). No import cycle anywhere in opfuse: ``tests/test_layout.py``."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "opfuse"
MAX_FUNCTION_LINES = 80


def test_no_function_of_the_quantiser_is_over_80_lines():
    long = [f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted((PACKAGE / "quantization").rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long
