"""A missing extra is one line naming the ``pip install 'opfuse[...]'`` to run, exit 2, nothing
written, for every command that needs it (:func:`opfuse.errors.require_extra`).

Each case hides the extra's module (``sys.modules[name] = None``: an import of it fails and
``importlib.util.find_spec`` reports it missing, as on a machine without it) and runs the
command line in this process.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import pytest
from onnx import helper

from graphs import model, rng, tensor, vinfo
from opfuse.cli import main
from opfuse.errors import EXTRAS, MissingExtraError, extra_error

# (modules hidden, the command's arguments after the model, the extra named)
CASES = {
    "quantize --preset ethos-u without LiteRT": (["ai_edge_litert"], ["quantize", "-o", "o.onnx", "--calibration",
                                                                     "random:8", "--preset", "ethos-u"], "ethos-u"),
    "quantize --preset ethos-u without Vela": (["ethosu"], ["quantize", "-o", "o.onnx", "--calibration", "random:8",
                                                            "--preset", "ethos-u"], "ethos-u"),
    "optimize --target ethos-u without LiteRT": (["ai_edge_litert"], ["optimize", "-o", "o.onnx", "--target",
                                                                       "ethos-u"], "ethos-u"),
    "optimize --target ethos-u without flatbuffers": (["flatbuffers"], ["optimize", "-o", "o.onnx", "--target",
                                                                         "ethos-u"], "ethos-u"),
    "bench --hardware ethos-u55-128 without Vela": (["ethosu"], ["bench", "--hardware", "ethos-u55-128",
                                                                 "--json", "b.json"], "ethos-u"),
    "optimize --target qnn": (["onnxruntime_qnn"], ["optimize", "-o", "o.onnx", "--target", "qnn"], "qnn"),
    "quantize --preset qnn": (["onnxruntime_qnn"], ["quantize", "-o", "o.onnx", "--calibration", "random:8",
                                                    "--preset", "qnn"], "qnn"),
    "quantize --reconstruct on": (["torch"], ["quantize", "-o", "o.onnx", "--calibration", "random:8",
                                              "--reconstruct", "on"], "torch"),
    "bench --plot": (["matplotlib"], ["bench", "--plot", "p.png"], "plot"),
}


def conv_relu() -> onnx.ModelProto:
    r = rng(0)
    return model([helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], name="conv"),
                  helper.make_node("Relu", ["c"], ["y"], name="relu")],
                 [vinfo("x", [1, 3, 8, 8])], [vinfo("y", [1, 4, 8, 8])],
                 [tensor("W", r.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32))])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_missing_extra_is_one_line_exit_2_and_nothing_written(case, tmp_path, monkeypatch, capsys):
    hidden, args, extra = CASES[case]
    source = tmp_path / "m.onnx"
    onnx.save(conv_relu(), source)
    monkeypatch.chdir(tmp_path)
    for name in hidden:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, loaded)
        monkeypatch.setitem(sys.modules, name, None)
    code = main([args[0], str(source), *args[1:]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and f"pip install 'opfuse[{extra}]'" in err[0], err
    assert "internal error" not in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # nothing written


def test_an_import_of_an_extra_deeper_down_is_the_same_line():
    """The command line's net for an import no check came before: the extra's line, not an internal error."""
    error = extra_error(ModuleNotFoundError("No module named 'ai_edge_litert'", name="ai_edge_litert"))
    assert isinstance(error, MissingExtraError) and error.exit_code == 2
    assert "pip install 'opfuse[ethos-u]'" in str(error)
    assert extra_error(ModuleNotFoundError("No module named 'nope'", name="nope")) is None


def test_every_extra_of_the_table_is_declared_in_pyproject():
    import pathlib
    import tomllib

    declared = tomllib.loads((pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert set(EXTRAS) <= set(declared["project"]["optional-dependencies"])


def test_adaround_without_torch_is_refused_with_its_line_and_the_weights_rounded_to_nearest(tmp_path, monkeypatch,
                                                                                           capsys):
    """AdaRound's optimiser is torch's (:mod:`opfuse.quantization.algorithms.rounding`): without torch the
    per-tensor preset still quantises (exit 0), its output says why AdaRound did not run and what to install,
    and the weights are ONNX Runtime's rounding to nearest."""
    source = tmp_path / "m.onnx"
    onnx.save(conv_relu(), source)
    monkeypatch.chdir(tmp_path)
    for loaded in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.setitem(sys.modules, "torch", None)
    args = ["quantize", str(source), "-o", "o.onnx", "--calibration", "random:8", "--preset", "per-tensor",
            "--report", "r.json"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())  # (the console wraps long lines)
    line = ("AdaRound did not run: torch is not installed (pip install 'opfuse[torch]'); "
            "the weights stay rounded to nearest")
    assert line in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert line in report["notes"]
    assert {"step": "adaround", "ran": False, "reason": line} in report["steps"]
    assert report["adaround"]["layers"] == 0
