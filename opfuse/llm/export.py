"""A causal LM from a GGUF file or a Hugging Face folder, exported by torch as one graph with past.

What it does:

- :func:`load` reads SOURCE with transformers: a ``.gguf`` file through
  ``AutoModelForCausalLM.from_pretrained(its folder, gguf_file=its name)`` (transformers dequantises
  every GGUF tensor to float32; it needs the ``gguf`` package), a folder with ``config.json`` through
  ``from_pretrained(folder)``, and the tokenizer the same way. The model is float32 and in eval mode.
  A GGUF's tensors reach the model one at a time (:func:`_one_tensor_at_a_time`): transformers'
  own loader would dequantise the whole file into a dict of float32 tensors first, then load the
  model from it, the file's float32 copy and the transient copies of its largest tensor in memory at
  once; each tensor is now dequantised and processed by transformers' own functions when the loader
  comes to it (the same values, tested). Its float32 values go to a :class:`WeightFile` (``load``'s
  ``weights_dir``): a temporary file mapped into the process, whose pages are given back as each
  tensor is written into it, so the float model is in the page cache, not in the process's memory.
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
  graph: the example sizes are all >= 2 so torch specialises none of them. Torch's tracer reads no
  weight's values; a model whose weights are in a :class:`WeightFile` is written as
  ``ONNXProgram.save(path, external_data=True)`` writes it, the file's pages given back before each
  tensor is written, so the process holds one tensor of the weights at a time.

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


_DEQUANTIZED_ROWS = 4096


class _LazyGgufWeight:
    """One GGUF tensor as transformers' legacy GGUF loader makes it (``load_gguf_checkpoint``: the gguf
    package's ``dequantize``, the architecture's ``TensorProcessor``, ``torch.from_numpy(np.copy(...))``,
    the dtype), made when the model's loader reads it (``value[...]``, as it reads a safetensors slice)."""

    def __init__(self, tensor, shape, processor, mapping, parsed, dtype, store=None):
        self.tensor, self.shape = tensor, shape
        self.processor, self.mapping, self.parsed, self.dtype = processor, mapping, parsed, dtype
        self.store = store  # a WeightFile: the float32 values go there

    def is_floating_point(self) -> bool:  # (what the loader asks of a tensor: dequantised, it is float)
        return True

    def __getitem__(self, _):
        # (torch, transformers, gguf: the llm extra, imported only when a model is loaded)
        import numpy as np
        import torch  # (as above)
        from gguf import dequantize  # (as above)

        # dequantised a slice of rows at a time into one array (the values are per block: the same as
        # the whole tensor's at once, without the float temporaries of a whole large tensor)
        rows = self.tensor.data.reshape(-1, self.tensor.data.shape[-1])
        weights = np.empty((rows.shape[0], self.shape[-1]), np.float32)
        for i in range(0, rows.shape[0], _DEQUANTIZED_ROWS):
            weights[i:i + _DEQUANTIZED_ROWS] = dequantize(rows[i:i + _DEQUANTIZED_ROWS], self.tensor.tensor_type)
        weights = self.processor.process(weights=weights.reshape(self.shape), name=self.tensor.name,
                                         tensor_key_mapping=self.mapping, parsed_parameters=self.parsed).weights
        if self.store is not None and self.dtype in (None, torch.float32):
            return torch.from_numpy(self.store.put(weights))  # (its pages in the file, not in this process)
        tensor = torch.from_numpy(np.ascontiguousarray(weights))  # (a copy where the processor left a view)
        return tensor.to(self.dtype) if self.dtype is not None else tensor


