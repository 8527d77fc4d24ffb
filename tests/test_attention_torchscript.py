"""Attention in a TorchScript export at ``--target onnxruntime`` (issue 49: SmolLM2's TorchScript prefill was
refused, "the graph would have 2766 nodes instead of 2676").

The TorchScript exporter writes each layer's attention as ``Softmax(q k^T * scale + Where(mask, 0, -inf))``,
guarded by ``Where(IsNaN(p), 0, p)``, with a Reshape that keeps [B, H, S, D] before the head merge, and
grouped-query attention's key and value expanded to every head (so onnxscript's MultiHeadAttention rules,
which read the projections directly, do not match; its SDPA -> MultiHeadAttention fallback does). What
:mod:`opfuse.passes.patterns.attention` adds there: the mask's ``-inf`` fill written finite where the guard is
taken (a fully masked row would be NaN in the fused op, and the next layer's real queries read it through
the padded keys), the mask read as it is where it has the query axis already, and the head merge absorbed
into the op. The oracle is ONNX Runtime's CPU running the export."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir

import opfuse
from decoder_nets import export_tiny_llama, padded_prefill_feeds
from graphs import ort_run


def test_a_torchscript_tiny_llama_prefill_fuses_attention_and_is_equal_on_padded_batches(tmp_path):
    """Two layers, two MultiHeadAttention, no Softmax or NaN guard left, no refusal at a Softmax (the
    rewrite's graph is smaller than the one it found, which the attention transaction requires); the logits equal the export's at every real token of a padded batch (row 1 left-padded,
    row 2 one real token), and finite everywhere (a NaN from a fully masked row would reach the real rows
    through the second layer's padded keys)."""
    path = export_tiny_llama(tmp_path / "llama.onnx", exporter="torchscript", opset=17, mask="input", positions=True)
    out, report = opfuse.optimize(str(path), target="onnxruntime")
    assert report.verification.ok
    written = Counter((n.domain, n.op_type) for n in out.graph)
    assert written[("com.microsoft", "MultiHeadAttention")] == 2, [r.reason for r in report.refusals]
    assert not written[("", "Softmax")] and not written[("", "IsNaN")], written
    assert not [r for r in report.refusals if "Softmax" in r.node], report.refusals  # (its root, when refused)

    feeds, real = padded_prefill_feeds()
    (expected,) = ort_run(onnx.load(path), feeds).values()
    (actual,) = ort_run(ir.to_proto(out), feeds).values()
    assert np.isfinite(actual).all()
    scale = float(np.abs(expected[real]).max())
    np.testing.assert_allclose(actual[real], expected[real], rtol=1e-4, atol=1e-5 * scale)
