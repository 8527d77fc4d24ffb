"""16-bit weights for QNN's HTP: the ``int16-weights`` keep action of the presets whose activations are
16-bit already (``qnn-a16``, ``qnn-a16-per-channel``, ``qnn-w4a16``), where keeping a layer "with 16-bit
activations" would keep nothing and keeping it in float would leave the NPU.

- what the HTP takes (onnxruntime-qnn 2.7.0): int16 symmetric MatMul, Gemm and Conv weights, per channel and
  per tensor, beside uint16 activations: each compiled with no CPU fallback allowed and closer to float
  than the same layer with int8 weights;
- the quantiser writes exactly the kept layers' weights in int16 (one scale per output channel with a
  per-channel preset), the others as the preset says;
- the mixed-precision search with this action: its candidates are the layers with weights, and
  ``search_candidates`` bounds the exact ranking to the costliest by the per-layer table.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphs import model, rng, tensor, vinfo
from qnn_graphs import needs_htp

n = helper.make_node


def _layers(op: str) -> onnx.ModelProto:
    """x -> two layers of ``op`` (MatMul [K, N] weights, Gemm with transB, Conv 3x3) -> y, at opset 21."""
    r = rng(3)
    if op == "Conv":
        nodes = [n("Conv", ["x", "W1", "B1"], ["h"], name="first", pads=[1, 1, 1, 1]),
                 n("Conv", ["h", "W2", "B2"], ["y"], name="second", pads=[1, 1, 1, 1])]
        inits = [tensor("W1", r.normal(0, 0.3, (6, 3, 3, 3)).astype(np.float32)),
                 tensor("B1", r.normal(0, 0.1, 6).astype(np.float32)),
                 tensor("W2", r.normal(0, 0.3, (4, 6, 3, 3)).astype(np.float32)),
                 tensor("B2", r.normal(0, 0.1, 4).astype(np.float32))]
        x = vinfo("x", [1, 3, 6, 6])
    elif op == "MatMul":
        nodes = [n("MatMul", ["x", "W1"], ["h"], name="first"), n("MatMul", ["h", "W2"], ["y"], name="second")]
        inits = [tensor("W1", r.normal(0, 0.3, (32, 24)).astype(np.float32)),
                 tensor("W2", r.normal(0, 0.3, (24, 16)).astype(np.float32))]
        x = vinfo("x", [1, 8, 32])
    else:
        nodes = [n("Gemm", ["x", "W1", "B1"], ["h"], name="first", transB=1),
                 n("Gemm", ["h", "W2", "B2"], ["y"], name="second", transB=1)]
        inits = [tensor("W1", r.normal(0, 0.3, (24, 32)).astype(np.float32)),
                 tensor("B1", r.normal(0, 0.1, 24).astype(np.float32)),
                 tensor("W2", r.normal(0, 0.3, (16, 24)).astype(np.float32)),
                 tensor("B2", r.normal(0, 0.1, 16).astype(np.float32))]
        x = vinfo("x", [8, 32])
    return model(nodes, [x], [vinfo("y", None)], inits, opset=21)


def _samples(m, count=6):
    shape = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    r = rng(5)
    return [{"x": r.normal(0, 1, shape).astype(np.float32)} for _ in range(count)]


def _quantizer(m, preset, tmp_path):
    from opfuse.quantization.presets import PRESETS
    from opfuse.quantization.qdq.quantizer import Quantizer, prepare

    float_model, _ = prepare(m, PRESETS[preset])
    return Quantizer(float_model, PRESETS[preset], _samples(m), tmp_path, method="minmax")


def _weight_types(qdq) -> dict[str, tuple[int, list[int]]]:
    """{float weight: (its stored type, its scale's dims)} of each weight DequantizeLinear."""
    inits = {i.name: i for i in qdq.graph.initializer}
    return {d.output[0].removesuffix("_DequantizeLinear_Output"): (inits[d.input[0]].data_type,
                                                                   list(inits[d.input[1]].dims))
            for d in qdq.graph.node if d.op_type == "DequantizeLinear" and d.input[0] in inits
            and d.output[0].removesuffix("_DequantizeLinear_Output") in ("W1", "W2")}


@pytest.mark.parametrize("preset", ["qnn-a16-per-channel", "qnn-a16", "qnn-w4a16"])
def test_the_kept_layers_weights_are_written_in_int16(preset, tmp_path):
    pytest.importorskip("onnxruntime")
    from opfuse.quantization.presets import PRESETS

    assert PRESETS[preset].keep_as == "int16-weights"
    quantizer = _quantizer(_layers("MatMul"), preset, tmp_path)
    qdq = quantizer.quantize(["second"])
    types = _weight_types(qdq)
    assert types["W2"][0] == TensorProto.INT16, types
    assert types["W1"][0] in (TensorProto.INT8, TensorProto.UINT8, TensorProto.INT4), types
    per_channel = PRESETS[preset].per_channel
    assert types["W2"][1] == ([16] if per_channel else []), types  # one scale per output channel, as the preset's


@needs_htp
@pytest.mark.parametrize("op", ["MatMul", "Gemm", "Conv"])
@pytest.mark.parametrize("preset", ["qnn-a16-per-channel", "qnn-a16"])
def test_int16_weights_compile_whole_on_the_htp_and_come_closer_to_float(op, preset, tmp_path):
    """What the HTP of onnxruntime-qnn 2.7.0 takes: int16 MatMul, Gemm and Conv weights (per channel and per
    tensor) beside uint16 activations, every node on the HTP (a fallback fails the strict session)."""
    import onnxruntime as ort

    from opfuse.targets.qnn.backend import open_session

    m = _layers(op)
    quantizer = _quantizer(m, preset, tmp_path)
    reference = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    sample = _samples(m, 1)[0]
    want = reference.run(["y"], sample)[0].astype(np.float64)
    db = {}
    for keep in ([], ["first", "second"]):
        qdq = quantizer.quantize(keep)
        if keep:
            assert {t for t, _ in _weight_types(qdq).values()} == {TensorProto.INT16}
        got = open_session(qdq, strict=True).run(sample, ["y"])[0]
        db[bool(keep)] = 10 * np.log10(np.sum(want ** 2) / np.sum((want - got) ** 2))
    assert db[True] > db[False] + 6, db  # 8 more bits of weight: well above the int8 weights' SQNR


def test_the_search_ranks_the_layers_with_weights_alone_and_at_most_the_costliest_n():
    """``candidates(weights_only=True)`` leaves out the unweighted ops; :func:`costliest` orders by the per-layer
    table's own noise."""
    pytest.importorskip("onnxruntime")
    from opfuse.quantization.algorithms.search import KEEP_ACTIONS, Candidate, candidates, costliest
    from opfuse.quantization.presets import PRESETS
    from opfuse.quantization.qdq.quantizer import Quantizer, prepare

    r = rng(4)
    m = model([n("MatMul", ["x", "W1"], ["h"], name="first"), n("Relu", ["h"], ["a"], name="act"),
               n("Softmax", ["a"], ["s"], name="soft"), n("MatMul", ["s", "W2"], ["y"], name="second")],
              [vinfo("x", [1, 8, 32])], [vinfo("y", None)],
              [tensor("W1", r.normal(0, 0.3, (32, 24)).astype(np.float32)),
               tensor("W2", (r.normal(0, 0.3, (24, 16)) * np.linspace(0.01, 3, 16)).astype(np.float32))], opset=21)
    preset = PRESETS["qnn-a16-per-channel"]
    float_model, _ = prepare(m, preset)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        qdq = Quantizer(float_model, preset, _samples(m), tmp, method="minmax").quantize([])
    assert KEEP_ACTIONS["int16-weights"].weights_only
    every = {c.label for c in candidates(float_model, qdq)}
    weighted = {c.label for c in candidates(float_model, qdq, weights_only=True)}
    assert weighted == {"first", "second"} and weighted < every, every
    pending = [Candidate("first", ("first",)), Candidate("second", ("second",))]
    (one,) = costliest(float_model, qdq, pending, _samples(m), 1)
    from opfuse.quantization.qdq.layers import qdq_layers
    from opfuse.quantization.qdq.sqnr import layer_costs, layer_pairs, measure

    layers = qdq_layers(float_model, qdq)
    own = {k: v[1] for k, v in layer_costs(layers, measure(float_model, qdq, _samples(m), layer_pairs(layers))).items()}
    assert one.label == min(("first", "second"), key=own.get), own


def test_search_candidates_is_a_count_and_the_command_line_passes_it(monkeypatch):
    from opfuse import cli
    from opfuse.errors import BadInputError
    from opfuse.quantization import pipeline
    from opfuse.quantization.options import QuantizeOptions

    with pytest.raises(BadInputError, match="search_candidates is at least 1"):
        QuantizeOptions(search_candidates=0).check("m.onnx")
    seen = {}

    def fake(model, calibration, options):
        seen["options"] = options
        raise BadInputError("stop here")

    monkeypatch.setattr(pipeline, "quantize", fake)
    code = cli.main(["quantize", "m.onnx", "-o", "o.onnx", "--calibration", "random:2", "--preset",
                     "qnn-a16-per-channel", "--min-sqnr", "30", "--search-candidates", "5"])
    assert code == 2 and seen["options"].search_candidates == 5 and seen["options"].min_sqnr == 30
