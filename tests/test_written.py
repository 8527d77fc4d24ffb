"""What is verified is what is written: the staged bytes are the model verification runs,
a change after verification is verified again, and no new value takes a removed value's name
(a name reused with another type reached the file once: ONNX Runtime refused to load it).
"""

from __future__ import annotations

import dataclasses
import sys
import types

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import extras
import opfuse.pipeline
from decoder_nets import export_tiny_llama
from graphs import conv_bn_model, ort_run
from opfuse.core.analysis import NameLedger, NameTable
from opfuse.errors import VerificationError
from opfuse.save import StagedModel, fingerprint


def test_the_model_verified_is_the_file_written(tmp_model, tmp_path, monkeypatch):
    seen = []
    real = opfuse.pipeline.verify_models

    def spy(original, optimised, **kw):
        seen.append(ir.serde.serialize_model(optimised).SerializeToString())
        return real(original, optimised, **kw)

    monkeypatch.setattr(opfuse.pipeline, "verify_models", spy)
    out = tmp_path / "out.onnx"
    opfuse.optimize(str(tmp_model(conv_bn_model())), output=out)
    assert len(seen) == 1
    # the file on disk, read the way verification read it
    assert seen[0] == ir.serde.serialize_model(ir.load(out)).SerializeToString()
    assert not list(tmp_path.glob(".opfuse-*"))  # nothing staged is left behind


def test_staged_bytes_changed_on_disk_are_not_committed(tmp_path):
    model = ir.serde.deserialize_model(conv_bn_model())
    out = tmp_path / "out.onnx"
    with StagedModel(model, out) as staged:
        staged.path.write_bytes(staged.path.read_bytes() + b"\0")
        with pytest.raises(RuntimeError, match="changed after they were verified"):
            staged.commit()
    assert not out.exists()
    assert not list(tmp_path.glob(".opfuse-*"))


def test_the_fingerprint_sees_a_changed_weight_attribute_and_name():
    model = ir.serde.deserialize_model(conv_bn_model())
    before = fingerprint(model)
    assert fingerprint(model) == before
    conv = next(n for n in model.graph if n.op_type == "Conv")
    w = conv.inputs[1]
    w.const_value = ir.tensor(w.const_value.numpy() * 2)
    assert fingerprint(model) != before
    again = fingerprint(model)
    conv.outputs[0].name = "renamed"
    assert fingerprint(model) != again


def _fake_device(monkeypatch, change):
    """The onnx target with a device whose compile step runs ``change`` on the model after
    verification (a device's compile is the step that comes after it)."""
    module = types.ModuleType("opfuse_test_device")

    class Options:
        @staticmethod
        def parse(pairs):
            return Options()

    def compile(model, report, **kw):  # noqa: A001 - the device interface's name
        change(model)

    module.Options, module.require_backend, module.compile = Options, lambda: None, compile
    monkeypatch.setitem(sys.modules, module.__name__, module)
    real = opfuse.pipeline.load_target
    monkeypatch.setattr(opfuse.pipeline, "load_target",
                        lambda name: dataclasses.replace(real(name), device=module.__name__))
    calls = []
    verify = opfuse.pipeline.verify_models
    monkeypatch.setattr(opfuse.pipeline, "verify_models", lambda *a, **kw: calls.append(1) or verify(*a, **kw))
    return calls


def test_a_change_after_verification_is_verified_again_and_written_as_verified(tmp_model, tmp_path, monkeypatch):
    calls = _fake_device(monkeypatch, lambda m: m.metadata_props.update({"compiled": "yes"}))
    out = tmp_path / "out.onnx"
    _, report = opfuse.optimize(str(tmp_model(conv_bn_model())), output=out)
    assert len(calls) == 2
    assert any("verified again" in n for n in report.notes)
    assert {p.key: p.value for p in onnx.load(out).metadata_props}["compiled"] == "yes"


def test_a_wrong_change_after_verification_is_caught_and_nothing_is_written(tmp_model, tmp_path, monkeypatch):
    def corrupt(model):
        conv = next(n for n in model.graph if n.op_type == "Conv")
        conv.inputs[1].const_value = ir.tensor(conv.inputs[1].const_value.numpy() * 2)

    calls = _fake_device(monkeypatch, corrupt)
    out = tmp_path / "out.onnx"
    with pytest.raises(VerificationError, match="nothing was written"):
        opfuse.optimize(str(tmp_model(conv_bn_model())), output=out)
    assert len(calls) == 2
    assert not out.exists()
    assert not list(tmp_path.glob(".opfuse-*"))


# -- names -----------------------------------------------------------------------------------

