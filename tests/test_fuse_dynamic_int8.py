"""``fuse-dynamic-int8`` (opfuse/passes/fuse_dynamic_int8.py): quantize_dynamic's MatMulInteger
chains as ONNX Runtime's DynamicQuantizeMatMul and MatMulIntegerToFloat.

The graphs are small float models built here and quantised by ONNX Runtime's own
``quantize_dynamic`` (per tensor and per channel, int8 and uint8 weights), so the chains are the
ones third parties ship; a few the quantiser does not write (no zero points, an int32 result read
twice, a static uint8 input) are built by hand. The oracle is the shipped model itself on ONNX
Runtime with its optimisations off, and ONNX Runtime's own EXTENDED rewrite of it: the kernels
compute the chain's expression term for term, so the outputs must agree to a float32 rounding.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from graphs import model, ort_run, rng, tensor, vinfo
from opfuse.errors import BadInputError
from opfuse.pipeline import optimize

KERNELS = {"DynamicQuantizeMatMul", "MatMulIntegerToFloat"}


def _dynamic(tmp_path, m, per_channel=False, weight_type=QuantType.QInt8) -> onnx.ModelProto:
    src, dst = tmp_path / "float.onnx", tmp_path / "dynamic.onnx"
    onnx.save(m, src)
    quantize_dynamic(src, dst, per_channel=per_channel, weight_type=weight_type)
    return onnx.load(dst)


def _ort_extended(proto: onnx.ModelProto, tmp_path) -> onnx.ModelProto:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "ort_extended.onnx")
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return onnx.load(tmp_path / "ort_extended.onnx")


def _ops(m) -> list[str]:
    return sorted(n.op_type for n in (m.graph.node if isinstance(m, onnx.ModelProto) else m.graph))


def _projections(shared: bool, bias: bool, rank: int = 3):
    """x[2, 3, 8] (or [6, 8]) -> MatMul W1 [8, 5] [+ b1] -> Relu -> MatMul W3 [5, 4]; with ``shared``
    a second projection of x (W2 [8, 6]), so one DynamicQuantizeLinear feeds two MatMulIntegers."""
    r = rng(3)
    shape = [2, 3, 8] if rank == 3 else [6, 8]
    lead = shape[:-1]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["m1"], name="mm1")]
    inits = [tensor("W1", r.normal(0, 0.3, (8, 5)).astype(np.float32)),
             tensor("W3", r.normal(0, 0.3, (5, 4)).astype(np.float32))]
    if bias:
        nodes.append(helper.make_node("Add", ["m1", "b1"], ["a1"], name="add1"))
        inits.append(tensor("b1", r.normal(0, 0.3, 5).astype(np.float32)))
    nodes += [helper.make_node("Relu", ["a1" if bias else "m1"], ["r1"], name="relu"),
              helper.make_node("MatMul", ["r1", "W3"], ["y"], name="mm3")]
    outputs = [vinfo("y", lead + [4])]
    if shared:
        nodes.append(helper.make_node("MatMul", ["x", "W2"], ["y2"], name="mm2"))
        inits.append(tensor("W2", r.normal(0, 0.3, (8, 6)).astype(np.float32)))
        outputs.append(vinfo("y2", lead + [6]))
    return model(nodes, [vinfo("x", shape)], outputs, inits), shape


def _feeds(shape, seed=4):
    return {"x": rng(seed).normal(0, 1, shape).astype(np.float32)}


def _close(expected: dict, actual: dict, ulps: float = 4.0) -> float:
    """The largest difference, checked to be a few float32 roundings of each output's scale."""
    worst = 0.0
    for name, ref in expected.items():
        got = actual[name]
        assert got.shape == ref.shape and got.dtype == ref.dtype
        scale = float(np.max(np.abs(ref))) or 1.0
        diff = float(np.max(np.abs(ref.astype(np.float64) - got)))
        assert diff <= ulps * np.finfo(np.float32).eps * scale, (name, diff, scale)
        worst = max(worst, diff)
    return worst


