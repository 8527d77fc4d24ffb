"""Verification inputs consistent with a KV-cache decode step, as torch's dynamo exporter writes one.

- The exporter names the present length ``past_seq + 1``: a dimension whose name is an
  expression of another. Drawn apart from ``past_seq`` the decode graph below runs at no
  size (its mask is reshaped to the keys' length, as Hugging Face's causal mask is built);
  derived from it, it runs and verifies. ``--dim`` may give the derived one (alone it fixes
  ``past_seq``; against it, a usage error).
- Dimension names are parsed, never evaluated: only names, integers, ``+ - * //`` and
  parentheses; a property test checks the arithmetic against Python's own on random trees.
- Position ids count 0..n-1 along their last axis (after the past length in a decode
  step), recognised by a Gather into a cos table, by Hugging Face's rotary form (and the
  Mul torch lowers it to at one token, which a mask reading would otherwise claim), and by
  their name.
- The optimised model failing to run where the original runs is said to be that.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from graphs import model, ort_run, rng, tensor, vinfo
from opfuse.cli import main
from opfuse.errors import BadInputError
from opfuse.core.dims import free_dims, parse_dim_expression, resolve_dims
from opfuse.verify.inputs import integer_ranges, make_feeds
from opfuse.pipeline import optimize
from opfuse.targets.onnxruntime import decode_step_sites
from opfuse.verify import verify_models
from decoder_nets import D, DH, H, PRESENT, decode_step

def _decode_feeds(past: int, mask_len: int, batch: int = 1) -> dict[str, np.ndarray]:
    r = rng(1)
    return {"x": r.normal(0, 1, (batch, 1, D)).astype(np.float32),
            "attention_mask": np.ones((batch, mask_len), np.int64),
            "position_ids": np.full((batch, 1), past, np.int64),
            "past_key": r.normal(0, 1, (batch, H, past, DH)).astype(np.float32)}


def test_the_decode_graph_runs_only_when_the_mask_is_one_longer_than_the_past():
    """The graph is one where the relation matters: a mask of any other length (1 too)
    does not run, so sizes drawn apart never do."""
    m = decode_step()
    assert ort_run(m, _decode_feeds(8, 9))["y"].shape == (1, 1, D)
    for wrong in (8, 1, 32):
        with pytest.raises(Exception, match="Reshape|reshape"):
            ort_run(m, _decode_feeds(8, wrong))


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
def test_the_present_length_is_derived_from_the_past_and_verification_passes(target):
    """On onnxruntime, untimed, the attention of a decode step is the standard Attention-23 (issue 40:
    MultiHeadAttention ran slower), and the log says so; the graph still verifies."""
    _, report = optimize(decode_step(), target=target)
    v = report.verification
    assert v.ok, v
    assert v.sizes["past_seq + 1"] == v.sizes["past_seq"] + 1 and v.sizes["past_seq"] > 1
    assert f"derived: past_seq + 1={v.sizes['past_seq'] + 1}" in v.inputs
    if target == "onnxruntime":
        assert any("untimed policy for a KV-cache decode step" in note for note in report.notes)


# -- attention in a decode step at onnxruntime, untimed: Attention-23, with the measured reason -------------

def _renamed(m, old: str, new: str):
    """``m`` with the graph input ``old`` named ``new`` (the cache recognised by its use, not its name)."""
    for node in m.graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
    for value in m.graph.input:
        if value.name == old:
            value.name = new
    return m


@pytest.mark.parametrize("past_name", ["past_key", "k_before"])
def test_a_decode_step_gets_the_standard_attention_at_onnxruntime_untimed_with_the_reason(past_name):
    """The cache is recognised by its use, whatever its name; this block's mask is reshaped to
    Shape(keys), so the cache stays a Concat (the op would read its own present), with that reason."""
    m = _renamed(decode_step(), "past_key", past_name)
    out, report = optimize(m, target="onnxruntime")
    assert report.verification.ok
    written = [(n.domain, n.op_type) for n in out.graph]
    assert ("", "Attention") in written and "Softmax" not in {op for _, op in written}
    assert "MultiHeadAttention" not in {op for _, op in written}
    (note,) = [n for n in report.notes if "untimed policy for a KV-cache decode step" in n]
    assert "MultiHeadAttention" in note and "opset raised to 23" in note
    assert any("would read its own output" in r.reason for r in report.refusals), report.refusals
    feeds = _decode_feeds(8, 9)
    feeds[past_name] = feeds.pop("past_key")
    np.testing.assert_allclose(ort_run(out, feeds)["y"], ort_run(m, feeds)["y"], rtol=1e-5, atol=1e-6)


def test_a_concat_of_an_input_along_another_axis_is_no_decode_step():
    """The cache is joined along the sequence axis (2); a Concat along the heads is not one."""
    m = decode_step()
    (append,) = [n for n in m.graph.node if n.name == "append"]
    append.attribute[0].i = 1
    assert decode_step_sites(ir.from_proto(m)) == []
    assert [site.name for site, _ in decode_step_sites(ir.from_proto(decode_step()))] == ["softmax"]


def _windowed_decode_step(past: str):
    """decode_step() with Mistral's window on the keys' cache: Slice(past, -4095:, axis 2) before the Concat."""
    m = decode_step()
    (append,) = [n for n in m.graph.node if n.name == "append"]
    append.input[0] = "past_window"
    m.graph.initializer.extend([tensor("window_start", np.array([-4095], np.int64)),
                                tensor("window_end", np.array([np.iinfo(np.int64).max], np.int64)),
                                tensor("window_axis", np.array([2], np.int64))])
    m.graph.node.insert(0, helper.make_node("Slice", [past, "window_start", "window_end", "window_axis"],
                                            ["past_window"], name="window"))
    return m


def test_a_sliding_window_cache_sliced_before_its_concat_is_a_decode_step():
    """Mistral's exports keep the cache's last positions (Slice of the past along axis 2) before
    the Concat: still a decode step, so the untimed policy writes the standard Attention, equal."""
    m = _windowed_decode_step("past_key")
    assert [site.name for site, _ in decode_step_sites(ir.from_proto(m))] == ["softmax"]
    out, report = optimize(m, target="onnxruntime")
    assert report.verification.ok
    assert ("", "Attention") in [(n.domain, n.op_type) for n in out.graph]
    assert any("untimed policy for a KV-cache decode step" in n for n in report.notes)
    feeds = _decode_feeds(8, 9)
    np.testing.assert_allclose(ort_run(out, feeds)["y"], ort_run(m, feeds)["y"], rtol=1e-5, atol=1e-6)


def test_a_mask_dimension_of_its_own_is_still_drawn_apart_and_does_not_run():
    """'mask_len' names no relation: drawn apart, no size runs (the old failure, exit 2)."""
    with pytest.raises(BadInputError, match="at any of .* size"):
        optimize(decode_step(mask_dim="mask_len"))


def test_the_derived_dimension_and_the_positions_in_the_free_dims_and_feeds():
    work = ir.serde.deserialize_model(decode_step())
    dims = free_dims(work)
    assert dims[PRESENT].derived is not None and dims[PRESENT].derived.names == ("past_seq",)
    assert dims["past_seq"].derived is None and dims["batch"].batch and not dims[PRESENT].batch
    ranges = integer_ranges(work)
    assert ranges["position_ids"].positions and ranges["position_ids"].after == "past_key"
    assert "cos/sin table made by Cos 'cos_of_angles'" in ranges["position_ids"].why
    assert ranges["attention_mask"].mask and not ranges["attention_mask"].positions
    feeds = make_feeds(work, {"batch": 3, "past_seq": 16})
    assert feeds["attention_mask"].shape == (3, 17) and feeds["past_key"].shape == (3, H, 16, DH)
    assert (feeds["position_ids"] == 16).all() and feeds["position_ids"].shape == (3, 1)


@pytest.mark.parametrize("given, sizes", [
    ({"batch": 2, "past_seq": 16}, {"batch": 2, "past_seq": 16, PRESENT: 17}),
    ({PRESENT: 17}, {"past_seq": 16, PRESENT: 17}),  # the derived one given alone fixes its name
    ({"past_seq": 16, PRESENT: 17}, {"past_seq": 16, PRESENT: 17}),
    ({"attention_mask:1": 5}, {"past_seq": 4, PRESENT: 5}),  # by position, too
])
def test_dims_given_decide_the_derived_ones(given, sizes):
    assert resolve_dims(ir.serde.deserialize_model(decode_step()), given) == sizes


def test_a_dim_that_contradicts_a_derived_one_is_a_usage_error(tmp_model, capsys):
    path = tmp_model(decode_step())
    out = path.with_name("o.onnx")
    assert main(["optimize", str(path), "-o", str(out), "--dim", "past_seq=16", "--dim", f"{PRESENT}=20"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "contradicts past_seq=16, at which past_seq + 1 is 17" in err
    assert not out.exists()
    assert main(["optimize", str(path), "-o", str(out), "--dim", "batch=2", "--dim", f"{PRESENT}=17"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "verification: passed" in text and "at batch=2, past_seq=16; derived: past_seq + 1=17" in text
    assert "position_ids 0..n-1 along the last axis, after the past length (past_key axis -2)" in text


def test_a_derived_dimension_of_two_unknown_names_given_alone_is_a_usage_error():
    m = model([helper.make_node("Concat", ["a", "b"], ["ab"], axis=1, name="cat"),
               helper.make_node("Add", ["ab", "c"], ["y"], name="add")],
              [vinfo("a", [1, "s0"]), vinfo("b", [1, "s1"]), vinfo("c", [1, "s0 + s1"])], [vinfo("y", [1, "s0 + s1"])])
    work = ir.serde.deserialize_model(m)
    with pytest.raises(BadInputError, match="derived from s0, s1"):
        resolve_dims(work, {"s0 + s1": 10})
    assert resolve_dims(work, {"s0 + s1": 10, "s0": 3}) == {"s0": 3, "s1": 7, "s0 + s1": 10}
    _, report = optimize(m)  # two free names, one derived sum: the search keeps them consistent
    assert report.verification.ok
    sizes = report.verification.sizes
    assert sizes["s0 + s1"] == sizes["s0"] + sizes["s1"]


def test_a_derived_size_below_one_is_skipped_by_the_search():
    """'seq - 1' at seq=1 has no size: that assignment is not tried."""
    m = model([helper.make_node("Slice", ["x", "one", "big", "one"], ["tail"], name="tail"),
               helper.make_node("Add", ["tail", "d"], ["y"], name="add")],
              [vinfo("x", [1, "seq"]), vinfo("d", [1, "seq - 1"])], [vinfo("y", [1, "seq - 1"])],
              [tensor("one", np.array([1], np.int64)), tensor("big", np.array([1 << 30], np.int64))])
    _, report = optimize(m)
    assert report.verification.ok and report.verification.sizes == {"seq": 8, "seq - 1": 7}
    with pytest.raises(BadInputError, match="seq - 1 is 0"):
        resolve_dims(ir.serde.deserialize_model(m), {"seq": 1})


# -- parsing dimension names ---------------------------------------------------------------------

@pytest.mark.parametrize("text, names, sizes, value", [
    ("past_seq + 1", ("past_seq",), {"past_seq": 16}, 17),
    ("2*seq", ("seq",), {"seq": 5}, 10),
    ("seq - 1", ("seq",), {"seq": 5}, 4),
    ("s0 + s1", ("s0", "s1"), {"s0": 3, "s1": 4}, 7),
    ("((past_seq + 1)//2)", ("past_seq",), {"past_seq": 16}, 8),
    ("batch*past_seq", ("batch", "past_seq"), {"batch": 2, "past_seq": 8}, 16),
    ("-s0 + 10", ("s0",), {"s0": 3}, 7),
])
def test_exporter_dimension_names_parse(text, names, sizes, value):
    expression = parse_dim_expression(text)
    assert expression is not None and expression.names == names and expression.evaluate(sizes) == value


@pytest.mark.parametrize("text", [
    "batch", "seq_len", "3", "", "?", "unk__0",  # plain names and numbers: dimensions of their own
    "__import__('os').system('echo owned')", "seq.__class__", "f(seq)", "seq ** 2", "seq / 2", "1.5*seq",
    "seq % 2", "seq if seq else 1", "[seq]", "'seq'", "lambda: seq", "seq; 1", "seq == 1", "(seq := 3)",
    "True*seq", "~seq", "seq << 2", "Max(1, seq)", "x" * 300 + " + 1", "(" * 400 + "s" + ")" * 400,
])
def test_anything_else_is_not_an_expression(text):
    assert parse_dim_expression(text) is None


def test_an_unsafe_dimension_name_is_a_dimension_of_its_own_never_run(tmp_path):
    marker = tmp_path / "owned"
    name = f"__import__('pathlib').Path('{marker}').touch() + seq"
    m = model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [vinfo("x", [1, name, "seq"])],
              [vinfo("y", [1, name, "seq"])])
    work = ir.serde.deserialize_model(m)
    assert free_dims(work)[name].derived is None
    assert make_feeds(work, {name: 3, "seq": 2})["x"].shape == (1, 3, 2)
    assert optimize(m)[1].verification.ok and not marker.exists()


_NAMES = st.sampled_from(["a", "b", "n_1", "Len"])


def _trees(depth: int = 4):
    """(text, Python's value at ENV) of random arithmetic, spaced as sympy and people write it."""
    leaf = st.one_of(_NAMES.map(lambda n: (n, ENV[n])), st.integers(0, 50).map(lambda i: (str(i), i)))
    ops = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y,
           "//": lambda x, y: x // y if y else None}

    def extend(inner):
        def combine(args):
            (lt, lv), op, (rt, rv), space = args
            value = None if lv is None or rv is None else ops[op](lv, rv)
            return f"({lt}{space}{op}{space}{rt})", value
        return st.tuples(inner, st.sampled_from(list(ops)), inner, st.sampled_from(["", " "])).map(combine)

    return st.recursive(leaf, extend, max_leaves=2 ** depth)


ENV = {"a": 3, "b": 17, "n_1": 1, "Len": 640}


@settings(max_examples=200, deadline=None)
@given(_trees())
def test_parsed_arithmetic_agrees_with_pythons(tree):
    text, value = tree
    expression = parse_dim_expression(text)
    if text in ENV or not any(n in text for n in ENV):  # a plain name, or numbers only: nothing derived
        assert expression is None
        return
    assert expression is not None
    if value is None:  # a // by 0 somewhere
        with pytest.raises(ZeroDivisionError):
            expression.evaluate(ENV)
    else:
        assert expression.evaluate(ENV) == value


# -- position ids ---------------------------------------------------------------------------------

def _rotary(lowered_to_mul: bool, with_past: bool):
    """Hugging Face's rotary angles: inv_freq[None, :, None] @ position_ids[:, None, :].float(),
    transposed, doubled, cos'd and sin'd, applied to x; torch writes the MatMul as a Mul when
    one token is decoded (its inner dimension is 1)."""
    seq = 1 if lowered_to_mul else "seq"
    inv_freq = (1.0 / 10000 ** (np.arange(0, DH, 2) / DH)).astype(np.float32).reshape(1, DH // 2, 1)
    nodes = [helper.make_node("Unsqueeze", ["position_ids", "axis1"], ["pos3"], name="pos_unsqueeze"),
             helper.make_node("Cast", ["pos3"], ["posf"], to=TensorProto.FLOAT, name="pos_float"),
             helper.make_node("Mul" if lowered_to_mul else "MatMul", ["inv_freq", "posf"], ["freqs"], name="angles"),
             helper.make_node("Transpose", ["freqs"], ["freqs_t"], perm=[0, 2, 1], name="freqs_t"),
             helper.make_node("Concat", ["freqs_t", "freqs_t"], ["emb"], axis=-1, name="emb"),
             helper.make_node("Cos", ["emb"], ["cos"], name="cos"),
             helper.make_node("Sin", ["emb"], ["sin"], name="sin"),
             helper.make_node("Mul", ["x", "cos"], ["xc"], name="x_cos"),
             helper.make_node("Mul", ["x", "sin"], ["xs"], name="x_sin"),
             helper.make_node("Add", ["xc", "xs"], ["y"], name="rotated")]
    inputs = [vinfo("x", ["batch", seq, DH]), vinfo("position_ids", ["batch", seq], TensorProto.INT64)]
    outputs = [vinfo("y", ["batch", seq, DH])]
    if with_past:
        nodes.append(helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], name="keep"))
        inputs.append(vinfo("past_key_values.0.key", ["batch", H, "past_seq", DH]))
        outputs.append(vinfo("present.0.key", ["batch", H, "past_seq", DH]))
    return model(nodes, inputs, outputs, [tensor("inv_freq", inv_freq), tensor("axis1", np.array([1], np.int64))])


