"""A tiny decoder LLM for the tests: a random Hugging Face Llama (RMSNorm, SiLU-gated MLP,
grouped-query attention) exported as a prefill graph by either torch exporter. Nothing is
downloaded; the larger corpus is ``benchmarks/decoders.py``."""

from __future__ import annotations

import contextlib
import io
import pathlib
import warnings

import pytest

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100, max_position_embeddings=64, use_cache=False)


def export_tiny_llama(path: pathlib.Path, *, exporter: str = "dynamo", opset: int = 18,
                      mask: str = "none", positions: bool = False) -> pathlib.Path:
    """The logits of a tiny random Llama for ``input_ids`` [batch, seq]. ``mask``: "input" (an
    ``attention_mask`` input too), "ones" (a mask of ones made inside: TorchScript needs one, as
    without it transformers traces ``torch.diff``, which it cannot export) or "none".
    ``positions``: a ``position_ids`` input [batch, seq] last (else transformers makes [1, seq] inside)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    net = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, input_ids, second=None, third=None):  # (mask and/or positions, in that order)
            attention_mask = second if mask == "input" else None
            position_ids = (third if mask == "input" else second) if positions else None
            if mask == "ones":
                attention_mask = torch.ones_like(input_ids)
            return self.net(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).logits

    ids = torch.randint(0, 100, (2, 8))
    names, args = ["input_ids"], [ids]
    if mask == "input":
        names, args = [*names, "attention_mask"], [*args, torch.ones_like(ids)]
    if positions:
        names, args = [*names, "position_ids"], [*args, torch.arange(8).repeat(2, 1)]
    args = tuple(args)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
            torch.onnx.export(Logits(), args, str(path), dynamo=True, opset_version=opset, external_data=False,
                              input_names=names, dynamic_shapes=tuple({0: batch, 1: seq} for _ in names))
        else:
            torch.onnx.export(Logits(), args, str(path), dynamo=False, opset_version=opset, input_names=names,
                              output_names=["logits"], dynamic_axes={n: {0: "batch", 1: "seq"} for n in names})
    return path
