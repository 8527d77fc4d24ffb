"""opfuse quantize: calibration data, the pipeline's steps, verification, the CLI.

Small conv nets built in code (BatchNormalization after each conv, as exporters leave
them); the quantised models run on ONNX Runtime like any user's would.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import opfuse
from graphs import bn_node, bn_params, model, rng, tensor, vinfo
from opfuse.cli import main
from opfuse.errors import BadInputError, VerificationError
from opfuse.runtime import create_session


def small_net(opset: int = 17, *, outlier_conv: int | None = None, c: int = 8, seed: int = 0) -> onnx.ModelProto:
    """x[N,3,12,12] -> 3 x (Conv -> BN -> Relu) -> GlobalAveragePool -> Flatten -> Gemm(5).

    ``outlier_conv``: that conv has one output channel with weights 300x the others, which
    per-tensor int8 cannot represent (the other channels round to a few levels)."""
    r = rng(seed)
    nodes, inits, x, cin = [], [], "x", 3
    for i in range(3):
        w = r.normal(0, 0.3, (c, cin, 3, 3))
        if outlier_conv == i:
            w[0] *= 300
        inits += [tensor(f"w{i}", w.astype(np.float32)), *bn_params(f"bn{i}", c, seed=i)]
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1], name=f"conv{i}"),
                  bn_node(f"bn{i}", f"c{i}", f"b{i}"),
                  helper.make_node("Relu", [f"b{i}"], [f"r{i}"], name=f"relu{i}")]
        x, cin = f"r{i}", c
    inits += [tensor("fc_w", r.normal(0, 0.3, (c, 5)).astype(np.float32)),
              tensor("fc_b", r.normal(0, 0.1, 5).astype(np.float32))]
    nodes += [helper.make_node("GlobalAveragePool", [x], ["gap"], name="gap"),
              helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
              helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], name="fc")]
    return model(nodes, [vinfo("x", ["N", 3, 12, 12])], [vinfo("logits", ["N", 5])], inits, opset=opset)


def samples(n: int = 12, seed: int = 1, batch: int = 1) -> list[dict[str, np.ndarray]]:
    r = rng(seed)
    return [{"x": r.uniform(0, 1, (batch, 3, 12, 12)).astype(np.float32)} for _ in range(n)]


def npz(path, items) -> str:
    np.savez(path, x=np.stack([s["x"] for s in items]))
    return str(path)


def ops(proto: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in proto.graph.node]


# -- calibration data -------------------------------------------------------------------------

def test_npz_with_a_sample_axis_and_a_directory_give_the_same_model(tmp_path):
    data = samples(8)
    (tmp_path / "dir").mkdir()
    for i, s in enumerate(data):
        np.savez(tmp_path / "dir" / f"{i:03d}.npz", **s)
    a, ra = opfuse.quantize(small_net(), npz(tmp_path / "c.npz", data), reconstruct=False)
    b, rb = opfuse.quantize(small_net(), str(tmp_path / "dir"), reconstruct=False)
    pa, pb = onnx.ModelProto(), onnx.ModelProto()
    from onnx_ir import serde

    pa, pb = serde.serialize_model(a), serde.serialize_model(b)
    assert pa.graph == pb.graph
    assert ra.calibration_samples == 6 and ra.verification.samples == 2
    assert ra.verification.ok and ra.verification.sqnr_db > 20


@pytest.mark.parametrize("bad, message", [
    ({"y": np.zeros((4, 1, 3, 12, 12), np.float32)}, "missing x"),
    ({"x": np.zeros((4, 1, 3, 12, 12), np.float32), "extra": np.zeros((4, 2), np.float32)},
     "not inputs of the model: extra"),
    ({"x": np.zeros((4, 1, 3, 12), np.float32)}, "rank"),
    ({"x": np.zeros((4, 1, 4, 12, 12), np.float32)}, "at axis 1"),
    ({"x": np.zeros((4, 1, 3, 12, 12), np.float64)}, "dtype float64"),
    ({"x": np.zeros((1, 1, 3, 12, 12), np.float32)}, "at least 2"),
    ({"x": np.zeros((0, 1, 3, 12, 12), np.float32)}, "at least 2"),
    ({"x": np.zeros((4, 0, 3, 12, 12), np.float32)}, "empty"),
    ({}, "holds no arrays"),
])
def test_bad_calibration_data_is_one_line_exit_2_nothing_written(tmp_path, capsys, bad, message):
    src, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(small_net(), src)
    np.savez(tmp_path / "bad.npz", **bad)
    code = main(["quantize", "--reconstruct", "off", str(src), "-o", str(out), "--calibration",
                 str(tmp_path / "bad.npz"), "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz", "m.onnx"]


def test_missing_or_unreadable_calibration_file(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(small_net(), src)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    for data, message in ((tmp_path / "nope.npz", "no such calibration"), (tmp_path / "junk.npz", "not a readable")):
        assert main(["quantize", "--reconstruct", "off", str(src), "-o", str(tmp_path / "q.onnx"), "--calibration",
                     str(data)]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(BadInputError, match="one mapping"):
        opfuse.quantize(small_net(), samples(1)[0], reconstruct=False)


def test_random_calibration_warns_it_is_for_smoke_tests():
    _, report = opfuse.quantize(small_net(), "random:6", reconstruct=False)
    assert any("smoke test only" in n for n in report.notes)
    assert report.calibration_samples + report.verification.samples == 6


def test_random_calibration_draws_at_the_sizes_dim_gives():
    import onnx_ir as ir

    from opfuse.quantization.calibration import load_calibration

    model = ir.serde.deserialize_model(small_net())  # x[N,3,12,12]
    assert {s["x"].shape for s in load_calibration("random:3", model)[0]} == {(1, 3, 12, 12)}
    assert {s["x"].shape for s in load_calibration("random:3", model, dims={"N": 2})[0]} == {(2, 3, 12, 12)}
    assert {s["x"].shape for s in load_calibration("random:3", model, dims={"x:0": 3})[0]} == {(3, 3, 12, 12)}
    with pytest.raises(BadInputError, match="no such free dimension"):
        load_calibration("random:3", model, dims={"M": 2})


def test_paddles_question_mark_dims_are_each_their_own():
    """Paddle2ONNX writes "?" on every free axis (PP-OCR's classifier: x[?, 3, ?, ?]); they
    are anonymous, not one dimension named "?": H and W take sizes of their own, from --dim
    or from the samples."""
    import onnx_ir as ir

    from opfuse.quantization.calibration import load_calibration

    proto = small_net()
    for axis in (0, 2, 3):
        proto.graph.input[0].type.tensor_type.shape.dim[axis].dim_param = "?"
    model = ir.serde.deserialize_model(proto)
    drawn, _ = load_calibration("random:3", model, dims={"x:2": 12, "x:3": 16})
    assert {s["x"].shape for s in drawn} == {(1, 3, 12, 16)}
    r = rng(3)
    given = [{"x": r.standard_normal((1, 3, 12, 16)).astype(np.float32)} for _ in range(3)]
    assert len(load_calibration(given, model)[0]) == 3


# -- the pipeline ------------------------------------------------------------------------------

def test_folds_first_then_quantises_every_weight_once():
    q, report = opfuse.quantize(small_net(), samples(), reconstruct=False)
    proto = opfuse.quantize.__globals__["ir"].serde.serialize_model(q)
    assert "BatchNormalization" not in ops(proto)
    assert len(report.fusion.applied("Conv+BatchNormalization")) == 3
    assert report.weights_8bit_fraction == 1.0
    # one QuantizeLinear per activation tensor, none for a BatchNormalization's input
    assert report.quantize_linear == sum(op == "QuantizeLinear" for op in ops(proto))
    int8 = {i.name for i in proto.graph.initializer if i.data_type == TensorProto.INT8}
    weights = [n.input[0] for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in int8]
    assert len(weights) == 4  # three conv weights and the Gemm's
    assert report.verification.ok and report.verification.min_sqnr_db is None


def test_opset_upgrade_for_per_channel_weights():
    """Paddle's models are opset 11/12; per-channel DequantizeLinear needs axis (opset 13)."""
    q, report = opfuse.quantize(small_net(opset=11), samples(), reconstruct=False)
    proto = opfuse.quantize.__globals__["ir"].serde.serialize_model(q)
    assert next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) >= 13
    axes = [a.i for n in proto.graph.node if n.op_type == "DequantizeLinear" for a in n.attribute if a.name == "axis"]
    assert axes, "per-channel weights carry an axis"
    assert any("opset upgraded 11 -> 13" in n for n in report.notes)
    onnx.checker.check_model(proto)
    create_session(proto, "all").run(None, samples(1)[0])
    _, per_tensor = opfuse.quantize(small_net(opset=11), samples(), preset="per-tensor", adaround=False,
                                    reconstruct=False)  # (the QDQ form decides the opset: AdaRound rounds within it)
    assert not any("opset upgraded" in n for n in per_tensor.notes)


