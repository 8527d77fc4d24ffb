"""opfuse.llm.fold_norm: RMSNorm scales folded into the projections, checked on ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest

from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("onnxruntime")
import onnxruntime as ort

from opfuse.llm.fold_norm import fold_norm_scales, rescale_hessians

K, N1, N2 = 64, 48, 32


def _graph(extra_reader: str | None = None, shared_weight: bool = False, zero_scale: bool = False):
    """x, skip [1, 5, K] -> SkipSimplifiedLayerNormalization (g1) -> q, k projections; its sum -> a
    SimplifiedLayerNormalization (g2) -> one projection. Outputs: the three projections and the sum."""
    rng = np.random.default_rng(0)
    g1 = rng.uniform(0.2, 3.0, K).astype(np.float32)
    if zero_scale:
        g1[3] = 0
    g2 = rng.uniform(-2.0, 2.0, K).astype(np.float32)
    inits = [numpy_helper.from_array(g1, "g1"), numpy_helper.from_array(g2, "g2"),
             numpy_helper.from_array(rng.standard_normal((K, N1)).astype(np.float32), "wq"),
             numpy_helper.from_array(rng.standard_normal((K, N2)).astype(np.float32), "wk"),
             numpy_helper.from_array(rng.standard_normal((K, N1)).astype(np.float32), "wu")]
    nodes = [
        helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "g1"], ["n1", "", "", "sum"],
                         name="norm1", domain="com.microsoft", epsilon=1e-6),
        helper.make_node("MatMul", ["n1", "wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["n1", "wk"], ["k"], name="k_proj"),
        helper.make_node("SimplifiedLayerNormalization", ["sum", "g2"], ["n2"], name="norm2", axis=-1,
                         epsilon=1e-6, stash_type=1),
        helper.make_node("MatMul", ["n2", "wu"], ["u"], name="up_proj"),
    ]
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("q", "k", "u", "sum")]
    if extra_reader:  # the normalised output read by something that is not a projection
        nodes.append(helper.make_node("Relu", [extra_reader], ["r"], name="other"))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    if shared_weight:  # wq also read by a MatMul of the raw input
        nodes.append(helper.make_node("MatMul", ["x", "wq"], ["raw"], name="raw_proj"))
        outputs.append(helper.make_tensor_value_info("raw", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info(i, TensorProto.FLOAT, [1, 5, K]) for i in ("x", "skip")]
    graph = helper.make_graph(nodes, "norms", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def _feeds():
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((1, 5, K)).astype(np.float32),
            "skip": rng.standard_normal((1, 5, K)).astype(np.float32)}


def _run(model):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, _feeds())


def _init(model, name):
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def _scale_of(model, node_name):
    node = next(n for n in model.graph.node if n.name == node_name)
    return _init(model, node.input[2 if node.op_type.startswith("Skip") else 1])


def test_both_norms_fold_and_the_outputs_agree():
    model = _graph()
    before = _run(model)
    g1, g2 = _init(model, "g1"), _init(model, "g2")
    wq = _init(model, "wq")
    folded = fold_norm_scales(model)
    assert set(folded) == {"n1", "n2"}
    np.testing.assert_array_equal(folded["n1"], g1)
    np.testing.assert_array_equal(_scale_of(model, "norm1"), np.ones(K, np.float32))
    np.testing.assert_array_equal(_scale_of(model, "norm2"), np.ones(K, np.float32))
    np.testing.assert_allclose(_init(model, "wq"), g1[:, None] * wq, rtol=1e-6)
    after = _run(model)
    for a, b in zip(before, after):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())
    np.testing.assert_array_equal(after[3], before[3])  # the residual stream is untouched
    assert g2.min() < 0  # (a negative scale folds as well)


def test_a_reader_that_is_not_a_projection_keeps_its_norm():
    model = _graph(extra_reader="n1")
    before = _run(model)
    folded = fold_norm_scales(model)
    assert set(folded) == {"n2"}
    np.testing.assert_array_equal(_scale_of(model, "norm1"), _init(model, "g1"))
    for a, b in zip(before, _run(model)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())


def test_a_zero_in_the_scale_keeps_its_norm():
    model = _graph(zero_scale=True)
    assert set(fold_norm_scales(model)) == {"n2"}


def test_a_weight_read_elsewhere_gets_a_copy():
    model = _graph(shared_weight=True)
    wq = _init(model, "wq")
    before = _run(model)
    assert set(fold_norm_scales(model)) == {"n1", "n2"}
    np.testing.assert_array_equal(_init(model, "wq"), wq)  # the raw projection's weight as it was
    q = next(n for n in model.graph.node if n.name == "q_proj")
    assert q.input[1] != "wq"
    for a, b in zip(before, _run(model)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())


def test_hessians_carried_over_equal_those_measured_after_the_fold():
    from opfuse.llm.quantize_int4 import hessians

    feeds = [_feeds()]
    model = _graph()
    before = hessians(model, feeds, {"n1", "n2"})
    folded = fold_norm_scales(model)
    after = hessians(model, feeds, {"n1", "n2"})
    carried = rescale_hessians(before, folded)
    for name in ("n1", "n2"):
        np.testing.assert_allclose(carried[name], after[name], rtol=1e-4, atol=1e-6 * np.abs(after[name]).max())


@pytest.mark.parametrize("algorithm", ["gptq", "q4_1"])
def test_quantize_int4_folds_first(algorithm):
    from opfuse.llm.quantize_int4 import quantize_int4

    model = _graph()
    kw = {"calibration": [_feeds()]} if algorithm == "gptq" else {}
    out = quantize_int4(model, algorithm=algorithm, embedding=False, fold_norms=True, **kw)
    assert all(n.op_type != "MatMul" or n.name.endswith(("_gguf_residual", "_gguf_block_sums"))
               for n in out.graph.node)
    np.testing.assert_array_equal(_scale_of(out, "norm1"), np.ones(K, np.float32))
    ref = _run(_graph())
    got = _run(out)
    for a, b in zip(ref[:3], got[:3]):  # 4 bits: near, not equal
        assert np.abs(b - a).mean() < 0.1 * np.abs(a).mean()
