"""A GGUF's quantised blocks imported as they are (opfuse.llm.gguf_blocks): a tiny GGUF written here with
the ``gguf`` package's writer (Q4_0, Q4_1 and Q8_0 tensors), a graph built here whose weights are that
file's dequantised values (what transformers exports), then: the weights the MatMulNBits and
GatherBlockQuantized nodes compute with equal ``gguf.quants.dequantize``'s (to float rounding), and the
graph's outputs equal the float graph's on ONNX Runtime (accuracy_level unset: float activations).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import extras
from onnx import TensorProto, helper, numpy_helper

gguf = extras.require("gguf")
import onnxruntime as ort
from gguf import GGMLQuantizationType, quants

from opfuse.llm.gguf_blocks import GgufRows, import_blocks
from opfuse.llm.quantize_int4 import untie_head

VOCAB, HIDDEN, FFN = 40, 64, 96


def _weights():
    rng = np.random.default_rng(0)
    # off-centre rows, so a Q4_1 minimum is not a multiple of its scale; one all-constant block (scale 0)
    up = (rng.standard_normal((FFN, HIDDEN)) * 0.1 + 0.05).astype(np.float32)
    up[3, :32] = 0.25
    return {"token_embd.weight": ("Q8_0", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)),
            "blk.0.ffn_up.weight": ("Q4_1", up),
            "blk.0.ffn_down.weight": ("Q4_0", (rng.standard_normal((HIDDEN, FFN)) * 0.1).astype(np.float32))}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    dequantised = {}
    for name, (kind, w) in _weights().items():
        q = quants.quantize(w, GGMLQuantizationType[kind])
        writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType[kind])
        dequantised[name] = quants.dequantize(q, GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, dequantised


def _graph(dq) -> onnx.ModelProto:
    """ids -> Gather(E) -> MatMul(up^T) -> Relu -> MatMul(down^T) -> MatMul(Transpose(E)): a tied head."""
    e, up, down = dq["token_embd.weight"], dq["blk.0.ffn_up.weight"], dq["blk.0.ffn_down.weight"]
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h"], name="embed"),
             helper.make_node("MatMul", ["h", "up"], ["u"], name="up"),
             helper.make_node("Relu", ["u"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "down"], ["d"], name="down"),
             helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0], name="tie"),
             helper.make_node("MatMul", ["d", "Et"], ["logits"], name="head")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("h", "u", "logits")],
        [numpy_helper.from_array(e, "E"), numpy_helper.from_array(np.ascontiguousarray(up.T), "up"),
         numpy_helper.from_array(np.ascontiguousarray(down.T), "down")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _run(model, ids):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["h", "u", "logits"], {"ids": ids})


def _unpack4(packed):
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def _nbits_weight(node, inits) -> np.ndarray:
    """[K, N]: scale * (q - zero point) (+ the residual E per block, for the residual form)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    n, k, bits = attrs["N"], attrs["K"], attrs["bits"]
    blocks = k // 32
    b = inits[node.input[1]]
    q = (b if bits == 8 else _unpack4(b)).reshape(n, blocks, 32).astype(np.float32)
    zp = inits[node.input[3]] if len(node.input) > 3 else None
    if zp is None:
        zp = np.full((n, blocks), 8, np.float32)
    elif zp.dtype == np.uint8 and bits == 4:
        zp = _unpack4(zp)[:, :blocks].astype(np.float32)
    return ((q - zp.reshape(n, blocks, 1).astype(np.float32)) * inits[node.input[2]][..., None]).reshape(n, k).T


@pytest.mark.parametrize("form", ["residual", "float-zp"])
def test_gguf_blocks_equal_the_files_dequantised_weights(tiny_gguf, form):
    path, dq = tiny_gguf
    model = _graph(dq)
    ids = np.array([[1, 5, 39, 0, 7]])
    reference = _run(model, ids)
    untie_head(model)
    done = import_blocks(model, path, form=form, accuracy_level=None)
    assert done == {"Q8_0": 2, "Q4_1": 1, "Q4_0": 1}  # the embedding and the tied head; up; down
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 3 and ops.count("GatherBlockQuantized") == 1
    assert ("Add" in ops) is (form == "residual")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert not any(v.dtype == np.float32 and v.size >= HIDDEN * FFN for v in inits.values())  # no float weight left
    by_name = {n.name: n for n in model.graph.node}
    np.testing.assert_array_equal(_nbits_weight(by_name["down_gguf"], inits), dq["blk.0.ffn_down.weight"].T)
    np.testing.assert_array_equal(_nbits_weight(by_name["head_gguf"], inits), dq["token_embd.weight"].T)
    up = _nbits_weight(by_name["up_gguf"], inits)
    if form == "residual":
        up = up + np.repeat(inits["up_gguf_residual"], 32, axis=0)
    np.testing.assert_allclose(up, dq["blk.0.ffn_up.weight"].T, rtol=0, atol=1e-6)
    got = _run(model, ids)
    np.testing.assert_array_equal(got[0], reference[0])  # the Q8_0 embedding: exact
    for g, r in zip(got[1:], reference[1:]):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())


