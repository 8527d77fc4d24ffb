"""Large inline models (opfuse.core.inline): written a tensor at a time to the bytes onnx-ir writes, read with
their weights mapped where they are in the file, and run through the pipeline to the same output as
a model read as a whole. The size thresholds are lowered here so that small graphs take that path.
"""

from __future__ import annotations

import os
import sys
import tracemalloc

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import opfuse
import opfuse.core.inline
import opfuse.pipeline
from graphs import conv_bn_model, model, tensor, vinfo
from opfuse.errors import BadInputError, VerificationError
from opfuse.core.inline import MappedTensor, read_mapped, write_inline
from opfuse.load import load_model, read_model
from opfuse.runtime import drop_resident_pages
from opfuse.save import needs_external_data


@pytest.fixture
def mapped_everywhere(monkeypatch):
    """Every file mapped, every initializer of 16 bytes or more, every inline write streamed."""
    monkeypatch.setattr(opfuse.core.inline, "MAPPED_FILE_BYTES", 0)
    monkeypatch.setattr(opfuse.core.inline, "MAPPED_MIN_TENSOR", 16)
    monkeypatch.setattr(opfuse.core.inline, "STREAMED_BYTES", 0)


def assorted() -> onnx.ModelProto:
    """Several initializers (float32 with a doc string, float16, int64 read as a shape, one that is a
    graph output, a small one), an If whose branch has its own initializer, doc strings and metadata."""
    r = np.random.default_rng(0)
    w = numpy_helper.from_array(r.normal(size=(64, 64)).astype(np.float32), "W")
    w.doc_string = "a weight"
    branch_init = tensor("B2", np.full((64,), 2, np.float32))
    then = helper.make_graph([helper.make_node("Add", ["y", "B2"], ["t"])], "then", [],
                             [vinfo("t", [1, 64])], [branch_init])
    otherwise = helper.make_graph([helper.make_node("Identity", ["y"], ["e"])], "else", [], [vinfo("e", [1, 64])])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
             helper.make_node("If", ["c"], ["z"], then_branch=then, else_branch=otherwise, name="if"),
             helper.make_node("Cast", ["H"], ["hf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Add", ["z", "hf"], ["z2"], name="add"),
             helper.make_node("Reshape", ["z2", "S"], ["out"], name="reshape")]
    m = model(nodes, [vinfo("x", [1, 64]), vinfo("c", [], TensorProto.BOOL)],
              [vinfo("out", [1, 64]), vinfo("Out2", [3]), vinfo("I", [10], TensorProto.INT64)],
              [w, tensor("H", r.normal(size=(64,)).astype(np.float16)), tensor("I", np.arange(10, dtype=np.int64)),
               tensor("S", np.array([1, 64], np.int64)), tensor("Out2", np.ones(3, np.float32))])
    m.graph.doc_string = "the graph"
    m.doc_string = "the model"
    m.producer_name = "opfuse tests"
    helper.set_model_props(m, {"k": "v", "a": "b"})
    return m


def with_a_function() -> onnx.ModelProto:
    """A model-local function called from the graph, and initializers of other dtypes (bfloat16, bool,
    strings)."""
    body = [helper.make_node("Mul", ["a", "a"], ["b"])]
    function = helper.make_function("local", "Square", ["a"], ["b"], body, [helper.make_opsetid("", 17)])
    bf16 = helper.make_tensor("BF", TensorProto.BFLOAT16, [4], np.arange(4, dtype=np.float32))
    words = helper.make_tensor("WORDS", TensorProto.STRING, [2], [b"one", b"two"])
    flags = tensor("FLAGS", np.array([True, False, True]))
    nodes = [helper.make_node("Square", ["x"], ["y"], domain="local", name="sq")]
    return model(nodes, [vinfo("x", [2, 3])], [vinfo("y", [2, 3]), vinfo("WORDS", [2], TensorProto.STRING)],
                 [bf16, words, flags], functions=[function], extra_opsets=[helper.make_opsetid("local", 1)])


def no_initializer() -> onnx.ModelProto:
    return model([helper.make_node("Relu", ["x"], ["y"])], [vinfo("x", [2])], [vinfo("y", [2])])


BUILDERS = {"assorted": assorted, "a function and other dtypes": with_a_function, "no initializer": no_initializer}


def _plain(m: ir.Model) -> ir.Model:
    """``m`` with every initializer an in-memory ``ir.Tensor`` (as a rewrite's result is)."""
    for value in m.graph.initializers.values():
        t = value.const_value
        if not isinstance(t, ir.StringTensor):
            value.const_value = ir.Tensor(t.numpy(), dtype=t.dtype, name=t.name, doc_string=t.doc_string,
                                          metadata_props=dict(t.metadata_props))
    return m


