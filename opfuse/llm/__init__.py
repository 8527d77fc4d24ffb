"""``opfuse llm SOURCE -o DIR --precision fp32|int4``: a causal LM in, a folder onnxruntime-genai runs out.

The steps (:func:`convert`):

1. :func:`opfuse.llm.export.load`: SOURCE, a GGUF file or a Hugging Face folder, through
   transformers (float32; a GGUF's quantised blocks are dequantised by transformers).
2. :func:`opfuse.llm.export.export`: one graph with past, the builder's names, by torch's dynamo exporter.
3. :func:`opfuse.pipeline.optimize` at ``target="onnxruntime"`` with ``tune=False`` (the target's
   default policy; the tuner is being rewritten), verified on ONNX Runtime against the export at
   :data:`VERIFY_DIMS` (a prefill of 4 tokens after a past of 8).
4. ``--attention gqa`` (the default): :func:`opfuse.llm.gqa.group_query_attention`, each layer's
   attention as one GroupQueryAttention with rotary inside and the cache shared between past and
   present (the graph genai runs fastest on a CPU), verified on ONNX Runtime against the optimised
   graph on the inputs genai feeds (:func:`opfuse.llm.gqa.verify`); kept as exported when a layer
   is not in that form or the two differ, and said.
5. ``int4``: :func:`opfuse.llm.quantize_int4.quantize_int4` on the optimised graph (fold first,
   quantise once): MatMulNBits (block 32) and GatherBlockQuantized (8 bits); from a GGUF, the file's
   own Q4_0/Q4_1/Q8_0 blocks as they are (:mod:`opfuse.llm.gguf_blocks`), the rest by GPTQ calibrated
   on standard-library docstrings (:mod:`opfuse.llm.calibration`); ``algorithm`` chooses another.
6. ``genai_config.json`` and the tokenizer files (:mod:`opfuse.llm.genai`), the config then told the
   graph's inputs and whether past and present share a buffer (step 4).

Steps 1, 2 and 6 (the files) run in a process of their own (spawned, :func:`_in_a_process`), and so do
step 3, step 4 and step 5: torch, transformers and the model's float weights are gone before the
optimisation loads the export, the optimiser's copies before the attention rewrite loads its output,
and the rewrite's before the quantiser reads it. This process keeps none of them: what it gets back
is small (the config's fields as plain values, :func:`_plain_config`: a transformers config would
import transformers and torch here). The quantiser reads the graph without its external data and
each weight from the file when it comes to it (:func:`opfuse.llm.quantize_int4.quantize_int4`'s
``base_dir``); GPTQ's calibration run reads the weights through ONNX Runtime from the file (peak
memory: docs/results/llm.md). A source smaller than :data:`IN_PROCESS_BYTES` is converted in this
process: a new process imports torch, transformers and the pipeline again, which costs more than
such a model's weights take.

Everything is written in a temporary folder beside DIR and moved into DIR at the end: on an error
DIR receives nothing. A model that is not a decoder-only LM with a KV cache transformers builds
(an encoder-decoder, no ``num_hidden_layers``) is refused with one line (exit 2).

Legality: steps 1-4 and 6 are exact up to float rounding (the export is transformers' forward; the
optimisation and the attention rewrite are verified; GroupQueryAttention for unpadded sequences, what
genai feeds a batch of one: :mod:`opfuse.llm.gqa`); step 5 is not (module :mod:`opfuse.llm.quantize_int4`).
"""

from __future__ import annotations

__all__ = ["ATTENTIONS", "PRECISIONS", "VERIFY_DIMS", "IN_PROCESS_BYTES", "Converted", "convert"]

import concurrent.futures
import dataclasses
import multiprocessing
import os
import pathlib
import shutil
import sys
import tempfile
import types

from opfuse.errors import BadInputError

