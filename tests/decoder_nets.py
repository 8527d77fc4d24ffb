"""Tiny decoders for the tests: a random Hugging Face Llama (RMSNorm, SiLU-gated MLP,
grouped-query attention) exported as a prefill graph by either torch exporter, and one
attention block of a KV-cache decode step built in code (:func:`decode_step`). Nothing is
downloaded; the larger corpus is ``benchmarks/decoders.py``.

An export is made once per test session for its arguments and copied to each test that asks for
it (:func:`shared_export`): a torch export takes seconds, and the same one was made by many tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pathlib
import shutil
import warnings
from collections.abc import Callable

import numpy as np
from onnx import TensorProto, helper

import extras
from graphs import model, rng, tensor, vinfo

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100, max_position_embeddings=64, use_cache=False)


# the session's folder of exports, shared by its pytest-xdist workers (set by conftest.py)
EXPORTS_ENV = "OPFUSE_TEST_EXPORTS"


def shared_export(path: pathlib.Path, key: str, write: Callable[[pathlib.Path], object]) -> pathlib.Path:
    """``write(path)`` (an export to that file, with any files beside it), made once per test session
    for ``key`` (the export's arguments) and copied to ``path`` for every test that asks: the exports
    here are seeded, so the copy is the graph a new export writes. The folder is the session's
    (:data:`EXPORTS_ENV`), shared by its workers, one lock per key; without it, ``write(path)``."""
    root = os.environ.get(EXPORTS_ENV)
    if not root:
        write(path)
        return path
    import filelock  # (torch's dependency: every export needs torch)

    key = f"{key}|{pathlib.Path(path).name}"  # (an external data file is named after the model's)
    folder = pathlib.Path(root) / hashlib.sha256(key.encode()).hexdigest()[:20]
    pathlib.Path(root).mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(f"{folder}.lock"):
        if not folder.exists():
            part = folder.with_suffix(".part")
            shutil.rmtree(part, ignore_errors=True)
            part.mkdir()
            write(part / pathlib.Path(path).name)
            part.rename(folder)
    for f in folder.iterdir():
        shutil.copyfile(f, pathlib.Path(path).parent / f.name)
    return path


def llm_export(model, path: pathlib.Path, export: Callable) -> None:
    """``export(model, path)`` (opfuse.llm.export.export) through :func:`shared_export`, keyed by the
    model's config and weights (a digest): the ``opfuse llm`` conversions of one seeded model, in the
    tests' process or in a process the command spawned, share one export a session."""
    digest = hashlib.sha256(model.config.to_json_string().encode())
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().cpu().numpy().tobytes())
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    shared_export(pathlib.Path(path), f"opfuse_llm|{digest.hexdigest()}", lambda to: export(model, to))


def llm_export_step(*args):
    """opfuse.llm's export step (load, refuse, the genai files, export) with its export through
    :func:`llm_export`: what a conversion's spawned process runs when a test puts it in place of
    ``opfuse.llm._export_step`` (a function of this module, so that process unpickles it by name and
    imports this module, from the tests' folder on the path the spawned process is given)."""
    import opfuse.llm
    import opfuse.llm.export

    step, real = opfuse.llm._export_step, opfuse.llm.export.export
    if step is llm_export_step:
        raise RuntimeError("llm_export_step runs in the process the conversion spawned, not in the tests'")
    opfuse.llm.export.export = lambda model, path: llm_export(model, path, real)
    try:
        return step(*args)
    finally:
        opfuse.llm.export.export = real


def export_tiny_llama(path: pathlib.Path, *, exporter: str = "dynamo", opset: int = 18,
                      mask: str = "none", positions: bool = False) -> pathlib.Path:
    return shared_export(path, f"tiny_llama|{exporter}|{opset}|{mask}|{positions}",
                         lambda to: _export_tiny_llama(to, exporter=exporter, opset=opset, mask=mask,
                                                       positions=positions))


def _export_tiny_llama(path: pathlib.Path, *, exporter: str = "dynamo", opset: int = 18,
                       mask: str = "none", positions: bool = False) -> pathlib.Path:
    """The logits of a tiny random Llama for ``input_ids`` [batch, seq]. ``mask``: "input" (an
    ``attention_mask`` input too), "ones" (a mask of ones made inside: TorchScript needs one, as
    without it transformers traces ``torch.diff``, which it cannot export) or "none".
    ``positions``: a ``position_ids`` input [batch, seq] last (else transformers makes [1, seq] inside)."""
    torch = extras.require("torch")
    transformers = extras.require("transformers")
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


H, DH = 2, 4
D = H * DH
MAXPOS = 700  # the cos table covers every past length the size search tries (640 + 1)
PRESENT = "past_seq + 1"


def _heads(name: str, source: str, weight: str) -> list:
    """source [b, 1, D] @ weight -> [b, H, 1, DH]."""
    return [helper.make_node("MatMul", [source, weight], [f"{name}_p"], name=f"{name}_proj"),
            helper.make_node("Reshape", [f"{name}_p", "heads_shape"], [f"{name}_r"], name=f"{name}_split"),
            helper.make_node("Transpose", [f"{name}_r"], [name], perm=[0, 2, 1, 3], name=f"{name}_heads")]