def strict_json(path):
    return json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_mixed_precision_keeps_the_worst_layer_in_float(tmp_path):
    net = small_net(outlier_conv=1)
    _, plain = opfuse.quantize(net, samples(), preset="per-tensor", bias_correction=False, equalize=False,
                               adaround=False, reconstruct=False)  # (equalisation and AdaRound would mend the outlier)
    worst = plain.costliest(1)[0]
    assert worst.name == "conv1", [(r.name, r.own_sqnr_db) for r in plain.costliest(3)]
    target = plain.verification.sqnr_db + 6
    q, report = opfuse.quantize(net, samples(), preset="per-tensor", bias_correction=False, min_sqnr=target,
                                equalize=False, adaround=False, report_path=tmp_path / "r.json", reconstruct=False)
    kept = report.kept()
    assert kept and kept[0].name == "conv1" and kept[0].precision == "float"
    assert "keeping it alone raised the tuning output SQNR" in kept[0].reason
    assert kept[0].gain_db > 3
    assert report.search[0].kept == [] and "conv1" in report.search[-1].kept
    assert report.verification.sqnr_db > plain.verification.sqnr_db
    proto = opfuse.quantize.__globals__["ir"].serde.serialize_model(q)
    conv1 = next(n for n in proto.graph.node if n.name == "conv1")
    weight_producer = [n for n in proto.graph.node if conv1.input[1] in n.output]
    assert not weight_producer, "a layer kept in float reads its float weight directly"
    assert report.weights_8bit_fraction < 1.0
    written = strict_json(tmp_path / "r.json")  # a kept layer's unmeasured SQNR is null, not NaN
    assert any(row["precision"] == "float" for row in written["layers"])