@pytest.mark.parametrize("form", ["parsed", "in memory"])
@pytest.mark.parametrize("case", sorted(BUILDERS))
def test_the_streamed_file_is_the_bytes_onnx_ir_writes(case, form, tmp_path):
    proto = BUILDERS[case]()
    m = ir.serde.deserialize_model(proto)
    if form == "in memory":
        m = _plain(m)
        for value in list(m.graph.initializers.values())[:1]:  # (a tensor's metadata is written too)
            value.const_value.metadata_props["origin"] = "test"
    ir.save(m, tmp_path / "saved.onnx")
    write_inline(m, tmp_path / "streamed.onnx")
    assert (tmp_path / "streamed.onnx").read_bytes() == (tmp_path / "saved.onnx").read_bytes()
    assert onnx.load(tmp_path / "streamed.onnx") == onnx.load(tmp_path / "saved.onnx")


def test_one_graph_field_is_written(tmp_path):
    """A reader that replaces a repeated message field (Netron's) must see the whole graph."""
    m = ir.serde.deserialize_model(assorted())
    write_inline(m, tmp_path / "m.onnx")
    data = (tmp_path / "m.onnx").read_bytes()
    fields = list(opfuse.core.inline._fields(data, 0, len(data)))
    assert [f[0] for f in fields].count(7) == 1


def test_writing_holds_one_tensor_at_a_time(tmp_path, mapped_everywhere):
    """The peak of Python's allocations while writing 24 tensors of 1 MB, in memory or mapped from a file:
    below twice the largest tensor (serialising the whole model would hold every tensor twice)."""
    r = np.random.default_rng(1)
    size = 1 << 18  # float32: 1 MB each
    inits = [tensor(f"W{i}", r.normal(size=size).astype(np.float32)) for i in range(24)]
    nodes = [helper.make_node("Add", ["x" if i == 0 else f"s{i - 1}", f"W{i}"], [f"s{i}" if i < 23 else "y"])
             for i in range(24)]
    proto = model(nodes, [vinfo("x", [size])], [vinfo("y", [size])], inits)
    in_memory = _plain(ir.serde.deserialize_model(proto))
    onnx.save(proto, tmp_path / "in.onnx")
    mapped, _ = load_model(tmp_path / "in.onnx", check=False)
    assert all(isinstance(v.const_value, MappedTensor) for v in mapped.graph.initializers.values())
    for name, m in [("in memory", in_memory), ("mapped", mapped)]:
        tracemalloc.start()
        try:
            write_inline(m, tmp_path / f"{name}.onnx")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 2 * 4 * size + (256 << 10), (name, peak)
    ir.save(ir.serde.deserialize_model(proto), tmp_path / "saved.onnx")
    for name in ("in memory", "mapped"):
        assert (tmp_path / f"{name}.onnx").read_bytes() == (tmp_path / "saved.onnx").read_bytes()


def test_mapped_weights_are_the_files_bytes_and_write_back_the_same(tmp_path, mapped_everywhere):
    proto = assorted()
    onnx.save(proto, tmp_path / "m.onnx")
    m, _ = load_model(tmp_path / "m.onnx")
    kinds = {name: type(v.const_value) for name, v in m.graph.initializers.items()}
    assert kinds == {"W": MappedTensor, "H": MappedTensor, "I": MappedTensor, "S": MappedTensor,
                     "Out2": ir.serde.TensorProtoTensor}  # (12 bytes: parsed)
    for t in proto.graph.initializer:
        array = m.graph.initializers[t.name].const_value.numpy()
        np.testing.assert_array_equal(array, numpy_helper.to_array(t))
    assert not m.graph.initializers["W"].const_value.numpy().flags.writeable
    assert m.graph.initializers["W"].const_value.doc_string == "a weight"
    assert not needs_external_data(m)  # (an inline model: written inline)
    write_inline(m, tmp_path / "again.onnx")
    ir.save(ir.load(tmp_path / "m.onnx"), tmp_path / "saved.onnx")  # (what the file parsed as a whole writes)
    assert (tmp_path / "again.onnx").read_bytes() == (tmp_path / "saved.onnx").read_bytes()
    assert read_model(tmp_path / "again.onnx").graph.initializers["W"].const_value.numpy().tobytes() == (
        proto.graph.initializer[0].raw_data)


