"""One rule for "the same dim" (opfuse.core.dims.same_dim), which every rewrite that checks two
dims agree uses: the same integer, or the same name the model states; never an anonymous dim."""

from __future__ import annotations

import ast
import pathlib

import onnx_ir as ir
import pytest

import opfuse
from opfuse.core.dims import same_dim, symbol

S = ir.SymbolicDim


@pytest.mark.parametrize("a, b", [
    (4, 4),
    (S("batch"), S("batch")),
    (S("past_seq + 1"), S("past_seq + 1")),
])
def test_the_same_integer_or_the_same_name_is_the_same_dim(a, b):
    assert same_dim(a, b) and same_dim(b, a)


@pytest.mark.parametrize("a, b", [
    (4, 5),
    (S("batch"), S("seq")),
    (1, S("batch")),  # batch may be 1 at run time, but nothing says it is
    (S("4"), 4),  # a name that reads like a number is a name
    (S("unk__3"), S("unk__3")),  # onnx's placeholder for a dim it could not determine
    (S("unk__3"), S("unk__4")),
    (S("unk__3"), S("batch")),
    (S(None), S(None)),
    (S("?"), S("?")),  # Paddle2ONNX writes "?" on every free axis
    (S(""), S("")),
    (None, None),
    (S("batch"), None),
])
def test_an_anonymous_dim_or_a_different_one_is_not_the_same(a, b):
    assert not same_dim(a, b) and not same_dim(b, a)


def test_an_anonymous_dim_is_not_the_same_even_as_itself():
    dim = S("unk__0")
    assert not same_dim(dim, dim)
    assert symbol(dim) is None and symbol(S("batch")) == "batch" and symbol(7) is None


def test_the_anonymous_prefix_is_spelled_only_in_core_dims():
    """Every rule that asks whether a dim is named or two dims agree reads core.dims: a module
    that spells ``unk__`` in code again has a rule of its own (docstrings and comments may say it)."""
    package = pathlib.Path(opfuse.__file__).resolve().parent
    stray = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel == "core/dims.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        stray += [f"{rel}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Constant)
                  and isinstance(n.value, str) and "unk__" in n.value and id(n) not in docstrings]
    assert not stray, stray