class WeightFile:
    """Float weights kept in a temporary file mapped into this process (shared, read and written
    through the page cache), not in its own memory: each array :meth:`put` is copied into the
    mapping and the mapping's resident pages are given back (``MADV_DONTNEED``: the values stay in the
    file), so the process holds a page of the weights only while something reads it. The export's
    process traces the model with its weights here (torch's tracer reads none of them) and writes
    them out one tensor at a time (:func:`export`), so the float model is never in its memory whole.
    The file has no name (deleted as it is made): it goes when the last array viewing it does."""

    def __init__(self, nbytes: int, folder: str | pathlib.Path | None = None):
        import mmap  # (only when a model is loaded)
        import tempfile  # (as above)
        import threading  # (as above)

        with tempfile.TemporaryFile(dir=folder) as f:
            f.truncate(max(nbytes, 1))
            self.map = mmap.mmap(f.fileno(), max(nbytes, 1))  # (its own handle on the file: it outlives f)
        self.offset = 0
        self.lock = threading.Lock()  # (transformers' loader reads its tensors from several threads)

    def put(self, array):
        """A view of ``array``'s values copied into the file (a numpy array of its shape and dtype)."""
        import numpy as np  # (as above)

        array = np.asarray(array)
        with self.lock:  # (each array its own place in the file)
            offset = self.offset
            self.offset += -(-array.nbytes // 64) * 64
        view = np.frombuffer(self.map, dtype=array.dtype, count=array.size, offset=offset).reshape(array.shape)
        view[...] = array
        self.drop()
        return view

    def drop(self) -> None:
        """Give back the mapping's resident pages (the file keeps the values)."""
        import mmap  # (as above)

        self.map.madvise(mmap.MADV_DONTNEED)


def _float_bytes(shape) -> int:
    n = 4
    for d in shape:
        n *= int(d)
    return -(-n // 64) * 64


def _lazy_gguf_state_dict(path: str, model, dtype, folder=None) -> tuple[dict, WeightFile | None] | None:
    """({transformers name: :class:`_LazyGgufWeight`} of the GGUF at ``path`` for ``model``, the
    :class:`WeightFile` in ``folder`` their float32 values go to); None where the architecture's tensor
    processor may rename, merge or reshape tensors (MoE experts, fused QKV: only the pass-through
    processor and Llama's q/k row permutation are taken)."""
    # (torch, transformers, gguf: the llm extra, imported only when a model is loaded)
    import torch
    from gguf import GGUFReader  # (as above)
    from gguf.quants import quant_shape_from_byte_shape  # (as above)
    from transformers.modeling_gguf_pytorch_utils import (  # (as above)
        TENSOR_PROCESSORS,
        LlamaTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    config = load_gguf_checkpoint(path, return_tensors=False).get("config", {})  # (what the processor reads)
    reader = GGUFReader(path)
    kind = TENSOR_PROCESSORS.get(read_field(reader, "general.architecture")[0], TensorProcessor)
    if kind not in (TensorProcessor, LlamaTensorProcessor):
        return None
    processor = kind(config=config)
    mapping = get_gguf_hf_weights_map(model, processor)
    parsed = {"config": config, "tensors": {}}  # (not the vocabulary: the tokenizer has it)
    shapes = {}
    for t in reader.tensors:
        if t.name in mapping:  # (what the legacy loader skips, skipped)
            shape = quant_shape_from_byte_shape(t.data.shape, t.tensor_type) if t.data.dtype == "uint8" else t.data.shape
            shapes[t.name] = (t, tuple(int(d) for d in shape))
    store = WeightFile(sum(_float_bytes(s) for _, s in shapes.values()), folder) if dtype in (None, torch.float32) else None
    weights = {mapping[name]: _LazyGgufWeight(t, shape, processor, mapping, parsed, dtype, store)
               for name, (t, shape) in shapes.items()}
    return weights, store


@contextlib.contextmanager
def _one_tensor_at_a_time(folder=None):
    """transformers' GGUF quantizer, where it falls back to its legacy loader (an architecture its
    packed kernels do not take, and the file dequantised), hands the model's loader lazy tensors
    (:func:`_lazy_gguf_state_dict`) instead of the whole file dequantised; unchanged elsewhere. Yields
    a list that receives the :class:`WeightFile` the float32 values went to (in ``folder``)."""
    # (torch, transformers: the llm extra, imported only when a model is loaded)
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

    legacy = GgufHfQuantizer.get_state_dict
    stores = []

    def get_state_dict(self, checkpoint_file, model):
        lazy = (None if getattr(self, "supported", True)
                else _lazy_gguf_state_dict(checkpoint_file, model, self.dtype, folder))
        if lazy is None:
            return legacy(self, checkpoint_file, model)
        stores.append(lazy[1])
        return lazy[0]

    GgufHfQuantizer.get_state_dict = get_state_dict
    try:
        yield stores
    finally:
        GgufHfQuantizer.get_state_dict = legacy


def load(source: str | pathlib.Path, *, lazy: bool = True, weights_dir: str | pathlib.Path | None = None) -> Loaded:
    """The model (float32, eval) and the tokenizer of a GGUF file or a Hugging Face folder; ``lazy``:
    a GGUF's tensors dequantised one at a time, their values in a :class:`WeightFile` in
    ``weights_dir`` (module docstring)."""
    # (torch, transformers: the llm extra, imported only when a model is loaded or exported)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # (as above)

    source = pathlib.Path(source)
    where, keywords = _from_pretrained(source)
    try:
        # (the tokenizer first: what building it from a GGUF's vocabulary takes is given back before the
        # model's weights are in memory)
        tokenizer = AutoTokenizer.from_pretrained(where, **keywords)
        with _one_tensor_at_a_time(weights_dir) if keywords and lazy else contextlib.nullcontext([]) as stores:
            model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **keywords).eval()
    except (OSError, ValueError, KeyError, ImportError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise BadInputError(f"{source}: transformers cannot load it: {type(e).__name__}: {first}") from e
    if any(stores):
        model._opfuse_weight_files = [s for s in stores if s is not None]  # (export gives their pages back)
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
        files = getattr(model, "_opfuse_weight_files", [])
        if not files:
            program.save(str(path), external_data=True)
            return
        import onnx_ir as ir  # (torch's exporter's IR: as above)

        def written(*_):  # (called before each tensor is written: the one before it read, its pages given back)
            for f in files:
                f.drop()

        # (what program.save(path, external_data=True) does, ONNXProgram.save -> onnxscript's
        # save_model_with_external_data, with the weights' pages given back as they are written)
        ir.save(program.model, str(path), external_data=f"{path.name}.data", callback=written)
        written()


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