@pytest.mark.parametrize("lowered_to_mul", [False, True])
@pytest.mark.parametrize("with_past", [False, True])
def test_rotary_position_ids_count_after_the_past_length(lowered_to_mul, with_past):
    work = ir.serde.deserialize_model(_rotary(lowered_to_mul, with_past))
    taken = integer_ranges(work)["position_ids"]
    op = "Mul" if lowered_to_mul else "MatMul"
    assert taken.positions and f"rotary angles, {op} 'angles' reaches Cos 'cos'" in taken.why
    assert not taken.mask, "the use as positions takes precedence over 'multiplied: a mask'"
    feeds = make_feeds(work, {"batch": 2, "seq": 5, "past_seq": 7})
    n = feeds["position_ids"].shape[-1]
    start = 7 if with_past else 0
    assert (feeds["position_ids"] == np.arange(start, start + n)).all() and feeds["position_ids"].shape == (2, n)


def test_position_ids_named_so_but_gathered_from_a_learned_table_are_counted():
    """GPT-2's wpe: a Gather no use tells apart from token ids; the name does. A table the
    positions reach past stops the size search there (sizes 8 and 32 fit 40 rows)."""
    r = rng(2)
    m = model([helper.make_node("Gather", ["wte", "input_ids"], ["tok"], axis=0, name="wte_gather"),
               helper.make_node("Gather", ["wpe", "position_ids"], ["pos"], axis=0, name="wpe_gather"),
               helper.make_node("Add", ["tok", "pos"], ["y"], name="embed")],
              [vinfo("input_ids", ["batch", "seq"], TensorProto.INT64),
               vinfo("position_ids", ["batch", "seq"], TensorProto.INT64)], [vinfo("y", ["batch", "seq", DH])],
              [tensor("wte", r.normal(0, 1, (50, DH)).astype(np.float32)),
               tensor("wpe", r.normal(0, 1, (40, DH)).astype(np.float32))])
    work = ir.serde.deserialize_model(m)
    ranges = integer_ranges(work)
    assert ranges["position_ids"].positions and ranges["position_ids"].why == "by the name"
    assert ranges["input_ids"].high == 50 and not ranges["input_ids"].positions
    assert (make_feeds(work, {"seq": 6})["position_ids"] == np.arange(6)).all()
    _, report = optimize(m)
    assert report.verification.ok and report.verification.sizes["seq"] == 8


