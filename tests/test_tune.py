"""The measured fusion choice (opfuse.tune): each fusion family timed on and off, kept only where faster.

- The decision (``judge``): a ratio below 1 - noise keeps the family; above 1 + noise it is
  refused as slower, in between as "no gain beyond noise"; the reason carries the ratio.
- Through ``optimize`` with a deterministic stand-in for the timer (the time of a variant read
  off its ops): MultiHeadAttention made slower is kept written out with its ratio in the
  reason, Attention-23 made faster is written (the opset raised to 23), a family that changes
  nothing is turned off; the written model verifies.
- Never slower than the input: when every rewrite is made slower, the input is written unchanged.
- A real (timed) run on a decode-step block fills the report's tuning section; no timed assertion.
- ``--no-tune`` and ``OPFUSE_TUNE=off`` follow the target's default policy and say so.
"""

from __future__ import annotations

import json

import pytest

from decoder_nets import decode_step
from graphs import conv_bn_model
from opfuse.cli import main
from opfuse.core.analysis import op_counts
from opfuse.pipeline import optimize
from opfuse.tune import judge, noise_of, timing


def test_faster_beyond_the_noise_is_kept():
    kept, why = judge([0.80, 0.82, 0.79, 0.81, 0.80], noise=0.05, aa=1.0)
    assert kept and "0.80x" in why and "A/A 1.00" in why


def test_slower_is_refused_with_the_ratio():
    kept, why = judge([1.21, 1.19, 1.25, 1.17, 1.22], noise=0.05)
    assert not kept and "1.21x" in why and "slower" in why


def test_within_the_noise_is_refused_as_no_gain():
    kept, why = judge([0.98, 1.01, 0.97, 0.99, 1.00], noise=0.05)
    assert not kept and "no gain beyond noise" in why


def test_the_noise_is_the_aa_distance_or_its_median_uncertainty_plus_a_floor():
    assert noise_of([1.10] * 11) == pytest.approx(0.12)  # a biased control: its distance from 1
    assert noise_of([1.0] * 11) == pytest.approx(0.02)  # a quiet control: the floor
    assert noise_of([0.5, 2.0] * 10 + [1.0]) > 0.5  # a wild control: its median is no estimate


def test_a_ratio_less_certain_than_the_control_must_beat_its_own_uncertainty():
    wild = [0.3, 1.3] * 5 + [0.8]  # median 0.8, but no estimate of anything
    assert judge([0.8] * 11, noise=0.05)[0]
    kept, why = judge(wild, noise=0.05)
    assert not kept and "no gain beyond noise" in why


def _fake_measure(cost):
    """A deterministic timer: each variant's time per round is ``cost(variant)`` times a drift
    shared by the round (which the paired ratio cancels)."""

    def measure(variants, feeds, *, threads=1, rounds=None, baseline=None, budget_s=0.0, **_):
        drift = [1.0, 1.3, 0.9, 1.1, 1.0, 1.2, 0.95, 1.05, 1.0, 1.15, 0.9]
        timings = {v.name: timing.Timing([cost(v) * d for d in drift]) for v in variants}
        return timing.Measurement(timings, baseline, threads, 0, len(drift), {}, {}, {})

    return measure


def _ops(variant) -> set[str]:
    return {key.split(".")[-1] if "." in key else key for key in op_counts(variant.model)}


def test_a_slower_multiheadattention_is_refused_and_the_policys_attention_23_written(monkeypatch):
    """A decode step at onnxruntime: the target's policy writes Attention-23 (its exception for a KV
    cache); MultiHeadAttention and attention written out measured slower than it, so it stands."""
    def cost(v):
        ops = _ops(v)
        return 1.0 + 0.3 * ("MultiHeadAttention" in ops) - 0.3 * ("Attention" in ops)

    monkeypatch.setattr(timing, "measure", _fake_measure(cost))
    written, report = optimize(decode_step(), target="onnxruntime", tune=True)
    families = {(f.family, f.candidate): f for f in report.tuning.families}
    mha = families["attention", "MultiHeadAttention"]
    assert mha.decision == "refused" and "MultiHeadAttention against Attention-23 measured 1.86x" in mha.reason
    assert "slower" in mha.reason
    out = families["attention", "written out"]
    assert out.decision == "refused" and "measured 1.43x" in out.reason
    assert families["epilogues", "on"].decision == "not in this graph"  # (its out_proj MatMul is 3-D)
    counts = op_counts(written)
    assert counts.get("Attention", 0) == 1 and "MultiHeadAttention" not in str(counts)
    assert not [r for r in report.refusals  # attention is written (the packed q/k MatMuls, no faster, are not)
                if r.reason.startswith("measured choice") and r.pattern.startswith("attention")]
    assert report.verification.ok
    assert report.tuning.final.median == pytest.approx(0.7)
    assert report.tuning.in_file["attention"] == {"Attention": 1}
    data = json.loads(report.to_json())["tuning"]
    assert data["timed"] and {f["family"] for f in data["families"]} >= {"attention", "epilogues"}
    assert data["record"]["configuration"]["attention"] == "Attention-23"


