"""Temporary files are removed on every path, errors included: the Ethos-U path (lowering,
Vela, LiteRT), the QNN path and a large inline model's (its weights mapped, its output written a
tensor at a time: opfuse.core.inline), run with the temporary directory pointed at a fresh one, leave
it as it was, and leave nothing beside the outputs either (a context's staging directory sits
beside it: ``.opfuse-vela-*``, ``.opfuse-ctx-*``; the model's own: ``.opfuse-*``)."""

from __future__ import annotations

import gc
import tempfile

import numpy as np
import onnx
import pytest
from onnx import helper

import extras
from graphs import model, rng, tensor, vinfo
from opfuse.cli import main
from opfuse.errors import BadInputError


@pytest.fixture
def fresh_tmp(tmp_path, monkeypatch):
    """TMPDIR (and tempfile's cached choice) pointed at an empty directory; returns it."""
    fresh = tmp_path / "tmpdir"
    fresh.mkdir()
    monkeypatch.setenv("TMPDIR", str(fresh))
    monkeypatch.setattr(tempfile, "tempdir", str(fresh))
    return fresh


def two_convs() -> onnx.ModelProto:
    r = rng(3)
    nodes = [helper.make_node("Conv", ["x", "W1"], ["a"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["a"], ["b"], name="relu"),
             helper.make_node("Conv", ["b", "W2"], ["y"], pads=[1, 1, 1, 1], name="conv2")]
    return model(nodes, [vinfo("x", [1, 3, 8, 8])], [vinfo("y", [1, 4, 8, 8])],
                 [tensor("W1", r.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)),
                  tensor("W2", r.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32))])


def _run(tmp_path, args: list[str]) -> int:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    source = work / "m.onnx"
    onnx.save(two_convs(), source)
    code = main([args[0], str(source), *[str(work / a) if a.endswith((".onnx", ".tflite", ".json")) else a
                                         for a in args[1:]], "-q"])
    gc.collect()  # a compile log dropped by an error removes its staging directory when collected
    return code


def _left(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "work").iterdir())


ETHOS = {
    "optimize": ["optimize", "-o", "o.onnx", "--target", "ethos-u"],
    "optimize with a context": ["optimize", "-o", "o.onnx", "--target", "ethos-u", "--context", "o_vela.tflite"],
    "quantize with a context": ["quantize", "-o", "o.onnx", "--calibration", "random:8", "--preset", "ethos-u",
                                "--reconstruct", "off", "--context", "o_vela.tflite"],
}


@pytest.mark.parametrize("case", sorted(ETHOS))
def test_the_ethos_u_path_leaves_no_temporary_file(case, tmp_path, fresh_tmp):
    extras.require("ethosu.vela")
    extras.require("ai_edge_litert")
    assert _run(tmp_path, ETHOS[case]) == 0
    assert not list(fresh_tmp.iterdir())
    assert not [name for name in _left(tmp_path) if name.startswith(".opfuse")]


def test_an_error_after_vela_leaves_no_temporary_file(tmp_path, fresh_tmp, monkeypatch):
    """Vela compiled, then writing the model fails: Vela's staging directory beside the context
    and the temporary directory are both left as they were."""
    extras.require("ethosu.vela")
    extras.require("ai_edge_litert")
    from opfuse import save

    def refuse(self):
        raise BadInputError("cannot write (refused by the test)")

    monkeypatch.setattr(save.StagedModel, "commit", refuse)
    assert _run(tmp_path, ETHOS["optimize with a context"]) == 2
    assert not list(fresh_tmp.iterdir())
    assert _left(tmp_path) == ["m.onnx"]


def test_vela_failing_leaves_no_temporary_file(tmp_path, fresh_tmp):
    """Vela refusing its input (not a TFLite) raises, and its temporary directory is gone."""
    extras.require("ethosu.vela")
    from opfuse.targets.ethos_u.vela import VelaError, compile_with_vela

    with pytest.raises(VelaError):
        compile_with_vela(b"not a tflite")
    assert not list(fresh_tmp.iterdir())


def test_vela_without_an_output_directory_removes_its_files(tmp_path, fresh_tmp):
    extras.require("ethosu.vela")
    extras.require("ai_edge_litert")
    from opfuse.targets.ethos_u.lower import lower_to_tflite
    from opfuse.targets.ethos_u.vela import compile_with_vela
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from test_ethos_u_lower import _Reader

    onnx.save(two_convs(), tmp_path / "f.onnx")
    quantize_static(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), _Reader(onnx.load(tmp_path / "f.onnx")),
                    quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    before = sorted(p.name for p in fresh_tmp.iterdir())  # (ONNX Runtime's quantiser cleans its own)
    result = compile_with_vela(lower_to_tflite(onnx.load(tmp_path / "q.onnx")))
    assert result.cycles > 0 and result.compiled is None
    assert sorted(p.name for p in fresh_tmp.iterdir()) == before


@pytest.mark.parametrize("context", [False, True])
def test_the_qnn_path_leaves_no_temporary_file(context, tmp_path, fresh_tmp):
    extras.require("onnxruntime_qnn")
    args = ["optimize", "-o", "o.onnx", "--target", "qnn"] + (["--context", "ctx.onnx"] if context else [])
    assert _run(tmp_path, args) == 0
    assert not list(fresh_tmp.iterdir())
    assert not [name for name in _left(tmp_path) if name.startswith(".opfuse")]


@pytest.mark.parametrize("case", ["written", "verification fails", "writing fails"])
def test_a_large_inline_model_leaves_no_temporary_file(case, tmp_path, fresh_tmp, monkeypatch):
    import opfuse.core.inline
    import opfuse.pipeline
    from opfuse import save
    from opfuse.errors import VerificationError

    monkeypatch.setattr(opfuse.core.inline, "MAPPED_FILE_BYTES", 0)  # (the small graph taken as a large one)
    monkeypatch.setattr(opfuse.core.inline, "MAPPED_MIN_TENSOR", 16)
    monkeypatch.setattr(opfuse.core.inline, "STREAMED_BYTES", 0)
    if case == "verification fails":
        def wrong(*args, **kw):
            raise VerificationError("made to fail by the test")

        monkeypatch.setattr(opfuse.pipeline, "verify_models", wrong)
    elif case == "writing fails":
        def refuse(model, path):
            with open(path, "wb") as f:
                f.write(b"half")
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(save, "write_inline", refuse)
    assert _run(tmp_path, ["optimize", "-o", "o.onnx", "--no-tune"]) == {"written": 0, "verification fails": 1,
                                                                          "writing fails": 2}[case]
    assert not list(fresh_tmp.iterdir())
    assert _left(tmp_path) == (["m.onnx", "o.onnx"] if case == "written" else ["m.onnx"])
