"""The int4 algorithms of opfuse.llm.quantize_int4 on small graphs built here: what each writes computes
with the weights it says it does (the blocks dequantised here), GPTQ beats round-to-nearest on inputs
like its calibration, the 8-bit embedding and head, and the command's list of algorithms and default are
the module's.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import extras
from onnx import TensorProto, helper, numpy_helper

extras.require("onnxruntime")
import onnxruntime as ort

from opfuse.llm import command
from test_llm import hf_folder, shared_llm_export  # noqa: F401  (fixtures: a tiny random Llama folder; its export once a session)
from opfuse.llm.quantize_int4 import ALGORITHMS, DEFAULT_ALGORITHM, quantize_int4


def _model(w: np.ndarray, table: np.ndarray | None = None) -> onnx.ModelProto:
    k, n = w.shape
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", n])]
    inits = [numpy_helper.from_array(w, "w")]
    if table is not None:
        nodes.append(helper.make_node("Gather", ["E", "ids"], ["h"], name="embed"))
        inputs.append(helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"]))
        outputs.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, None))
        inits.append(numpy_helper.from_array(table, "E"))
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                             opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _run(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _weights(k=128, n=48, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((k, n)) * 0.1 + rng.standard_normal((1, n)) * 0.05).astype(np.float32)


def _unpack4(packed):
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def _effective_weight(model) -> np.ndarray:
    """[K, N] the q4_1 form computes with: MatMulNBits' scale * (q - zp), plus the residual per block."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    n, k, block = attrs["N"], attrs["K"], attrs["block_size"]
    blocks = k // block
    q = _unpack4(inits[node.input[1]]).reshape(n, blocks, block).astype(np.float32)
    zp = _unpack4(inits[node.input[3]])[:, :blocks].astype(np.float32)
    w = ((q - zp[..., None]) * inits[node.input[2]][..., None]).reshape(n, k).T
    residual = [v for name, v in inits.items() if name.endswith("_residual")]
    return w + np.repeat(residual[0], block, axis=0) if residual else w


@pytest.mark.parametrize("algorithm", ["q4_1", "gptq"])
@pytest.mark.parametrize("block", [32, 64])
def test_float_minimum_form_computes_its_blocks(algorithm, block):
    w = _weights()
    rng = np.random.default_rng(1)
    calibration = [{"x": rng.standard_normal((16, 128)).astype(np.float32)} for _ in range(4)]
    model = quantize_int4(_model(w), algorithm=algorithm, block_size=block, accuracy_level=None,
                          calibration=calibration)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 1 and ops.count("Add") == 1
    effective = _effective_weight(model)
    if algorithm == "q4_1":  # min-max with a float minimum: every block's minimum and maximum kept
        blocks = w.reshape(-1, block, w.shape[1])
        got = effective.reshape(-1, block, w.shape[1])
        np.testing.assert_allclose(got.min(axis=1), blocks.min(axis=1), atol=1e-6)
        np.testing.assert_allclose(got.max(axis=1), blocks.max(axis=1), atol=1e-6)
        step = (blocks.max(axis=1) - blocks.min(axis=1)) / 15
        assert (np.abs(got - blocks) <= step[:, None, :] / 2 + 1e-6).all()
    x = rng.standard_normal((5, 128)).astype(np.float32)
    (y,) = _run(model, {"x": x})
    np.testing.assert_allclose(y, x @ effective, rtol=1e-5, atol=1e-5 * np.abs(x @ effective).max())


@pytest.mark.parametrize("block", [32, 64])
def test_gptq_with_integer_zero_points_writes_no_residual_pair(block):
    w = _weights()
    rng = np.random.default_rng(1)
    calibration = [{"x": rng.standard_normal((16, 128)).astype(np.float32)} for _ in range(4)]
    model = quantize_int4(_model(w), algorithm="gptq_int", block_size=block, accuracy_level=None,
                          calibration=calibration)
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits"]
    effective = _effective_weight(model)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    (y,) = _run(model, {"x": x})
    np.testing.assert_allclose(y, x @ effective, rtol=1e-5, atol=1e-5 * np.abs(x @ effective).max())
    err = np.abs(effective - w)  # on its grid: near the float weights, within a step of each
    step = (np.maximum(w.reshape(-1, block, w.shape[1]).max(axis=1), 0)
            - np.minimum(w.reshape(-1, block, w.shape[1]).min(axis=1), 0)) / 15
    assert err.mean() < 0.5 * step.mean()


def test_gptq_beats_rtn_on_inputs_like_its_calibration():
    """Correlated inputs (a few directions dominate), as a layer's activations are: GPTQ's output error on
    held-out inputs of the same kind is below round-to-nearest's."""
    rng = np.random.default_rng(2)
    k = 128
    mix = rng.standard_normal((k, k)).astype(np.float32) * np.linspace(3, 0.05, k, dtype=np.float32)[:, None]

    def inputs(rows):
        return (rng.standard_normal((rows, k)).astype(np.float32) @ mix).astype(np.float32)

    w = _weights(k)
    calibration = [{"x": inputs(64)} for _ in range(4)]
    x = inputs(256)
    errors = {}
    for algorithm in ("rtn", "q4_1", "gptq"):
        model = quantize_int4(_model(w), algorithm=algorithm, accuracy_level=None, calibration=calibration)
        (y,) = _run(model, {"x": x})
        errors[algorithm] = float(np.sqrt(((y - x @ w) ** 2).mean()))
    assert errors["gptq"] < 0.8 * min(errors["rtn"], errors["q4_1"]), errors


