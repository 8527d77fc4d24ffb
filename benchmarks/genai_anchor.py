"""The anchor row of ``benchmarks/decoders.py`` (issue 40): onnxruntime-genai's model builder at fp32 for CPU.

What it owns:

- :func:`built`: the decoder's config and weights (the same seed as the exports) saved by
  ``save_pretrained`` to a folder with a tokenizer (a WordLevel vocabulary ``t0 .. t{vocab-1}`` built
  in code with ``tokenizers`` and saved by ``PreTrainedTokenizerFast``: the builder wants one), then
  ``python -m onnxruntime_genai.models.builder -i FOLDER -o OUT -p fp32 -e cpu -c CACHE`` in a
  subprocess with this interpreter. Kept beside the exports in
  ``<model folder>/genai<version>-fp32-cpu/`` (``model.onnx``, ``genai_config.json``); a build that
  fails is kept as its last stderr line (``build-failed.txt``) and becomes a row, not a crash.
- One change to the config saved: ``max_position_embeddings`` is raised to :data:`CONTEXT` (and
  ``original_max_position_embeddings`` set equal to it where the config has one, so the builder takes
  Phi3's plain RoPE branch, not LongRoPE). The builder sizes its cos/sin caches by it, and GroupQueryAttention refuses a
  total length beyond them ("cos_cache dimension 0 shall not be less than total_sequence_length"):
  the timed decode step reads position 256 of a 256-position model. No weight depends on it for
  these models (their rotary tables are computed, not learned); GPT-2's learned table would, but the
  builder does not build GPT-2.
- :func:`anchor_feeds`: the builder's graph inputs from the original's timing feeds, by the names in
  ``genai_config.json``: the same ``input_ids`` and ``attention_mask``; the cache
  ``past_key_values.N.key/value`` [batch, kv_heads, past, head_size] is the original's in a decode
  step and empty (past 0) in prefill; ``position_ids`` (where the builder keeps it) the original's.
  Run on a plain ONNX Runtime session with no shared past/present buffer, so ``present`` is
  [batch, kv_heads, past + new, head_size], as in the export.
- :func:`check_logits`: the anchor's ``logits`` against the original's on those inputs, under the
  tolerance of ``decoders.py`` (both caches hold keys after rotary, so the same random past means
  the same thing to both graphs).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import pathlib
import subprocess
import sys

import numpy as np

ROW = "genai builder"
CONTEXT = 512  # max_position_embeddings saved with the anchor's config (>= the timed decode's 257)


def available() -> str:
    """"" if onnxruntime-genai is importable, else why the anchor is not run."""
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return "not run: onnxruntime-genai is not installed (pip install onnxruntime-genai)"
    return ""


def folder_name() -> str:
    return f"genai{importlib.metadata.version('onnxruntime-genai')}-fp32-cpu"


def _save_folder(decoder, folder: pathlib.Path) -> None:
    """The decoder's config and weights (seed 0, as exported) and a WordLevel tokenizer, in ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = decoder.build()
    if getattr(model.config, "quantization_config", None) is not None:
        # a model loaded from a GGUF refuses save_pretrained: the same weights in a fresh model of its
        # config without the quantisation entry (as benchmarks/llm_cpu.py writes its HF folder)
        fields = model.config.to_dict()
        fields.pop("quantization_config", None)
        fresh = type(model)(type(model.config).from_dict(fields)).eval()
        fresh.load_state_dict(model.state_dict())
        model = fresh
    config = model.config
    if getattr(config, "max_position_embeddings", None) is not None:
        config.max_position_embeddings = max(CONTEXT, config.max_position_embeddings)
        if getattr(config, "original_max_position_embeddings", None) is not None:
            config.original_max_position_embeddings = config.max_position_embeddings
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(decoder.config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0").save_pretrained(folder)


def built(decoder, model_folder: pathlib.Path) -> tuple[pathlib.Path | None, str]:
    """(path of the builder's model.onnx, "") built or cached under ``model_folder``; (None, why) if not."""
    out = model_folder / folder_name()
    path, failed = out / "model.onnx", out / "build-failed.txt"
    if path.exists():
        return path, ""
    if failed.exists():
        return None, failed.read_text().strip()
    hf, cache = model_folder / "hf-folder", model_folder / "genai-cache"
    try:
        _save_folder(decoder, hf)
    except Exception as e:  # noqa: BLE001 - the folder cannot be written: a row
        return None, f"save_pretrained failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    proc = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf),
                           "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(cache)],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not path.exists():
        lines = [x.strip() for x in proc.stderr.splitlines() or proc.stdout.splitlines() if x.strip()]
        error = lines[-1].replace(str(hf), "FOLDER") if lines else f"no model.onnx written (exit {proc.returncode})"
        error += f" (architectures: {', '.join(json.loads((hf / 'config.json').read_text())['architectures'])})"
        out.mkdir(parents=True, exist_ok=True)
        failed.write_text(f"builder exit {proc.returncode}: {error}"[:300] + "\n")
        return None, failed.read_text().strip()
    return path, ""


def genai_config(path: pathlib.Path) -> dict:
    return json.loads((path.parent / "genai_config.json").read_text())["model"]


def anchor_feeds(path: pathlib.Path, original: dict[str, np.ndarray], graph: str) -> dict[str, np.ndarray]:
    """The builder graph's inputs for the original's timing feeds (module docstring)."""
    import onnx

    cfg = genai_config(path)
    decoder = cfg["decoder"]
    names = decoder["inputs"]
    kv_heads, head_size = decoder["num_key_value_heads"], decoder["head_size"]
    batch = original["input_ids"].shape[0]
    pasts = {names["past_key_names"] % i: f"past_key_values.{i}.key" for i in range(decoder["num_hidden_layers"])}
    pasts.update({names["past_value_names"] % i: f"past_key_values.{i}.value"
                  for i in range(decoder["num_hidden_layers"])})
    proto = onnx.load(str(path), load_external_data=False)
    feeds = {}
    for value in proto.graph.input:
        name = value.name
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        if name == names.get("input_ids", "input_ids"):
            feeds[name] = original["input_ids"].astype(dtype)
        elif name == names.get("attention_mask", "attention_mask"):
            feeds[name] = original["attention_mask"].astype(dtype)
        elif name == names.get("position_ids", "position_ids"):
            feeds[name] = original["position_ids"].astype(dtype)
        elif name in pasts:
            past = original.get(pasts[name]) if graph == "decode" else None
            feeds[name] = (np.zeros((batch, kv_heads, 0, head_size), dtype) if past is None
                           else past.astype(dtype))
        else:
            raise ValueError(f"the builder's graph has an input no feed is known for: {name!r}")
    return feeds


def check_logits(path: pathlib.Path, feeds: dict[str, np.ndarray], reference: dict, compare) -> dict:
    """{"logits_max_diff", "logits_equal", "check"}: the anchor's logits against the original's."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], feeds)[0]
    expected = reference["outputs"][reference["names"].index("logits")]
    equal, worst, _ = compare([expected], [logits], ["logits"], False)
    scale = float(np.max(np.abs(expected)))
    return {"logits_equal": bool(equal), "logits_max_diff": worst,
            "check": f"logits {'equal' if equal else 'NOT equal'}: max |diff| {worst:.2g} (max |logit| {scale:.2g})"}
