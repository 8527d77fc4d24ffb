"""Models that draw random numbers verify, and no rewrite is blamed for the draw.

The VITS-style graph: Conv -> LeakyRelu (a rewrite on --target onnxruntime), noise from
RandomNormalLike scaled by an input, a duration Ceil(sum |z|) from it, and an output whose
length is that duration (Expand to ConstantOfShape's shape): two draws give two lengths,
as a Piper voice's 37888 and 38912 samples. Without a seed, ONNX Runtime's kernels also
keep their generator between runs of a session, so an original that ran more often (to
find sizes) draws differently from the optimised one.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from graphs import model, ort_run, rng, tensor, vinfo
from opfuse.errors import VerificationError
from opfuse.cli import main
from opfuse.pipeline import optimize
from opfuse.verify.random_ops import random_nodes, seed_for, seed_random_nodes
from opfuse.runtime import create_session
from opfuse.verify import verify_models

C, T = 4, 5


def vits_like(opset: int = 17, dropout_mode: bool | None = None):
    r = rng(11)
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3], pads=[1, 1], name="/dec/conv_pre/Conv"),
        helper.make_node("LeakyRelu", ["c"], ["a"], alpha=0.1, name="/dec/LeakyRelu"),
        helper.make_node("RandomNormalLike", ["a"], ["noise"], name="/dp/RandomNormalLike"),
        helper.make_node("Mul", ["noise", "noise_scale"], ["scaled"], name="/dp/Mul"),
        helper.make_node("Add", ["a", "scaled"], ["z"], name="/dp/Add"),
        helper.make_node("Abs", ["z"], ["az"], name="/dp/Abs"),
        helper.make_node("ReduceSum", ["az"], ["total"], keepdims=0, name="/dp/ReduceSum"),
        helper.make_node("Ceil", ["total"], ["dur"], name="/dp/Ceil"),
        helper.make_node("Cast", ["dur"], ["n"], to=TensorProto.INT64, name="/dp/Cast"),
        helper.make_node("Reshape", ["n", "one_dim"], ["len"], name="/dp/Reshape"),
        helper.make_node("ConstantOfShape", ["len"], ["ones"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]),
                         name="/dp/ConstantOfShape"),
        helper.make_node("ReduceMean", ["z"], ["mean"], keepdims=0, name="/dp/ReduceMean"),
        helper.make_node("Mul", ["ones", "mean"], ["y"], name="/out/Mul"),
    ]
    inits = [tensor("w", r.normal(0, 0.5, (C, C, 3)).astype(np.float32)),
             tensor("b", r.normal(0, 0.1, C).astype(np.float32)),
             tensor("one_dim", np.array([1], np.int64))]
    if dropout_mode is not None:
        nodes.insert(2, helper.make_node("Dropout", ["a", "ratio", "mode"], ["a_drop"], name="/drop"))
        nodes[3].input[0] = "a_drop"
        inits += [tensor("ratio", np.array(0.5, np.float32)), tensor("mode", np.array(dropout_mode))]
    return model(nodes, [vinfo("x", [1, C, T]), vinfo("noise_scale", [1])], [vinfo("y", ["samples"])], inits,
                 opset=opset)


def test_the_output_length_follows_the_draw():
    """The graph is one where the draw matters: runs of an unseeded session give other lengths."""
    session = create_session(vits_like())
    feeds = {"x": rng(0).normal(0, 1, (1, C, T)).astype(np.float32), "noise_scale": np.array([1.0], np.float32)}
    lengths = {session.run(None, feeds)[0].shape for _ in range(12)}
    assert len(lengths) > 1


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
def test_a_vits_like_model_verifies_with_its_random_ops_seeded(target, tmp_model, capsys):
    path = tmp_model(vits_like())
    out = path.with_name("o.onnx")
    assert main(["optimize", str(path), "-o", str(out), "--target", target]) == 0
    text = capsys.readouterr().out
    assert "verification: passed" in text
    assert "random ops: 1 RandomNormalLike ('/dp/RandomNormalLike')" in text and "fixed seed" in text
    written = onnx.load(out)
    assert all(not any(a.name == "seed" for a in n.attribute) for n in written.graph.node)  # its own attributes
    if target == "onnxruntime":
        assert any(n.op_type == "FusedConv" for n in written.graph.node)
    # on deterministic inputs (zero noise) the written model computes the same as the original
    feeds = {"x": rng(3).normal(0, 1, (1, C, T)).astype(np.float32), "noise_scale": np.zeros(1, np.float32)}
    want, got = ort_run(vits_like(), feeds)["y"], ort_run(written, feeds)["y"]
    assert want.shape == got.shape and np.allclose(want, got, rtol=1e-5, atol=1e-6)


def test_an_undetected_draw_is_not_blamed_on_a_rewrite(monkeypatch):
    """Without the seeds (as if the op were not known to draw), the original differs from
    itself: verification says so and names no rewrite, instead of blaming Conv+LeakyRelu."""
    monkeypatch.setattr("opfuse.verify.seed_random_nodes", lambda m: {})
    fused, report = optimize(vits_like(), target="onnxruntime", verify=False)
    original = ir.serde.deserialize_model(vits_like())
    results = [verify_models(original, fused, records=report.records, seed=s) for s in range(6)]
    failing = [v for v in results if not v.ok]
    assert failing, "six draws of the unseeded model all matched"
    for v in failing:
        assert "differs between two runs on the same inputs" in v.unverified
        assert "no rewrite is blamed" in v.unverified


def test_dropout_draws_only_in_training_mode():
    def nodes(mode):
        return [n.op_type for n in random_nodes(ir.serde.deserialize_model(vits_like(dropout_mode=mode)))]
    assert nodes(True) == ["Dropout", "RandomNormalLike"]
    assert nodes(False) == ["RandomNormalLike"]


def test_seeds_come_from_names_and_keep_a_seed_the_model_has():
    a = ir.serde.deserialize_model(vits_like(dropout_mode=True))
    b = ir.serde.deserialize_model(vits_like(dropout_mode=True))
    drop = next(n for n in a.graph if n.op_type == "Dropout")
    drop.attributes["seed"] = ir.AttrInt64("seed", 7)
    seeds = seed_random_nodes(a)
    assert seeds == {"/drop": None, "/dp/RandomNormalLike": seed_for(next(n for n in b.graph if n.op_type == "RandomNormalLike"))}
    assert seed_random_nodes(b)["/dp/RandomNormalLike"] == seeds["/dp/RandomNormalLike"]
    assert drop.attributes["seed"].value == 7
    assert next(n for n in a.graph if n.op_type == "RandomNormalLike").attributes["seed"].type == ir.AttributeType.FLOAT


def test_a_training_mode_dropout_model_verifies(tmp_model, capsys):
    path = tmp_model(vits_like(dropout_mode=True))
    assert main(["optimize", str(path), "-o", str(path.with_name("o.onnx"))]) == 0
    text = capsys.readouterr().out
    assert "1 Dropout, 1 RandomNormalLike" in text and "verification: passed" in text


def test_clean_up_never_folds_a_draw():
    """Bernoulli of a constant has all-constant inputs; onnxscript's folder would evaluate it."""
    nodes = [helper.make_node("Bernoulli", ["p"], ["coin"], name="coin"),
             helper.make_node("Add", ["x", "coin"], ["y"], name="add")]
    m = model(nodes, [vinfo("x", [3])], [vinfo("y", [3])], [tensor("p", np.full(3, 0.5, np.float32))])
    out, report = optimize(m)
    assert [n.op_type for n in out.graph] == ["Bernoulli", "Add"] and report.verification.ok