# -- the optimised model that does not run ------------------------------------------------------

def test_an_optimised_model_that_cannot_run_where_the_original_runs_is_said_to_be_that():
    """The size search passes over sizes at which the original fails (its Reshape to
    [-1, 16] needs a multiple of 16: not 8, but 32); at 32 the original runs, and a
    'rewritten' model with a Reshape to a fixed [2, 16] does not: its own failure, said so."""
    def reshaped(shape):
        return model([helper.make_node("Reshape", ["x", "shape"], ["r"], name="split"),
                      helper.make_node("Relu", ["r"], ["y"], name="relu")],
                     [vinfo("x", [1, "n"])], [vinfo("y", None)], [tensor("shape", np.array(shape, np.int64))])

    original, broken = (ir.serde.deserialize_model(reshaped(s)) for s in ([-1, 16], [4, 16]))
    v = verify_models(original, broken)
    assert not v.ok and not v.unverified and v.sizes == {"n": 32}
    bad = v.first_failure()
    assert bad.label == "the optimised model"
    assert bad.problem.startswith("ONNX Runtime cannot run the optimised model on inputs the original runs on "
                                  "(random (seed 0) at n=32)")
    assert not v.rewrites, "no rewrite is blamed"
    assert verify_models(original, original.clone()).ok


