"""Generated inputs follow what they feed, and no verification passes on a non-finite reference.

- A BERT-style attention mask, ``(1 - mask) * finfo.min`` added to the scores: a mask
  value of 7 overflows to inf and the softmax to NaN (checked here on the graph itself,
  without opfuse), so the mask must be drawn 0/1, found by walking its readers (through
  Unsqueeze and Cast; its name says nothing).
- An Embedding-style Gather: ids must index the table (ONNX Runtime rejects an id past
  it), reached through a Cast.
- A graph whose output is NaN on every input exits 1 with the message and writes nothing;
  on the user's inputs too; ``--no-verify`` still writes.
- ``quantize --calibration random:N`` draws from the same generator.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from graphs import model, ort_run, rng, tensor, vinfo
from opfuse.cli import main
from opfuse.verify.inputs import integer_ranges, make_feeds
from opfuse.pipeline import optimize
from opfuse.quantization.calibration import load_calibration

VOCAB, HIDDEN, SEQ = 30, 8, 6
FMIN = float(np.finfo(np.float32).min)


def bert_mask_model(mask_name: str = "m", opset: int = 17):
    """ids -> Cast -> Gather(table) -> scores = x x^T + (1 - Cast(Unsqueeze(mask))) * finfo.min
    -> Softmax -> @ x -> MatMul(W) + b (a MatMul+Add rewrite to verify)."""
    r = rng(5)
    nodes = [
        helper.make_node("Cast", ["tokens"], ["ids32"], to=TensorProto.INT32, name="cast_ids"),
        helper.make_node("Gather", ["table", "ids32"], ["x"], axis=0, name="embed"),
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1], name="t"),
        helper.make_node("MatMul", ["x", "xt"], ["scores"], name="qk"),
        helper.make_node("Unsqueeze", [mask_name, "axis1"], ["m3"], name="unsq"),
        helper.make_node("Cast", ["m3"], ["mf"], to=TensorProto.FLOAT, name="cast_mask"),
        helper.make_node("Sub", ["one", "mf"], ["inv"], name="invert"),
        helper.make_node("Mul", ["inv", "fmin"], ["bias"], name="scale_mask"),
        helper.make_node("Add", ["scores", "bias"], ["masked"], name="add_mask"),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["p", "x"], ["ctx"], name="pv"),
        helper.make_node("MatMul", ["ctx", "w"], ["proj"], name="dense"),
        helper.make_node("Add", ["proj", "b"], ["y"], name="dense_bias"),
    ]
    inits = [tensor("table", r.normal(0, 1, (VOCAB, HIDDEN)).astype(np.float32)),
             tensor("axis1", np.array([1], np.int64)), tensor("one", np.array(1.0, np.float32)),
             tensor("fmin", np.array(FMIN, np.float32)),
             tensor("w", r.normal(0, 0.3, (HIDDEN, HIDDEN)).astype(np.float32)),
             tensor("b", r.normal(0, 0.1, HIDDEN).astype(np.float32))]
    return model(nodes, [vinfo("tokens", [1, SEQ], TensorProto.INT64), vinfo(mask_name, [1, SEQ], TensorProto.INT64)],
                 [vinfo("y", [1, SEQ, HIDDEN])], inits, opset=opset)


def test_the_mask_graph_gives_nan_on_the_old_values_and_finite_on_0_1():
    """The graph is one where the values matter: a mask of 7 makes the reference NaN."""
    m = bert_mask_model()
    ids = np.arange(SEQ, dtype=np.int64).reshape(1, SEQ) % VOCAB
    bad = ort_run(m, {"tokens": ids, "m": np.full((1, SEQ), 7, np.int64)})["y"]
    good = ort_run(m, {"tokens": ids, "m": np.array([[1, 1, 1, 0, 1, 0]], np.int64)})["y"]
    assert np.isnan(bad).all() and np.isfinite(good).all()


def test_integer_inputs_follow_their_readers_not_their_names():
    work = ir.serde.deserialize_model(bert_mask_model())
    ranges = integer_ranges(work)
    assert ranges["tokens"].high == VOCAB and "embed" in ranges["tokens"].why
    assert ranges["m"].high == 2 and ranges["m"].mask and "subtracted from 1" in ranges["m"].why
    for seed in range(20):
        feeds = make_feeds(work, {}, seed=seed)
        assert set(np.unique(feeds["m"])) <= {0, 1} and (feeds["m"][..., 0] == 1).all()
        assert feeds["tokens"].min() >= 0 and feeds["tokens"].max() < VOCAB


def test_a_mask_named_mask_with_no_telling_reader_is_drawn_0_1():
    nodes = [helper.make_node("Cast", ["attention_mask"], ["f"], to=TensorProto.FLOAT, name="c"),
             helper.make_node("Relu", ["f"], ["y"], name="r")]
    work = ir.serde.deserialize_model(model(nodes, [vinfo("attention_mask", [2, 5], TensorProto.INT64)],
                                            [vinfo("y", [2, 5])]))
    assert integer_ranges(work)["attention_mask"].high == 2


def test_bert_style_mask_graph_verifies_on_finite_outputs(capsys, tmp_model):
    path = tmp_model(bert_mask_model())
    out = path.with_name("o.onnx")
    assert main(["optimize", str(path), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "verification: passed" in text and "scale 0)" not in text
    assert "m 0/1 (a mask" in text and f"tokens 0-{VOCAB - 1}" in text
    _, report = optimize(str(path))
    assert report.verification.ok and all(o.scale > 0 for o in report.verification.outputs)


def test_embedding_ids_stay_within_the_table():
    """A table of 5 rows: ids drawn 0-7 made ONNX Runtime reject the model at every size."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], axis=0, name="embed"),
             helper.make_node("Relu", ["e"], ["y"], name="relu")]
    m = model(nodes, [vinfo("ids", [1, "seq"], TensorProto.INT64)], [vinfo("y", None)],
              [tensor("table", rng(1).normal(0, 1, (5, 4)).astype(np.float32))])
    _, report = optimize(m)
    assert report.verification.ok
    assert any("ids 0-4 (indexes Gather 'embed' of 5" in n for n in report.verification.notes)


