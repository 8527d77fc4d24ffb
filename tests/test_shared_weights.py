"""Weights that stay where they are (issue 49's memory bars): a model kept with external data runs
in verification's sessions from its mapped file, not from a copy, and the float64 reference of the
original's own variation widens its weights as the run reads them, with the same numbers as the
model widened whole."""

from __future__ import annotations

import mmap
import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import opfuse.runtime as runtime
from opfuse.load import load_model
from opfuse.runtime import create_session, drop_resident_pages, serialized, shared_weights
from opfuse.verify import verify_models
from opfuse.verify.variation import runtime_rounding
from test_padded_verification import D, deep_net


def _external(tmp_path, proto: onnx.ModelProto, name: str = "m.onnx") -> ir.Model:
    path = tmp_path / name
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=name + ".data", size_threshold=1024)  # (the weights; the scalars inline)
    model, _ = load_model(str(path))
    assert all(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values()
               if v.const_value.nbytes >= 1024)
    return model


def _feeds(seed=0):
    return {"x": np.random.default_rng(seed).standard_normal((1, 16, D)).astype(np.float32)}


def test_a_shared_session_reads_the_mapped_file_and_computes_what_a_copy_does(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "SHARED_MIN_BYTES", 1024)
    model = _external(tmp_path, deep_net())
    copied = create_session(model, "disabled", prepack=False)  # (through a serialised copy)
    shared = create_session(model, "disabled", prepack=False, share_weights=True)
    values, arrays = shared._opfuse_weights
    assert set(arrays) == {n for n, v in model.graph.initializers.items() if v.const_value.nbytes >= 1024}
    for name, array in arrays.items():  # the runtime's weights are views of the mapped file
        tensor = model.graph.initializers[name].const_value
        if isinstance(tensor, ir.ExternalTensor):
            assert isinstance(tensor.raw, mmap.mmap) and np.shares_memory(array, tensor.numpy())
    x = _feeds()
    assert np.array_equal(copied.run(None, x)[0], shared.run(None, x)[0])
    drop_resident_pages(model)  # the pages go, the mapping stays: the weights read the same
    assert np.array_equal(copied.run(None, x)[0], create_session(model, share_weights=True).run(None, x)[0])
    # the model is left as it was: its weights still external, the file the only copy
    assert all(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values()
               if v.const_value.nbytes >= 1024)


def test_small_or_input_initializers_stay_in_the_graph_with_their_bytes(tmp_path):
    model = _external(tmp_path, deep_net())  # 64x64 float32 weights: under the default size
    proto, arrays = shared_weights(model)
    assert arrays == {}
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    x = _feeds()
    assert np.array_equal(create_session(model, share_weights=True).run(None, x)[0],
                          create_session(serialized(load_model(deep_net())[0])).run(None, x)[0])


@pytest.mark.parametrize("threshold", [1024, None])
def test_the_float64_reference_of_an_external_model_equals_the_one_widened_whole(tmp_path, monkeypatch, threshold):
    """The weights kept float32 and cast as the run reads them: the same d0, to the last bit, as the
    model with every weight widened in the proto (the path of a model given as bytes)."""
    if threshold is not None:
        monkeypatch.setattr(runtime, "SHARED_MIN_BYTES", threshold)
    original, _ = load_model(deep_net())
    whole = serialized(original)
    assert isinstance(whole, bytes)
    external = _external(tmp_path, deep_net())
    sets = []
    for seed in range(2):
        x = _feeds(seed)
        expected = create_session(whole).run(None, x)
        sets.append((f"set {seed}", x, {"y": expected[0]}))
    level_bytes, bytes_d0 = runtime_rounding(whole, sets, ["y"])
    level_ir, ir_d0 = runtime_rounding(external, sets, ["y"])
    assert level_bytes == level_ir == "float64"
    assert bytes_d0 == ir_d0 and all(v > 0 for v in ir_d0.values())


