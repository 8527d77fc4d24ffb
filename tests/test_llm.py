"""``opfuse llm``: a tiny random-weight Llama folder to a folder onnxruntime-genai runs, fp32 and int4;
the int4 rewrite (ONNX Runtime's MatMulNBitsQuantizer as opfuse.llm.quantize_int4 drives it) on small
graphs built here against the weights it wrote, dequantised in numpy.

The model: LlamaConfig, hidden 64, 2 layers, 4 heads, 2 KV heads, tied embeddings, weights drawn with
std 0.3 (at transformers' 0.02 a 2-layer model repeats one token, which would hide a wrong cache); its
tokenizer a byte-level BPE of 320 tokens trained here on ``pydoc_data.topics`` (nothing downloaded;
genai's tokenizer does not load a WordLevel one).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import decoder_nets
import extras
from onnx import TensorProto, helper, numpy_helper

extras.require("transformers")
og = extras.require("onnxruntime_genai")
import onnxruntime as ort
import torch

from opfuse.cli import main
from opfuse.llm.genai import greedy
from opfuse.llm.quantize_int4 import quantize_int4

VOCAB, NEW_TOKENS = 320, 12
PROMPT = "def f(x): return x"


def _tokenizer():
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sorted(pydoc_data.topics.topics.values())[:50], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp("llm") / "hf"
    tokenizer = _tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", autouse=True)
def shared_llm_export():
    """The ``opfuse llm`` conversions of this file and test_llm_int4.py (fp32, int4, the int4 algorithms,
    the spawned one) start from the same seeded tiny Llama: its export, a torch dynamo export that is
    most of a conversion's time, is made once a session (decoder_nets.llm_export, keyed by the model's
    weights and config) and copied to where each conversion asks; every step after it runs in each
    conversion. A conversion that spawns its export step (``exported_folder``) runs
    decoder_nets.llm_export_step there: the step's loading, checks and genai files in the spawned
    process, its export the session's."""
    import opfuse.llm.export

    real = opfuse.llm.export.export
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(opfuse.llm.export, "export", lambda model, path: decoder_nets.llm_export(model, path, real))
        yield


def _convert(hf_folder, precision, *flags):
    out = hf_folder.parent / "-".join((precision, *(f.strip("-") for f in flags)))
    if not (out / "genai_config.json").exists():
        assert main(["llm", str(hf_folder), "-o", str(out), "--precision", precision, *flags]) == 0
    return out


@pytest.fixture(scope="module")
def fp32_folder(hf_folder):
    return _convert(hf_folder, "fp32")


@pytest.fixture(scope="module")
def int4_folder(hf_folder):
    return _convert(hf_folder, "int4")


@pytest.fixture(scope="module")
def exported_folder(hf_folder):
    """Converted as a large model is: the export step and the optimisation each in a spawned process (a
    source this small is converted in this process, as the other folders here are); the spawned export
    step's export is the session's (decoder_nets.llm_export_step)."""
    import opfuse.llm

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(opfuse.llm, "IN_PROCESS_BYTES", 0)
        patch.setattr(opfuse.llm, "_export_step", decoder_nets.llm_export_step)
        return _convert(hf_folder, "fp32", "--attention", "exported")


def _genai_greedy(folder, prompt: str, new: int) -> tuple[list[int], list[int]]:
    model = og.Model(str(folder))
    tokenizer = og.Tokenizer(model)
    ids = [int(i) for i in tokenizer.encode(prompt)]
    return ids, greedy(model, ids, new)


def _transformers_greedy(hf_folder, ids: list[int], new: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_folder).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new, do_sample=False)  # stops at eos, as genai
    return out[0, len(ids):].tolist()


def test_folder_has_what_genai_reads(fp32_folder):
    names = {p.name for p in fp32_folder.iterdir()}
    assert {"model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((fp32_folder / "genai_config.json").read_text())["model"]
    decoder = config["decoder"]
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]) == (2, 2, 16)
    graph = onnx.load(str(fp32_folder / "model.onnx"), load_external_data=False).graph
    # GroupQueryAttention: no position_ids (its rotary counts from the mask), the cache shared
    assert [i.name for i in graph.input][:2] == ["input_ids", "attention_mask"]
    assert "position_ids" not in {i.name for i in graph.input} and "position_ids" not in decoder["inputs"]
    assert [n.op_type for n in graph.node].count("GroupQueryAttention") == 2
    assert json.loads((fp32_folder / "genai_config.json").read_text())["search"]["past_present_share_buffer"]
    assert decoder["inputs"]["past_key_names"] % 1 in {i.name for i in graph.input}
    assert decoder["outputs"]["present_value_names"] % 1 in {o.name for o in graph.output}


def test_attention_exported_keeps_position_ids_and_concat(exported_folder, hf_folder):
    config = json.loads((exported_folder / "genai_config.json").read_text())
    graph = onnx.load(str(exported_folder / "model.onnx"), load_external_data=False).graph
    assert [i.name for i in graph.input][:3] == ["input_ids", "attention_mask", "position_ids"]
    assert config["model"]["decoder"]["inputs"]["position_ids"] == "position_ids"
    assert not config["search"]["past_present_share_buffer"]
    assert "GroupQueryAttention" not in {n.op_type for n in graph.node}
    ids, genai = _genai_greedy(exported_folder, PROMPT, NEW_TOKENS)
    assert genai == _transformers_greedy(hf_folder, ids, NEW_TOKENS)