def test_bias_correction_lowers_the_mean_error():
    """Per-tensor weights with one large channel: the small weights all round the same
    way, and on inputs with a positive mean (after a Relu) the outputs shift."""
    r = rng(3)
    w = np.full((6, 4, 3, 3), 0.0) + r.uniform(0.3, 0.45, (6, 4, 3, 3)) * (1.0 / 127)
    w[0, 0, 0, 0] = 1.0  # sets the per-tensor scale: 1/127; the rest are 0.3-0.45 of a step
    nodes = [helper.make_node("Relu", ["x"], ["rx"], name="relu"),
             helper.make_node("Conv", ["rx", "w", "b"], ["y"], pads=[1, 1, 1, 1], name="conv")]
    net = model(nodes, [vinfo("x", [1, 4, 10, 10])], [vinfo("y", [1, 6, 10, 10])],
                [tensor("w", w.astype(np.float32)), tensor("b", np.zeros(6, np.float32))])
    data = [{"x": r.uniform(-0.2, 1, (1, 4, 10, 10)).astype(np.float32)} for _ in range(12)]
    reference = [create_session(net, "disabled").run(None, s)[0] for s in data]

    def mean_error(q) -> float:
        session = create_session(q, "all")
        errors = [session.run(None, s)[0] - ref for s, ref in zip(data, reference)]
        return float(np.abs(np.mean(errors, axis=(0, 1, 3, 4))).mean())

    plain, _ = opfuse.quantize(net, data, preset="per-tensor", bias_correction=False, reconstruct=False)
    corrected, report = opfuse.quantize(net, data, preset="per-tensor", reconstruct=False)
    assert report.bias_corrected == 1
    before, after = report.bias_sqnr_db
    assert after > before
    assert mean_error(corrected) < 0.5 * mean_error(plain)