PRECISIONS = ("fp32", "int4")
ATTENTIONS = ("gqa", "exported")
VERIFY_DIMS = {"batch_size": 1, "sequence_length": 4, "past_sequence_length": 8, "total_sequence_length": 12}
# a source (its files) smaller than this is converted without spawning: its peak memory is the imports'
IN_PROCESS_BYTES = 64 * 1024 * 1024
# the config's fields the steps after the export read (_shape, _attention_refused, the attention rewrite)
_CONFIG_FIELDS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "hidden_size", "vocab_size", "max_position_embeddings", "sliding_window", "use_sliding_window",
                  "attn_logit_softcapping")


@dataclasses.dataclass
class Converted:
    """What :func:`convert` wrote and did."""

    folder: pathlib.Path
    files: list[str]
    precision: str
    ops: dict[str, int]  # op type -> count in the written graph
    optimize_summary: str
    not_quantized: list[str] = dataclasses.field(default_factory=list)  # MatMul/Gather left in float, why
    attention: str = ""  # what became of attention (GroupQueryAttention, or why it was kept as exported)

    def summary(self) -> str:
        nbits, gbq = self.ops.get("MatMulNBits", 0), self.ops.get("GatherBlockQuantized", 0)
        quant = f"; {nbits} MatMulNBits, {gbq} GatherBlockQuantized" if self.precision == "int4" else ""
        return (f"{self.folder}: {self.precision}, {sum(self.ops.values())} nodes{quant}; "
                f"{', '.join(self.files)}")


def _check_decoder(config) -> None:
    if getattr(config, "is_encoder_decoder", False):
        raise BadInputError(f"{config.model_type}: an encoder-decoder; opfuse llm takes decoder-only models")
    for field in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"):
        if getattr(config, field, None) is None:
            raise BadInputError(f"{config.model_type}: its config has no {field}; opfuse llm takes decoder-only "
                                "models with a KV cache (Llama, Qwen2, Mistral, Phi3, ...)")


def _not_quantized(model) -> list[str]:
    """The MatMul and Gather nodes left in float after quantisation, with why."""
    inits = {t.name: t for t in model.graph.initializer}
    left = []
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gather") or node.name.endswith(("_gguf_residual", "_gguf_block_sums")):
            continue  # (the float minimum's per-block part of the q4_1 form: opfuse.llm.gguf_blocks)
        weight = inits.get(node.input[1] if node.op_type == "MatMul" else node.input[0])
        why = "both inputs are activations" if weight is None else f"weight of shape {list(weight.dims)}"
        left.append(f"{node.op_type} {node.name}: {why}")
    return left


def _attention_refused(config) -> str:
    """Why GroupQueryAttention cannot compute ``config``'s attention whatever its graph ("": it can)."""
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"a sliding window of {config.sliding_window} (not written as local_window_size yet)"
    if getattr(config, "attn_logit_softcapping", None):
        return "soft-capped attention logits"
    return ""


LOADED_BYTES = 1 << 20  # _without_large_weights: external tensors smaller than this are read in


def _without_large_weights(path: pathlib.Path):
    """The graph at ``path`` with its external tensors under :data:`LOADED_BYTES` read in (the rotary
    tables' inputs, shapes, scalars: what the attention rewrite reads) and the larger ones (the weights)
    left in their file, for :func:`_save_streamed`."""
    import onnx  # (onnx: only when a model is converted)
    from onnx import external_data_helper as ext  # (as above)

    model = onnx.load(str(path), load_external_data=False)
    for tensor in ext._get_all_tensors(model):
        if ext.uses_external_data(tensor):
            length = ext.ExternalDataInfo(tensor).length
            if length is None or length < LOADED_BYTES:
                ext.load_external_data_for_tensor(tensor, str(path.parent))
    return model