def test_fp32_genai_greedy_equals_transformers(hf_folder, fp32_folder):
    ids, genai = _genai_greedy(fp32_folder, PROMPT, NEW_TOKENS)
    assert len(genai) == NEW_TOKENS
    assert len(set(genai)) > 1  # the model does not just repeat a token (a wrong cache would hide there)
    assert genai == _transformers_greedy(hf_folder, ids, NEW_TOKENS)


def test_int4_folder_generates_with_matmulnbits(int4_folder):
    proto = onnx.load(str(int4_folder / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in proto.graph.node]
    # per layer: packed QKV, o_proj, packed gate/up, down (4 x 2); the tied head: 1
    assert ops.count("MatMulNBits") == 9
    assert ops.count("GatherBlockQuantized") == 1
    assert ops.count("GroupQueryAttention") == 2
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (4, 32, 4)
    _, tokens = _genai_greedy(int4_folder, PROMPT, NEW_TOKENS)
    assert len(tokens) == NEW_TOKENS and all(0 <= t < VOCAB for t in tokens)


def test_bad_source_exit_2_nothing_written(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["llm", str(tmp_path / "missing.gguf"), "-o", str(out)]) == 2
    (tmp_path / "model.bin").write_bytes(b"x")
    assert main(["llm", str(tmp_path / "model.bin"), "-o", str(out)]) == 2
    assert not out.exists()
    assert capsys.readouterr().err.count("\n") == 2


# -- the int4 rewrite on graphs built here ----------------------------------------------------------

def _unpack_nibbles(packed: np.ndarray, count: int) -> np.ndarray:
    """uint8 bytes -> their 4-bit values, low nibble first, the last axis cut to ``count``."""
    low, high = packed & 0x0F, packed >> 4
    return np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)[..., :count]


def _dequantised_matmulnbits(node, inits) -> np.ndarray:
    """The [K, N] float weight a MatMulNBits node computes with, from its initializers."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
    blocks = -(-k // block)
    q = _unpack_nibbles(inits[node.input[1]], block).reshape(n, blocks, block).astype(np.float32)
    scales = inits[node.input[2]].reshape(n, blocks, 1)
    if len(node.input) > 3 and node.input[3]:
        zero = _unpack_nibbles(inits[node.input[3]].reshape(n, -1), blocks).reshape(n, blocks, 1).astype(np.float32)
    else:
        zero = np.full((n, blocks, 1), 8, np.float32)
    return ((q - zero) * scales).reshape(n, blocks * block)[:, :k].T


def _dequantised_gather(node, inits) -> np.ndarray:
    """The [vocab, hidden] float table a GatherBlockQuantized node reads, from its initializers."""
    data = inits[node.input[0]].astype(np.float32)
    hidden = data.shape[1]
    block = {a.name: helper.get_attribute_value(a) for a in node.attribute}["block_size"]
    scales = np.repeat(inits[node.input[2]], block, axis=1)[:, :hidden]
    zero = np.repeat(inits[node.input[3]].astype(np.float32), block, axis=1)[:, :hidden] if len(node.input) > 3 \
        else np.zeros_like(data)
    return (data - zero) * scales


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _matmul_model(w: np.ndarray) -> onnx.ModelProto:
    k, n = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", n])],
        [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("block", [32, 64])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k", [128, 96])  # 96 at block 64: the last block padded
def test_matmulnbits_equals_dequantised_reference(block, symmetric, k):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, 48)) + rng.standard_normal((1, 48))).astype(np.float32)  # off-centre columns
    x = rng.standard_normal((5, k)).astype(np.float32)
    model = quantize_int4(_matmul_model(w), block_size=block, symmetric=symmetric, accuracy_level=None,
                          algorithm="rtn")
    (node,) = model.graph.node
    assert node.op_type == "MatMulNBits" and node.domain == "com.microsoft"
    assert (len(node.input) > 3 and bool(node.input[3])) is not symmetric
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    dequantised = _dequantised_matmulnbits(node, inits)
    step = np.abs(w).max() / 7
    assert np.abs(dequantised - w).max() <= step  # it is a 4-bit grid near w: the reference is not w itself
    (y,) = _run(model, {"x": x})
    np.testing.assert_allclose(y, x @ dequantised, rtol=1e-5, atol=1e-5 * np.abs(x @ dequantised).max())


def test_matmulnbits_accuracy_level_4_near_dequantised_reference():
    """accuracy_level 4 quantises the activations to int8 per block: near, not equal."""
    rng = np.random.default_rng(1)
    w, x = rng.standard_normal((128, 64)).astype(np.float32), rng.standard_normal((3, 128)).astype(np.float32)
    model = quantize_int4(_matmul_model(w), algorithm="rtn")
    (node,) = model.graph.node
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["accuracy_level"] == 4
    reference = x @ _dequantised_matmulnbits(node, {t.name: numpy_helper.to_array(t) for t in model.graph.initializer})
    (y,) = _run(model, {"x": x})
    assert np.abs(y - reference).max() <= 0.02 * np.abs(reference).max()


def test_tied_head_and_embedding_equal_dequantised_reference():
    """ids -> Gather(E) -> MatMul(., Transpose(E)): the embedding a GatherBlockQuantized, the head a
    MatMulNBits of E's transposed copy, each equal to the float graph on its dequantised table."""
    rng = np.random.default_rng(2)
    vocab, hidden = 40, 64
    table = rng.standard_normal((vocab, hidden)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["h"], name="embed"),
         helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0], name="tie"),
         helper.make_node("MatMul", ["h", "Et"], ["logits"], name="head")], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["b", "s", hidden]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocab])],
        [numpy_helper.from_array(table, "E")])
    model = quantize_int4(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10),
                          accuracy_level=None, embedding_bits=4, algorithm="rtn")
    ops = {n.op_type: n for n in model.graph.node}
    assert set(ops) == {"GatherBlockQuantized", "MatMulNBits"}  # the Transpose is gone
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    embed = _dequantised_gather(ops["GatherBlockQuantized"], inits)
    head = _dequantised_matmulnbits(ops["MatMulNBits"], inits)
    np.testing.assert_allclose(head, embed.T, rtol=1e-6, atol=1e-6)  # one table, quantised the same way twice
    ids = rng.integers(0, vocab, (2, 7))
    h, logits = _run(model, {"ids": ids})
    np.testing.assert_array_equal(h, embed[ids])
    np.testing.assert_allclose(logits, embed[ids] @ embed.T, rtol=1e-5, atol=1e-5 * np.abs(logits).max())


