"""A causal LM from a GGUF file or a Hugging Face folder, exported by torch as one graph with past.

What it does:

- :func:`load` reads SOURCE with transformers: a ``.gguf`` file through
  ``AutoModelForCausalLM.from_pretrained(its folder, gguf_file=its name)`` (transformers dequantises
  every GGUF tensor to float32; it needs the ``gguf`` package), a folder with ``config.json`` through
  ``from_pretrained(folder)``, and the tokenizer the same way. The model is float32 and in eval mode.
- :class:`CausalLMStep` wraps the model's forward with a flat signature: ``(input_ids, attention_mask,
  position_ids, *past) -> (logits, *present)``, the cache being transformers' ``DynamicCache`` filled
  from / flattened to ``key 0, value 0, key 1, ...`` (:func:`filled_cache`, :func:`flat_cache`).
  ``benchmarks/decoders.py`` exports its prefill and decode steps with the same three.
- :func:`export` writes the graph onnxruntime-genai's model builder writes for a decoder, one graph
  for prefill and decode: inputs ``input_ids`` [batch, seq], ``attention_mask`` [batch, past + seq],
  ``position_ids`` [batch, seq], ``past_key_values.N.key|value`` [batch, kv_heads, past, head_size];
  outputs ``logits`` [batch, seq, vocab], ``present.N.key|value`` [batch, kv_heads, past + seq,
  head_size]. Exported by the dynamo exporter (opset 18) with batch, seq and past dynamic, from
  example inputs of batch 2, 3 new tokens and a past of 5, one row's mask left-padded (so no branch of
  the model's mask code takes an all-ones shortcut). A past of 0 (genai's first step) runs on the same
  graph: the example sizes are all >= 2 so torch specialises none of them.

Legality: the export is transformers' own forward traced by torch; nothing is rewritten here. What the
graph computes is checked by the caller (opfuse's verification, and the tests against transformers'
greedy tokens).
"""

from __future__ import annotations

__all__ = ["OPSET", "CausalLMStep", "Loaded", "export", "filled_cache", "flat_cache", "io_names", "load"]

import contextlib
import dataclasses
import io
import logging
import pathlib
import warnings

from opfuse.errors import BadInputError

OPSET = 18
EXAMPLE_BATCH, EXAMPLE_SEQ, EXAMPLE_PAST, EXAMPLE_PADDED = 2, 3, 5, 2


@dataclasses.dataclass
class Loaded:
    """A model and its tokenizer, and where they came from."""

    model: object  # a transformers PreTrainedModel (float32, eval)
    tokenizer: object
    source: pathlib.Path
    gguf: bool


def _from_pretrained(source: pathlib.Path) -> tuple[str, dict]:
    if source.is_file():
        if source.suffix.lower() != ".gguf":
            raise BadInputError(f"{source}: expected a .gguf file or a Hugging Face folder (config.json)")
        return str(source.parent), {"gguf_file": source.name}
    if source.is_dir():
        if not (source / "config.json").is_file():
            raise BadInputError(f"{source}: a Hugging Face folder needs config.json (and the weights)")
        return str(source), {}
    raise BadInputError(f"{source}: no such file or folder")