def _nan_model(op="Sqrt"):
    """y = Sqrt(-(x*x) - 1): NaN on every input (Log(0 * x): -inf); a BN after it to fold."""
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"], name="square"),
             helper.make_node("Neg", ["sq"], ["neg"], name="neg"),
             helper.make_node("Sub", ["neg", "one"], ["below"], name="minus_one")]
    if op == "Sqrt":
        nodes.append(helper.make_node("Sqrt", ["below"], ["y"], name="sqrt"))
    else:
        nodes += [helper.make_node("Mul", ["below", "zero"], ["z"], name="times_zero"),
                  helper.make_node("Log", ["z"], ["y"], name="log")]
    return model(nodes, [vinfo("x", [1, 3])], [vinfo("y", [1, 3])],
                 [tensor("one", np.array(1.0, np.float32)), tensor("zero", np.array(0.0, np.float32))])


@pytest.mark.parametrize("op, what", [("Sqrt", "is NaN"), ("Log", "is infinite")])
def test_a_non_finite_reference_is_not_verified_and_nothing_is_written(op, what, tmp_model, capsys):
    path = tmp_model(_nan_model(op))
    out = path.with_name("o.onnx")
    assert main(["optimize", str(path), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"not verified: the original's output 'y' {what} on generated inputs (seeds 0-3); pass --inputs" in err
    assert "passed" not in err and not out.exists()
    assert main(["optimize", str(path), "-o", str(out), "--no-verify"]) == 0 and out.exists()


def test_a_non_finite_reference_on_the_users_inputs_is_not_verified(tmp_model, tmp_path, capsys):
    path = tmp_model(_nan_model())
    np.savez(tmp_path / "in.npz", x=np.ones((1, 3), np.float32))
    out = path.with_name("o.onnx")
    assert main(["optimize", str(path), "-o", str(out), "--inputs", str(tmp_path / "in.npz")]) == 1
    assert "'y' is NaN on the given inputs" in capsys.readouterr().err and not out.exists()


def test_a_reference_finite_on_a_later_seed_is_used_and_said():
    """Sqrt(x) is NaN where x < 0: with 2 standard-normal values, a seed giving both >= 0
    comes within a few draws (and the report names the seed used)."""
    m = model([helper.make_node("Sqrt", ["x"], ["y"], name="sqrt")], [vinfo("x", [2])], [vinfo("y", [2])])
    seeds = [s for s in range(4) if (np.random.default_rng(s).standard_normal(2) >= 0).all()]
    _, report = optimize(m, seed=0)
    v = report.verification
    if seeds:
        assert v.ok and v.inputs.startswith(f"random (seed {seeds[0]})")
        assert seeds[0] == 0 or any("were not finite" in n for n in v.notes)
    else:
        assert not v.ok and "is NaN" in v.unverified


def test_random_calibration_uses_the_same_generator():
    work = ir.serde.deserialize_model(bert_mask_model())
    samples, notes = load_calibration("random:6", work)
    assert len(samples) == 6 and "random samples" in notes[0]
    for s in samples:
        assert set(np.unique(s["m"])) <= {0, 1}
        assert s["tokens"].max() < VOCAB
        assert np.isfinite(ort_run(bert_mask_model(), s)["y"]).all()
