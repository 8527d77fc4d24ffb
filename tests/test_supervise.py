"""A command line that opens a QNN session runs in a child interpreter: QNN's compiler dying of a
signal is one line on stderr and exit 1, with nothing written (opfuse.cli)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import extras
from decoder_nets import export_tiny_llama
from opfuse.cli import SUPERVISED_CHILD as CHILD
from opfuse.cli import _needs_supervision as needs_supervision
from opfuse.cli import build_parser


@pytest.mark.parametrize("line, supervised", [
    (["optimize", "m.onnx", "-o", "o.onnx", "--target", "qnn"], True),
    (["quantize", "m.onnx", "-o", "o.onnx", "--calibration", "c.npz", "--preset", "qnn-a16"], True),
    (["optimize", "m.onnx", "-o", "o.onnx", "--target", "onnxruntime"], False),
    (["quantize", "m.onnx", "-o", "o.onnx", "--calibration", "c.npz", "--preset", "ethos-u"], False),
    (["inspect", "m.onnx"], False),
])
def test_only_commands_that_open_a_qnn_session_run_supervised(line, supervised, monkeypatch):
    monkeypatch.delenv(CHILD, raising=False)
    args = build_parser().parse_args(line)
    assert needs_supervision(args) is supervised
    monkeypatch.setenv(CHILD, "1")  # the child runs the command itself
    assert needs_supervision(args) is False


def test_a_compiler_crash_is_one_line_exit_1_and_nothing_written(tmp_path):
    """A tiny Llama (dynamo, position_ids an input) crashed QNN's HTP compiler with SIGSEGV in
    onnxruntime-qnn 2.7.0 while its mask's GatherNDs were left for the CPU (docs/results/qnn.md);
    since index-arithmetic writes them as Gathers it compiles, and the command succeeds. Either way it
    never dies of a signal."""
    extras.require("onnxruntime_qnn")
    src = export_tiny_llama(tmp_path / "llama.onnx", positions=True)
    out, ctx = tmp_path / "o.onnx", tmp_path / "ctx.onnx"
    env = {k: v for k, v in os.environ.items() if k != CHILD}
    done = subprocess.run([sys.executable, "-m", "opfuse", "optimize", str(src), "-o", str(out), "--target", "qnn",
                           "--dim", "batch=1", "--dim", "seq=8", "--context", str(ctx), "-q"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode in (0, 1), (done.returncode, done.stderr[-2000:])
    if done.returncode == 1:
        err = done.stderr.strip()
        assert "\n" not in err and err.startswith("opfuse: error: the compiler crashed (SIG"), err
        assert err.endswith("nothing was written")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["llama.onnx"]
    else:
        assert out.exists() and ctx.exists()