def test_equalize_runs_before_quantising_and_is_exact_in_float():
    _, report = opfuse.quantize(small_net(), samples(), preset="per-tensor", equalize=True, adaround=False,
                                reconstruct=False)  # (AdaRound comes after: the float model checked is before it)
    assert "equalize" in report.fusion.passes
    assert report.fusion.verification.ok  # the folded and equalised float model, checked as any rewrite


def test_metric_drives_the_search_and_is_reported():
    net = small_net(outlier_conv=1)
    data = samples()
    reference = create_session(net, "disabled")

    def agreement(session) -> float:  # the caller's own measure: top-1 agreement with float
        same = [np.argmax(session.run(None, s)[0]) == np.argmax(reference.run(None, s)[0]) for s in data]
        return float(np.mean(same))

    _, report = opfuse.quantize(net, data, preset="per-tensor", metric=agreement, min_metric=1.0, adaround=False,
                                reconstruct=False)
    assert report.verification.metric == 1.0 and report.verification.ok
    assert report.search[-1].metric == 1.0


# -- verification and the command line ---------------------------------------------------------

def test_below_min_sqnr_exits_1_writes_only_the_report(tmp_path, capsys):
    src, out, rep = tmp_path / "m.onnx", tmp_path / "q.onnx", tmp_path / "r.json"
    onnx.save(small_net(outlier_conv=1), src)
    code = main(["quantize", "--reconstruct", "off", str(src), "-o", str(out), "--calibration",
                 npz(tmp_path / "c.npz", samples()),
                 "--preset", "per-tensor", "--no-adaround", "--min-sqnr", "150", "--max-steps", "1",
                 "--report", str(rep)])  # (no rounding reaches 150 dB: AdaRound off, the failure is the same)
    err = capsys.readouterr().err
    assert code == 1 and not out.exists()
    last = err.strip().splitlines()[-1]
    assert last.startswith("opfuse: quantisation failed: output SQNR") and "costliest layers" in last
    data = json.loads(rep.read_text())
    assert data["verification"]["ok"] is False and data["layers"]
    with pytest.raises(VerificationError):
        opfuse.quantize(small_net(outlier_conv=1), samples(), preset="per-tensor", min_sqnr=150, max_steps=0,
                        adaround=False, reconstruct=False)