def _save_streamed(model, path: pathlib.Path, base_dir: pathlib.Path) -> None:
    """``onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
    location="model.onnx.data", size_threshold=1024)`` of ``model`` as ``onnx.load`` would have read
    it whole (the same bytes: the same tensors in the same order, the same threshold), for a model
    whose large tensors are still in their file in ``base_dir`` (:func:`_without_large_weights`): their
    bytes are copied from that file to the new one, one tensor at a time, never into the graph (whose
    memory a cleared field does not give back), so the weights are not all in memory at once."""
    import onnx  # (onnx: only when a model is converted)
    from onnx import external_data_helper as ext  # (as above)

    location, threshold = "model.onnx.data", 1024
    data = path.parent / location
    data.touch()
    for tensor in ext._get_initializer_tensors(model):  # (the order onnx.save writes them in)
        if ext.uses_external_data(tensor):  # (large: its bytes copied from file to file, never in the graph,
            info = ext.ExternalDataInfo(tensor)  # whose memory a cleared field does not give back)
            with open(base_dir / info.location, "rb") as f, open(data, "ab") as out:
                f.seek(info.offset or 0)
                offset = out.tell()
                out.write(f.read(info.length))
            del tensor.external_data[:]  # (what onnx's set_external_data writes, which asks for the bytes)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", location), ("offset", offset), ("length", info.length)):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
        elif tensor.HasField("raw_data") and sys.getsizeof(tensor.raw_data) >= threshold:
            ext.set_external_data(tensor, location)
            ext.save_external_data(tensor, str(path.parent))
            tensor.ClearField("raw_data")
    for tensor in ext._get_attribute_tensors(model):  # (the nodes' tensors: kept in the graph, as onnx.save does)
        if ext.uses_external_data(tensor):
            ext.load_external_data_for_tensor(tensor, str(base_dir))
    onnx.save(model, str(path))


def _group_query_attention(optimised: pathlib.Path, work: pathlib.Path, config) -> tuple[pathlib.Path, str, bool]:
    """(the graph to go on with, what was done, whether it has GroupQueryAttention): step 4."""
    # (torch through export's helpers: only when a model is converted)
    from opfuse.llm.export import _shape
    from opfuse.llm.gqa import group_query_attention, verify  # (as above)

    why = _attention_refused(config)
    if why:
        return optimised, f"kept as exported: {why}", False
    layers, kv_heads, head_size = _shape(config)
    model = _without_large_weights(optimised)
    context = getattr(config, "max_position_embeddings", None) or 2048
    try:
        done = group_query_attention(model, layers=layers, heads=config.num_attention_heads, kv_heads=kv_heads,
                                     head_size=head_size, context=context)
    except ValueError as e:  # the rotary tables read more than the positions
        return optimised, f"kept as exported: {e}", False
    if done.layers != layers:
        return optimised, f"kept as exported: {(done.refused or ['?'])[0]}", False
    work.mkdir()
    path = work / "model.onnx"
    _save_streamed(model, path, optimised.parent)
    del model
    try:
        why = verify(str(optimised), str(path), layers=layers, kv_heads=kv_heads, head_size=head_size,
                     vocab=config.vocab_size)
    except Exception as e:  # ONNX Runtime refuses the rewritten graph: keep the graph that runs  # noqa: BLE001
        why = f"ONNX Runtime: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    if why:
        shutil.rmtree(work)
        return optimised, f"kept as exported: GroupQueryAttention differs: {why}", False
    shutil.rmtree(optimised.parent)
    return path, f"{layers} GroupQueryAttention (rotary inside, past and present sharing a buffer)", True


def _plain_config(config) -> types.SimpleNamespace:
    """The fields of a transformers config that the steps after the export read (:data:`_CONFIG_FIELDS`,
    those it has), as plain values: unpickled in another process, a transformers config imports
    transformers and torch there."""
    return types.SimpleNamespace(**{f: getattr(config, f) for f in _CONFIG_FIELDS if hasattr(config, f)})