@pytest.mark.parametrize("weight_type", [QuantType.QInt8, QuantType.QUInt8], ids=["int8", "uint8"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shared", [False, True], ids=["own-input", "shared-input"])
def test_quantize_dynamic_chains_become_the_runtimes_kernels_and_compute_the_same(tmp_path, weight_type, per_channel,
                                                                                  bias, shared):
    float_model, shape = _projections(shared, bias)
    shipped = _dynamic(tmp_path, float_model, per_channel, weight_type)
    assert _ops(shipped).count("MatMulInteger") == 2 + shared
    out, report = optimize(shipped, target="onnxruntime")
    ops = _ops(out)
    assert "MatMulInteger" not in ops and "Cast" not in ops
    # the second projection reads its own (Relu's) quantisation: DynamicQuantizeMatMul; x's, shared, the other kernel
    assert ops.count("DynamicQuantizeMatMul") == (1 if shared else 2)
    assert ops.count("MatMulIntegerToFloat") == (2 if shared else 0)
    assert ops.count("DynamicQuantizeLinear") == (1 if shared else 0)
    assert ops.count("Add") == 0  # a bias goes into the kernel
    scales = [tuple(n.inputs[2 if n.op_type == "DynamicQuantizeMatMul" else 3].const_value.shape) for n in out.graph
              if n.op_type in KERNELS]
    assert all(len(s) <= 1 for s in scales) and any(s and s[0] > 1 for s in scales) == per_channel
    extended = _ort_extended(shipped, tmp_path)
    assert len(out.graph) <= len(extended.graph.node)
    assert report.verification.ok
    assert {c.rewrite.split(" at ")[0] for c in report.verification.rewrites} <= {
        f"DynamicQuantizeLinear+MatMulInteger->{k}" for k in KERNELS}
    feeds = _feeds(shape)
    expected = ort_run(shipped, feeds)
    _close(expected, ort_run(out, feeds))
    _close(ort_run(extended, feeds), ort_run(out, feeds))


def test_a_two_dimensional_input_and_a_bias_of_one_value_for_every_column(tmp_path):
    """A bias of one value is written as N values (the kernel's bias is per column)."""
    float_model, shape = _projections(shared=False, bias=True, rank=2)
    for t in float_model.graph.initializer:
        if t.name == "b1":
            t.CopyFrom(tensor("b1", np.array([0.25], np.float32)))
    shipped = _dynamic(tmp_path, float_model)
    out, report = optimize(shipped, target="onnxruntime")
    assert _ops(out) == ["DynamicQuantizeMatMul", "DynamicQuantizeMatMul", "Relu"]
    feeds = _feeds(shape)
    _close(ort_run(shipped, feeds), ort_run(out, feeds))


def _hand_chain(*, weight_zero: bool, input_zero: bool, graph_output: str | None = None):
    """DynamicQuantizeLinear -> MatMulInteger [zero points as asked] -> Cast -> Mul(., Mul(xs, ws)) -> Add(b),
    written by hand (quantize_dynamic always writes both zero points)."""
    r = rng(5)
    mmi_inputs = ["xq", "wq"] + (["xz"] if input_zero else ([""] if weight_zero else [])) + (["wz"] if weight_zero else [])
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dql"),
             helper.make_node("MatMulInteger", mmi_inputs, ["acc"], name="mm_quant"),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Mul", ["xs", "ws"], ["s"], name="scales"),
             helper.make_node("Mul", ["accf", "s"], ["m"], name="rescale"),
             helper.make_node("Add", ["m", "b"], ["y"], name="bias")]
    outputs = [vinfo("y", [3, 4])]
    if graph_output:
        dtype = TensorProto.INT32 if graph_output == "acc" else TensorProto.FLOAT
        outputs.append(vinfo(graph_output, [3, 4], dtype))
    inits = [tensor("wq", r.integers(-127, 128, (6, 4)).astype(np.int8)),
             tensor("ws", np.abs(r.normal(0.01, 0.003, 4)).astype(np.float32)),
             tensor("b", r.normal(0, 0.3, 4).astype(np.float32))]
    if weight_zero:
        inits.append(tensor("wz", r.integers(-3, 4, 4).astype(np.int8)))
    return model(nodes, [vinfo("x", [3, 6])], outputs, inits, opset=13)


@pytest.mark.parametrize("weight_zero", [False, True], ids=["no-weight-zero-point", "weight-zero-point"])
@pytest.mark.parametrize("input_zero", [False, True], ids=["no-input-zero-point", "input-zero-point"])
def test_chains_without_zero_points(weight_zero, input_zero):
    """An absent input zero point is 0 in the chain, not the DynamicQuantizeLinear's: only
    MatMulIntegerToFloat (a_zero_point absent too) computes that; an absent weight zero point
    is absent in either kernel."""
    shipped = _hand_chain(weight_zero=weight_zero, input_zero=input_zero)
    out, report = optimize(shipped, target="onnxruntime")
    kernel = "DynamicQuantizeMatMul" if input_zero else "MatMulIntegerToFloat"
    assert _ops(out) == ([kernel] if input_zero else ["DynamicQuantizeLinear", kernel])
    node = next(n for n in out.graph if n.op_type == kernel)
    zero_index = 3 if input_zero else 5
    assert (len(node.inputs) > zero_index and node.inputs[zero_index] is not None) == weight_zero
    feeds = {"x": rng(6).normal(0, 1, (3, 6)).astype(np.float32)}
    _close(ort_run(shipped, feeds), ort_run(out, feeds))


def test_a_graph_output_inside_the_chain_keeps_it_and_says_why():
    shipped = _hand_chain(weight_zero=True, input_zero=True, graph_output="acc")
    out, report = optimize(shipped, target="onnxruntime")
    assert "MatMulInteger" in _ops(out)
    reasons = [r.reason for r in report.refusals if r.pattern == "DynamicQuantizeLinear+MatMulInteger"]
    assert reasons == ["its int32 result 'acc' is a graph output, so the chain must stay"]


def test_the_rescaled_result_as_a_graph_output_keeps_its_bias_add_after_the_kernel():
    shipped = _hand_chain(weight_zero=True, input_zero=True, graph_output="m")
    out, report = optimize(shipped, target="onnxruntime")
    assert _ops(out) == ["Add", "DynamicQuantizeMatMul"]
    assert [v.name for v in out.graph.outputs] == ["y", "m"]
    feeds = {"x": rng(6).normal(0, 1, (3, 6)).astype(np.float32)}
    _close(ort_run(shipped, feeds), ort_run(out, feeds))


def test_one_weight_shared_by_two_chains_stays_one_initializer(tmp_path):
    """Two MatMuls of one weight (tied projections): both chains fused, the int8 weight not copied."""
    r = rng(7)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"], name="mm_a"),
             helper.make_node("Relu", ["a"], ["ra"], name="relu"),
             helper.make_node("MatMul", ["x2", "W"], ["b"], name="mm_b"),
             helper.make_node("Add", ["ra", "b"], ["y"], name="sum")]
    float_model = model(nodes, [vinfo("x", [4, 8]), vinfo("x2", [4, 8])], [vinfo("y", [4, 8])],
                        [tensor("W", r.normal(0, 0.3, (8, 8)).astype(np.float32))])
    shipped = _dynamic(tmp_path, float_model)
    out, report = optimize(shipped, target="onnxruntime")
    kernels = [n for n in out.graph if n.op_type == "DynamicQuantizeMatMul"]
    assert len(kernels) == 2 and kernels[0].inputs[1] is kernels[1].inputs[1]
    assert len([v for v in out.graph.initializers.values() if v.const_value.dtype == ir.DataType.INT8 and v.const_value.size > 1]) == 1
    feeds = {"x": rng(8).normal(0, 1, (4, 8)).astype(np.float32), "x2": rng(9).normal(0, 1, (4, 8)).astype(np.float32)}
    _close(ort_run(shipped, feeds), ort_run(out, feeds))