def test_attention_written_out_faster_beyond_the_noise_replaces_the_policys_form(monkeypatch):
    monkeypatch.setattr(timing, "measure", _fake_measure(lambda v: 1.3 if "Attention" in _ops(v) else 1.0))
    written, report = optimize(decode_step(), target="onnxruntime", tune=True)
    out = next(f for f in report.tuning.families if f.candidate == "written out")
    assert out.decision == "kept" and "written out written: measured 0.77x" in out.reason
    assert "Attention" not in {key.split(".")[-1] for key in op_counts(written)}
    site = [r for r in report.refusals if r.reason.startswith("measured choice: written out was faster")]
    assert site and site[0].also  # one refusal per attention site, its nodes named
    assert report.tuning.in_file["attention"] == {}
    assert report.verification.ok


def test_a_form_within_the_noise_leaves_the_policy_standing(monkeypatch):
    """Written out measured 0.99x of Attention-23: the clock cannot tell, so the target's policy
    (Attention-23 in a decode step) is written, and the reason says so."""
    monkeypatch.setattr(timing, "measure", _fake_measure(lambda v: 1.01 if "Attention" in _ops(v) else 1.0))
    written, report = optimize(decode_step(), target="onnxruntime", tune=True)
    out = next(f for f in report.tuning.families if f.candidate == "written out")
    assert out.decision == "refused" and "Attention-23 kept (the target's policy)" in out.reason
    assert "no gain beyond noise" in out.reason
    assert op_counts(written).get("Attention", 0) == 1


def _each_a_little(factor):
    """Attention-23 and the packed projections each make the step ``factor`` times as long."""
    def cost(v):
        ops = _ops(v)
        return factor ** ("Attention" in ops) * factor ** ("Split" in ops)
    return cost


@pytest.mark.parametrize("factor", [0.985, 1.004])
def test_families_within_the_noise_follow_the_targets_policy(monkeypatch, factor):
    """Each family 0.985x or 1.004x: within the 0.02 noise floor, so neither is turned off (the
    target fuses both): the policy stands, never "off" because of noise."""
    monkeypatch.setattr(timing, "measure", _fake_measure(_each_a_little(factor)))
    written, report = optimize(decode_step(), target="onnxruntime", tune=True)
    packed = next(f for f in report.tuning.families if f.family == "packed-projections")
    assert packed.decision == "kept" and packed.reason.startswith("kept (the target's policy)")
    assert "no gain beyond noise" in packed.reason
    counts = op_counts(written)
    assert counts.get("Attention", 0) == 1 and counts.get("Split", 0) >= 1
    assert report.verification.ok


def test_a_family_slower_beyond_the_noise_is_turned_off_with_its_sites_refused(monkeypatch):
    monkeypatch.setattr(timing, "measure", _fake_measure(lambda v: 1.2 if "Split" in _ops(v) else 1.0))
    written, report = optimize(decode_step(), target="onnxruntime", tune=True)
    packed = next(f for f in report.tuning.families if f.family == "packed-projections")
    assert packed.decision == "refused" and packed.reason.startswith("turned off: measured 1.20x")
    assert "Split" not in {key.split(".")[-1] for key in op_counts(written)}
    assert [r for r in report.refusals if r.reason.startswith("measured choice: turned off")]
    assert report.verification.ok


