"""pytest fixtures. The helpers for building and running graphs are in ``graphs.py``.

``quantize``'s default (``reconstruct="auto"``) runs block reconstruction, which takes seconds
on the graphs built here and minutes on the built-in models: a test of another step asks for
``reconstruct=False`` (``--reconstruct off``) in its own call, and the tests of reconstruction
set ``reconstruction_budget_s`` and ``reconstruction_iterations`` where they need to.
"""

from __future__ import annotations

import onnx
import pytest


@pytest.fixture
def tmp_model(tmp_path):
    """Save a ModelProto under tmp_path and return its path."""

    def save(m: onnx.ModelProto, name: str = "model.onnx"):
        path = tmp_path / name
        onnx.save(m, path)
        return path

    return save