def test_rows_not_in_the_file_are_left_alone(tiny_gguf):
    path, dq = tiny_gguf
    model = _graph(dq)
    for t in model.graph.initializer:
        if t.name == "down":  # one value moved by one float step: no longer the file's rows
            w = numpy_helper.to_array(t).copy()
            w[0, 0] = np.nextafter(w[0, 0], np.float32(1))
            t.CopyFrom(numpy_helper.from_array(w, "down"))
    done = import_blocks(model, path, rows=GgufRows(path))
    assert done == {"Q8_0": 1, "Q4_1": 1}  # the embedding and up; the head is not untied here
    assert {n.name: n.op_type for n in model.graph.node}["down"] == "MatMul"


@pytest.mark.parametrize("algorithm", ["rtn", "gptq"])
def test_quantize_int4_with_gguf_leaves_the_residual_matmuls_float(tiny_gguf, algorithm):
    """quantize_int4(gguf=...): every weight of the file imported, and the algorithm that runs after it
    does not requantise the Q4_1 form's float block-sum and residual MatMuls."""
    from opfuse.llm.quantize_int4 import quantize_int4

    path, dq = tiny_gguf
    model = _graph(dq)
    ids = np.array([[3, 1, 4, 1, 5]])
    reference = _run(model, ids)
    calibration = [{"ids": ids}]
    model = quantize_int4(model, gguf=path, algorithm=algorithm, accuracy_level=None, calibration=calibration)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 3 and ops.count("MatMul") == 2  # the block sums and the residual
    for g, r in zip(_run(model, ids), reference):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())


def test_gptq_without_calibration_when_the_gguf_covers_every_weight(tiny_gguf):
    """What `opfuse llm GGUF --precision int4` does when the file's blocks cover every weight: GPTQ is
    left nothing, so no calibration is needed (the SmolLM2 conversion stopped with exit 2 without this)."""
    from opfuse.llm.quantize_int4 import quantize_int4

    path, dq = tiny_gguf
    model = quantize_int4(_graph(dq), gguf=path, algorithm="gptq", accuracy_level=None)
    assert [n.op_type for n in model.graph.node].count("MatMulNBits") == 3


def test_q4_1_block_selector_is_one_initializer_per_k_across_writers():
    """Every Q4_1 residual pair of the same K reads one 0/1 block-sum matrix (a decode step then reads it
    from cache, not once per projection), also when two writers run on the same graph; still exact."""
    from opfuse.llm.gguf_blocks import write_min_blocks

    rng = np.random.default_rng(1)
    k = n = 64  # (p2 reads p0's output: the same K)
    ws = [(rng.standard_normal((k, n)) * 0.1 + 0.03).astype(np.float32) for _ in range(3)]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["a"], name="p0"),
             helper.make_node("MatMul", ["x", "w1"], ["b"], name="p1"),  # the same x: one block sum
             helper.make_node("Tanh", ["a"], ["t"], name="tanh"),
             helper.make_node("MatMul", ["t", "w2"], ["c"], name="p2")]  # another x, the same K
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["s", k])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["s", n]) for o in "bc"],
                              [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(ws)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)

    def q4_1(w):  # min-max blocks of 32 along K with a float minimum: w = d * code + m
        b = w.T.reshape(n, k // 32, 32)
        m = b.min(axis=2)
        d = (b.max(axis=2) - m) / 15
        codes = np.clip(np.rint((b - m[..., None]) / d[..., None]), 0, 15).astype(np.uint8)
        return codes, d.astype(np.float32), m.astype(np.float32)

    blocks = {f"p{i}": q4_1(w) for i, w in enumerate(ws)}
    exact = [(b[1][..., None] * b[0] + b[2][..., None]).reshape(n, k).T for b in blocks.values()]
    write_min_blocks(model, {"p0": blocks["p0"], "p1": blocks["p1"]}, 32, accuracy_level=None)
    write_min_blocks(model, {"p2": blocks["p2"]}, 32, accuracy_level=None)
    onnx.checker.check_model(model)
    ops = [nd.op_type for nd in model.graph.node]
    assert ops.count("MatMulNBits") == 3 and ops.count("Add") == 3
    assert ops.count("MatMul") == 2 + 3  # a block sum per distinct input, a residual per weight
    selectors = [t.name for t in model.graph.initializer if "block_selector" in t.name]
    assert selectors == [f"gguf_block_selector_{k}_32"]
    x = rng.standard_normal((5, k)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["b", "c"], {"x": x})
    np.testing.assert_allclose(got[0], x @ exact[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], np.tanh(x @ exact[0]) @ exact[2], rtol=1e-5, atol=1e-5)
