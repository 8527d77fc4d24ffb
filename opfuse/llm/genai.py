"""The files besides the model that onnxruntime-genai reads from a folder: ``genai_config.json`` and the tokenizer.

What it does:

- :func:`genai_config` returns the configuration in the schema onnxruntime-genai's model builder
  writes (``model``: the token ids, ``context_length``, ``vocab_size``, ``type``; ``model.decoder``:
  the file name, the head and layer counts, the input and output names with ``%d`` for the layer;
  ``search``: greedy decoding defaults), read from the transformers config of the model exported.
  ``position_ids`` is among the inputs when the graph takes it (attention as exported; genai fills
  it from the attention mask). ``past_present_share_buffer`` is true when the graph's attention is
  GroupQueryAttention (:mod:`opfuse.llm.gqa`), which writes the new keys and values into the past's
  own buffer of ``max_length``, as the builder's graph does; false when the graph concatenates its
  past and the new keys (``present`` past + seq long).
- :func:`write_tokenizer` saves the tokenizer with ``save_pretrained`` (``tokenizer.json``,
  ``tokenizer_config.json``: what genai's tokenizer loads); from a GGUF, transformers has built it
  from the file's own vocabulary and merges.

Legality: nothing here changes a computation; the names written are those of the graph
(:func:`opfuse.llm.export.io_names`), and the tests run genai on the folder.
"""

from __future__ import annotations

__all__ = ["genai_config", "write_config", "write_tokenizer"]

import json
import pathlib

from opfuse.save import write_text_atomic


def _token_id(value):
    """A config's token id; a list (several eos ids) as genai takes it, one int or a list."""
    if isinstance(value, (list, tuple)):
        return list(value) if len(value) > 1 else value[0]
    return value


def genai_config(config, tokenizer, filename: str = "model.onnx", *, inputs=None, share_buffer: bool = False) -> dict:
    """The genai_config.json of a decoder whose transformers config is ``config`` (module docstring);
    ``inputs``: the graph's input names (None: the export's, position_ids among them)."""
    # (export imports torch: only when a config is written)
    from opfuse.llm.export import _shape

    layers, kv_heads, head_size = _shape(config)
    bos = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id
    eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    pad = config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _token_id(eos)
        pad = pad[0] if isinstance(pad, list) else pad
    context = getattr(config, "max_position_embeddings", None) or 2048
    names = {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
             "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    if inputs is not None:
        names = {k: v for k, v in names.items() if "%d" in v or v in inputs}
    return {
        "model": {
            "bos_token_id": _token_id(bos),
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": head_size,
                "hidden_size": config.hidden_size,
                "inputs": names,
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": config.num_attention_heads,
                "num_hidden_layers": layers,
                "num_key_value_heads": kv_heads,
            },
            "eos_token_id": _token_id(eos),
            "pad_token_id": pad,
            "type": config.model_type,
            "vocab_size": config.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": context,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": share_buffer,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def write_config(config, tokenizer, folder: str | pathlib.Path, *, inputs=None, share_buffer: bool = False) -> pathlib.Path:
    path = pathlib.Path(folder) / "genai_config.json"
    body = genai_config(config, tokenizer, inputs=inputs, share_buffer=share_buffer)
    write_text_atomic(path, json.dumps(body, indent=4) + "\n")
    return path


def write_tokenizer(tokenizer, folder: str | pathlib.Path) -> list[str]:
    """Save the tokenizer's files in ``folder``; their names."""
    return sorted(pathlib.Path(p).name for p in tokenizer.save_pretrained(str(folder)))


def restate_config(folder: str | pathlib.Path, *, inputs, share_buffer: bool) -> pathlib.Path:
    """Tell the genai_config.json in ``folder`` (written with the export) the graph's input names and
    whether past and present share a buffer: what the attention step decided after it was written."""
    path = pathlib.Path(folder) / "genai_config.json"
    body = json.loads(path.read_text())
    names = body["model"]["decoder"]["inputs"]
    body["model"]["decoder"]["inputs"] = {k: v for k, v in names.items() if "%d" in v or v in inputs}
    body["search"]["past_present_share_buffer"] = share_buffer
    write_text_atomic(path, json.dumps(body, indent=4) + "\n")
    return path


def greedy(model, ids: list[int], new: int) -> list[int]:
    """The ``new`` tokens onnxruntime-genai's ``model`` generates greedily after the prompt ``ids``."""
    import onnxruntime_genai as og  # (the llm extra: only a caller that generates needs it)

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + new, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(ids):]