def _chain() -> ir.Model:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([4]))
    a = ir.node("Relu", [x], name="relu")
    a.outputs[0].name = "t"
    b = ir.node("Neg", [a.outputs[0]], name="neg")
    b.outputs[0].name = "y"
    graph = ir.Graph([x], [b.outputs[0]], nodes=[a, b], opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


def test_a_removed_value_name_is_never_given_to_a_new_value():
    model = _chain()
    ledger = NameLedger(model)
    relu, neg = list(model.graph)
    neg.replace_input_with(0, model.graph.inputs[0])
    model.graph.remove(relu, safe=True)  # 't' is gone
    assert ledger.settle(model) == {}
    assert NameTable(model).fresh("t") != "t"  # a pass asking for a fresh name never gets it back
    new = ir.node("Abs", [model.graph.inputs[0]], name="abs")
    new.outputs[0].name = "t"  # as onnx-ir's per-graph counter mints a name after a clone
    model.graph.insert_before(neg, new)
    neg.replace_input_with(0, new.outputs[0])
    renamed = ledger.settle(model)
    assert renamed == {"t": new.outputs[0].name} and new.outputs[0].name != "t"
    assert [v.name for v in model.graph.outputs] == ["y"]  # a graph output keeps its name


def test_a_replacement_keeps_the_name_of_the_tensor_it_replaces():
    model = _chain()
    ledger = NameLedger(model)
    relu, neg = list(model.graph)
    new = ir.node("Abs", [model.graph.inputs[0]], name="abs")
    model.graph.insert_before(relu, new)
    relu.outputs[0].replace_all_uses_with(new.outputs[0])
    model.graph.remove(relu, safe=True)
    new.outputs[0].name = "t"  # same pass: the rewrite's result takes the replaced tensor's name
    assert ledger.settle(model) == {}
    assert new.outputs[0].name == "t"


def test_a_reused_name_cannot_reach_the_file(tmp_path):
    """The trait of a 32-layer Llama that once reached the file: the dynamo exporter's
    ``val_N`` names, declared types for every value, and a fusion whose new values onnx-ir
    names ``val_N`` by a counter that a clone restarts. Here the values the fusions remove
    are numbered first, so the first names minted are theirs. (The export with a mask and position_ids
    inputs: test_mask_fill's, test_rotary_table's and test_padded_verification's, made once a session.)"""
    exported = export_tiny_llama(tmp_path / "llama.onnx", mask="input", positions=True)
    model = ir.load(exported)
    kept = {v.name for n in opfuse.optimize(model, target="onnxruntime", verify=False)[0].graph for v in n.outputs}
    outputs = {v.name for v in model.graph.outputs}
    for k, w in enumerate(list(model.graph.initializers.values())):  # (the exporter names some val_N too)
        model.graph.initializers.pop(w.name)
        w.name = f"w_{k}"
        model.graph.register_initializer(w)
    values = [v for n in model.graph for v in n.outputs if v.name not in outputs]
    for k, v in enumerate(values):
        v.name = f"tmp_{k}"
    for k, v in enumerate([v for v in values if v.name not in kept] + [v for v in values if v.name in kept]):
        v.name = f"val_{k}"  # (after all were renamed: no two values share a name on the way)
    ir.passes.common.ShapeInferencePass()(model)  # every value declared, as the exporter does
    declared = {v.name: v.dtype for n in model.graph for v in n.outputs}
    renamed = tmp_path / "renamed.onnx"
    ir.save(model, renamed)

    out = tmp_path / "out.onnx"
    _, report = opfuse.optimize(str(renamed), output=out, target="onnxruntime")
    assert report.verification.ok
    written = ir.load(out)
    for node in written.graph:
        for v in node.outputs:
            if v.name in declared and v.dtype is not None:
                assert v.dtype == declared[v.name], f"{v.name} is {v.dtype}, was declared {declared[v.name]}"
    feeds = {"input_ids": np.arange(16, dtype=np.int64).reshape(2, 8) % 100,
             "attention_mask": np.ones((2, 8), np.int64), "position_ids": np.tile(np.arange(8), (2, 1))}
    ort.InferenceSession(str(out))  # loads
    expected, got = ort_run(onnx.load(renamed), feeds), ort_run(onnx.load(out), feeds)
    for name, ref in expected.items():
        np.testing.assert_allclose(got[name], ref, rtol=1e-3, atol=1e-4 * float(np.abs(ref).max()))


# -- paths -----------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["onnx", "onnxruntime", "qnn"])
def test_external_data_is_read_beside_the_model_whatever_the_working_directory(tmp_path, monkeypatch, target):
    if target == "qnn":
        extras.require("onnxruntime_qnn")
    from opfuse.cli import main

    folder, elsewhere = tmp_path / "models", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    onnx.save(conv_bn_model(), folder / "m.onnx", save_as_external_data=True, location="m.onnx.data",
              size_threshold=0)
    monkeypatch.chdir(elsewhere)  # neither the model's folder nor the output's
    out = folder / "out.onnx"
    dims = ["--dim", "N=1"] if target == "qnn" else []
    assert main(["optimize", str(folder / "m.onnx"), "-o", str(out), "--target", target, *dims]) == 0
    assert (folder / "out.onnx.data").exists()  # the input kept its weights outside: so does the output
    assert not list(elsewhere.iterdir())  # nothing was written where it ran
    feeds = {"x": np.random.default_rng(0).normal(size=(1, 4, 7, 7)).astype(np.float32)}
    expected = ort_run(onnx.load(folder / "m.onnx"), feeds)
    got = ort_run(onnx.load(out), feeds)
    for name, ref in expected.items():
        np.testing.assert_allclose(got[name], ref, rtol=1e-4, atol=1e-5 * float(np.abs(ref).max()))
