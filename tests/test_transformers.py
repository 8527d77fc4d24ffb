"""Transformers as users export them: Hugging Face BertModel / ViTModel from small configs with
random weights and torch's TransformerEncoder, through both torch exporters at several
opsets, optimised for both targets and verified on ONNX Runtime.

What each must show: ``--target onnxruntime`` runs ONNX Runtime's fused kernels for every
LayerNorm and GELU (SkipLayerNormalization, BiasGelu; Attention where the export lets it),
and leaves no more nodes than ONNX Runtime's own transformers optimizer; ``--target onnx`` writes the standard ops (LayerNormalization, Gelu) and nothing of
ONNX Runtime's. The counts the assertions use come from the model's config (layers), not
from opfuse.
"""

from __future__ import annotations

import logging

import onnx
import pytest

import opfuse
from opfuse.models.transformers import SMALL_BERT, SMALL_VIT, export


LAYERS = {"bert": SMALL_BERT["num_hidden_layers"], "vit": SMALL_VIT["num_hidden_layers"], "encoder": 2}
CASES = [(kind, exporter, opset) for kind in ("bert", "vit")
         for exporter, opset in (("torchscript", 14), ("torchscript", 17), ("torchscript", 20),
                                 ("dynamo", 18), ("dynamo", 20))]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cache = {}
    folder = tmp_path_factory.mktemp("transformers")

    def get(kind, exporter, opset):
        key = (kind, exporter, opset)
        if key not in cache:
            cache[key] = export(kind, exporter, opset, folder / f"{kind}-{exporter}-{opset}.onnx")
        return cache[key]

    return get


def ops_of(m) -> list[str]:
    return [f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in m.graph]


def ort_transformers_nodes(path, kind: str) -> int:
    from onnxruntime.transformers.optimizer import optimize_model  # (the peer, imported where used)

    cfg = SMALL_BERT if kind == "bert" else SMALL_VIT
    logging.disable(logging.WARNING)
    try:
        return len(optimize_model(str(path), model_type=kind, num_heads=cfg["num_attention_heads"],
                                  hidden_size=cfg["hidden_size"]).model.graph.node)
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("kind, exporter, opset", CASES)
def test_onnxruntime_target_runs_the_fused_transformer_kernels(exported, kind, exporter, opset):
    path = exported(kind, exporter, opset)
    out, report = opfuse.optimize(str(path), target="onnxruntime")
    assert report.verification.ok, report.verification.first_failure()
    found = ops_of(out)
    layers = LAYERS[kind]
    # each block: Add + LayerNorm twice (after attention, after the MLP), one GELU with its bias
    assert found.count("com.microsoft.SkipLayerNormalization") >= 2 * layers - (kind == "vit"), found
    assert found.count("com.microsoft.BiasGelu") == layers, found
    assert "Erf" not in found and "ReduceMean" not in found, found
    if exporter == "dynamo":
        assert found.count("com.microsoft.Attention") == layers, found
    assert len(found) <= ort_transformers_nodes(path, kind)


@pytest.mark.parametrize("kind, exporter, opset", [c for c in CASES if c[2] >= 20] + [("bert", "torchscript", 14)])
def test_onnx_target_writes_the_standard_ops(exported, tmp_path, kind, exporter, opset):
    path = exported(kind, exporter, opset)
    written = tmp_path / "out.onnx"
    out, report = opfuse.optimize(str(path), target="onnx", opset=max(opset, 20), output=written)
    assert report.verification.ok, report.verification.first_failure()
    found = ops_of(out)
    layers = LAYERS[kind]
    assert found.count("LayerNormalization") >= 2 * layers, found
    assert found.count("Gelu") == layers and "Erf" not in found, found
    assert not any(op.startswith("com.microsoft") for op in found)
    onnx.checker.check_model(str(written), full_check=True)  # what any ONNX tool opens


@pytest.mark.parametrize("exporter, opset", [("torchscript", 17), ("dynamo", 18)])
def test_torch_transformer_encoder(exported, exporter, opset):
    path = exported("encoder", exporter, opset)
    out, report = opfuse.optimize(str(path), target="onnxruntime")
    assert report.verification.ok, report.verification.first_failure()
    found = ops_of(out)
    assert found.count("com.microsoft.SkipLayerNormalization") >= 2 * LAYERS["encoder"] - 1, found
    assert "Erf" not in found, found


@pytest.mark.parametrize("kind", ["bert", "vit"])
def test_onnx_target_at_opset_23_writes_the_standard_attention(exported, kind):
    path = exported(kind, "dynamo", 20)
    out, report = opfuse.optimize(str(path), target="onnx", opset=23)
    assert report.verification.ok, report.verification.first_failure()
    found = ops_of(out)
    assert found.count("Attention") == LAYERS[kind] and "Softmax" not in found, found
    assert not any(op.startswith("com.microsoft") for op in found)