def test_a_static_uint8_input_is_not_this_rewrite_and_says_so():
    """MatMulInteger reading a uint8 graph input: its scale is no run-time value."""
    r = rng(10)
    nodes = [helper.make_node("MatMulInteger", ["xq", "wq"], ["acc"], name="mmi"),
             helper.make_node("Cast", ["acc"], ["f"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Mul", ["f", "s"], ["y"], name="rescale")]
    shipped = model(nodes, [vinfo("xq", [3, 6], TensorProto.UINT8)], [vinfo("y", [3, 4])],
                    [tensor("wq", r.integers(-127, 128, (6, 4)).astype(np.int8)),
                     tensor("s", np.array(0.01, np.float32))], opset=13)
    out, report = optimize(shipped, target="onnxruntime")
    assert _ops(out) == ["Cast", "MatMulInteger", "Mul"]
    reason = next(r.reason for r in report.refusals if r.pattern == "DynamicQuantizeLinear+MatMulInteger")
    assert reason.startswith("its input comes from nothing, not from a DynamicQuantizeLinear")


def test_portable_onnx_keeps_the_chains_and_refuses_to_run_the_pass(tmp_path):
    float_model, _ = _projections(shared=True, bias=True)
    shipped = _dynamic(tmp_path, float_model)
    out, report = optimize(shipped, target="onnx")
    assert not KERNELS & set(_ops(out)) and _ops(out).count("MatMulInteger") == 3
    assert all(n.domain in ("", "ai.onnx") for n in out.graph)
    with pytest.raises(BadInputError, match="fuse-dynamic-int8"):
        optimize(shipped, target="onnx", passes=["fuse-dynamic-int8"])
