"""opfuse's own ``--target onnxruntime`` output as its input (idempotence).

ONNX Runtime registers SimplifiedLayerNormalization in the ONNX domain, where onnx's schemas do not
have it; onnx.checker refused opfuse's own output ("No Op registered for SimplifiedLayerNormalization
with domain_version of 18"). Loading checks a stand-in with those ops in another domain
(:func:`opfuse.load._check_runtime_ops`): the rest of the model is still checked, and a second run
writes the same bytes, untimed and with the measured choice (a deterministic clock)."""

from __future__ import annotations

import onnx
import pytest
from onnx import helper

from decoder_nets import decode_step
from graphs import model, ops, vinfo
from opfuse.cli import main
from opfuse.errors import BadInputError
from opfuse.load import load_model
from opfuse.pipeline import optimize
from opfuse.tune import timing
from test_rms_norm_forms import rms_model
from test_tune_records import _clock


def _written(tmp_path, m, name="first.onnx", **kw):
    out = tmp_path / name
    _, report = optimize(m, target="onnxruntime", output=out, **kw)
    assert report.verification.ok
    return out


def test_an_rms_norm_written_for_onnx_runtime_loads_again(tmp_path):
    first = _written(tmp_path, rms_model(opset=18))
    proto = onnx.load(first)
    assert [(n.domain, n.op_type) for n in proto.graph.node] == [("", "SimplifiedLayerNormalization")]
    with pytest.raises(onnx.checker.ValidationError, match="No Op registered for SimplifiedLayerNormalization"):
        onnx.checker.check_model(proto)  # (what opfuse refused before)
    loaded, _ = load_model(first)
    assert [n.op_type for n in loaded.graph] == ["SimplifiedLayerNormalization"]


@pytest.mark.parametrize("tuned", [False, True])
def test_the_second_run_writes_the_same_bytes(tmp_path, monkeypatch, tuned):
    if tuned:
        monkeypatch.setattr(timing, "measure", _clock())
    first = _written(tmp_path, rms_model(opset=18), tune=tuned)
    second = _written(tmp_path, first, "second.onnx", tune=tuned, retune=tuned)
    assert ops(onnx.load(first)) == ["SimplifiedLayerNormalization"]
    assert second.read_bytes() == first.read_bytes()


@pytest.mark.parametrize("tuned", [True, False])
def test_a_decode_step_through_the_default_command_again(tmp_path, monkeypatch, tuned):
    """The CLI with no flag but the target (timed on the test's clock: MultiHeadAttention), then on
    what it wrote: the same bytes. Untimed (Attention-23), the first run leaves the Expand of the mask
    over the query's one row ([1, 1, 1, 1]: the 3-D form's rules read it), which the second takes out
    (Expand(ones)); a third writes the second's bytes."""
    monkeypatch.setenv("OPFUSE_TUNE", "on" if tuned else "off")
    monkeypatch.setattr(timing, "measure", _clock())
    runs = [tmp_path / f"{i}.onnx" for i in range(4)]
    onnx.save(decode_step(), runs[0])
    for source, out in zip(runs, runs[1:]):
        assert main(["optimize", str(source), "-o", str(out), "--target", "onnxruntime", "--retune", "-q"]) == 0
    assert runs[3].read_bytes() == runs[2].read_bytes()
    if tuned:
        assert "MultiHeadAttention" in ops(onnx.load(runs[1]))
        assert runs[2].read_bytes() == runs[1].read_bytes()
    else:
        assert ops(onnx.load(runs[2])) == [op for op in ops(onnx.load(runs[1])) if op != "Expand"]


def test_with_external_data(tmp_path):
    """The stand-in is checked in memory: the initializers kept beside the model are not read again."""
    first = _written(tmp_path, rms_model(opset=18))
    proto = onnx.load(first)
    external = tmp_path / "external.onnx"
    onnx.save(proto, external, save_as_external_data=True, location="external.onnx.data", size_threshold=0)
    loaded, _ = load_model(external)
    assert [n.op_type for n in loaded.graph] == ["SimplifiedLayerNormalization"]
    _written(tmp_path, external, "again.onnx")


def test_the_rest_of_the_model_is_still_checked(tmp_path):
    """A runtime op does not wave the other nodes through: an op onnx does not know after it is refused."""
    proto = onnx.load(_written(tmp_path, rms_model(opset=18)))
    proto.graph.node.append(helper.make_node("NoSuchOp", ["y"], ["z"]))
    del proto.graph.output[:]
    proto.graph.output.append(vinfo("z", ["N", 5, 8]))
    with pytest.raises(BadInputError, match="No Op registered for NoSuchOp"):
        load_model(proto)
    broken = model([helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y"], axis=-1, epsilon=1e-5),
                    helper.make_node("Relu", ["y", "y"], ["z"])],  # Relu takes one input
                   [vinfo("x", [2, 8]), vinfo("g", [8])], [vinfo("z", [2, 8])], [], opset=18)
    with pytest.raises(BadInputError, match="invalid ONNX model"):
        load_model(broken)


def test_shape_inference_keeps_the_order_of_the_initializers():
    """Those above 1 KB reach onnx's inference without their data and come back where they were
    (they came back last: a second run wrote them in another order)."""
    import numpy as np
    import onnx_ir as ir

    from graphs import tensor
    from opfuse.core.analysis import infer_shapes

    big, small = np.ones((64, 8), np.float32), np.ones((8,), np.float32)
    m = ir.from_proto(model([helper.make_node("MatMul", ["x", "big"], ["h"]), helper.make_node("Add", ["h", "small"], ["y"])],
                            [vinfo("x", [2, 64])], [vinfo("y", [2, 8])], [tensor("big", big), tensor("small", small)]))
    infer_shapes(m)
    assert list(m.graph.initializers) == ["big", "small"]
    assert m.graph.initializers["big"].const_value is not None