def _export_step(source: str, exported: pathlib.Path, files_dir: pathlib.Path, windows: int) -> dict:
    """Load ``source``, refuse what is not a decoder, export it to ``exported``, write genai_config.json
    and the tokenizer into ``files_dir``; ``windows`` calibration windows of tokens (opfuse.llm.calibration)."""
    from opfuse.llm import calibration, genai  # (its heavy imports: only in the export's process)
    from opfuse.llm.export import _shape, export, load  # (its heavy imports (torch, the pipeline): only when used)

    files_dir.mkdir(parents=True, exist_ok=True)
    loaded = load(source, weights_dir=files_dir.parent)  # (a GGUF's float weights: in a file there)
    config, tokenizer = loaded.model.config, loaded.tokenizer
    _check_decoder(config)
    genai.write_config(config, tokenizer, files_dir)
    genai.write_tokenizer(tokenizer, files_dir)
    export(loaded.model, exported)
    return {"gguf": loaded.gguf, "shape": _shape(config), "config": _plain_config(config),
            "windows": calibration.windows(tokenizer, windows) if windows else []}


def _in_a_process(fn, *args, here: bool = False):
    """``fn(*args)`` in a process of its own (spawned): what it allocates (torch, transformers, the float
    weights, the optimiser's copies) is gone when it returns, so the next step does not carry it (peak
    memory: docs/results/llm.md). Its exceptions are raised here. ``here``: in this process (a source
    under :data:`IN_PROCESS_BYTES`)."""
    if here:
        return fn(*args)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _export_in_a_process(source, exported: pathlib.Path, files_dir: pathlib.Path, windows: int,
                         here: bool = False) -> dict:
    return _in_a_process(_export_step, str(source), exported, files_dir, windows, here=here)


def _source_bytes(source: str | pathlib.Path) -> int:
    """The size of the source's files (a GGUF file, or every file of a folder)."""
    path = pathlib.Path(source)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _optimize_step(exported: str, optimised: str, verify: bool) -> str:
    from opfuse.pipeline import optimize  # (its heavy imports (torch, the pipeline): only when used)

    _, report = optimize(exported, target="onnxruntime", tune=False, verify=verify, dims=VERIFY_DIMS,
                         output=optimised, external_data=True)
    return report.summary()