def test_the_start_of_a_range_is_a_position_and_its_limit_a_length():
    m = model([helper.make_node("Range", ["start", "limit", "step"], ["r"], name="range"),
               helper.make_node("Cast", ["r"], ["y"], to=TensorProto.FLOAT, name="cast")],
              [vinfo("start", [], TensorProto.INT64), vinfo("limit", [], TensorProto.INT64)], [vinfo("y", None)],
              [tensor("step", np.array(1, np.int64))], fill_output_shapes=False)
    ranges = integer_ranges(ir.serde.deserialize_model(m))
    assert ranges["start"].positions and "the start of Range 'range'" in ranges["start"].why
    assert "limit" not in ranges


def test_a_window_over_torchscripts_one_input_concat_of_the_past_is_a_decode_step_untimed():
    """TorchScript writes the window's Slice over a one-input Concat of the past (a copy that clean-up
    removes only later): the untimed policy, which looks at the graph as loaded, still sees the cache,
    so the standard Attention is written, equal to the input."""
    m = _windowed_decode_step("past_copy")
    m.graph.node.insert(0, helper.make_node("Concat", ["past_key"], ["past_copy"], axis=-2, name="copy"))
    assert [site.name for site, _ in decode_step_sites(ir.from_proto(m))] == ["softmax"]
    out, report = optimize(m, target="onnxruntime")
    assert report.verification.ok
    assert ("", "Attention") in [(n.domain, n.op_type) for n in out.graph]
    assert any("untimed policy for a KV-cache decode step" in n for n in report.notes)
    feeds = _decode_feeds(8, 9)
    np.testing.assert_allclose(ort_run(out, feeds)["y"], ort_run(m, feeds)["y"], rtol=1e-5, atol=1e-6)
