"""The HTP backend and its compile log: placement, QNN's reasons, strict mode, static shapes.

Each HTP test opens a session on QNN's HTP backend (emulated) on a graph of a few nodes,
and checks what the backend itself said: the placement comes from ONNX Runtime's
assignment record and the reasons from QNN's validation log, never from opfuse's tables.
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

from graphs import model, ort_run, tensor, vinfo
from opfuse.errors import BadInputError
from opfuse.targets.qnn import backend
from opfuse.targets.qnn.backend import HtpCompileError, HtpOptions, open_session
from opfuse.targets.qnn.placement import Placement, parse_validation
from opfuse.prepare.static_shapes import dims_from_samples, make_static, make_static_proto
from qnn_graphs import conv_then, feeds, needs_htp

# -- the log, read (no backend) -------------------------------------------------------------------

LOG = """\
2026-12-03 16:45:42.794 [V:onnxruntime:, qnn_execution_provider.cc:2198 GetCapabilityImpl] GetCapability pass 1 (pre-Layout-Transform)
2026-12-03 16:45:43.264 [V:onnxruntime:, qnn_execution_provider.cc:1713 LogNodeSupport] Validation PASSED for 3 nodes in OrtNodeUnit (Conv) :
\tOperator type: DequantizeLinear Node name: x_dq Node index: 0
\tOperator type: Conv Node name: conv Node index: 1
\tOperator type: QuantizeLinear Node name: c_q Node index: 2

2026-12-03 16:45:43.264 [V:onnxruntime:, qnn_execution_provider.cc:1713 LogNodeSupport] Validation FAILED for 1 nodes in OrtNodeUnit (Erf) :
\tOperator type: Erf Node name: erf Node index: 3
\tREASON : Operators of type `Erf` are not supported by QNN EP.
2026-12-03 16:45:43.264 [V:onnxruntime:, qnn_execution_provider.cc:2198 GetCapabilityImpl] GetCapability pass 2 (post-Layout-Transform)
2026-12-03 16:45:43.281 [V:onnxruntime:, qnn_execution_provider.cc:1713 LogNodeSupport] Validation FAILED for 1 nodes in OrtNodeUnit (Erf) :
\tOperator type: Erf Node name: erf Node index: 3
\tREASON : Cannot get shape
""".splitlines()


class _Node:
    def __init__(self, name, op_type):
        self.name, self.op_type, self.domain = name, op_type, ""


class _Sub:
    def __init__(self, ep, nodes):
        self.ep_name, self._nodes = ep, [_Node(*n) for n in nodes]

    def get_nodes(self):
        return self._nodes


def test_the_validation_log_is_read_node_by_node_with_its_stage_and_reason():
    checks = parse_validation(LOG)
    assert [(c.name, c.op_type, c.passed, c.unit, c.stage) for c in checks] == [
        ("x_dq", "DequantizeLinear", True, "Conv", 1), ("conv", "Conv", True, "Conv", 1),
        ("c_q", "QuantizeLinear", True, "Conv", 1), ("erf", "Erf", False, "Erf", 1), ("erf", "Erf", False, "Erf", 2)]
    assert checks[3].reason == "Operators of type `Erf` are not supported by QNN EP."


def test_placement_counts_the_models_nodes_and_gives_the_last_reason_with_its_fix():
    assignment = [_Sub("QNNExecutionProvider", [("Transpose", "Transpose"), ("conv_token_1", "Conv"),
                                                ("x_dq", "DequantizeLinear"), ("c_q", "QuantizeLinear")]),
                  _Sub("CPUExecutionProvider", [("erf", "Erf")])]
    nodes = [("x_dq", "DequantizeLinear"), ("conv", "Conv"), ("c_q", "QuantizeLinear"), ("erf", "Erf"),
             ("folded", "Identity")]
    p = Placement.from_log(LOG, assignment, nodes)
    assert p.on_qnn == ["x_dq", "conv", "c_q"] and p.removed == ["folded"] and len(p.partitions) == 1
    (fallback,) = p.fallbacks
    assert (fallback.name, fallback.reason) == ("erf", "Cannot get shape") and "--dim" in fallback.fix
    assert not p.all_on_npu
    assert p.summary() == "3 of 5 nodes on the HTP in 1 partition(s), 1 on the CPU, 1 removed by ONNX Runtime before placement"


# -- the backend ---------------------------------------------------------------------------------

def test_a_missing_backend_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", None)  # as on a machine without it
    with pytest.raises(BadInputError, match=r"pip install 'opfuse\[qnn\]'") as e:
        backend.require_backend()
    assert "\n" not in str(e.value) and e.value.exit_code == 2


def test_htp_options_parse_and_report_what_is_set():
    o = HtpOptions.parse({"soc_model": "", "htp_arch": "79", "vtcm_mb": "8"})
    assert (o.soc_model, o.htp_arch, o.vtcm_mb) == (None, "79", 8)
    assert o.provider_options("/lib.so") == {"backend_path": "/lib.so", "offload_graph_io_quantization": "0",
                                             "htp_arch": "79", "vtcm_mb": "8"}
    assert o.describe() == "htp_arch 79, vtcm_mb 8, graph I/O quantisation on the HTP"
    with pytest.raises(BadInputError, match="vtcm_mb"):
        HtpOptions.parse({"vtcm_mb": "lots"})


@needs_htp
def test_a_symbolic_batch_puts_every_node_on_the_cpu_with_qnns_reason_and_the_fix():
    s = open_session(conv_then("Relu"))
    assert not s.placement.partitions and [f.name for f in s.placement.fallbacks] == ["conv", "relu"]
    assert all(f.reason == "Cannot get shape" and "--dim" in f.fix for f in s.placement.fallbacks)


@needs_htp
def test_with_static_shapes_the_graph_is_one_qnn_partition_and_opens_strictly():
    static, info = make_static(ir.serde.deserialize_model(conv_then("Relu")), {"batch": 1})
    s = open_session(static, strict=True)
    assert s.placement.all_on_npu and s.placement.on_qnn == ["conv", "relu"] and len(s.placement.partitions) == 1
    x = feeds(conv_then("Relu"))
    got = s.run(x)[0]
    want = ort_run(conv_then("Relu"), x)["y"]
    assert got.shape == want.shape and np.allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@needs_htp
def test_a_forced_fallback_names_the_node_and_qnns_reason_and_strict_mode_refuses_it():
    m = conv_then("Erf", batch=1)
    s = open_session(m)
    (erf,) = s.placement.fallbacks
    assert (erf.name, erf.op_type) == ("erf", "Erf") and "not supported by QNN EP" in erf.reason
    assert s.placement.on_qnn == ["conv"]
    with pytest.raises(HtpCompileError, match=r"CPU fallback is disabled: erf \(Erf\): Operators of type `Erf`"):
        open_session(m, strict=True)


# -- static shapes --------------------------------------------------------------------------------

def _reshape_through_shape():
    """x[batch, 4, w] -> Reshape to [Shape(x)[0], -1] -> Relu: the target is computed."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["b"], name="gather", axis=0),
        helper.make_node("Concat", ["b", "minus1"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"], name="reshape"),
        helper.make_node("Relu", ["r"], ["y"], name="relu"),
    ]
    return model(nodes, [vinfo("x", ["batch", 4, None])], [vinfo("y", ["batch", None])],
                 [tensor("zero", np.array([0], np.int64)), tensor("minus1", np.array([-1], np.int64))])


def test_every_dimension_named_or_unnamed_is_bound_and_every_tensor_gets_a_static_shape():
    m = _reshape_through_shape()
    fixed, info = make_static_proto(m, {"batch": 2, "x:2": 5})
    assert info.bound == {"batch": 2, "x:2": 5} and not info.unknown
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in (*fixed.graph.value_info, *fixed.graph.output, *fixed.graph.input)}
    assert shapes["x"] == [2, 4, 5] and shapes["r"] == [2, 20] and shapes["y"] == [2, 20]
    x = {"x": np.random.default_rng(0).normal(size=(2, 4, 5)).astype(np.float32)}
    assert np.array_equal(ort_run(fixed, x)["y"], ort_run(m, x)["y"])
    assert "bound batch=2, x:2=5 (from --dim)" in info.note()


