"""pytest fixtures. The helpers for building and running graphs are in ``graphs.py``.

``quantize``'s default (``reconstruct="auto"``) runs block reconstruction, which takes seconds
on the graphs built here and minutes on the built-in models: a test of another step asks for
``reconstruct=False`` (``--reconstruct off``) in its own call, and the tests of reconstruction
set ``reconstruction_budget_s`` and ``reconstruction_iterations`` where they need to.

``optimize``'s measured fusion choice (``tune``, :mod:`opfuse.tune`) times every fusion family on
ONNX Runtime: seconds per model, and on a shared machine a decision that is noise. The suite runs
with ``OPFUSE_TUNE=off`` in the environment (set here, so the CLI run in a subprocess sees it too):
every test follows the target's default policy, as ``--no-tune`` does, and the tests of tuning
(``test_tune.py``) ask for ``tune=True`` in their own calls.

A test that needs an extra's package carries ``extras.needs(module)`` (the ``needs_extra`` mark,
checked here) or calls ``extras.require(module)``: a skip, or a failure when the run declares
the extra installed (:mod:`extras`).
"""

from __future__ import annotations

import os

import onnx
import pytest

import extras

os.environ["OPFUSE_TUNE"] = "off"


@pytest.fixture
def tmp_model(tmp_path):
    """Save a ModelProto under tmp_path and return its path."""

    def save(m: onnx.ModelProto, name: str = "model.onnx"):
        path = tmp_path / name
        onnx.save(m, path)
        return path

    return save


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_extra(*modules): the test needs these modules of an extra (tests/extras.py)")


def pytest_runtest_setup(item):
    extras.check_marks(item)