def load(source: str | pathlib.Path) -> Loaded:
    """The model (float32, eval) and the tokenizer of a GGUF file or a Hugging Face folder."""
    # (torch, transformers: the llm extra, imported only when a model is loaded or exported)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # (as above)

    source = pathlib.Path(source)
    where, keywords = _from_pretrained(source)
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **keywords).eval()
        tokenizer = AutoTokenizer.from_pretrained(where, **keywords)
    except (OSError, ValueError, KeyError, ImportError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise BadInputError(f"{source}: transformers cannot load it: {type(e).__name__}: {first}") from e
    return Loaded(model, tokenizer, source, bool(keywords))


def flat_cache(cache) -> list:
    """A DynamicCache as [key 0, value 0, key 1, ...]."""
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def filled_cache(config, past) -> object:
    """A DynamicCache holding ``past`` = (key 0, value 0, key 1, ...)."""
    # (torch, transformers: the llm extra, imported only when a model is loaded or exported)
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i in range(len(past) // 2):
        cache.update(past[2 * i], past[2 * i + 1], i)
    return cache


def _module_class():
    # (torch, transformers: the llm extra, imported only when a model is loaded or exported)
    import torch

    class _CausalLMStep(torch.nn.Module):
        """(input_ids, attention_mask, position_ids, *past) -> (logits, *present); no past: prefill."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=filled_cache(self.model.config, past), use_cache=True)
            return (out.logits, *flat_cache(out.cache))

    return _CausalLMStep


def CausalLMStep(model):
    """The nn.Module exported: ``model``'s forward with a flat signature (module docstring)."""
    return _module_class()(model)


def _shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_size) of a decoder config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_size


def io_names(layers: int) -> tuple[list[str], list[str]]:
    """The graph's input and output names, as the builder names them."""
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def _example_args(config) -> tuple:
    # (torch, transformers: the llm extra, imported only when a model is loaded or exported)
    import torch

    layers, kv_heads, head_size = _shape(config)
    g = torch.Generator().manual_seed(1)
    b, s, p = EXAMPLE_BATCH, EXAMPLE_SEQ, EXAMPLE_PAST
    mask = torch.ones(b, p + s, dtype=torch.int64)
    mask[1, :EXAMPLE_PADDED] = 0
    ids = torch.randint(0, config.vocab_size, (b, s), generator=g)
    positions = torch.arange(p, p + s).expand(b, s).contiguous()
    past = [torch.randn(b, kv_heads, p, head_size, generator=g) for _ in range(2 * layers)]
    return (ids, mask, positions, *past)


def _dynamic_shapes(layers: int) -> tuple:
    """Every axis but the heads' dynamic; torch works out that the mask's length is past + seq."""
    # (torch, transformers: the llm extra, imported only when a model is loaded or exported)
    from torch.export import Dim

    token = {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}
    return (token, token, token, tuple({0: Dim.DYNAMIC, 2: Dim.DYNAMIC} for _ in range(2 * layers)))


def export(model, path: str | pathlib.Path) -> None:
    """Write ``model``'s one-graph-with-past export (module docstring) to ``path`` (weights inside it)."""
    # (torch, transformers: the llm extra, imported only when a model is loaded or exported)
    import torch

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    layers = _shape(model.config)[0]
    inputs, outputs = io_names(layers)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(CausalLMStep(model), _example_args(model.config), input_names=inputs,
                                    output_names=outputs, opset_version=OPSET, dynamo=True,
                                    dynamic_shapes=_dynamic_shapes(layers))
        _name_axes(program.model)
        program.save(str(path), external_data=True)


def _name_axes(model) -> None:
    """The builder's names for the free axes (torch writes s0, s1, ...): batch_size, sequence_length,
    past_sequence_length, total_sequence_length."""
    # (torch, transformers: the llm extra, imported only when a model is loaded or exported)
    import onnx_ir as ir

    def named(value, names):
        dims = list(value.shape)
        for axis, name in names.items():
            if not isinstance(dims[axis], int):
                dims[axis] = name
        value.shape = ir.Shape(dims)

    for value in model.graph.inputs:
        if value.name.startswith("past_key_values."):
            named(value, {0: "batch_size", 2: "past_sequence_length"})
        elif value.name == "attention_mask":
            named(value, {0: "batch_size", 1: "total_sequence_length"})
        else:
            named(value, {0: "batch_size", 1: "sequence_length"})
    for value in model.graph.outputs:
        if value.name.startswith("present."):
            named(value, {0: "batch_size", 2: "total_sequence_length"})
        else:
            named(value, {0: "batch_size", 1: "sequence_length"})