def test_when_every_rewrite_is_slower_the_input_is_written_unchanged(monkeypatch):
    monkeypatch.setattr(timing, "measure", _fake_measure(lambda v: 1.0 if v.name.startswith("original") else 1.5))
    original = decode_step()
    written, report = optimize(original, target="onnxruntime", tune=True)
    assert report.tuning.written.startswith("the input unchanged")
    assert sum(op_counts(written).values()) == len(original.graph.node)
    assert report.verification.ok


def test_a_real_run_on_a_decode_step_fills_the_tuning_section(tmp_path):
    out, report_path = tmp_path / "out.onnx", tmp_path / "report.json"
    _, report = optimize(decode_step(), target="onnxruntime", tune=True, tune_rounds=9,
                         output=out, report_path=report_path)
    tuning = json.loads(report_path.read_text())["tuning"]
    assert tuning["timed"] and "decode step" in tuning["shapes"] and "past_seq=256" in tuning["shapes"]
    assert tuning["rounds"] >= 9 and tuning["aa"]["rounds"] >= 9
    timed = [f for f in tuning["families"] if f["decision"] != "not in this graph"]
    assert timed and all(f["ratio"]["q1"] <= f["ratio"]["median"] <= f["ratio"]["q3"] for f in timed)
    assert tuning["written"] and report.verification.ok and out.exists()


def test_no_tune_follows_the_targets_default_policy_and_says_so(tmp_path, capsys):
    import onnx

    src, out, report_path = tmp_path / "in.onnx", tmp_path / "out.onnx", tmp_path / "report.json"
    onnx.save(decode_step(), src)
    assert main(["optimize", str(src), "-o", str(out), "--target", "onnxruntime", "--no-tune",
                 "--report", str(report_path)]) == 0
    data = json.loads(report_path.read_text())
    assert data["tuning"]["reason"] == ("not timed (--no-tune): followed the onnxruntime target's default policy, "
                                        "which benchmarks/decoders.py measured")
    assert any("untimed policy for a KV-cache decode step" in note for note in data["notes"]), data["notes"]
    assert "not timed (--no-tune)" in capsys.readouterr().out


def test_the_environment_default_is_said_too(monkeypatch):
    monkeypatch.setenv("OPFUSE_TUNE", "off")
    _, report = optimize(decode_step(), target="onnx")
    assert report.tuning.reason.startswith("not timed (OPFUSE_TUNE=off): followed the onnx target's default policy")


def test_attention_23_keeps_the_opset_raise_it_needs_at_the_onnx_target(monkeypatch):
    def cost(v):
        if "Attention" in _ops(v):
            return 0.7
        return 1.2 if v.model.opset_imports.get("", 0) >= 23 else 1.0  # the raise alone made slower

    monkeypatch.setattr(timing, "measure", _fake_measure(cost))
    written, report = optimize(decode_step(), target="onnx", opset=23, tune=True)
    families = {f.family: f for f in report.tuning.families}
    # without the raise there is no Attention-23: the raise measured what the form gains
    assert families["opset"].decision == "kept" and families["opset"].reason.startswith("kept: measured 0.70x")
    assert "Attention" in op_counts(written) and report.verification.ok


def test_a_graph_without_attention_has_no_attention_candidate(monkeypatch):
    """Attention-23 raises the opset at onnxruntime: on a CNN that writes no attention it is no candidate."""
    timed = []

    def measure(variants, feeds, **kw):
        timed.extend(v.name for v in variants)
        return _fake_measure(lambda v: 1.0)(variants, feeds, **kw)

    monkeypatch.setattr(timing, "measure", measure)
    written, report = optimize(conv_bn_model(), target="onnxruntime", tune=True)
    attention = [f for f in report.tuning.families if f.family == "attention"]
    assert attention and all(f.decision == "not in this graph" for f in attention)
    assert not [name for name in timed if "attention" in name]
    assert report.verification.ok and "BatchNormalization" not in op_counts(written)