@pytest.mark.parametrize("preset", ["cpu", "per-tensor", "qnn"])
def test_cli_writes_a_model_onnx_runtime_runs(tmp_path, capsys, preset):
    src, out, rep = tmp_path / "m.onnx", tmp_path / "q.onnx", tmp_path / "r.json"
    onnx.save(small_net(), src)
    code = main(["quantize", "--reconstruct", "off", str(src), "-o", str(out), "--calibration",
                 npz(tmp_path / "c.npz", samples()),
                 "--preset", preset, "--report", str(rep)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "verification: passed" in printed and "Conv+BatchNormalization" in printed
    proto = onnx.load(out)
    onnx.checker.check_model(proto)
    assert "QuantizeLinear" in ops(proto)
    create_session(proto, "all").run(None, samples(1)[0])
    data = json.loads(rep.read_text())
    assert data["preset"] == preset and data["summary"]["verified"] is True
    equalised = {"Conv+Relu+Conv equalisation": 2} if preset == "per-tensor" else {}  # (the preset equalises)
    assert data["fusion"]["summary"]["applied"] == {"Conv+BatchNormalization": 3, **equalised}


def test_the_per_tensor_preset_equalises_and_rounds_by_adaround_unless_told_not_to(tmp_path, capsys):
    """Per-tensor weights lose the small channels of a layer whose channel ranges differ
    (the outlier conv here): the preset equalises the conv pairs and rounds each layer with
    AdaRound by default (its report says so), and ``--no-equalize --no-adaround`` is the
    preset without them."""
    src = tmp_path / "m.onnx"
    onnx.save(small_net(outlier_conv=1), src)
    calib = npz(tmp_path / "c.npz", samples(16))
    runs = {}
    for label, flags in (("default", []), ("without", ["--no-equalize", "--no-adaround"])):
        rep = tmp_path / f"{label}.json"
        code = main(["quantize", str(src), "-o", str(tmp_path / f"{label}.onnx"), "--calibration", calib,
                     "--preset", "per-tensor", "--report", str(rep), *flags,
                     *(["--reconstruct", "off"] if flags else [])])  # (by default AdaRound: no reconstruction)
        assert code == 0, capsys.readouterr().err
        runs[label] = json.loads(rep.read_text())
    default, without = runs["default"], runs["without"]
    assert default["fusion"]["summary"]["applied"].get("Conv+Relu+Conv equalisation") == 2
    assert default["adaround"]["per_layer"] and default["adaround"]["output_sqnr_db"] is not None
    assert any("AdaRound rounds the weights" in n for n in default["notes"])
    assert "Conv+Relu+Conv equalisation" not in without["fusion"]["summary"]["applied"]
    assert not without["adaround"]["per_layer"] and without["adaround"]["output_sqnr_db"] is None
    assert default["verification"]["sqnr_db"] > without["verification"]["sqnr_db"] + 2  # 35.6 against 32.4 dB


def test_calibration_auto_chooses_each_tensors_range_and_beats_one_method_for_all():
    """Heavy-tailed inputs (Student's t, 2 degrees of freedom): MinMax spends its 256 steps
    on the tails, the percentile clips every tensor alike; auto gives each tensor the range
    of least round-trip error, and the output is closer to float's on held-out samples."""
    r = rng(5)
    data = [{"x": r.standard_t(2, (1, 3, 12, 12)).astype(np.float32)} for _ in range(20)]
    sqnr = {}
    for method in ("auto", "minmax", "percentile"):
        _, report = opfuse.quantize(small_net(), data, holdout=4, calibrate=method, adaround=False,
                                    bias_correction=False, reconstruct=False)
        assert report.calibration == method
        sqnr[method] = report.verification.sqnr_db
        if method == "auto":
            assert sum(report.range_kinds.values()) >= 4 and report.range_kinds.get("clipped", 0) >= 1
        else:
            assert not report.range_kinds
    assert sqnr["auto"] > max(sqnr["minmax"], sqnr["percentile"]) + 0.5, sqnr
    with pytest.raises(BadInputError, match="unknown calibration method"):
        opfuse.quantize(small_net(), data, calibrate="median", reconstruct=False)


def test_a_model_computing_inside_if_branches_says_nothing_was_quantised_and_keeps_stderr_quiet(tmp_path, capfd):
    """silero-vad computes inside an If: ONNX Runtime's quantiser does not enter subgraphs
    (and its calibration sessions log every unused initializer to stderr)."""
    r = rng(9)
    branch = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y_then"])], "then", [],
        [vinfo("y_then", [1, 4, 8, 8])], [tensor("w", r.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32))])
    other = helper.make_graph([helper.make_node("Identity", ["z"], ["y_else"])], "else", [],
                              [vinfo("y_else", [1, 4, 8, 8])])
    nodes = [helper.make_node("If", ["flag"], ["y"], then_branch=branch, else_branch=other, name="if")]
    net = model(nodes, [vinfo("x", [1, 3, 8, 8]), vinfo("z", [1, 4, 8, 8]), vinfo("flag", [], TensorProto.BOOL)],
                [vinfo("y", [1, 4, 8, 8])])
    src = tmp_path / "m.onnx"
    onnx.save(net, src)
    data = [{"x": r.normal(size=(1, 3, 8, 8)).astype(np.float32), "z": r.normal(size=(1, 4, 8, 8)).astype(np.float32),
             "flag": np.array(True)} for _ in range(6)]
    np.savez(tmp_path / "c.npz", **{k: np.stack([d[k] for d in data]) for k in data[0]})
    assert main(["quantize", "--reconstruct", "off", str(src), "-o", str(tmp_path / "q.onnx"), "--calibration",
                 str(tmp_path / "c.npz"),
                 "--report", str(tmp_path / "r.json")]) == 0
    out, err = capfd.readouterr()
    assert "nothing was quantised" in out and "If and Loop bodies" in out
    assert "--constant-input" in out  # an If an input decides: the way to take it out
    assert "bias correction" not in out  # nothing to correct: no figure (it printed "200.0 -> 200.0 dB" on silero-vad)
    assert err == ""


