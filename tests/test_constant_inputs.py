"""``--constant-input NAME=VALUE``: an input bound to the value a deployment fixes, and the If it decides resolved.

The graphs are silero-vad's shape in miniature: ``If(Equal(sr, 16000))`` whose branches read
tensors of the main graph (``x``, the weights). The oracle is ONNX Runtime running the
original model fed the bound value (:func:`graphs.ort_run`), never opfuse's own code.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from graphs import assert_outputs_close, model, ort_run, rng, tensor, vinfo
from opfuse.cli import main
from opfuse.prepare.constant_inputs import deciding_inputs, resolve_constant_inputs
from opfuse.errors import BadInputError, VerificationError
from opfuse.passes.cleanup import CleanupPass
from opfuse.pipeline import optimize
from opfuse.quantization.pipeline import quantize
from opfuse.report import FusionReport
from opfuse.verify import verify_models
from qnn_graphs import needs_htp

X_SHAPE = [1, 3, 6, 6]


def sr_model(*, nested: bool = False) -> onnx.ModelProto:
    """y = If(sr == 16000): Relu(Conv(x, W)) else Sigmoid(Conv(x, W2)); with ``nested`` the
    then-branch holds a second If on sr > 12000 (Relu or Neg after its conv)."""
    r = rng(0)
    weights = [tensor("W", r.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)),
               tensor("W2", r.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)),
               tensor("B", r.normal(0, 0.1, 4).astype(np.float32)),
               tensor("k16", np.array(16000, np.int64)), tensor("k12", np.array(12000, np.int64))]
    y = vinfo("t_y", [1, 4, 6, 6])
    conv = helper.make_node("Conv", ["x", "W", "B"], ["t_c"], pads=[1, 1, 1, 1], name="t_conv")
    if nested:
        inner = [helper.make_graph([helper.make_node(op, ["t_c"], [f"i_{op}"], name=f"i_{op.lower()}")], op, [],
                                   [vinfo(f"i_{op}", [1, 4, 6, 6])]) for op in ("Relu", "Neg")]
        then_nodes = [conv, helper.make_node("Greater", ["sr", "k12"], ["t_cond"], name="t_gt"),
                      helper.make_node("If", ["t_cond"], ["t_y"], then_branch=inner[0], else_branch=inner[1],
                                       name="inner")]
    else:
        then_nodes = [conv, helper.make_node("Relu", ["t_c"], ["t_y"], name="t_relu")]
    else_nodes = [helper.make_node("Conv", ["x", "W2", "B"], ["e_c"], pads=[1, 1, 1, 1], name="e_conv"),
                  helper.make_node("Sigmoid", ["e_c"], ["e_y"], name="e_sig")]
    nodes = [helper.make_node("Equal", ["sr", "k16"], ["cond"], name="eq"),
             helper.make_node("If", ["cond"], ["y"], name="branch",
                              then_branch=helper.make_graph(then_nodes, "then", [], [y]),
                              else_branch=helper.make_graph(else_nodes, "else", [], [vinfo("e_y", [1, 4, 6, 6])]))]
    return model(nodes, [vinfo("x", X_SHAPE), vinfo("sr", [], TensorProto.INT64)], [vinfo("y", [1, 4, 6, 6])],
                 weights)


def x_feed(seed: int = 1) -> np.ndarray:
    return rng(seed).normal(0, 1, X_SHAPE).astype(np.float32)


def all_ops(m: ir.Model) -> list[str]:
    return [n.op_type for n in m.graph.all_nodes()]


def expected(original: onnx.ModelProto, sr: int, x: np.ndarray) -> dict[str, np.ndarray]:
    return ort_run(original, {"x": x, "sr": np.array(sr, np.int64)})


@pytest.mark.parametrize("sr, branch, ops, weight, gone", [
    (16000, "then_branch", ["Conv", "Relu"], "W", "W2"),
    (8000, "else_branch", ["Conv", "Sigmoid"], "W2", "W"),
])
def test_binding_resolves_the_if_to_the_branch_the_value_takes(sr, branch, ops, weight, gone):
    original = sr_model()
    result, report = optimize(original, constant_inputs={"sr": sr})
    assert all_ops(result) == ops  # no If anywhere, only the taken branch
    assert [v.name for v in result.graph.inputs] == ["x"]  # the input is gone from the interface
    assert weight in result.graph.initializers and gone not in result.graph.initializers
    x = x_feed()
    assert_outputs_close(expected(original, sr, x), ort_run(result, {"x": x}))
    assert report.verification.ok and f"sr={sr}" in " ".join(report.verification.notes)
    details = {r.pattern: r.detail for r in report.records}
    assert details["constant input"] == f"input 'sr' bound to {sr} (--constant-input): removed from the graph's inputs"
    assert details["If resolved"] == f"If 'branch' resolved to its {branch}: 2 nodes inlined"
    applied = json.loads(report.to_json())["applied"]
    assert {a["pattern"] for a in applied} >= {"constant input", "If resolved"}


def test_without_the_clean_up_the_input_is_bound_and_the_if_stays():
    original = sr_model()
    result, report = optimize(original, constant_inputs={"sr": 8000}, cleanup=False)
    assert "If" in all_ops(result) and [v.name for v in result.graph.inputs] == ["x"]
    assert any("--no-cleanup: nothing the bound values decide was folded" in n for n in report.notes)
    x = x_feed()
    assert_outputs_close(expected(original, 8000, x), ort_run(result, {"x": x}))


def test_a_nested_if_whose_condition_the_binding_decides_resolves_too():
    original = sr_model(nested=True)
    for sr, ops in ((16000, ["Conv", "Relu"]), (8000, ["Conv", "Sigmoid"])):
        result, report = optimize(original, constant_inputs={"sr": sr})
        assert all_ops(result) == ops
        x = x_feed(2)
        assert_outputs_close(expected(original, sr, x), ort_run(result, {"x": x}))
    assert [r.produced for r in report.records if r.pattern == "If resolved"] == ["else_branch"]
    _, report = optimize(original, constant_inputs={"sr": 16000})
    assert sorted(r.node for r in report.records if r.pattern == "If resolved") == ["branch", "inner"]


@settings(max_examples=8, deadline=None)
@given(sr=st.one_of(st.just(16000), st.integers(-(2**40), 2**40)))
def test_any_bound_value_computes_what_the_original_computes_on_it(sr):
    original = sr_model(nested=True)
    result, _ = optimize(original, constant_inputs={"sr": sr})
    assert "If" not in all_ops(result)
    x = x_feed(3)
    assert_outputs_close(expected(original, sr, x), ort_run(result, {"x": x}))


def test_verification_feeds_the_original_the_bound_value():
    """The rewrite for 8000 checked as if 16000 were bound: the outputs differ, so it fails."""
    original = ir.serde.deserialize_model(sr_model())
    wrong, _ = optimize(sr_model(), constant_inputs={"sr": 8000}, verify=False)
    assert not verify_models(original, wrong, constant_inputs={"sr": np.array(16000, np.int64)}).ok
    right, _ = optimize(sr_model(), constant_inputs={"sr": 16000}, verify=False)
    assert verify_models(original, right, constant_inputs={"sr": np.array(16000, np.int64)}).ok


def test_an_if_whose_condition_stays_open_is_left_exactly_as_it_was():
    """The guard put on branch outputs before the fold (a repeated output, the branch's own
    initializer) is taken out again when the If stays."""
    then = helper.make_graph([helper.make_node("Relu", ["x"], ["h"], name="r")], "then", [],
                             [vinfo("h", [2]), vinfo("h", [2]), vinfo("bi", [2])],
                             [tensor("bi", np.array([3.0, 4.0], np.float32))])
    other = helper.make_graph([helper.make_node("Sigmoid", ["x"], ["s"], name="s")], "else", [],
                              [vinfo("s", [2])] * 3)
    proto = model([helper.make_node("Equal", ["sr", "k16"], ["cond"], name="eq"),
                   helper.make_node("If", ["cond"], ["y1", "y2", "y3"], then_branch=then, else_branch=other,
                                    name="branch")],
                  [vinfo("x", [2]), vinfo("sr", [], TensorProto.INT64)],
                  [vinfo(n, [2]) for n in ("y1", "y2", "y3")], [tensor("k16", np.array(16000, np.int64))])
    m = ir.serde.deserialize_model(proto)
    report = FusionReport()
    CleanupPass(report)(m)
    node = next(n for n in m.graph if n.op_type == "If")
    branches = {name: node.attributes[name].value for name in ("then_branch", "else_branch")}
    assert [v.name for v in branches["then_branch"].outputs] == ["h", "h", "bi"]
    assert [n.op_type for n in branches["then_branch"]] == ["Relu"]
    assert list(branches["then_branch"].initializers) == ["bi"]
    assert [n.op_type for n in branches["else_branch"]] == ["Sigmoid"]
    assert not report.records


def test_a_branch_output_the_branch_does_not_compute_keeps_the_graph_output():
    """onnxscript alone would make the graph output 'y' an initializer without a type, or
    lose it; the resolved graph keeps 'y' and is valid ONNX."""
    then = helper.make_graph([], "then", [], [vinfo("bi", [2])], [tensor("bi", np.array([3.0, 4.0], np.float32))])
    other = helper.make_graph([helper.make_node("Sigmoid", ["x"], ["s"], name="s")], "else", [], [vinfo("s", [2])])
    proto = model([helper.make_node("Equal", ["sr", "k16"], ["cond"], name="eq"),
                   helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other, name="branch"),
                   helper.make_node("Add", ["y", "x"], ["z"], name="add")],
                  [vinfo("x", [2]), vinfo("sr", [], TensorProto.INT64)], [vinfo("y", [2]), vinfo("z", [2])],
                  [tensor("k16", np.array(16000, np.int64))])
    for sr in (16000, 8000):
        result, report = optimize(proto, constant_inputs={"sr": sr})
        written = ir.serde.serialize_model(result)
        onnx.checker.check_model(written, full_check=True)
        assert [o.name for o in written.graph.output] == ["y", "z"] and "If" not in all_ops(result)
        x = np.array([0.5, -1.0], np.float32)
        assert_outputs_close(ort_run(proto, {"x": x, "sr": np.array(sr, np.int64)}), ort_run(written, {"x": x}))


# -- reading the value ------------------------------------------------------------------------

def _values_model():
    nodes = [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Mul", ["s", "c"], ["m"]),
             helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["m", "nf"], ["y"])]
    return ir.serde.deserialize_model(model(
        nodes, [vinfo("a", [2, 2]), vinfo("b", ["rows", 2]), vinfo("c", []), vinfo("n", [], np.uint8)],
        [vinfo("y", None)], fill_output_shapes=False))


def test_a_value_is_read_with_the_inputs_dtype_and_shape():
    got = resolve_constant_inputs(_values_model(), {"a": "1,2,3,4", "b": "1, 2, 3, 4, 5, 6", "c": "0.5",
                                                    "n": "7.0"})
    assert got["a"].dtype == np.float32 and got["a"].tolist() == [[1, 2], [3, 4]]
    assert got["b"].shape == (3, 2)  # the one free dimension takes what the count leaves
    assert got["c"].shape == () and got["c"] == np.float32(0.5)
    assert got["n"].dtype == np.uint8 and got["n"] == 7  # a whole number written as a float is one
    arrays = resolve_constant_inputs(_values_model(), {"a": [[1, 2], [3, 4]], "n": np.int64(3)})
    assert arrays["a"].dtype == np.float32 and arrays["n"].dtype == np.uint8


@pytest.mark.parametrize("given, says", [
    ({"rate": "16000"}, "the model has no input 'rate' (its inputs: a, b, c, n)"),
    ({"a": "1,2,3"}, "3 number(s) given; the input is shape [2, 2]: give 4 numbers"),
    ({"c": "1,2"}, "the input is a scalar: give one number"),
    ({"c": "abc"}, "'abc' is not a number"),
    ({"c": "nan"}, "is not a finite number"),
    ({"n": "2.5"}, "'2.5' is not a whole number, and the input is uint8"),
    ({"n": "300"}, "300 is outside the range of uint8 (0..255)"),
    ({"n": "-1"}, "outside the range of uint8"),
    ({"b": "1,2,3"}, "3 number(s) do not fill shape [rows, 2]"),
    ({"c": "1e39"}, "a number is outside the range of float32"),
    ({"c": ""}, "expected a number or a comma-separated list"),
    ({"c": "1,,2"}, "expected a number or a comma-separated list"),
])
def test_a_value_that_does_not_fit_is_one_line_naming_it(given, says):
    with pytest.raises(BadInputError) as caught:
        resolve_constant_inputs(_values_model(), given)
    assert says in str(caught.value) and "\n" not in str(caught.value)
    name, value = next(iter(given.items()))
    assert str(caught.value).startswith(f"--constant-input {name}={value}")


@pytest.mark.parametrize("args, says", [
    (["sr=abc"], "'abc' is not a number"),
    (["sr=1,2"], "2 number(s) given; the input is a scalar: give one number"),
    (["rate=16000"], "the model has no input 'rate' (its inputs: x, sr)"),
    (["sr=16000.5"], "'16000.5' is not a whole number, and the input is int64"),
    (["sr"], "expected NAME=VALUE"),
    (["sr=16000", "sr=8000"], "given twice"),
])
def test_the_command_line_refuses_a_bad_value_in_one_line_exit_2_nothing_written(args, says, tmp_path, capsys):
    source, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(sr_model(), source)
    argv = ["optimize", str(source), "-o", str(out)]
    for a in args:
        argv += ["--constant-input", a]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not out.exists()


def test_the_command_line_binds_and_reports_in_json(tmp_path, capsys):
    source, out, rep = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "r.json"
    onnx.save(sr_model(), source)
    assert main(["optimize", str(source), "-o", str(out), "--constant-input", "sr=1.6e4", "--report", str(rep),
                 "-q"]) == 0
    written = onnx.load(out)
    assert [i.name for i in written.graph.input] == ["x"] and "If" not in [n.op_type for n in written.graph.node]
    data = json.loads(rep.read_text())
    details = [a["detail"] for a in data["applied"]]
    assert "input 'sr' bound to 16000 (--constant-input): removed from the graph's inputs" in details
    assert "If 'branch' resolved to its then_branch: 2 nodes inlined" in details
    assert any("input 'sr' bound to 16000" in n for n in data["notes"]) and data["verification"]["ok"]


def test_given_inputs_may_carry_the_bound_input_with_its_value_only(tmp_path, capsys):
    source = tmp_path / "m.onnx"
    onnx.save(sr_model(), source)
    same, other = tmp_path / "same.npz", tmp_path / "other.npz"
    np.savez(same, x=x_feed(), sr=np.array(16000, np.int64))
    np.savez(other, x=x_feed(), sr=np.array(8000, np.int64))
    base = ["optimize", str(source), "--constant-input", "sr=16000", "-q", "--inputs"]
    assert main([*base, str(same), "-o", str(tmp_path / "a.onnx")]) == 0
    assert main([*base, str(other), "-o", str(tmp_path / "b.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{other}: sr=8000, but --constant-input binds it to 16000" in err[0], err
    assert not (tmp_path / "b.onnx").exists()


# -- quantize -----------------------------------------------------------------------------------

def _calibration(path, srs):
    np.savez(path, x=np.stack([x_feed(i) for i in range(len(srs))]), sr=np.array(srs, np.int64))


def test_quantize_drops_the_bound_input_from_samples_that_carry_its_value(tmp_path, capsys):
    source, out, data = tmp_path / "m.onnx", tmp_path / "q.onnx", tmp_path / "calib.npz"
    onnx.save(sr_model(), source)
    _calibration(data, [16000] * 6)
    assert main(["quantize", "--reconstruct", "off", str(source), "-o", str(out), "--calibration", str(data),
                 "--constant-input", "sr=16000", "-q"]) == 0
    written = onnx.load(out)
    assert [i.name for i in written.graph.input] == ["x"] and "If" not in [n.op_type for n in written.graph.node]
    assert main(["quantize", "--reconstruct", "off", str(source), "-o", str(tmp_path / "r.onnx"), "--calibration",
                 "random:6",
                 "--constant-input", "sr=8000", "-q"]) == 0  # random:N draws no sr


def test_quantize_refuses_a_sample_with_another_value_of_the_bound_input(tmp_path, capsys):
    source, out, data = tmp_path / "m.onnx", tmp_path / "q.onnx", tmp_path / "calib.npz"
    onnx.save(sr_model(), source)
    _calibration(data, [16000, 16000, 8000, 16000, 16000, 16000])
    assert main(["quantize", "--reconstruct", "off", str(source), "-o", str(out), "--calibration", str(data),
                 "--constant-input", "sr=16000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sample 2 has sr=8000, but --constant-input binds it to 16000" in err[0], err
    assert not out.exists()


# -- which inputs decide a condition ----------------------------------------------------------

def test_the_inputs_a_condition_is_computed_from():
    m = ir.serde.deserialize_model(model(
        [helper.make_node("Reshape", ["sr", "one"], ["r"]), helper.make_node("Gather", ["r", "zero"], ["g"]),
         helper.make_node("Equal", ["g", "k16"], ["by_value"]),
         helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Gather", ["shape", "zero"], ["n"]),
         helper.make_node("Equal", ["n", "k1"], ["by_shape"]),
         helper.make_node("Relu", ["x"], ["rx"]), helper.make_node("ReduceSum", ["rx"], ["s"], keepdims=0),
         helper.make_node("Cast", ["s"], ["si"], to=TensorProto.INT64),
         helper.make_node("Equal", ["si", "g"], ["mixed"])],
        [vinfo("x", X_SHAPE), vinfo("sr", [], TensorProto.INT64)],
        [vinfo(n, [], TensorProto.BOOL) for n in ("by_value", "by_shape", "mixed")],
        [tensor("one", np.array([1], np.int64)), tensor("zero", np.array(0, np.int64)),
         tensor("k16", np.array(16000, np.int64)), tensor("k1", np.array(1, np.int64))]))
    found = {v.name: deciding_inputs(v, m.graph) for v in m.graph.outputs}
    assert found == {"by_value": ["sr"], "by_shape": [], "mixed": ["sr", "x"]} or \
        found == {"by_value": ["sr"], "by_shape": [], "mixed": ["x", "sr"]}


# -- on Qualcomm's HTP (emulated: tiny tensors) -------------------------------------------------

@needs_htp
def test_on_the_htp_the_if_falls_back_until_sr_is_bound():
    """Unbound, the If and its branches run on the CPU and the fix names the binding; bound,
    the model opens strictly with every node on the HTP."""
    _, report = optimize(sr_model(), target="qnn")
    fallbacks = report.device.placement.fallbacks
    assert {f.op_type for f in fallbacks} >= {"If", "Conv", "Relu", "Sigmoid"}
    assert all("--constant-input sr=VALUE" in f.fix for f in fallbacks), [f.sentence() for f in fallbacks]
    branch_node = next(f for f in fallbacks if f.name == "t_conv")
    assert branch_node.fix.startswith("it is in the then_branch of If 'branch', whose condition is computed from "
                                      "input 'sr' only")
    with pytest.raises(VerificationError) as caught:
        optimize(sr_model(), target="qnn", require_npu=True)
    assert "--constant-input sr=VALUE" in str(caught.value)
    result, report = optimize(sr_model(), target="qnn", require_npu=True, constant_inputs={"sr": 16000})
    placement = report.device.placement
    assert placement.all_on_npu and report.device.strict and not placement.fallbacks
    assert sorted(placement.on_qnn) == sorted(n.name for n in result.graph)


@needs_htp
def test_quantize_names_the_value_every_calibration_sample_has():
    samples = [{"x": x_feed(i), "sr": np.array(16000, np.int64)} for i in range(4)]
    _, report = quantize(sr_model(), samples, preset="qnn", holdout=1, reconstruct=False)
    fixes = {f.fix for f in report.device.placement.fallbacks}
    assert fixes and all("--constant-input sr=16000 (the value every calibration sample has)" in f for f in fixes)
    on_cpu = len(report.device.placement.cpu)  # the verification's figure says it is not the NPU's alone
    assert on_cpu and f"with {on_cpu} node(s) on ONNX Runtime's CPU" in report.verification.runtime
    _, report = quantize(sr_model(), samples, preset="qnn", holdout=1, constant_inputs={"sr": 16000},
                         require_npu=True, reconstruct=False)
    assert report.device.placement.all_on_npu and report.device.strict
    assert report.verification.runtime.startswith("QNN HTP backend") and "CPU" not in report.verification.runtime