def _all_from(rows, path: pathlib.Path) -> bool:
    """Whether every MatMul weight of the graph at ``path`` is among the GGUF's quantised rows (then
    GPTQ has nothing to do and no calibration run is needed)."""
    import onnx  # (onnx: only when a model is converted)
    from onnx import numpy_helper  # (onnx: only when a model is converted)

    model = onnx.load(str(path), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in inits:
            tensor = inits[node.input[1]]
            if len(tensor.dims) != 2:
                continue
            w = numpy_helper.to_array(tensor, str(path.parent))
            if rows.find(w.T.copy()) is None:
                return False
    return True


def _int4_step(source: str, optimised: pathlib.Path, stage: pathlib.Path, info: dict, windows: int,
               options: dict) -> tuple[list[str], dict[str, int], list[str]]:
    """Step 5: the graph at ``optimised`` quantised (``options``: :func:`quantize_int4`'s) and written to
    ``stage``; (what was left in float, op counts, the graph's inputs). ``info``: the export step's."""
    import onnx  # (onnx: only when a model is converted)

    # (calibration's heavy imports (torch, the pipeline): only when used)
    from opfuse.llm import calibration as calibration_text
    from opfuse.llm.gguf_blocks import GgufRows  # (gguf (the llm extra): imported when a GGUF is read)
    from opfuse.llm.quantize_int4 import counts, hessians, quantize_int4  # (as above)

    options = dict(options)
    gguf = GgufRows(source) if options.pop("gguf_blocks") and info["gguf"] else None
    input_hessians = None
    if windows and not (gguf is not None and _all_from(gguf, optimised)):
        # measured on the file (ONNX Runtime reads its weights), before this process loads them
        input_hessians = hessians(str(optimised), calibration_text.feeds(info["shape"], info["windows"]))
    stage.mkdir()
    # (read without its external data: quantize_int4 reads each weight from the file when it comes to it)
    model = quantize_int4(onnx.load(str(optimised), load_external_data=False), input_hessians=input_hessians,
                          gguf=gguf, base_dir=optimised.parent, **options)
    del input_hessians
    shutil.rmtree(optimised.parent)
    not_quantized = _not_quantized(model)
    onnx.save(model, str(stage / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=1024)
    return not_quantized, counts(model), [i.name for i in model.graph.input]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def convert(source: str | pathlib.Path, out: str | pathlib.Path, precision: str = "fp32", *,
            verify: bool = True, block_size: int = 32, symmetric: bool = False, algorithm: str | None = None,
            head_bits: int = 4, embedding_bits: int = 8, gguf_blocks: bool = True,
            calibration_windows: int = 8, attention: str = "gqa", fold_norms: bool | None = None) -> Converted:
    """Write the genai folder of ``source`` at ``precision`` into ``out`` (module docstring)."""
    # (the steps import torch, transformers and the pipeline: only when a model is converted)
    import onnx

    # (the pipeline and the quantiser: only when a model is converted; torch only in the export's process)
    from opfuse.llm import genai
    from opfuse.llm.quantize_int4 import (  # (its heavy imports (torch, the pipeline): only when used)
        DEFAULT_ALGORITHM,
        counts,
    )

    if precision not in PRECISIONS:
        raise BadInputError(f"--precision {precision}: expected one of {', '.join(PRECISIONS)}")
    if attention not in ATTENTIONS:
        raise BadInputError(f"--attention {attention}: expected one of {', '.join(ATTENTIONS)}")
    out = pathlib.Path(out)
    if out.exists() and not out.is_dir():
        raise BadInputError(f"{out}: exists and is not a folder")
    if not pathlib.Path(source).exists():
        raise BadInputError(f"{source}: no such file or folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    algorithm = algorithm or DEFAULT_ALGORITHM
    windows = calibration_windows if precision == "int4" and algorithm.startswith("gptq") else 0
    with tempfile.TemporaryDirectory(prefix=".opfuse-llm-", dir=out.parent) as tmp:
        tmp = pathlib.Path(tmp)
        exported, optimised, stage = tmp / "export" / "model.onnx", tmp / "opt" / "model.onnx", tmp / "out"
        files_dir = tmp / "genai"
        here = _source_bytes(source) < IN_PROCESS_BYTES
        exported_info = _export_in_a_process(source, exported, files_dir, windows, here=here)
        optimised.parent.mkdir()
        summary = _in_a_process(_optimize_step, str(exported), str(optimised), verify, here=here)
        shutil.rmtree(exported.parent)
        shared, did = False, "kept as exported (--attention exported)"
        if attention == "gqa":
            optimised, did, shared = _in_a_process(_group_query_attention, optimised, tmp / "gqa",
                                                   exported_info["config"], here=here)
        not_quantized = []
        if precision == "int4":
            options = {"block_size": block_size, "symmetric": symmetric, "algorithm": algorithm,
                       "head_bits": head_bits, "embedding_bits": embedding_bits, "gguf_blocks": gguf_blocks,
                       **({} if fold_norms is None else {"fold_norms": fold_norms})}
            not_quantized, ops, inputs = _in_a_process(_int4_step, str(source), optimised, stage, exported_info,
                                                       windows, options, here=here)
        else:
            optimised.parent.rename(stage)
            model = onnx.load(str(stage / "model.onnx"), load_external_data=False)
            ops, inputs = counts(model), [i.name for i in model.graph.input]
            del model
        for f in files_dir.iterdir():  # genai_config.json and the tokenizer's files
            f.replace(stage / f.name)
        genai.restate_config(stage, inputs=inputs, share_buffer=shared)
        out.mkdir(exist_ok=True)
        files = sorted(p.name for p in stage.iterdir())
        mode = 0o666 & ~_umask()  # the staging files are private (mkstemp); the folder's are for whoever runs it
        for name in files:
            (stage / name).chmod(mode)
            (stage / name).replace(out / name)
    return Converted(out, files, precision, ops, summary, not_quantized, did)