def test_a_branch_reading_a_relu_the_quantiser_removed_still_reads_its_output(tmp_path):
    """silero_vad_half: ONNX Runtime's QDQ quantiser drops a Relu after a quantised Conv (the
    QuantizeLinear's range clips instead) and names the Conv's output after the Relu's. An If
    branch that reads that tensor from the outer scope is a reader the quantiser does not
    see: it read the values before the Relu, negative ones included (the model's output
    SQNR was -1.4 dB). It must read the Relu's output."""
    r = rng(11)
    then = helper.make_graph([helper.make_node("Identity", ["relu_out"], ["t"])], "then", [], [vinfo("t", [1, 4, 6, 6])])
    other = helper.make_graph([helper.make_node("Neg", ["relu_out"], ["e"])], "else", [], [vinfo("e", [1, 4, 6, 6])])
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv_out"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["conv_out"], ["relu_out"], name="relu"),
             helper.make_node("Conv", ["relu_out", "w2"], ["z"], name="conv2"),
             helper.make_node("If", ["flag"], ["y"], then_branch=then, else_branch=other, name="if")]
    inits = [tensor("w", r.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32)),
             tensor("b", r.normal(0, 0.5, 4).astype(np.float32)),
             tensor("w2", r.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32))]
    net = model(nodes, [vinfo("x", [1, 3, 6, 6]), vinfo("flag", [], TensorProto.BOOL)],
                [vinfo("y", [1, 4, 6, 6]), vinfo("z", [1, 4, 6, 6])], inits)
    data = [{"x": r.normal(size=(1, 3, 6, 6)).astype(np.float32), "flag": np.array(True)} for _ in range(8)]
    q, report = opfuse.quantize(net, data, holdout=2, reconstruct=False)
    assert report.quantize_linear > 0
    assert report.verification.sqnr_db > 25, report.verification.outputs
    import onnx_ir as ir

    got = create_session(ir.serde.serialize_model(q), "all").run(["y"], data[0])[0]
    assert got.min() >= 0  # a Relu's output, as the branch reads it


def test_a_relu_that_is_also_a_graph_output_gets_no_copy_unless_its_reader_stays_in_float(tmp_path):
    """When the removed Relu's output is a graph output, the quantiser gives the Conv's
    output a name of its own and a DequantizeLinear writes the graph output: the next
    quantised Conv reads that DequantizeLinear directly (a float Relu in between would
    break its QDQ unit), and a Conv kept in float reads the Relu's values."""
    from opfuse.quantization.presets import PRESETS
    from opfuse.quantization.qdq.quantizer import prepare, Quantizer

    r = rng(12)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["y"], name="relu"),
             helper.make_node("Conv", ["y", "w2"], ["z"], name="conv2")]
    inits = [tensor("w", r.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32)),
             tensor("b", r.normal(0, 0.5, 4).astype(np.float32)),
             tensor("w2", r.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32))]
    float_model, _ = prepare(model(nodes, [vinfo("x", [1, 3, 6, 6])], [vinfo("y", [1, 4, 6, 6]), vinfo("z", [1, 4, 6, 6])],
                                   inits), PRESETS["cpu"])
    data = [{"x": r.normal(size=(1, 3, 6, 6)).astype(np.float32)} for _ in range(6)]
    quantizer = Quantizer(float_model, PRESETS["cpu"], data, tmp_path)
    qdq = quantizer.quantize()
    assert [n.op_type for n in qdq.graph.node if "relu" in n.name.lower()] == []
    (conv2,) = [n for n in qdq.graph.node if n.name == "conv2"]
    assert {n.op_type for n in qdq.graph.node if n.output[0] == conv2.input[0]} == {"DequantizeLinear"}
    kept = quantizer.quantize(["conv2"], keep_as="float")
    (conv2,) = [n for n in kept.graph.node if n.name == "conv2"]
    (feed,) = [n for n in kept.graph.node if conv2.input[0] in n.output]
    (conv,) = [n for n in kept.graph.node if n.name == "conv"]
    assert feed.op_type == "Relu" and feed.input[0] == conv.output[0]  # the Relu's values, in float


