"""opfuse.llm.export's GGUF loading one tensor at a time: a tiny Llama GGUF written here with the ``gguf``
package's writer (Q4_0, Q4_1, Q8_0 and F32 tensors, q and k rows that transformers permutes), loaded by
transformers with its whole-file loader and with opfuse's (each tensor dequantised when the model's
loader reads it, a few rows at a time): the same parameters, bit for bit.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import extras

gguf = extras.require("gguf")
extras.require("transformers")
import torch
from gguf import GGMLQuantizationType, quants

from opfuse.llm import export

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 64, 4, 2, 96, 40


def _tensors():
    rng = np.random.default_rng(0)
    kv = KV_HEADS * HIDDEN // HEADS

    def w(rows, cols, shift=0.0):
        return (rng.standard_normal((rows, cols)) * 0.1 + shift).astype(np.float32)

    return {"token_embd.weight": ("Q8_0", w(VOCAB, HIDDEN)), "output_norm.weight": ("F32", w(1, HIDDEN)[0] + 1),
            "blk.0.attn_norm.weight": ("F32", w(1, HIDDEN)[0] + 1), "blk.0.ffn_norm.weight": ("F32", w(1, HIDDEN)[0]),
            "blk.0.attn_q.weight": ("Q4_0", w(HIDDEN, HIDDEN)), "blk.0.attn_k.weight": ("Q4_1", w(kv, HIDDEN, 0.05)),
            "blk.0.attn_v.weight": ("Q8_0", w(kv, HIDDEN)), "blk.0.attn_output.weight": ("F32", w(HIDDEN, HIDDEN)),
            "blk.0.ffn_gate.weight": ("Q4_1", w(FFN, HIDDEN, 0.05)), "blk.0.ffn_up.weight": ("Q4_0", w(FFN, HIDDEN)),
            "blk.0.ffn_down.weight": ("Q8_0", w(HIDDEN, FFN))}


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    for name, (kind, w) in _tensors().items():
        if kind == "F32":
            writer.add_tensor(name, w)
        else:
            q = quants.quantize(w, GGMLQuantizationType[kind])
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _state(path, lazy: bool) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    with export._one_tensor_at_a_time(path.parent) if lazy else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_lazy_gguf_loading_gives_the_same_parameters(llama_gguf, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_gguf.parent), gguf_file=llama_gguf.name,
                                                 dtype=torch.float32)
    lazy, store = export._lazy_gguf_state_dict(str(llama_gguf), model, torch.float32)
    assert len(lazy) == len(_tensors()) and store is not None  # (the lazy path is the one taken)
    monkeypatch.setattr(export, "_DEQUANTIZED_ROWS", 7)  # (slices that split tensors, and blocks' rows)
    whole, one_at_a_time = _state(llama_gguf, lazy=False), _state(llama_gguf, lazy=True)
    assert sorted(whole) == sorted(one_at_a_time)
    for name, want in whole.items():
        got = one_at_a_time[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.numpy().tobytes() == want.numpy().tobytes(), name


def test_weight_file_keeps_each_array_from_many_threads(tmp_path):
    import concurrent.futures

    arrays = [np.full((17 + i, 5), i, np.float32) for i in range(64)]
    store = export.WeightFile(sum(export._float_bytes(a.shape) for a in arrays), tmp_path)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # (transformers' loader reads from threads)
        views = list(pool.map(store.put, arrays))
    for a, v in zip(arrays, views):
        assert v.shape == a.shape and v.dtype == a.dtype and np.array_equal(v, a)  # (read back after the drop)
    assert list(tmp_path.iterdir()) == []  # (the file has no name)


def test_export_from_the_weight_file_writes_the_same_bytes(llama_gguf, tmp_path):
    import onnx
    from transformers import AutoModelForCausalLM

    written = {}
    for lazy in (False, True):  # (as export.load loads the model: this GGUF has no tokenizer)
        with export._one_tensor_at_a_time(tmp_path) if lazy else contextlib.nullcontext([]) as stores:
            model = AutoModelForCausalLM.from_pretrained(str(llama_gguf.parent), gguf_file=llama_gguf.name,
                                                         dtype=torch.float32).eval()
        assert len(stores) == lazy
        model._opfuse_weight_files = stores
        path = tmp_path / ("lazy" if lazy else "whole") / "model.onnx"
        export.export(model, path)
        model = onnx.load(str(path), load_external_data=False)
        for node in model.graph.node:  # (torch's stack traces name this file's lines)
            del node.metadata_props[:]
        written[lazy] = (model.SerializeToString(), (path.parent / "model.onnx.data").read_bytes())
    assert written[True] == written[False]