def _tied(vocab=512, hidden=32):
    """An embedding lookup, a layer, and a head tied to the embedding (MatMul with its Transpose)."""
    from onnx import TensorProto, helper

    r = np.random.default_rng(7)
    table = r.standard_normal((vocab, hidden)).astype(np.float32)
    w = (r.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]),
             helper.make_node("MatMul", ["e", "w"], ["m"]),
             helper.make_node("Tanh", ["m"], ["h"]),
             helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "table_t"], ["logits"])]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocab])],
                              [onnx.numpy_helper.from_array(table, "table"), onnx.numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _float64_reference(tmp_path, monkeypatch, proto):
    """runtime_rounding of ``proto`` kept with external data, on one batch of ids: (level, d0, the model
    serialised whole, the input sets, the graph of the float64 reference's one session)."""
    import opfuse.verify.variation as variation

    ids = np.random.default_rng(8).integers(0, 512, (2, 5), dtype=np.int64)
    whole = serialized(load_model(proto)[0])
    expected = create_session(whole).run(None, {"ids": ids})[0]
    sets = [("", {"ids": ids}, {"logits": expected})]
    seen = []
    built = variation.session_with_weights

    def capture(proto64, weights, *args, **kwargs):
        seen.append(onnx.ModelProto.FromString(proto64.SerializeToString()))
        return built(proto64, weights, *args, **kwargs)

    monkeypatch.setattr(variation, "session_with_weights", capture)
    level, d0 = runtime_rounding(_external(tmp_path, proto), sets, ["logits"])
    (graph,) = (m.graph for m in seen)
    return level, d0, whole, sets, graph


def test_the_float64_reference_widens_what_a_lookup_takes_not_the_whole_table(tmp_path, monkeypatch):
    """A weight read by an op that only moves or selects its elements (an embedding's Gather, a tied
    head's Transpose) is read by it in float32 and widened after it: the lookup widens the rows it
    takes. The same d0, to the last bit, as the model widened whole."""

    monkeypatch.setattr(runtime, "SHARED_MIN_BYTES", 1024)
    proto = _tied()
    level, d0, whole, sets, graph = _float64_reference(tmp_path, monkeypatch, proto)
    assert level == "float64" and d0 == runtime_rounding(whole, sets, ["logits"])[1] and d0[("", "logits")] > 0
    by_output = {o: n for n in graph.node for o in n.output}
    stored = {t.name: t.data_type for t in graph.initializer}
    for op in ("Gather", "Transpose"):  # each reads the float32 table, and a Cast widens what it gives
        (node,) = (n for n in graph.node if n.op_type == op)
        assert stored[node.input[0]] == onnx.TensorProto.FLOAT and node.input[0] not in by_output
        (cast,) = (n for n in graph.node if n.input == [node.output[0]])
        assert cast.op_type == "Cast"
    # the table is never cast whole; the layer's weight (read by a MatMul) is
    assert sorted(by_output[n.input[1]].op_type for n in graph.node if n.op_type == "MatMul") == ["Cast", "Cast"]
    assert sum(1 for n in graph.node if n.op_type == "Cast" and stored.get(n.input[0]) is not None) == 1


@pytest.mark.parametrize("tied", [True, False])
def test_a_large_product_of_the_float64_reference_is_widened_a_block_of_columns_at_a_time(tmp_path, monkeypatch, tied):
    """A MatMul whose right operand is a large weight (a head; tied: the Transpose of the embedding) is
    computed in the float64 reference as MatMuls of blocks of its columns, each widened on its own and
    their results concatenated: the same d0 as the model widened whole, with one block in float64."""
    import opfuse.verify.variation as variation

    monkeypatch.setattr(runtime, "SHARED_MIN_BYTES", 1024)
    monkeypatch.setattr(variation, "SPLIT_BYTES", 512 * 32 * 8 // 3 + 8)  # three blocks of the table
    proto = _tied()
    if not tied:  # the head its own weight (as TorchScript exports it): MatMul(h, W) with W [hidden, vocab]
        table = onnx.numpy_helper.to_array(proto.graph.initializer[0])
        proto.graph.initializer.append(onnx.numpy_helper.from_array(np.ascontiguousarray(table.T), "head"))
        head = next(n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] == "table_t")
        head.input[1] = "head"
        proto.graph.node.remove(next(n for n in proto.graph.node if n.op_type == "Transpose"))
    level, d0, whole, sets, graph = _float64_reference(tmp_path, monkeypatch, proto)
    assert level == "float64" and d0[("", "logits")] > 0
    assert d0[("", "logits")] == pytest.approx(runtime_rounding(whole, sets, ["logits"])[1][("", "logits")], rel=1e-9)
    ops = [n.op_type for n in graph.node]
    assert ops.count("Concat") == 1 and ops.count("Slice") == 3 and ops.count("MatMul") == 4
    assert ops.count("Transpose") == (3 if tied else 0)


def test_an_extra_output_of_the_original_does_not_keep_the_head_whole_in_float64(tmp_path, monkeypatch):
    """Verification exposes a tied head's transposed table as an output of the original (a floor's source);
    the float64 reference, asked for the logits only, leaves it out of its outputs and still computes the
    head a block of columns at a time: the same d0 as the model widened whole."""
    import opfuse.verify.variation as variation
    from onnx import TensorProto, helper

    monkeypatch.setattr(runtime, "SHARED_MIN_BYTES", 1024)
    monkeypatch.setattr(variation, "SPLIT_BYTES", 512 * 32 * 8 // 3 + 8)  # three blocks of the table
    proto = _tied()
    proto.graph.output.append(helper.make_tensor_value_info("table_t", TensorProto.FLOAT, [32, 512]))
    level, d0, whole, sets, graph = _float64_reference(tmp_path, monkeypatch, proto)
    assert level == "float64" and d0[("", "logits")] > 0
    assert d0[("", "logits")] == pytest.approx(runtime_rounding(whole, sets, ["logits"])[1][("", "logits")], rel=1e-9)
    assert [o.name for o in graph.output] == ["logits"]
    ops = [n.op_type for n in graph.node]
    assert ops.count("Concat") == 1 and ops.count("Slice") == 3 and ops.count("MatMul") == 4


def test_a_model_with_large_weights_in_the_file_gives_its_sessions_the_weights_as_they_are(monkeypatch):
    """Weights kept inside the model file (no external data), when they are large, go to verification's
    sessions as they are, like external ones (no serialised copy held for all the sessions): the same
    outputs, the same float64 reference, and a wrong rewrite still fails."""
    monkeypatch.setattr(runtime, "SHARED_MIN_BYTES", 1024)
    original, _ = load_model(deep_net())
    whole = serialized(original)
    assert isinstance(whole, bytes) and not runtime.weights_shared(original)
    monkeypatch.setattr(runtime, "SHARED_TOTAL_BYTES", 1 << 16)
    assert runtime.weights_shared(original) and serialized(original) is original
    session = create_session(original, "disabled", prepack=False, share_weights=True)
    assert session._opfuse_weights[1]  # (the weights given as arrays)
    sets = []
    for seed in range(2):
        x = _feeds(seed)
        expected = create_session(whole).run(None, x)
        assert np.array_equal(expected[0], session.run(None, x)[0])
        sets.append((f"set {seed}", x, {"y": expected[0]}))
    assert runtime_rounding(whole, sets, ["y"]) == runtime_rounding(original, sets, ["y"])
    good = verify_models(original, load_model(deep_net(reorder=True))[0])
    assert good.ok and good.variation_level == "float64"
    bad = verify_models(original, load_model(deep_net(wrong="scaled", reorder=True))[0])
    assert not bad.ok


def test_verification_of_external_models_still_fails_a_wrong_rewrite(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "SHARED_MIN_BYTES", 1024)
    original = _external(tmp_path, deep_net(), "a.onnx")
    good = verify_models(original, _external(tmp_path, deep_net(reorder=True), "b.onnx"))
    assert good.ok and good.variation_level == "float64"
    bad = verify_models(original, _external(tmp_path, deep_net(wrong="scaled", reorder=True), "c.onnx"))
    (check,) = bad.outputs
    assert not bad.ok and check.max_abs_error > 2 * check.floor


def test_a_tensor_no_input_reaches_is_fetched_once_and_its_scale_still_sets_the_floor():
    """A tied head's transposed table (Transpose of the embedding, then MatMul to the logits) enters
    the last operator: its largest magnitude sets the output's floor as before, but it is fetched on
    the first run only, not held in every input set."""
    from onnx import TensorProto, helper

    from opfuse.verify import TOLERANCES
    from opfuse.verify.reference import ScaledOnce as _ScaledOnce, input_free as _input_free

    w = np.random.default_rng(3).standard_normal((8, 16)).astype(np.float32) * 10
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4, 8])],
                              [onnx.numpy_helper.from_array(w, "w")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model, _ = load_model(proto)
    assert _input_free(model, {"wt", "x", "y"}) == {"wt"}
    from opfuse.verify.reference import permuted_scales

    known = permuted_scales(model, {"wt"})  # (a Transpose keeps every element: read from the weight itself)
    assert set(known) == {"wt"} and known["wt"].shape == () and float(known["wt"]) == float(np.abs(w).max())
    x = np.random.default_rng(4).standard_normal((1, 4, 16)).astype(np.float32)
    result = verify_models(model, load_model(proto)[0], inputs={"x": x})
    (check,) = result.outputs
    assert result.ok and check.floor == pytest.approx(TOLERANCES["float32"][1] * float(np.abs(w).max()), rel=1e-7)

    class Fake:
        names = ["y", "wt"]
        fetched: list = []

        def __call__(self, feeds):
            self.fetched.append(list(self.names))
            return {"y": np.ones(2, np.float32), "wt": w.T.copy()}

    runner = _ScaledOnce(Fake(), {"wt"})
    first, second = runner({}), runner({})
    assert Fake.fetched == [["y", "wt"], ["y"]]
    assert first["wt"].shape == () and float(first["wt"]) == float(np.abs(w).max()) and second["wt"] is first["wt"]
    Fake.fetched, Fake.names = [], ["y", "wt"]
    runner = _ScaledOnce(Fake(), {"wt"}, known)  # known: never fetched, not even once
    assert float(runner({})["wt"]) == float(np.abs(w).max()) and Fake.fetched == [["y"]]


def test_weights_the_rewrites_made_are_read_back_from_the_file_written(tmp_path):
    """With an output, the model optimize returns holds its new weights (a folded conv's) as references
    to the data file written, the same bytes, not a second copy in memory: verification of the staged
    file and the rest of the run hold the weights once. The input's external weights stay external."""
    import opfuse
    from graphs import conv_bn_model

    src = tmp_path / "in.onnx"
    onnx.save_model(conv_bn_model(c_in=32, c_out=64), str(src), save_as_external_data=True,
                    location="in.onnx.data", size_threshold=0)
    out = tmp_path / "out.onnx"
    work, report = opfuse.optimize(str(src), output=str(out), tune=False)
    assert report.verification.ok
    tensors = {n: v.const_value for n, v in work.graph.initializers.items()}
    written = ir.load(out)
    external = [n for n, v in written.graph.initializers.items() if isinstance(v.const_value, ir.ExternalTensor)]
    assert external == ["W_folded"]  # (the folded weight; ONNX's writer keeps a small bias inline)
    for name in external:
        tensor = tensors[name]
        assert isinstance(tensor, ir.ExternalTensor), name
        assert pathlib.Path(tensor.path).resolve().parent == tmp_path.resolve()
        assert np.array_equal(tensor.numpy(), written.graph.initializers[name].const_value.numpy())
    again = tmp_path / "again.onnx"  # the model returned still saves (its weights read from the file)
    ir.save(work, again, external_data="again.onnx.data")
    assert not list(tmp_path.glob(".opfuse-*"))


def test_without_an_output_the_new_weights_stay_in_memory(tmp_path):
    import opfuse
    from graphs import conv_bn_model

    src = tmp_path / "in.onnx"
    onnx.save_model(conv_bn_model(c_in=32, c_out=64), str(src), save_as_external_data=True,
                    location="in.onnx.data", size_threshold=0)
    work, report = opfuse.optimize(str(src), tune=False)
    assert report.verification.ok
    folded = [v.const_value for v in work.graph.initializers.values() if not isinstance(v.const_value, ir.ExternalTensor)]
    assert folded and all(t.numpy() is not None for t in folded)


def test_giving_back_memory_is_safe_to_call_anywhere():
    from opfuse.runtime import give_back_memory

    kept = np.ones(1 << 20, np.float32)
    give_back_memory()  # (glibc's malloc_trim where there is one; nothing elsewhere)
    assert float(kept.sum()) == float(1 << 20)


def test_dropping_a_large_models_pages_collects_the_cycles_left_behind(monkeypatch):
    """The pipeline runs with full collections off: a graph a step left behind (a cycle) holds its
    arrays until one runs. Dropping the pages of a model with large weights runs one; of a small
    model, none (its cost is not paid where nothing large can be held)."""
    import gc
    import weakref

    from opfuse.pipeline import young_collections_only

    class Node:
        pass

    model, _ = load_model(deep_net())
    with young_collections_only():
        gc.collect()
        a, b = Node(), Node()
        a.other, b.other, a.array = b, a, np.ones(1 << 16, np.float32)  # a cycle holding an array
        gone = weakref.ref(a)
        for _ in range(2):  # (alive: into the oldest generation, which only a full collection visits)
            gc.collect(1)
        del a, b  # (garbage now)
        gc.collect(1)
        assert gone() is not None
        drop_resident_pages(model)  # small weights: no full collection
        assert gone() is not None
        monkeypatch.setattr(runtime, "SHARED_TOTAL_BYTES", 1024)
        drop_resident_pages(model)
        assert gone() is None