def test_a_family_whose_patterns_cannot_match_is_not_built(monkeypatch):
    """A CNN has none of the ops the attention, rotary or norm rules need: no variant is built
    for those families (each build is a whole optimiser run), and the log says why."""
    from opfuse import pipeline

    built = []
    real = pipeline._prepare

    def counting(model, options, plan, loaded=None):
        built.append(tuple(sorted(plan.chosen.patterns.items())))
        return real(model, options, plan, loaded)

    monkeypatch.setattr(timing, "measure", _fake_measure(lambda v: 1.0))
    monkeypatch.setattr(pipeline, "_prepare", counting)
    _, report = optimize(conv_bn_model(), target="onnxruntime", tune=True)
    absent = {f.family for f in report.tuning.families if "finds all its ops" in f.reason}
    assert {"attention", "self-attention", "rotary", "norms"} <= absent
    integer = next(f for f in report.tuning.families if f.family == "dynamic-int8")
    assert integer.reason == ("not in this graph: fuse-dynamic-int8 does not run at this target or finds none of "
                              "the ops it needs here")
    # the reference, the epilogues off, the folds alone, the chosen one again with verification
    assert len(built) <= 4


def _cnn_with_a_head_reshape():
    """A CNN head as detectors and classifiers write it: Conv, then Shape/Slice/Concat to a
    Reshape target, a Transpose, one MatMul (a classifier's) and a Softmax; attention's SDPA needs
    two MatMul around its Softmax, so no attention."""
    from onnx import TensorProto, helper

    from graphs import model, rng, tensor, vinfo

    w = rng(3).standard_normal((8, 8, 1, 1)).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv"),
             helper.make_node("Shape", ["y"], ["shape"], name="shape"),
             helper.make_node("Slice", ["shape", "zero", "two"], ["lead"], name="slice"),
             helper.make_node("Concat", ["lead", "minus_one"], ["target"], axis=0, name="concat"),
             helper.make_node("Reshape", ["y", "target"], ["flat"], name="reshape"),
             helper.make_node("Transpose", ["flat"], ["moved"], perm=[0, 2, 1], name="transpose"),
             helper.make_node("MatMul", ["moved", "fc"], ["logits"], name="classifier"),
             helper.make_node("Softmax", ["logits"], ["out"], axis=-1, name="softmax")]
    fc = rng(4).standard_normal((8, 5)).astype("float32")
    inits = [tensor("w", w), tensor("fc", fc), tensor("zero", [0]), tensor("two", [2]), tensor("minus_one", [-1])]
    return model(nodes, [vinfo("x", [1, 8, 4, 4])], [vinfo("out", None, TensorProto.FLOAT)], inits)


def test_the_attention_gate_asks_for_its_sdpa_stage_not_its_shape_stage():
    """Attention's first stage (the head split's Shape/Slice/Concat/Reshape/Transpose) matches a CNN;
    the gate asks for the SDPA stage's own ops, as many as it has (two MatMul, a Softmax), so a CNN
    with a classifier's one MatMul and Softmax has no attention,
    while a decode step (its scale a Mul, no Div: onnxscript's Mul | Div | nothing) has it."""
    import onnx_ir as ir

    from opfuse.passes.pattern_gate import patterns_that_could_match
    from opfuse.passes.patterns import PATTERN_ORDER
    from opfuse.targets.kernels import load_target

    target = load_target("onnxruntime")
    cnn = ir.from_proto(_cnn_with_a_head_reshape())
    assert "attention" not in patterns_that_could_match(cnn, target, PATTERN_ORDER)
    step = ir.from_proto(decode_step())
    assert "Div" not in op_counts(step) and "attention" in patterns_that_could_match(step, target, PATTERN_ORDER)


def test_a_cnn_with_a_head_reshape_builds_no_attention_variant(monkeypatch):
    """Tuned on that CNN head, no configuration with attention fused is built (each build is a
    whole optimiser run); attention's forms are 'not in this graph' with the reason; it verifies."""
    from opfuse import pipeline

    built = []
    real = pipeline._prepare

    def counting(model, options, plan, loaded=None):
        built.append((plan.chosen.patterns.get("attention"), plan.chosen.pattern_forms.get("attention")))
        return real(model, options, plan, loaded)

    monkeypatch.setattr(timing, "measure", _fake_measure(lambda v: 1.0))
    monkeypatch.setattr(pipeline, "_prepare", counting)
    _, report = optimize(_cnn_with_a_head_reshape(), target="onnxruntime", tune=True)
    attention = [f for f in report.tuning.families if f.family == "attention"]
    assert attention and all("finds all its ops" in f.reason for f in attention)
    # every build is the target's policy (its own form, MultiHeadAttention) or the folds alone: no other form
    assert built and set(built) <= {("fuse", "onnxruntime"), ("keep", "onnxruntime")}
    assert report.verification.ok