def test_mapped_dtypes(tmp_path, mapped_everywhere):
    """Whole-byte dtypes in raw_data are mapped, bfloat16 and float8 among them (ml_dtypes' arrays);
    4-bit ones and data in typed fields are parsed; each reads as onnx-ir reads the file."""
    raw = {"bf16": (TensorProto.BFLOAT16, np.arange(32, dtype=np.float32).astype(ml_dtypes.bfloat16)),
           "f8": (TensorProto.FLOAT8E4M3FN, (np.arange(32, dtype=np.float32) / 4).astype(ml_dtypes.float8_e4m3fn)),
           "c64": (TensorProto.COMPLEX64, (np.arange(32) + 1j).astype(np.complex64)),
           "flags": (TensorProto.BOOL, np.arange(64) % 3 == 0), "u16": (TensorProto.UINT16, np.arange(64, dtype=np.uint16))}
    inits = [helper.make_tensor(name, dtype, array.shape, array.tobytes(), raw=True) for name, (dtype, array) in raw.items()]
    inits += [helper.make_tensor("i4", TensorProto.INT4, [64], (np.arange(64) % 8 - 4).tolist()),
              helper.make_tensor("bf16_typed", TensorProto.BFLOAT16, [32], np.arange(32, dtype=np.float32).tolist())]
    graph = helper.make_graph([], "g", [], [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                            for t in inits], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    proto.ir_version = 10
    onnx.save(proto, tmp_path / "m.onnx")
    mapped, _ = load_model(tmp_path / "m.onnx", check=False)
    parsed = ir.load(tmp_path / "m.onnx")
    assert {n for n, v in mapped.graph.initializers.items() if isinstance(v.const_value, MappedTensor)} == set(raw)
    for name, value in mapped.graph.initializers.items():
        expected = parsed.graph.initializers[name].const_value
        assert value.const_value.numpy().dtype == expected.numpy().dtype
        assert value.const_value.tobytes() == expected.tobytes()
    write_inline(mapped, tmp_path / "streamed.onnx")
    ir.save(parsed, tmp_path / "saved.onnx")
    assert (tmp_path / "streamed.onnx").read_bytes() == (tmp_path / "saved.onnx").read_bytes()
    with pytest.raises(ValueError, match="the file the model's weights are read from"):
        write_inline(mapped, tmp_path / "m.onnx")


def test_the_weights_stay_when_the_file_is_replaced(tmp_path, mapped_everywhere):
    """The map holds the file it was made from: the weights (and what is written from them) are the
    ones loaded, whatever replaces the file's path meanwhile (``--overwrite``)."""
    onnx.save(assorted(), tmp_path / "m.onnx")
    ir.save(ir.load(tmp_path / "m.onnx"), tmp_path / "saved.onnx")
    expected = (tmp_path / "saved.onnx").read_bytes()
    m, _ = load_model(tmp_path / "m.onnx")
    other = assorted()
    other.graph.initializer[0].raw_data = bytes(len(other.graph.initializer[0].raw_data))
    onnx.save(other, tmp_path / "other.onnx")
    os.replace(tmp_path / "other.onnx", tmp_path / "m.onnx")
    write_inline(m, tmp_path / "out.onnx")
    assert (tmp_path / "out.onnx").read_bytes() == expected


def test_a_file_laid_out_otherwise_is_read_as_a_whole(tmp_path, mapped_everywhere):
    # a tensor stored in float_data: parsed, the others mapped
    proto = assorted()
    floats = helper.make_tensor("F", TensorProto.FLOAT, [64], np.ones(64, np.float32))
    proto.graph.initializer.append(floats)
    proto.graph.output.append(vinfo("F", [64]))
    onnx.save(proto, tmp_path / "floats.onnx")
    m, _ = load_model(tmp_path / "floats.onnx")
    assert type(m.graph.initializers["F"].const_value) is ir.serde.TensorProtoTensor
    assert type(m.graph.initializers["W"].const_value) is MappedTensor
    # two encodings of the graph field (protobuf merges them): not mapped, loaded as before
    first = assorted()
    second = onnx.ModelProto()
    second.graph.node.append(helper.make_node("Identity", ["out"], ["out_copy"]))
    (tmp_path / "twice.onnx").write_bytes(first.SerializeToString() + second.SerializeToString())
    assert read_mapped(tmp_path / "twice.onnx") is None
    # a tensor with external data: read by path as before (the checker finds its file)
    external = assorted()
    onnx.save(external, tmp_path / "ext.onnx", save_as_external_data=True, location="ext.data",
              size_threshold=4096)
    assert read_mapped(tmp_path / "ext.onnx") is None
    m, _ = load_model(tmp_path / "ext.onnx")
    assert isinstance(m.graph.initializers["W"].const_value, ir.ExternalTensor)
    # truncated: the same one line as before
    data = (tmp_path / "floats.onnx").read_bytes()
    (tmp_path / "cut.onnx").write_bytes(data[: len(data) // 2])
    assert read_mapped(tmp_path / "cut.onnx") is None
    with pytest.raises(BadInputError, match="not an ONNX model"):
        load_model(tmp_path / "cut.onnx")


def test_a_mapped_model_is_checked_as_a_parsed_one(tmp_path, mapped_everywhere):
    """The checks see the mapped initializers as what they are (an invalid node is still refused)."""
    bad = assorted()
    bad.graph.node.append(helper.make_node("MatMul", ["W"], ["lonely"], name="one_input"))
    onnx.save(bad, tmp_path / "bad.onnx")
    with pytest.raises(BadInputError, match="invalid ONNX model"):
        load_model(tmp_path / "bad.onnx")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
def test_the_pages_read_are_given_back(tmp_path, mapped_everywhere):
    r = np.random.default_rng(2)
    proto = model([helper.make_node("Add", ["x", "W"], ["y"])], [vinfo("x", [1 << 20])], [vinfo("y", [1 << 20])],
                  [tensor("W", r.normal(size=1 << 20).astype(np.float32))])
    onnx.save(proto, tmp_path / "m.onnx")
    m, _ = load_model(tmp_path / "m.onnx")
    assert float(m.graph.initializers["W"].const_value.numpy().sum()) == pytest.approx(
        float(numpy_helper.to_array(proto.graph.initializer[0]).sum()), rel=1e-4)

    def resident() -> int:
        total, current = 0, None
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and not head[0].endswith(":"):
                    current = head[5] if len(head) > 5 else None
                elif head and head[0] == "Rss:" and current == str(tmp_path / "m.onnx"):
                    total += int(head[1]) * 1024
        return total

    assert resident() > 3 << 20
    drop_resident_pages(m)
    assert resident() < 1 << 20


def test_a_large_inline_model_is_verified_from_the_staged_file_and_written_as_before(tmp_model, tmp_path,
                                                                                     monkeypatch):
    source = tmp_model(conv_bn_model())
    reference, _ = opfuse.optimize(str(source), output=tmp_path / "reference.onnx", tune=False)
    seen = []
    real = opfuse.pipeline.verify_models

    def spy(original, optimised, **kw):
        seen.append({type(v.const_value) for m in (original, optimised) for v in m.graph.initializers.values()})
        return real(original, optimised, **kw)

    monkeypatch.setattr(opfuse.pipeline, "verify_models", spy)
    monkeypatch.setattr(opfuse.core.inline, "MAPPED_FILE_BYTES", 0)
    monkeypatch.setattr(opfuse.core.inline, "MAPPED_MIN_TENSOR", 16)
    monkeypatch.setattr(opfuse.core.inline, "STREAMED_BYTES", 0)
    written = []
    real_write = opfuse.core.inline.write_inline
    monkeypatch.setattr("opfuse.save.write_inline", lambda m, p: (written.append(p), real_write(m, p)))
    _, report = opfuse.optimize(str(source), output=tmp_path / "mapped.onnx", tune=False)
    assert report.verification.ok
    assert seen == [{MappedTensor}] and len(written) == 1
    assert (tmp_path / "mapped.onnx").read_bytes() == (tmp_path / "reference.onnx").read_bytes()
    # --overwrite: the input's weights stay what they were while its path is replaced
    opfuse.optimize(str(source), output=source, overwrite=True, tune=False)
    assert source.read_bytes() == (tmp_path / "reference.onnx").read_bytes()
    assert not list(tmp_path.glob(".opfuse-*"))


def test_a_failed_verification_of_a_mapped_model_writes_nothing(tmp_model, tmp_path, monkeypatch, mapped_everywhere):
    source = tmp_model(conv_bn_model())

    def wrong(original, optimised, **kw):
        raise VerificationError("made to fail")

    monkeypatch.setattr(opfuse.pipeline, "verify_models", wrong)
    with pytest.raises(VerificationError):
        opfuse.optimize(str(source), output=tmp_path / "out.onnx", tune=False)
    assert not (tmp_path / "out.onnx").exists()
    assert not list(tmp_path.glob(".opfuse-*"))