def reshaping_net() -> onnx.ModelProto:
    """a[1, 'n'] + b[1, 'n'] -> Reshape to [2, 3]: runs only where n is 6."""
    nodes = [helper.make_node("Add", ["a", "b"], ["s"], name="add"),
             helper.make_node("Reshape", ["s", "shape"], ["y"], name="reshape")]
    return model(nodes, [vinfo("a", [1, "n"]), vinfo("b", [1, "n"])], [vinfo("y", [2, 3])],
                 [tensor("shape", np.array([2, 3], np.int64))])


def test_a_named_dimension_has_one_size_per_sample(tmp_path, capsys):
    src, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(reshaping_net(), src)
    (tmp_path / "d").mkdir()
    for i in range(4):
        np.savez(tmp_path / "d" / f"{i}.npz", a=np.ones((1, 6), np.float32), b=np.ones((1, 6 if i != 2 else 5), np.float32))
    assert main(["quantize", "--reconstruct", "off", str(src), "-o", str(out), "--calibration",
                 str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sample 2" in err[0] and "dimension 'n' is 6" in err[0], err
    assert not out.exists()


def test_a_sample_the_model_cannot_run_on_is_named_before_any_work(tmp_path, capsys):
    src, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(reshaping_net(), src)
    data = [{"a": np.ones((1, 5 if i == 3 else 6), np.float32), "b": np.ones((1, 5 if i == 3 else 6), np.float32)}
            for i in range(4)]
    (tmp_path / "d").mkdir()
    for i, d in enumerate(data):
        np.savez(tmp_path / "d" / f"{i}.npz", **d)
    assert main(["quantize", "--reconstruct", "off", str(src), "-o", str(out), "--calibration",
                 str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "calibration sample 3: ONNX Runtime cannot run the model" in err[0], err
    assert not out.exists()


def test_a_missing_output_directory_is_refused_before_any_work(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(small_net(), src)
    data = npz(tmp_path / "c.npz", samples(4))
    for args in (["-o", str(tmp_path / "no" / "q.onnx")],
                 ["-o", str(tmp_path / "q.onnx"), "--report", str(tmp_path / "no" / "r.json")]):
        assert main(["quantize", "--reconstruct", "off", str(src), "--calibration", data, *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "directory does not exist" in err[0], err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz", "m.onnx"]


def test_sqnr_of_a_model_computing_nan_or_overflowing_is_the_worst():
    from opfuse.quantization.qdq.sqnr import INFINITE, Accumulator, sqnr_db

    assert sqnr_db(1.0, float("nan")) == -INFINITE
    assert sqnr_db(1.0, float("inf")) == -INFINITE
    assert sqnr_db(float("inf"), 1.0) == -INFINITE
    assert sqnr_db(1.0, 0.0) == INFINITE and abs(sqnr_db(100.0, 1.0) - 20.0) < 1e-12
    acc = Accumulator()
    f = np.ones((1, 2, 3, 3), np.float32)
    acc.add("t", f, np.where(f > 0, np.nan, 0).astype(np.float32), axis=1)
    assert acc.db("t") == -INFINITE and acc.channel_db("t") == -INFINITE


def test_reports_are_strict_json():
    """NaN and infinities (an unmeasured or exact SQNR) are null; numpy scalars are numbers."""
    from opfuse.report import json_text

    text = json_text({"a": float("nan"), "b": [np.float32(1.5), float("inf")], "c": (1, {2})})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) == \
        {"a": None, "b": [1.5, None], "c": [1, [2]]}


def test_a_low_output_sqnr_without_a_target_suggests_min_sqnr(monkeypatch):
    import opfuse.quantization.pipeline as qp

    _, fine = opfuse.quantize(small_net(), samples(), reconstruct=False)
    assert not any("--min-sqnr" in n for n in fine.notes)
    monkeypatch.setattr(qp, "LOW_SQNR_DB", 1000)  # every result counts as low
    _, low = opfuse.quantize(small_net(), samples(), reconstruct=False)
    assert any("is low" in n and "--min-sqnr" in n for n in low.notes)
    _, targeted = opfuse.quantize(small_net(), samples(), min_sqnr=5, reconstruct=False)  # the user chose a target
    assert not any("is low" in n for n in targeted.notes)
