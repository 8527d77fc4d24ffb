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
