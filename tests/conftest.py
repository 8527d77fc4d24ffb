"""pytest fixtures. The helpers for building and running graphs are in ``graphs.py``.

``quantize``'s default (``reconstruct="auto"``) runs block reconstruction, which takes seconds
on the graphs built here and minutes on the built-in models: a test of another step asks for
``reconstruct=False`` (``--reconstruct off``) in its own call, and the tests of reconstruction
set ``reconstruction_budget_s`` and ``reconstruction_iterations`` where they need to.

``optimize``'s measured fusion choice (``tune``, :mod:`opfuse.tune`) times every fusion family on
ONNX Runtime: seconds per model, and on a shared machine a decision that is noise. The suite runs
with ``OPFUSE_TUNE=off`` in the environment (set here, so the CLI run in a subprocess sees it too):
every test follows the target's default policy, as ``--no-tune`` does, and the tests of tuning
(``test_tune.py``) ask for ``tune=True`` in their own calls, with a deterministic clock. Tuning
records are cached in a folder of the suite's own (``OPFUSE_CACHE_DIR``), removed at exit.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import onnx
import pytest

os.environ["OPFUSE_TUNE"] = "off"
# tuning records are cached per graph and machine (opfuse.tune.record): the suite's own, never the user's
os.environ["OPFUSE_CACHE_DIR"] = _CACHE = tempfile.mkdtemp(prefix="opfuse-test-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _own_tuning_cache(tmp_path_factory, monkeypatch):
    """Each test its own tuning cache: a record one test's clock wrote is never another's replay."""
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path_factory.mktemp("tuning-cache")))


@pytest.fixture
def tmp_model(tmp_path):
    """Save a ModelProto under tmp_path and return its path."""

    def save(m: onnx.ModelProto, name: str = "model.onnx"):
        path = tmp_path / name
        onnx.save(m, path)
        return path

    return save
