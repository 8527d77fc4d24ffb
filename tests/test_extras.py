"""The tests' own check of an extra (tests/extras.py): a package missing from an extra the run
declares installed fails the test; one the run does not declare skips it."""

from __future__ import annotations

import pathlib
import sys

import pytest

import extras


@pytest.fixture
def no_onnxslim(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxslim", None)  # find_spec then says "not installed"
    monkeypatch.delenv("CI", raising=False)
    return monkeypatch


def test_a_missing_package_of_a_declared_extra_fails(no_onnxslim):
    no_onnxslim.setenv("OPFUSE_REQUIRE_EXTRAS", "test,bench")
    with pytest.raises(pytest.fail.Exception, match=r"declares the 'bench' extra installed"):
        extras.require("onnxslim")


@pytest.mark.parametrize("value", ["", "0", "qnn,ethos-u"])
def test_a_missing_package_of_an_undeclared_extra_skips(no_onnxslim, value):
    no_onnxslim.setenv("OPFUSE_REQUIRE_EXTRAS", value)
    with pytest.raises(pytest.skip.Exception, match=r"pip install 'opfuse\[bench\]'"):
        extras.require("onnxslim")


def test_ci_declares_every_extra(no_onnxslim):
    no_onnxslim.delenv("OPFUSE_REQUIRE_EXTRAS", raising=False)
    no_onnxslim.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception):
        extras.require("onnxslim")


def test_an_extra_is_declared_only_where_its_marker_installs_it(monkeypatch):
    """onnxruntime-qnn's requirement carries a platform marker: the qnn extra declares it only
    where that marker holds (CPython 3.11+, Linux x86_64)."""
    import platform

    monkeypatch.setenv("OPFUSE_REQUIRE_EXTRAS", "qnn")
    wheel = sys.version_info >= (3, 11) and sys.platform == "linux" and platform.machine() == "x86_64"
    assert (extras.declared("onnxruntime_qnn") == "qnn") is wheel
    assert extras.declared("torch") is None  # the qnn extra does not install torch


def test_vela_is_found_without_the_venv_on_path(monkeypatch):
    """``make test`` runs ``.venv/bin/python -m pytest`` without ``.venv/bin`` on PATH: Vela is
    still found, as the script beside the interpreter or as its module."""
    extras.require("ethosu.vela")
    monkeypatch.setenv("PATH", "")
    command = extras.vela_command()
    assert command is not None
    assert command[0] == str(pathlib.Path(sys.executable).parent / "vela") or command[1:] == ["-m", "ethosu.vela"]
