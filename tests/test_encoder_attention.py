"""An encoder's self-attention from torch's TorchScript exporter -> ONNX Runtime's Attention
(:mod:`opfuse.passes.patterns.self_attention`).

The graphs are Hugging Face BertModels with random weights in eager attention (the form the
sentence encoders shipped as ONNX files have; transformers 5 scales by Mul and builds the mask
[B, 1, S, T], so the [B, 1, 1, T] broadcast is exercised by the shipped MiniLM-L3 only), exported with ``dynamo=False`` at opset 14 with dynamic batch and
sequence. What must hold: one Attention per layer (the count comes from the config), outputs
equal to the export's on ONNX Runtime at two batch/sequence sizes with padded masks, and an
illegal variant (Softmax on another axis, a scale computed at run time) refused with its reason.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import opfuse

LAYERS, HEADS, HIDDEN, VOCAB = 2, 4, 32, 50


def _bert(path, masked: bool, exporter: str = "torchscript"):
    from transformers import BertConfig, BertModel  # (heavy: only these tests build one)

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                     intermediate_size=2 * HIDDEN, max_position_embeddings=32)
    cfg._attn_implementation = "eager"  # (what the shipped encoders were exported from)
    torch.manual_seed(0)
    model = BertModel(cfg).eval()

    class LastHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, mask=None):
            return self.model(input_ids=ids, attention_mask=mask).last_hidden_state

    ids, mask = torch.randint(0, VOCAB, (1, 8)), torch.ones(1, 8, dtype=torch.int64)
    names = ["input_ids", "attention_mask"] if masked else ["input_ids"]
    args = (ids, mask) if masked else (ids,)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(LastHidden(), args, str(path), input_names=names, opset_version=18, dynamo=True)
        else:
            torch.onnx.export(LastHidden(), args, str(path), input_names=names, opset_version=14, dynamo=False,
                              dynamic_axes={n: {0: "batch", 1: "seq"} for n in names})
    return path


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    folder = tmp_path_factory.mktemp("encoders")
    return {"masked": _bert(folder / "masked.onnx", True), "unmasked": _bert(folder / "unmasked.onnx", False)}


def _ops(model) -> list[str]:
    return [f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in model.graph]


def _run(model_bytes: bytes, feeds: dict) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in names})[0]


@pytest.mark.parametrize("variant", ["masked", "unmasked"])
def test_each_layer_becomes_one_attention_equal_on_onnxruntime(exports, tmp_path, variant):
    source = exports[variant]
    written = tmp_path / "out.onnx"
    out, report = opfuse.optimize(str(source), target="onnxruntime", output=written)
    assert report.verification.ok, report.verification.first_failure()
    found = _ops(out)
    assert found.count("com.microsoft.Attention") == LAYERS, found
    assert "Softmax" not in found and "Transpose" not in found, found
    assert sum(r.pattern == "self-attention->Attention" for r in report.records) == LAYERS
    rng = np.random.default_rng(0)
    for batch, seq in ((1, 5), (3, 11)):
        mask = np.ones((batch, seq), np.int64)
        mask[1:, seq - 3:] = 0  # padded sequences after the first
        feeds = {"input_ids": rng.integers(0, VOCAB, (batch, seq)).astype(np.int64), "attention_mask": mask}
        want = _run(onnx.load(str(source)).SerializeToString(), feeds)
        got = _run(onnx.load(str(written)).SerializeToString(), feeds)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_every_layer_reads_the_one_mask_and_nothing_is_added_per_layer(exports):
    out, _ = opfuse.optimize(str(exports["masked"]), target="onnxruntime")
    found = _ops(out)
    # the exporter's [B, 1, 1, T] mask, which ONNX Runtime's attention_bias does not broadcast
    exported = [n.op_type for n in onnx.load(str(exports["masked"])).graph.node]
    assert found.count("Expand") - exported.count("Expand") <= 1, found
    biases = {n.inputs[5] for n in out.graph if n.op_type == "Attention"}
    assert len(biases) == 1  # every layer reads the one mask


def _edited(source, path, edit):
    model = onnx.load(str(source))
    edit(model)
    onnx.save(model, str(path))
    return path


def _softmax_on_queries(model):
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    del softmax.attribute[:]
    softmax.attribute.append(onnx.helper.make_attribute("axis", 2))


def _scale_as_input(model):
    made = {o: n for n in model.graph.node for o in n.output}
    scaling = next(n for n in model.graph.node if n.op_type in ("Div", "Mul") and "attention/self" in n.name
                   and made.get(n.input[0]) is not None and made[n.input[0]].op_type == "MatMul")
    scaling.input[1] = "scale"
    model.graph.input.append(onnx.helper.make_tensor_value_info("scale", onnx.TensorProto.FLOAT, []))


@pytest.mark.parametrize("edit, reason", [(_softmax_on_queries, "Softmax is over axis 2"),
                                          (_scale_as_input, "not a constant scalar")])
def test_an_illegal_layer_is_refused_with_its_reason(exports, tmp_path, edit, reason):
    path = _edited(exports["masked"], tmp_path / "edited.onnx", edit)
    out, report = opfuse.optimize(str(path), target="onnxruntime")
    assert report.verification.ok, report.verification.first_failure()
    refused = [r for r in report.refusals if r.pattern == "self-attention->Attention"]
    assert any(reason in r.reason for r in refused), [r.reason for r in refused]
    assert _ops(out).count("com.microsoft.Attention") == LAYERS - 1  # the other layer is fused


def test_dynamo_export_is_fused_to_attention_too(tmp_path):
    path = _bert(tmp_path / "dynamo.onnx", True, exporter="dynamo")
    out, report = opfuse.optimize(str(path), target="onnxruntime")
    assert report.verification.ok, report.verification.first_failure()
    assert _ops(out).count("com.microsoft.Attention") == LAYERS, _ops(out)