def test_int4_logits_follow_fp32(fp32_folder, int4_folder):
    """The int4 graph's prefill logits against the fp32 graph's on the same tokens: 4-bit weights move
    them (the random weights of std 0.3 make this tiny model sensitive), a wrong quantisation (a weight
    read along the wrong axis, a tied head not the embedding) leaves no correlation at all."""
    n = 9
    feeds = {"input_ids": np.arange(20, 20 + n)[None], "attention_mask": np.ones((1, n), np.int64),
             "position_ids": np.arange(n)[None]}
    feeds.update({f"past_key_values.{i}.{kv}": np.zeros((1, 2, 0, 16), np.float32)
                  for i in range(2) for kv in ("key", "value")})
    sessions = [ort.InferenceSession(str(f / "model.onnx")) for f in (fp32_folder, int4_folder)]
    fp32, int4 = (s.run(["logits"], {i.name: feeds[i.name] for i in s.get_inputs()})[0] for s in sessions)
    assert np.corrcoef(fp32.ravel(), int4.ravel())[0, 1] > 0.8


# -- GroupQueryAttention (opfuse.llm.gqa) on the tiny model's graph as exported and optimised ---------

def test_gqa_rewrite_verified_and_a_wrong_scale_caught(exported_folder, tmp_path):
    from opfuse.llm.gqa import group_query_attention, verify

    before = str(exported_folder / "model.onnx")
    model = onnx.load(before)
    done = group_query_attention(model, layers=2, heads=4, kv_heads=2, head_size=16, context=256)
    assert (done.layers, done.refused, done.removed_inputs) == (2, [], ["position_ids"])
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("GroupQueryAttention") == 2
    assert not {"Softmax", "Concat", "RotaryEmbedding", "Expand"} & set(ops)  # all of attention is inside it
    after = tmp_path / "gqa.onnx"
    onnx.save(model, str(after))
    assert verify(before, str(after), layers=2, kv_heads=2, head_size=16, vocab=VOCAB) == ""
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            next(a for a in node.attribute if a.name == "scale").f *= 1.01
    onnx.save(model, str(after))
    assert "max |diff|" in verify(before, str(after), layers=2, kv_heads=2, head_size=16, vocab=VOCAB)


def test_gqa_refuses_what_is_not_its_form(exported_folder):
    from opfuse.llm.gqa import group_query_attention

    model = onnx.load(str(exported_folder / "model.onnx"))
    nodes = len(model.graph.node)
    done = group_query_attention(model, layers=2, heads=2, kv_heads=2, head_size=16, context=256)  # wrong heads
    assert done.layers == 0 and len(done.refused) == 2 and "split sizes" in done.refused[0]
    assert len(model.graph.node) == nodes  # nothing changed


def test_gqa_qwen2_biases_packed_greedy_equals_transformers(tmp_path):
    """Qwen2's q, k and v have biases (drawn non-zero here: its init leaves them 0, which would hide
    their order): one Add of the three on the packed projection, before GroupQueryAttention."""
    import transformers

    folder, tokenizer = tmp_path / "qwen2", _tokenizer()
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    assert main(["llm", str(folder), "-o", str(out)]) == 0
    ops = [n.op_type for n in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count("GroupQueryAttention") == 2
    ids, genai = _genai_greedy(out, PROMPT, NEW_TOKENS)
    assert genai == _transformers_greedy(folder, ids, NEW_TOKENS)