def test_placeholder_dim_names_shared_by_several_axes_are_bound_axis_by_axis():
    # Paddle2ONNX writes "?" for every free spatial axis (PP-OCR cls: [-1, 3, "?", "?"]);
    # binding them by name would give both axes the first value
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [-1, 3, "?", "?"])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [-1, 3, "?", "?"])
    m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17)])
    fixed, info = make_static_proto(m, {"x:0": 1, "x:2": 4, "x:3": 6})
    assert [d.dim_value for d in fixed.graph.input[0].type.tensor_type.shape.dim] == [1, 3, 4, 6]
    assert [d.dim_value for d in fixed.graph.output[0].type.tensor_type.shape.dim] == [1, 3, 4, 6]
    assert not info.unknown


def test_an_unbound_dimension_is_one_line_naming_it():
    with pytest.raises(BadInputError) as e:
        make_static_proto(_reshape_through_shape(), {"batch": 1})
    assert "x:2 (x axis 2) not bound" in str(e.value) and "--dim x:2=N" in str(e.value)
    assert "\n" not in str(e.value) and e.value.exit_code == 2


def test_the_calibration_samples_bind_the_dims_and_must_agree():
    m = ir.serde.deserialize_model(_reshape_through_shape())
    samples = [{"x": np.zeros((1, 4, 7), np.float32)}, {"x": np.zeros((1, 4, 7), np.float32)}]
    assert dims_from_samples(m, samples) == {"batch": 1, "x:2": 7}
    samples.append({"x": np.zeros((1, 4, 9), np.float32)})
    with pytest.raises(BadInputError, match=r"disagree on dimension x:2: 7 \(sample 0, x axis 2\) and 9"):
        dims_from_samples(m, samples)


def test_a_data_dependent_shape_is_named_in_the_note():
    nodes = [helper.make_node("NonZero", ["x"], ["nz"], name="nonzero"),
             helper.make_node("Transpose", ["nz"], ["y"], name="t")]
    m = model(nodes, [vinfo("x", ["n", 3])], [vinfo("y", None, onnx.TensorProto.INT64)], fill_output_shapes=False)
    _, info = make_static_proto(m, {"n": 2})
    assert info.unknown == ["nz", "y"] and "depends on the data (nz, y)" in info.note()
