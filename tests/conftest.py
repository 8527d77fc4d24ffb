"""pytest fixtures. The helpers for building and running graphs are in ``graphs.py``."""

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


@pytest.fixture(autouse=True)
def _no_reconstruction_by_default(monkeypatch):
    """``quantize``'s default (``reconstruct="auto"``) runs block reconstruction, which takes
    seconds even on the graphs built here and minutes on the built-in models: tests of other
    steps run without it (a budget of 0 s), and tests of it ask for it or set the budget."""
    from opfuse.quantization import pipeline

    monkeypatch.setattr(pipeline, "RECONSTRUCTION_BUDGET_S", 0)