def decode_step(mask_dim=PRESENT):
    """One decode step of attention: keys = Concat(past, new) [b, H, past_seq + 1, DH];
    the mask [b, past_seq + 1] becomes an additive bias reshaped to the keys' length (from
    Shape(keys): no broadcast can absorb a wrong length); q is scaled by cos(position) from
    a table made by Cos; y = MatMul(ctx, wo) + bo (a MatMul+Add rewrite to verify)."""
    r = rng(38)
    nodes = [helper.make_node("Cos", ["angles"], ["table"], name="cos_of_angles"),
             helper.make_node("Gather", ["table", "position_ids"], ["cos"], axis=0, name="rotary_gather"),
             helper.make_node("Mul", ["x", "cos"], ["x_rot"], name="rotate"),
             *_heads("q", "x_rot", "wq"), *_heads("k_new", "x_rot", "wk"),
             helper.make_node("Concat", ["past_key", "k_new"], ["present_key"], axis=2, name="append"),
             helper.make_node("Transpose", ["present_key"], ["kt"], perm=[0, 1, 3, 2], name="kt"),
             helper.make_node("MatMul", ["q", "kt"], ["qk"], name="qk"),
             helper.make_node("Mul", ["qk", "scale"], ["scores"], name="scale"),
             helper.make_node("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT, name="mask_float"),
             helper.make_node("Sub", ["one", "mf"], ["hidden"], name="invert"),
             helper.make_node("Mul", ["hidden", "minus_big"], ["bias"], name="bias"),
             helper.make_node("Shape", ["present_key"], ["kshape"], name="kshape"),
             helper.make_node("Slice", ["kshape", "s0", "s1"], ["kb"], name="kb"),
             helper.make_node("Slice", ["kshape", "s2", "s3"], ["kl"], name="kl"),
             helper.make_node("Concat", ["kb", "ones2", "kl"], ["bias_shape"], axis=0, name="bias_shape"),
             helper.make_node("Reshape", ["bias", "bias_shape"], ["bias4"], name="bias_to_keys"),
             helper.make_node("Add", ["scores", "bias4"], ["masked"], name="add_mask"),
             helper.make_node("Softmax", ["masked"], ["p"], axis=-1, name="softmax"),
             helper.make_node("MatMul", ["p", "present_key"], ["ctx"], name="pv"),
             helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3], name="merge_t"),
             helper.make_node("Reshape", ["ctx_t", "merged_shape"], ["ctx2"], name="merge"),
             helper.make_node("MatMul", ["ctx2", "wo"], ["proj"], name="out_proj"),
             helper.make_node("Add", ["proj", "bo"], ["y"], name="out_bias")]
    inits = [tensor("wq", r.normal(0, 0.3, (D, D)).astype(np.float32)),
             tensor("wk", r.normal(0, 0.3, (D, D)).astype(np.float32)),
             tensor("wo", r.normal(0, 0.3, (D, D)).astype(np.float32)),
             tensor("bo", r.normal(0, 0.1, D).astype(np.float32)),
             tensor("angles", np.outer(np.arange(MAXPOS), 1.0 / 10000 ** (np.arange(D) / D)).astype(np.float32)),
             tensor("scale", np.array(DH ** -0.5, np.float32)),
             tensor("heads_shape", np.array([0, 1, H, DH], np.int64)),
             tensor("merged_shape", np.array([0, 1, D], np.int64)),
             tensor("ones2", np.array([1, 1], np.int64)),
             tensor("one", np.array(1.0, np.float32)), tensor("minus_big", np.array(-1e4, np.float32)),
             *(tensor(f"s{i}", np.array([i], np.int64)) for i in range(4))]
    inputs = [vinfo("x", ["batch", 1, D]), vinfo("attention_mask", ["batch", mask_dim], TensorProto.INT64),
              vinfo("position_ids", ["batch", 1], TensorProto.INT64), vinfo("past_key", ["batch", H, "past_seq", DH])]
    outputs = [vinfo("y", ["batch", 1, D]), vinfo("present_key", ["batch", H, PRESENT, DH])]
    return model(nodes, inputs, outputs, inits)


STEP = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=100, max_position_embeddings=64)


def export_llama_step(path: pathlib.Path, graph: str = "decode") -> pathlib.Path:
    """A one-layer random Llama's ``graph`` ("decode": one token after a KV cache; "prefill"), exported by
    ``benchmarks/decoders.py``'s own code (dynamo, its input names and symbolic axes: batch, seq, past_seq,
    ``past_seq + 1``), so the tests compile what the corpus measures, at a tenth of its size."""
    extras.require("torch")
    extras.require("transformers")
    import importlib
    import sys

    benchmarks = str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.append(benchmarks)  # (decoders.py imports its neighbours genai_anchor and wild)
    decoders = importlib.import_module("decoders")
    decoder = decoders.Decoder("llama-step", "LlamaConfig", "LlamaForCausalLM", dict(decoders.SMALL, **STEP))
    return shared_export(path, f"llama_step|{graph}", lambda to: decoders.export(decoder, "dynamo", graph, to))


def padded_prefill_feeds(seed: int = 1) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A batch of 3 x 8 token ids for :func:`export_tiny_llama` (``mask="input", positions=True``): row 0
    unpadded, row 1 left-padded by 3, row 2 one real token; positions counted from each row's first real
    token. Returns (feeds, real): ``real`` the mask as bools, where the logits must agree."""
    from graphs import rng

    ids = rng(seed).integers(0, 100, (3, 8)).astype(np.int64)
    mask = np.ones((3, 8), np.int64)
    mask[1, :3] = 0  # left padding
    mask[2, :7] = 0  # one real token
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int64)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}, mask.astype(bool)