def _noisy_conv():
    """y = Relu(Conv(x)) + RandomNormalLike * scale: the noise dominates y unless both
    models draw the same numbers."""
    r = rng(4)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["a"], name="relu"),
             helper.make_node("RandomNormalLike", ["a"], ["noise"], name="noise"),
             helper.make_node("Mul", ["noise", "scale"], ["scaled"], name="scale_noise"),
             helper.make_node("Add", ["a", "scaled"], ["y"], name="add_noise")]
    return model(nodes, [vinfo("x", [1, 3, 8, 8])], [vinfo("y", [1, 4, 8, 8])],
                 [tensor("w", r.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32)),
                  tensor("b", r.normal(0, 0.1, 4).astype(np.float32)), tensor("scale", np.array(3.0, np.float32))])


def test_quantize_measures_a_model_with_random_ops_on_the_same_draws(tmp_model, monkeypatch):
    """Seeded, the float and int8 models add the same noise, and the SQNR measures the
    quantisation (over 20 dB); unseeded, it measures two draws (near 0 dB). The written
    model keeps its own attributes."""
    from opfuse.quantization import quantize

    path = tmp_model(_noisy_conv())
    q, report = quantize(str(path), "random:8", reconstruct=False)
    assert report.verification.sqnr_db > 20 and any("random ops (noise)" in n for n in report.notes)
    assert all("seed" not in n.attributes for n in q.graph)
    monkeypatch.setattr("opfuse.quantization.pipeline.seed_random_nodes", lambda m: {})
    with pytest.raises(VerificationError) as failed:  # (two draws: under the 3 dB floor, exit 1, issue 18)
        quantize(str(path), "random:8", reconstruct=False)
    assert failed.value.report.verification.sqnr_db < 10
