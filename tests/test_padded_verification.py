"""Verification feeds what callers feed (issue 49, item 4): a padded batch where the model has an
attention mask, outputs compared only where they are defined, fully masked rows, and a tolerance
that scales with the original's own float32 variation.

The rule under test (:func:`opfuse.verify.inputs.defined_positions`): on the padded batch, a tensor
whose axis 0 is the batch (or batch x heads) is compared where the mask is 1 at its index on every
other axis whose size is the mask's length; anything else is compared whole. A fully masked query
row that is a padded position is therefore not compared (its output is undefined: a tiny Llama's
Attention-23 differs there from the export's NaN guard, and only there); a fully masked row that is
not padded is compared, and a fusion that changes it fails.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import opfuse
from decoder_nets import decode_step, export_tiny_llama
from graphs import model, rng, tensor, vinfo
from opfuse.errors import VerificationError
from opfuse.load import load_model
from opfuse.verify import VARIATION_FACTOR, compare_tensor, verify_models
from opfuse.verify.inputs import defined_positions, padded_feeds
from opfuse.verify.reference import GIVEN_PADDED_LABEL, PADDED_LABEL


def _session_run(m, feeds):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = m.SerializeToString() if isinstance(m, onnx.ModelProto) else onnx.load(str(m)).SerializeToString()
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"]).run(None, feeds)


# -- the rule ---------------------------------------------------------------------------------

def test_defined_positions_follow_the_mask_on_every_position_axis():
    mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    logits = defined_positions((3, 5, 7), mask)  # [batch, seq, vocab]
    assert logits.shape == (3, 5, 7) and (logits == mask[:, :, None].astype(bool)).all()
    present = defined_positions((3, 2, 5, 4), mask)  # [batch, kv heads, positions, head size]
    assert (present == mask[:, None, :, None].astype(bool)).all()
    merged = defined_positions((6, 5, 4), mask)  # [batch * heads, seq, head size], batch-major
    assert (merged.reshape(3, 2, 5, 4) == mask[:, None, :, None].astype(bool)).all()
    tokens = defined_positions((15, 6), mask)  # [batch * seq, hidden]: a 2-D MatMul's rows
    assert (tokens == mask.reshape(15, 1).astype(bool)).all()
    scores = defined_positions((3, 2, 5, 5), mask)  # [batch, heads, query, key]: both position axes
    assert not scores[1, 0, 2, 1] and scores[1, 0, 2, 3] and not scores[2, 0, 4, 0]
    assert defined_positions((3, 1, 7), mask) is None  # a decode step's logits: no position axis
    assert defined_positions((4, 5), mask) is None  # axis 0 is not the batch
    assert defined_positions((5,), mask) is None


def test_a_padded_decode_step_pads_its_past_and_counts_positions_from_the_mask():
    m, _ = load_model(decode_step())
    feeds, padding = padded_feeds(m, {"batch": 3, "past_seq": 11})
    mask = feeds["attention_mask"]
    assert mask.shape == (3, 12) and padding.rows == ("unpadded", "past left-padded 6", "past left-padded 1")
    assert mask[0].all() and not mask[1, :6].any() and mask[1, 6:].all() and mask[2, 0] == 0 and mask[2, 1:].all()
    assert feeds["position_ids"].tolist() == [[11], [5], [10]]  # cumsum(mask) - 1 at the new token
    assert padding.positions == "position_ids"


# -- the padded batch in verification -----------------------------------------------------------

def _positions_model(wrong: bool = False):
    """y = x * cos(position_ids) * mask (the rotary scaling of a token by its position); ``wrong``:
    the positions taken as 0..S-1 (a Range), as a rewrite that forgot the position ids would: the
    same on an unpadded batch, other values at a left-padded row's real tokens."""
    nodes = [helper.make_node("Cast", ["position_ids"], ["pf"], to=TensorProto.FLOAT)]
    if wrong:
        nodes = [helper.make_node("Shape", ["position_ids"], ["shape"]),
                 helper.make_node("Gather", ["shape", "one_i"], ["len"], axis=0),
                 helper.make_node("Range", ["zero_i", "len", "one_i"], ["r"]),
                 helper.make_node("Cast", ["r"], ["pf"], to=TensorProto.FLOAT)]
    nodes += [helper.make_node("Cos", ["pf"], ["c"]),
              helper.make_node("Unsqueeze", ["c", "last"], ["c3"]),
              helper.make_node("Mul", ["x", "c3"], ["xc"]),
              helper.make_node("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT),
              helper.make_node("Unsqueeze", ["mf", "last"], ["m3"]),
              helper.make_node("Mul", ["xc", "m3"], ["y"])]
    inits = [tensor("last", np.array([-1], np.int64)), tensor("one_i", np.array(1, np.int64)),
             tensor("zero_i", np.array(0, np.int64))]
    return model(nodes, [vinfo("x", ["batch", "seq", 4]), vinfo("attention_mask", ["batch", "seq"], TensorProto.INT64),
                         vinfo("position_ids", ["batch", "seq"], TensorProto.INT64)],
                 [vinfo("y", ["batch", "seq", 4])], inits)


def test_a_rewrite_wrong_only_on_a_padded_row_is_caught_by_the_padded_batch():
    original, _ = load_model(_positions_model())
    wrong, _ = load_model(_positions_model(wrong=True))
    result = verify_models(original, wrong)
    assert not result.ok and result.input_sets == [PADDED_LABEL]
    assert "left-padded" in result.padded and "right-padded" in result.padded and "position_ids" in result.padded
    failing = [c for c in result.outputs if not c.ok]
    assert [c.inputs for c in failing] == [PADDED_LABEL]  # batch 1, unpadded: equal
    assert "where 'attention_mask' is 1" in failing[0].positions
    assert verify_models(original, load_model(_positions_model())[0]).ok


def test_a_batch_fixed_to_one_is_said_not_silently_skipped():
    nodes = [helper.make_node("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["mf", "last"], ["m3"]), helper.make_node("Mul", ["x", "m3"], ["y"])]
    m = model(nodes, [vinfo("x", [1, "seq", 4]), vinfo("attention_mask", [1, "seq"], TensorProto.INT64)],
              [vinfo("y", [1, "seq", 4])], [tensor("last", np.array([-1], np.int64))])
    original, _ = load_model(m)
    result = verify_models(original, original)
    assert result.ok and not result.padded and PADDED_LABEL not in result.input_sets
    assert "fixed to 1" in result.padded_skipped
    assert any("no padded batch verified" in n and "fixed to 1" in n for n in result.notes)


# -- fully masked rows: a tiny Llama export with its NaN guard ----------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return export_tiny_llama(tmp_path_factory.mktemp("llama") / "llama.onnx", mask="input", positions=True)


def test_attention_23_differs_from_the_guard_only_at_padded_queries_which_are_not_compared(llama):
    """The export guards a fully masked row (Softmax -> IsNaN -> Where: 0); Attention-23 gives
    other values there. On a left-padded row the fully masked rows are its padded queries: the
    written model differs there (by far more than any tolerance) and nowhere else, and
    verification, which compares only defined positions, passes on the padded batch."""
    assert any(n.op_type == "IsNaN" for n in onnx.load(str(llama)).graph.node)
    written, report = opfuse.optimize(str(llama), target="onnx", opset=23, tune=False)
    assert report.applied("attention->Attention")
    v = report.verification
    assert v.ok and PADDED_LABEL in v.input_sets and "left-padded" in v.padded
    padded = [c for c in v.outputs if c.inputs == PADDED_LABEL]
    assert padded and all("where 'attention_mask' is 1" in c.positions for c in padded)

    original, _ = load_model(str(llama))
    feeds, padding = padded_feeds(original, {"batch": 3, "seq": 11})
    (ref,) = _session_run(llama, feeds)
    (got,) = _session_run(ir_to_proto(written), feeds)
    diff = np.abs(ref - got).max(axis=-1)  # [rows, positions]
    defined = padding.value.astype(bool)
    assert diff[defined].max() < 1e-4 * np.abs(ref).max()
    assert diff[~defined].max() > 1e-2  # the undefined rows do differ: comparing them would fail
    assert (diff[2] < 1e-4 * np.abs(ref).max()).all()  # right padding: no fully masked row


def ir_to_proto(m):
    import onnx_ir as ir

    return ir.serde.serialize_model(m)


def _left_padded(original, seq: int = 11, pad: int = 4) -> dict:
    """One row of ``original``'s inputs at ``seq`` positions, its first ``pad`` masked, positions counted from the
    mask: what a caller (or a calibration set for a fixed-size prefill) feeds."""
    feeds, _ = padded_feeds(original, {"batch": 3, "seq": seq})
    feeds = {k: v[1:2] for k, v in feeds.items()}
    mask = np.ones((1, seq), np.int64)
    mask[0, :pad] = 0
    feeds["attention_mask"] = mask
    feeds["position_ids"] = np.where(mask == 1, np.cumsum(mask, -1) - 1, 0)
    return feeds


def test_given_inputs_whose_mask_pads_are_compared_where_defined(llama):
    """The user's own inputs (``--inputs``, or the calibration sample ``quantize`` verifies its folds on) with
    a left-padded mask: Attention-23's other values at the padded queries are not compared, the record says
    which mask and rows, and the real tokens are still compared."""
    original, _ = load_model(str(llama))
    feeds = _left_padded(original)
    written, report = opfuse.optimize(str(llama), target="onnx", opset=23, tune=False, inputs=feeds)
    v = report.verification
    assert report.applied("attention->Attention") and v.ok
    assert v.padded == "attention_mask [1, 11]: rows left-padded 4" and not v.padded_skipped
    assert {c.inputs for c in v.outputs} == {GIVEN_PADDED_LABEL}
    assert all("where 'attention_mask' is 1" in c.positions for c in v.outputs)
    (ref,), (got,) = _session_run(llama, feeds), _session_run(ir_to_proto(written), feeds)
    assert np.abs(ref - got)[0, :4].max() > 1e-2  # the padded queries differ: comparing them whole would fail


def test_given_padded_inputs_still_catch_a_rewrite_wrong_at_real_tokens():
    original, _ = load_model(_positions_model())
    wrong, _ = load_model(_positions_model(wrong=True))
    feeds = {**_left_padded(original, seq=6, pad=2), "x": rng(1).standard_normal((1, 6, 4)).astype(np.float32)}
    result = verify_models(original, wrong, inputs=feeds)
    assert not result.ok and "left-padded 2" in result.padded
    unpadded = {**feeds, "attention_mask": np.ones((1, 6), np.int64), "position_ids": np.arange(6)[None]}
    result = verify_models(original, wrong, inputs=unpadded)  # (the same positions: equal, compared whole)
    assert result.ok and not result.padded and "unpadded" in result.padded_skipped


class _Attention:
    """A torch attention layer whose boolean mask is ``key padding & causal``; ``strict``: a key
    strictly before its query, so query 0 of every row is fully masked though it is no padding."""

    @staticmethod
    def export(path, strict: bool):
        torch = pytest.importorskip("torch")
        import torch.nn.functional as F

        dim, heads = 32, 4

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))

            def forward(self, x, attention_mask):
                b, s, _ = x.shape
                split = lambda t: t.view(b, s, heads, dim // heads).transpose(1, 2)
                i = torch.arange(s)
                causal = (i[None, :] < i[:, None]) if strict else (i[None, :] <= i[:, None])
                mask = causal[None, None] & attention_mask[:, None, None, :].bool()
                y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), attn_mask=mask)
                return self.o(y.transpose(1, 2).reshape(b, s, dim))

        args = (torch.randn(2, 8, dim), torch.ones(2, 8, dtype=torch.int64))
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
            torch.onnx.export(Net(), args, str(path), dynamo=True, opset_version=18, external_data=False,
                              input_names=["x", "attention_mask"], dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
        return path


def test_a_fully_masked_row_that_is_not_padding_is_compared_and_a_fusion_changing_it_fails(tmp_path):
    causal = _Attention.export(tmp_path / "causal.onnx", strict=False)
    _, report = opfuse.optimize(str(causal), target="onnx", opset=23, tune=False)
    assert report.applied("attention->Attention") and report.verification.ok
    assert PADDED_LABEL in report.verification.input_sets

    strict = _Attention.export(tmp_path / "strict.onnx", strict=True)
    assert any(n.op_type == "IsNaN" for n in onnx.load(str(strict)).graph.node)
    with pytest.raises(VerificationError, match="attention->Attention"):
        opfuse.optimize(str(strict), target="onnx", opset=23, tune=False, output=str(tmp_path / "out.onnx"))
    assert not (tmp_path / "out.onnx").exists()


# -- a tolerance that scales with the model -----------------------------------------------------

D, LAYERS, GAIN = 64, 30, 8.0


def deep_net(wrong: str = "", reorder: bool = False):
    """30 residual layers h + tanh(LayerNorm(h) @ W), the LayerNorm written out (ONNX Runtime's ALL
    level fuses it: another float32 order), weights of gain 8 so rounding grows with depth.
    ``reorder``: each product as two half sums added (exact in reals, another float32 order);
    ``wrong``: "scaled" (layer 15's weight 1% larger) or "transposed" (layer 15's weight transposed)."""
    r = rng(5)
    nodes, inits, h = [], [], "x"
    for i in range(LAYERS):
        w = r.normal(0, GAIN / np.sqrt(D), (D, D)).astype(np.float32)
        if i == LAYERS // 2 and wrong == "scaled":
            w = w * np.float32(1.01)
        if i == LAYERS // 2 and wrong == "transposed":
            w = np.ascontiguousarray(w.T)
        p = f"l{i}."
        nodes += [helper.make_node("ReduceMean", [h], [p + "mu"], axes=[-1]),
                  helper.make_node("Sub", [h, p + "mu"], [p + "c"]),
                  helper.make_node("Pow", [p + "c", "two"], [p + "sq"]),
                  helper.make_node("ReduceMean", [p + "sq"], [p + "var"], axes=[-1]),
                  helper.make_node("Add", [p + "var", "eps"], [p + "ve"]),
                  helper.make_node("Sqrt", [p + "ve"], [p + "sd"]),
                  helper.make_node("Div", [p + "c", p + "sd"], [p + "nd"]),
                  helper.make_node("Mul", [p + "nd", p + "g"], [p + "ng"]),
                  helper.make_node("Add", [p + "ng", p + "b"], [p + "n"])]
        inits += [tensor(p + "g", r.uniform(0.5, 1.5, D).astype(np.float32)),
                  tensor(p + "b", r.normal(0, 0.1, D).astype(np.float32))]
        if reorder:
            nodes += [helper.make_node("Slice", [p + "n", "zero", "half", "last"], [p + "n0"]),
                      helper.make_node("Slice", [p + "n", "half", "full", "last"], [p + "n1"]),
                      helper.make_node("MatMul", [p + "n0", p + "w0"], [p + "m0"]),
                      helper.make_node("MatMul", [p + "n1", p + "w1"], [p + "m1"]),
                      helper.make_node("Add", [p + "m0", p + "m1"], [p + "m"])]
            inits += [tensor(p + "w0", w[: D // 2]), tensor(p + "w1", w[D // 2:])]
        else:
            nodes.append(helper.make_node("MatMul", [p + "n", p + "w"], [p + "m"]))
            inits.append(tensor(p + "w", w))
        nodes += [helper.make_node("Tanh", [p + "m"], [p + "t"]), helper.make_node("Add", [h, p + "t"], [p + "h"])]
        h = p + "h"
    nodes.append(helper.make_node("Identity", [h], ["y"]))
    inits += [tensor("eps", np.array(1e-5, np.float32)), tensor("two", np.array(2.0, np.float32)),
              tensor("zero", np.array([0], np.int64)), tensor("half", np.array([D // 2], np.int64)),
              tensor("full", np.array([D], np.int64)), tensor("last", np.array([-1], np.int64))]
    return model(nodes, [vinfo("x", ["batch", 16, D])], [vinfo("y", ["batch", 16, D])], inits)


def test_a_deep_model_s_reordering_passes_on_its_own_variation_and_wrong_rewrites_still_fail():
    original, _ = load_model(deep_net())
    reordered, _ = load_model(deep_net(reorder=True))
    result = verify_models(original, reordered)
    (check,) = result.outputs
    assert result.ok, check.problem
    assert check.variation is not None and check.variation > 0  # d0: the original against itself in float64
    assert check.floor == pytest.approx(VARIATION_FACTOR * check.variation)
    assert result.variation_level in ("float64", "all") and result.variation_factor == VARIATION_FACTOR
    # the fixed tolerance alone fails it: the variation is what lets a legitimate reordering pass
    x = np.random.default_rng(0).standard_normal((1, 16, D)).astype(np.float32)
    (a,) = _session_run(deep_net(), {"x": x})
    (b,) = _session_run(deep_net(reorder=True), {"x": x})
    assert not compare_tensor("y", a, b).ok

    for wrong in ("scaled", "transposed"):
        bad, _ = load_model(deep_net(wrong=wrong, reorder=True))
        result = verify_models(original, bad)
        (check,) = result.outputs
        assert not result.ok and check.variation is not None and check.max_abs_error > 2 * check.floor, wrong
        assert "original's own float32 variation" in check.problem


def test_compare_outputs_takes_the_variation_another_caller_measured():
    """The measured choice compares variants with compare_outputs: runtime_variation gives it d0."""
    from opfuse.runtime import serialized
    from opfuse.verify import compare_outputs, run_model, runtime_variation

    original, _ = load_model(deep_net())
    x = {"x": np.random.default_rng(1).standard_normal((1, 16, D)).astype(np.float32)}
    expected = run_model(original, x)
    d0 = runtime_variation(serialized(original), x, expected, ["y"])
    assert d0["y"] > 0
    (reordered,) = _session_run(deep_net(reorder=True), x)
    (wrong,) = _session_run(deep_net(wrong="scaled", reorder=True), x)
    assert not compare_outputs(expected, {"y": reordered})[0].ok
    (check,) = compare_outputs(expected, {"y": reordered}, variation=d0)
    assert check.ok and check.variation == d0["y"]
    assert not compare_outputs(expected, {"y": wrong}, variation=d0)[0].ok


# -- a padded calibration sample in the quantiser's SQNR -------------------------------------------

def test_a_padded_samples_sqnr_counts_its_real_positions_only():
    from opfuse.quantization.qdq.sqnr import defined_in, outputs_db, padding_of, sqnr_db

    mask = np.array([[0, 0, 1, 1, 1]])
    padded, unpadded = {"attention_mask": mask, "input_ids": np.ones((1, 5), np.int64)}, {"attention_mask": mask * 0 + 1}
    assert padding_of(unpadded) is None and padding_of({"attention_mask": mask[None]}) is None  # (rank 3: no mask)
    assert (padding_of(padded) == mask).all()
    assert (defined_in(padded, (1, 5, 3)) == mask[:, :, None].astype(bool)).all() and defined_in(unpadded, (1, 5, 3)) is None
    reference = rng(0).standard_normal((1, 5, 3)).astype(np.float32)
    approx = reference + np.float32(0.01)
    approx[0, :2] = 50.0  # the padded positions: another runtime's own values there
    expected = sqnr_db(float(np.sum(reference[0, 2:].astype(np.float64) ** 2)), 9 * 0.01 ** 2)
    assert abs(outputs_db(["logits"], [[reference]], [[approx]], [padded]) - expected) < 1e-3
    assert outputs_db(["logits"], [[reference]], [[approx]], [unpadded]) < 0  # unpadded: every position counts
