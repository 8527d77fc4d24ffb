"""Transformer networks built in PyTorch and exported to ONNX (the tests' and benchmarks').

Unlike the built-in CNNs (ONNX written directly), these go the way users' transformers do:
Hugging Face ``transformers`` builds BertModel and ViTModel from a config with random
weights (nothing is downloaded), ``torch.nn.TransformerEncoder`` is torch's own, and one
of torch's exporters writes the ONNX: ``"torchscript"`` (``dynamo=False``, symbolic batch
and sequence) or ``"dynamo"`` (``dynamo=True``, the default since torch 2.9, static
shapes). Needs torch and transformers (the ``test`` extra).

    bert / bert-base   BertModel, 2 layers of 32 / BERT-base's 12 of 768, 8 / 128 tokens
    vit                ViTModel, 2 layers of 32, 16x16 images in 8x8 patches
    encoder            nn.TransformerEncoder, 2 GELU layers of 32, batch 2, 8 tokens
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import warnings

import torch

SMALL_BERT = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=32)
SMALL_VIT = dict(image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=64)
BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512)
SEQ = 8


class _LastHidden(torch.nn.Module):
    """The model's last hidden state as the one output (what an encoder deploys)."""

    def __init__(self, model: torch.nn.Module, keys: tuple[str, ...]):
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *args):
        return self.model(**dict(zip(self.keys, args))).last_hidden_state


def bert(config: dict | None = None, seed: int = 0, seq: int = SEQ) -> tuple[torch.nn.Module, tuple, dict]:
    """(module, example inputs, dynamic axes) of a BertModel with random weights."""
    from transformers import BertConfig, BertModel  # (heavy: only what builds one imports it)

    torch.manual_seed(seed)
    cfg = BertConfig(**(config or SMALL_BERT))
    module = _LastHidden(BertModel(cfg).eval(), ("input_ids", "attention_mask"))
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    mask = torch.ones(1, seq, dtype=torch.int64)
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    return module, (ids, mask), axes


def vit(config: dict | None = None, seed: int = 0) -> tuple[torch.nn.Module, tuple, dict]:
    from transformers import ViTConfig, ViTModel  # (heavy: only what builds one imports it)

    torch.manual_seed(seed)
    cfg = ViTConfig(**(config or SMALL_VIT))
    module = _LastHidden(ViTModel(cfg).eval(), ("pixel_values",))
    x = torch.randn(1, cfg.num_channels, cfg.image_size, cfg.image_size)
    return module, (x,), {"pixel_values": {0: "batch"}}


def encoder(d_model: int = 32, layers: int = 2, seed: int = 0) -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model=d_model, nhead=4, dim_feedforward=2 * d_model,
                                             activation="gelu", batch_first=True, dropout=0.0)
    module = torch.nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False).eval()
    return module, (torch.randn(2, SEQ, d_model),), {}  # (its TorchScript export fixes the batch)


def bert_base(seed: int = 0):
    return bert(BERT_BASE, seed, seq=128)


BUILDERS = {"bert": bert, "bert-base": bert_base, "vit": vit, "encoder": encoder}
INPUT_NAMES = {"bert": ["input_ids", "attention_mask"], "bert-base": ["input_ids", "attention_mask"],
               "vit": ["pixel_values"], "encoder": ["x"]}


def example_feeds(kind: str, **build) -> dict:
    """The example inputs of ``kind`` as numpy arrays, by input name."""
    _, args, _ = BUILDERS[kind](**build)
    return {name: a.numpy() for name, a in zip(INPUT_NAMES[kind], args)}


def export(kind: str, exporter: str, opset: int, path: pathlib.Path, **build) -> pathlib.Path:
    """Build ``kind`` and export it to ``path`` with ``exporter`` at ``opset``."""
    module, args, axes = BUILDERS[kind](**build)
    names = INPUT_NAMES[kind]
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(module, args, str(path), input_names=names, opset_version=opset, dynamo=True)
        else:
            torch.onnx.export(module, args, str(path), input_names=names, opset_version=opset, dynamo=False,
                              dynamic_axes=axes or None)
    return path
