"""``mask-fill`` on Attention-23's mask (``--target qnn`` at opset 23, where ``fuse-patterns`` writes the
attention as one ``Attention``): the mask ``Where(allowed, 0, finfo(float32).min)`` read as the op's
``attn_mask`` gets the fill -32768, which float16 and a 16-bit range hold, and the outputs at real positions
are the same numbers on padded and unpadded batches.

The oracle is ONNX Runtime's CPU running the unrewritten graph; a padded query's own row (fully masked) is
undefined and not compared (:mod:`opfuse.verify`, "Padded batches")."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import opfuse
from graphs import model, ort_run, rng, tensor, vinfo
from opfuse.passes.mask_fill import ATTENTION_FILL

n = helper.make_node
MIN = float(np.finfo(np.float32).min)
B, H, S, D = 2, 2, 6, 8
PATTERN = "attention mask fill->-32768"


def _attention(fill=MIN, *, softcap=0.0, read_qk=False, extra_reader=False) -> onnx.ModelProto:
    """q, k, v [B, H, S, D] and attention_mask [B, S] (int64, 0 where padded) -> Attention-23 whose
    attn_mask is Expand(Where(And(causal, Cast(mask)), 0, fill)), as the dynamo export writes it."""
    causal = np.tril(np.ones((S, S), bool))[None, None]
    nodes = [n("Cast", ["attention_mask"], ["mask_bool"], to=TensorProto.BOOL),
             n("Unsqueeze", ["mask_bool", "axes12"], ["mask4"]),
             n("And", ["causal", "mask4"], ["allowed"]),
             n("Where", ["allowed", "zero", "fill"], ["bias"], name="mask_where"),
             n("Expand", ["bias", "shape"], ["bias_full"]),
             n("Attention", ["q", "k", "v", "bias_full"], ["y", "", "", *(["qk"] if read_qk else [])],
               name="attention", **({"softcap": softcap} if softcap else {}),
               **({"qk_matmul_output_mode": 0} if read_qk else {}))]
    outputs = [vinfo("y", None)]
    if read_qk:
        outputs.append(vinfo("qk", None))
    if extra_reader:
        nodes.append(n("Relu", ["bias_full"], ["r"]))
        outputs.append(vinfo("r", None))
    inits = [tensor("causal", causal), tensor("axes12", np.array([1, 2], np.int64)),
             tensor("zero", np.array(0.0, np.float32)), tensor("fill", np.array(fill, np.float32)),
             tensor("shape", np.array([B, 1, S, S], np.int64))]
    return model(nodes, [*(vinfo(x, [B, H, S, D]) for x in "qkv"), vinfo("attention_mask", [B, S], TensorProto.INT64)],
                 outputs, inits, opset=23)


def _inputs(seed=0, padded=True) -> dict:
    r = rng(seed)
    mask = np.ones((B, S), np.int64)
    if padded:
        mask[1, :3] = 0  # the second row left-padded by 3
    return {**{x: (r.standard_normal((B, H, S, D)) * 3).astype(np.float32) for x in "qkv"}, "attention_mask": mask}


def _mask_fill(m):
    out, report = opfuse.optimize(m, passes=["mask-fill"], runtime_level="disabled", tune=False)
    assert report.verification.ok, report.verification
    return ir.to_proto(out), report


def _fills(m) -> set[float]:
    return {float(v) for i in m.graph.initializer if i.data_type == TensorProto.FLOAT and i.name != "causal"
            for v in onnx.numpy_helper.to_array(i).reshape(-1)[:1]}


def test_the_attention_mask_fill_becomes_minus_32768_and_real_rows_are_the_same():
    original = _attention()
    out, report = _mask_fill(original)
    (record,) = [r for r in report.records if r.pattern == PATTERN]
    assert "attention" in record.detail and "-32768" in record.detail
    assert MIN not in _fills(out) and ATTENTION_FILL in _fills(out), _fills(out)
    assert {"Where", "Attention"} <= {x.op_type for x in out.graph.node}
    for seed in range(3):
        for padded in (True, False):
            inputs = _inputs(seed, padded)
            expected, actual = ort_run(original, inputs)["y"], ort_run(out, inputs)["y"]
            real = inputs["attention_mask"].astype(bool)  # a query's row: defined where its own position is real
            np.testing.assert_array_equal(actual.transpose(0, 2, 1, 3)[real], expected.transpose(0, 2, 1, 3)[real])
            if not padded:
                np.testing.assert_array_equal(actual, expected)


def test_the_masked_scores_stay_finite_in_float16():
    """Why -32768 and not -65504: the mask is added to the scores, and in float16 s - 65504 is -inf for a
    score below -16, so a fully masked row (a padded query) would be NaN on an NPU computing in float16."""
    scores = np.array([-40.0, -3.0, 5.0], np.float16)
    with np.errstate(over="ignore"):
        assert not np.isfinite(scores + np.float16(-65504)).all()
    assert np.isfinite(scores + np.float16(ATTENTION_FILL)).all()
    masked = scores + np.float16(ATTENTION_FILL)
    assert np.isfinite(np.exp((masked - masked.max()).astype(np.float32))).all()


@pytest.mark.parametrize("case", ["softcap", "qk output read", "another reader", "a finite fill"])
def test_other_attention_masks_stay(case):
    """A softcap (tanh of the masked scores), a read qk_matmul_output (it shows the mask's values), another
    reader of the mask, or a fill float16 holds already (-1e4): nothing is rewritten."""
    original = _attention(-1e4 if case == "a finite fill" else MIN, softcap=30.0 if case == "softcap" else 0.0,
                          read_qk=case == "qk output read", extra_reader=case == "another reader")
    out, report = _mask_fill(original)
    assert not [r for r in report.records if r.pattern == PATTERN]
    assert _fills(out) == _fills(original)


def test_a_llama_at_opset_23_with_padded_batches_computes_the_same(tmp_path):
    """The tiny Llama's prefill raised to opset 23 through the qnn target's passes (Attention fused, then its
    mask's fill rewritten): the logits at real tokens are the float export's, left-padded and not."""
    from decoder_nets import export_tiny_llama, padded_prefill_feeds
    from opfuse.prepare.opset import upgrade_opset
    from opfuse.targets import TARGET_DEFAULT_PASSES

    path = export_tiny_llama(tmp_path / "llama.onnx", mask="input", positions=True)
    original = ir.to_proto(upgrade_opset(ir.load(str(path)), 23)[0])
    out, report = opfuse.optimize(original, passes=list(TARGET_DEFAULT_PASSES["qnn"]), runtime_level="disabled",
                                  tune=False)
    assert report.verification.ok, report.verification
    assert report.applied("attention->Attention"), sorted({r.pattern for r in report.records})
    assert [r.pattern for r in report.records].count(PATTERN) == 1, sorted({r.pattern for r in report.records})
    out = ir.to_proto(out)
    assert MIN not in _fills(out)
    padded, _ = padded_prefill_feeds()
    unpadded = dict(padded, attention_mask=np.ones((3, 8), np.int64),
                    position_ids=np.tile(np.arange(8), (3, 1)).astype(np.int64))
    for inputs in (padded, unpadded):
        (expected,), (actual,) = ort_run(original, inputs).values(), ort_run(out, inputs).values()
        real = inputs["attention_mask"].astype(bool)
        np.testing.assert_allclose(actual[real], expected[real], rtol=1e-4, atol=1e-4)
