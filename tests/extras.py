"""What a test needs from an extra (``opfuse[ethos-u]``, ``opfuse[qnn]``, ...), found in the
environment the tests run in, and whether its absence is a skip or a failure.

A test that needs a package of an extra asks :func:`require` (module level or inside a test) or
carries :func:`needs` (a mark). When the package is missing:

- it is a **failure** when the run declares the extra installed: ``OPFUSE_REQUIRE_EXTRAS`` lists
  the extras (``make test`` sets it to the extras it installs; ``1`` or ``CI=true`` means every
  extra of pyproject.toml) and that extra installs the package on this platform (its
  environment marker in pyproject.toml: ``onnxruntime-qnn`` has wheels for Linux x86_64 only,
  so elsewhere the ``qnn`` extra installs nothing and its tests skip);
- otherwise a **skip** naming the ``pip install`` that would run it.

So a fresh clone's ``make test`` cannot stay green with the tests of an extra it installed
skipped. :func:`vela_command` is Arm's Vela compiler as the tests run it: the ``vela`` script
beside ``sys.executable`` (the venv the tests run in, whether or not its ``bin`` is on PATH),
else ``vela`` on PATH, else Vela's module (``python -m ethosu.vela``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import pathlib
import shutil
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, a dependency there
    import tomli as tomllib

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent.parent

# the module a test imports -> the distribution that provides it
DISTRIBUTIONS = {"ethosu": "ethos-u-vela", "ai_edge_litert": "ai-edge-litert", "onnxruntime_qnn": "onnxruntime-qnn",
                 "torch": "torch", "transformers": "transformers", "matplotlib": "matplotlib",
                 "onnxslim": "onnxslim", "onnxruntime_genai": "onnxruntime-genai", "gguf": "gguf",
                 "accelerate": "accelerate"}


@functools.cache
def _extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}


def required_extras() -> set[str]:
    """The extras this run declares installed (``OPFUSE_REQUIRE_EXTRAS``, or all under ``CI=true``)."""
    value = os.environ.get("OPFUSE_REQUIRE_EXTRAS", "").strip()
    if value in ("1", "all") or (not value and os.environ.get("CI", "").lower() == "true"):
        return set(_extras())
    return {name.strip() for name in value.split(",") if name.strip() and name.strip() != "0"}


def declared(module: str) -> str | None:
    """The first required extra that installs ``module``'s distribution on this platform, or None."""
    dist = DISTRIBUTIONS.get(module.split(".")[0])
    for extra in sorted(required_extras()):
        for req in _extras().get(extra, []):
            if req.name == dist and (req.marker is None or req.marker.evaluate({"extra": extra})):
                return extra
    return None


def _extra_of(module: str) -> str:
    dist = DISTRIBUTIONS.get(module.split(".")[0])
    return next((name for name, reqs in _extras().items() if any(r.name == dist for r in reqs)), "test")


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _missing(module: str) -> None:
    extra = declared(module)
    if extra is not None:
        pytest.fail(f"{module} is not installed, though this run declares the {extra!r} extra installed "
                    f"(OPFUSE_REQUIRE_EXTRAS / CI): pip install -e '.[{extra}]'", pytrace=False)
    pytest.skip(f"{module} is not installed (pip install 'opfuse[{_extra_of(module)}]')", allow_module_level=True)


def require(module: str):
    """``module`` imported, or a failure (its extra declared installed) or a skip (not)."""
    if not installed(module):
        _missing(module)
    return importlib.import_module(module)


def needs(*modules: str) -> pytest.MarkDecorator:
    """A mark: the test runs only with ``modules`` installed (see :func:`require` for a missing one);
    checked by ``conftest.pytest_runtest_setup``."""
    return pytest.mark.needs_extra(*modules)


def check_marks(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs_extra"):
        for module in mark.args:
            if not installed(module):
                _missing(module)


def vela_command() -> list[str] | None:
    """Arm's Vela command line as this environment has it (see the module docstring), or None."""
    beside = pathlib.Path(sys.executable).parent / ("vela.exe" if sys.platform == "win32" else "vela")
    if beside.is_file():
        return [str(beside)]
    if (on_path := shutil.which("vela")) is not None:
        return [on_path]
    if installed("ethosu.vela"):
        return [sys.executable, "-m", "ethosu.vela"]
    return None


def vela() -> list[str]:
    """:func:`vela_command`, or a failure or skip (as :func:`require`) when Vela is not installed."""
    command = vela_command()
    if command is None:
        _missing("ethosu.vela")
    return command