def test_gptq_needs_calibration():
    from opfuse.errors import BadInputError

    with pytest.raises(BadInputError, match="calibration"):
        quantize_int4(_model(_weights()), algorithm="gptq")


@pytest.mark.parametrize("bits", [4, 8])
def test_embedding_bits(bits):
    rng = np.random.default_rng(3)
    table = rng.standard_normal((30, 64)).astype(np.float32)
    model = quantize_int4(_model(_weights(), table), embedding_bits=bits, accuracy_level=None, algorithm="rtn")
    (gbq,) = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    assert {a.name: helper.get_attribute_value(a) for a in gbq.attribute}.get("bits", 4) == bits  # 4: the default
    ids = rng.integers(0, 30, (2, 5))
    _, h = _run(model, {"x": np.zeros((1, 128), np.float32), "ids": ids})
    # per block of 32: 8 bits round to max|w| / 127 / 2; 4 bits (min-max, 15 steps) to (max - min) / 15 / 2
    blocks = table[ids].reshape(2, 5, 2, 32)
    bound = (np.abs(blocks).max(-1) / 254 if bits == 8 else (blocks.max(-1) - blocks.min(-1)) / 30) * 1.001 + 1e-6
    assert (np.abs(h.reshape(blocks.shape) - blocks) <= bound[..., None]).all()


def test_head_at_8_bits():
    rng = np.random.default_rng(4)
    vocab, hidden = 40, 64
    table = rng.standard_normal((vocab, hidden)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["h"], name="embed"),
         helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0], name="tie"),
         helper.make_node("MatMul", ["h", "Et"], ["logits"], name="head")], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(table, "E")])
    model = quantize_int4(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10),
                          head_bits=8, accuracy_level=None, algorithm="rtn")
    (head,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert {a.name: helper.get_attribute_value(a) for a in head.attribute}["bits"] == 8
    ids = rng.integers(0, vocab, (1, 6))
    (logits,) = _run(model, {"ids": ids})
    reference = table[ids] @ table.T
    assert np.abs(logits - reference).max() < 0.02 * np.abs(reference).max()


def test_command_lists_the_modules_algorithms_and_default():
    assert command.ALGORITHMS == ALGORITHMS
    assert command.DEFAULT_ALGORITHM == DEFAULT_ALGORITHM


def test_command_int4_gptq_folder_generates(hf_folder):  # noqa: F811  (the fixture imported above)
    """``opfuse llm HF -o DIR --precision int4 --int4-algorithm gptq --head-bits 8``: the tiny model of
    test_llm.py, calibrated on the standard-library docstrings, generates in onnxruntime-genai."""
    from test_llm import NEW_TOKENS, PROMPT, VOCAB, _genai_greedy

    from opfuse.cli import main

    out = hf_folder.parent / "int4-gptq"
    assert main(["llm", str(hf_folder), "-o", str(out), "--precision", "int4", "--int4-algorithm", "gptq",
                 "--head-bits", "8"]) == 0
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    bits = sorted({helper.get_attribute_value(a) for n in proto.graph.node if n.op_type == "MatMulNBits"
                   for a in n.attribute if a.name == "bits"})
    assert bits == [4, 8]  # the layers at 4, the head at 8
    assert [n.op_type for n in proto.graph.node].count("MatMulNBits") == 9
    _, tokens = _genai_greedy(out, PROMPT, NEW_TOKENS)
    assert len(tokens) == NEW_TOKENS and all(0 <= t < VOCAB for t in tokens)


def test_command_int4_gptq_int_folded_norms_folder_generates(hf_folder):  # noqa: F811  (the fixture above)
    """``--int4-algorithm gptq_int --fold-norms`` on the tiny model: every norm before a projection has
    ones for its scale, no residual MatMul pair is written, and the folder generates."""
    from test_llm import NEW_TOKENS, PROMPT, VOCAB, _genai_greedy

    from opfuse.cli import main
    from opfuse.llm.fold_norm import NORMS

    out = hf_folder.parent / "int4-gptq-int-folded"
    assert main(["llm", str(hf_folder), "-o", str(out), "--precision", "int4", "--int4-algorithm", "gptq_int",
                 "--fold-norms"]) == 0
    proto = onnx.load(str(out / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    norms = [n for n in proto.graph.node if n.op_type in NORMS]
    assert norms
    for n in norms:
        np.testing.assert_array_equal(inits[n.input[NORMS[n.op_type]]], 1)
    assert not [n.name for n in proto.graph.node if n.name.endswith(("_gguf_residual", "_gguf_block_sums"))]
    _, tokens = _genai_greedy(out, PROMPT, NEW_TOKENS)
    assert len(tokens) == NEW_TOKENS and all(0 <= t < VOCAB for t in tokens)


def test_default_algorithm_is_gptq_and_needs_no_flag():
    """The default (measured best: docs/results/llm.md) is GPTQ: the same blocks as asking for it."""
    assert DEFAULT_ALGORITHM == "gptq"
    rng = np.random.default_rng(5)
    calibration = [{"x": rng.standard_normal((16, 128)).astype(np.float32)} for _ in range(2)]
    default = quantize_int4(_model(_weights()), accuracy_level=None, calibration=calibration)
    asked = quantize_int4(_model(_weights()), accuracy_level=None, calibration=calibration, algorithm="gptq")
    np.testing.assert_array_equal(_effective_weight(default), _effective_weight(asked))
