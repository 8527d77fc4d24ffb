"""No absolute path of one machine anywhere in the repository, tests included.

A path such as a venv's ``bin`` under one checkout, a home directory or a scratch folder in
``/tmp`` holds only on the machine that wrote it: a test that looks there skips (or passes) for
the wrong reason on every other one, and a note that cites a script there cannot be rerun. Every
file git tracks is read (text files; binaries are skipped) for an absolute path under one of
:data:`MACHINE_ROOTS`. ``/usr`` is not one of them: ``/usr/bin/env`` and Debian's font directory
(``benchmarks/ocr_text.py``) are the system's, the same on every machine they exist on.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MACHINE_ROOTS = ("work", "root", "home", "tmp", "Users", "mnt", "opt", "srv", "var", "scratch", "data")
# an absolute path: the root right after a start of line, a quote, a space, "(" or "=" ...
ABSOLUTE = re.compile(r"(?:^|[\s\"'`(=\[,:])/(?:" + "|".join(MACHINE_ROOTS) + r")/")
# (file, text on the line): the one place a forbidden root is named on purpose, with why
ALLOWED = {
    ("tests/test_layout.py", 're.compile(r"'): "the lab-note test's own pattern for a path outside the repository",
}


def _tracked() -> list[str]:
    try:
        done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an sdist): nothing to list")
    return [name for name in done.stdout.decode().split("\0") if name]


def test_no_file_names_an_absolute_machine_path():
    found = []
    for name in _tracked():
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if ABSOLUTE.search(line) and not any(name == f and part in line for f, part in ALLOWED):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "absolute machine paths:\n" + "\n".join(found)


# (the examples are built so that this file names no such path itself)
@pytest.mark.parametrize("line, hit", [('VELA = Path("' + "/work" + '/main/.venv/bin/vela")', True),
                                        ("see `" + "/home" + "/me/run.py ocr 0`", True),
                                        ("scratch in " + "/tmp" + "/opfuse-x", True),
                                        ("#!/usr/bin/env bash", False),
                                        ("experiments/ocr_fragility/perturb.py", False),
                                        ("~/.cache/opfuse-decoders", False)])
def test_the_pattern_finds_an_absolute_path_and_only_that(line, hit):
    assert bool(ABSOLUTE.search(line)) is hit
