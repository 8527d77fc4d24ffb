"""int4 weight-only quantisation of an exported LLM: MatMulNBits and GatherBlockQuantized.

What it does (:func:`quantize_int4`):

- Every ``MatMul`` whose second input is a 2-D initializer becomes ``com.microsoft.MatMulNBits``:
  4 bits, blocks of ``block_size`` (32) along K, a float scale per block; ``accuracy_level`` 4 (the CPU
  kernel quantises the activations to int8 per block and uses int8 dot products).
- Every ``Gather`` of an initializer (the token embedding) becomes ``com.microsoft.GatherBlockQuantized``
  with the same blocks along the hidden axis, at ``embedding_bits`` (8 by default: GGUF's Q8_0 rule,
  ``d = max |w| / 127`` per block, written here since ONNX Runtime's quantiser writes 4-bit tables only;
  a Gather reads a few rows per token, so the bits cost file size, not time). The graph then declares
  opset 21 and IR version 10 (int4 tensors need them); the exported graph's ops mean the same at 21 for
  what it contains, and ONNX Runtime loads the result (the tests run it).
- ``algorithm`` (:data:`ALGORITHMS`) says how each weight is put on its grid:

  - ``rtn``: ONNX Runtime's ``DefaultWeightOnlyQuantConfig``, block-wise min/max round-to-nearest with a
    4-bit integer zero point per block (``symmetric=True``: none, the zero point is 8).
  - ``k_quant``: ONNX Runtime's port of llama.cpp's k-quant search for each block's scale and minimum
    (the minimum then rounded to an integer zero point).
  - ``hqq``: ONNX Runtime's Half-Quadratic Quantization; it writes float zero points, which ONNX Runtime
    1.32's CPU kernel runs by dequantising the whole weight on every call (docs/results/llm.md): measured
    for accuracy, not a default.
  - ``q4_1``: min-max per block with a *float* minimum (GGUF's Q4_1 rule, ``w = d * code + m``), written as
    :func:`opfuse.llm.gguf_blocks.write_min_blocks` writes it: a uint8 zero point in the MatMulNBits and
    the rest of ``m`` as one float per block added through ``(x @ S) @ E`` (exact for that grid; the
    fast kernel).
  - ``gptq``: GPTQ (Frantar et al.) on the ``q4_1`` grid: rows quantised in order, each one's error
    spread over the rows not yet quantised through the inverse Hessian of the layer's input, which
    :func:`hessians` measures on ``calibration`` feeds (one ONNX Runtime run per feed, every MatMul input
    an output).
  - ``gptq_int``: GPTQ on the grid ``d * (code - z)`` with an integer zero point ``z`` per block (the
    range widened to hold 0): no residual pair (:mod:`opfuse.llm.gguf_blocks` writes none where the
    minimum is a whole multiple of the scale), so fewer nodes per projection than ``gptq``.

- ``gguf``: before the algorithm, every weight that is a GGUF's own Q4_0 / Q4_1 / Q8_0 rows is
  written from the file's blocks as they are (:mod:`opfuse.llm.gguf_blocks`: exact).
- ``head_bits`` 8: the tied LM head as an 8-bit MatMulNBits (round-to-nearest, symmetric).

What it does not quantise: a MatMul whose weight is not a 2-D initializer (attention's Q.K^T and
P.V, whose both sides are activations), a weight reached through another node (a Transpose or a
Cast left in front of it), and every op that is not MatMul or Gather (norm weights, rotary tables).
One exception to the first: a tied LM head is ``MatMul(x, Transpose(E))`` of the embedding's matrix
``E``, which the clean-up leaves unfolded (folding would store a second float copy);
:func:`untie_head` gives that MatMul a transposed copy of ``E`` of its own first, so the head becomes
a MatMulNBits beside the embedding's GatherBlockQuantized (two quantised copies of one matrix; one
shared copy would need a MatMulNBits-layout Gather, not written). RMSNorm scales are not folded into
the next projection unless ``fold_norms`` (:mod:`opfuse.llm.fold_norm`), and then only into weights
still in float after the GGUF import: on a GGUF's weights that would move them off the file's grid.

Legality: not exact (but the GGUF import): each weight is replaced by a point on a 4-bit grid per
block, so the outputs change. The tests check that each rewrite computes with the blocks it wrote
(dequantised in numpy), not the float model, and the accuracy is measured in
``benchmarks/llm_accuracy.py``.
"""

from __future__ import annotations

__all__ = ["ACCURACY_LEVEL", "ALGORITHMS", "BLOCK_SIZE", "DEFAULT_ALGORITHM", "counts", "hessians", "quantize_int4"]

import collections
import contextlib
import io
import logging
import os
import pathlib
import tempfile
import warnings

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import load_external_data_for_model

from opfuse.errors import BadInputError

BLOCK_SIZE = 32
ACCURACY_LEVEL = 4
ALGORITHMS = ("rtn", "k_quant", "hqq", "q4_1", "gptq", "gptq_int")
DEFAULT_ALGORITHM = "gptq"  # measured best: docs/results/llm.md
FOLD_NORMS = False  # measured: docs/results/llm.md


# the float MatMuls of the q4_1 form (opfuse.llm.gguf_blocks): its block sums and residuals, never quantised
_FORM_SUFFIXES = ("_gguf_residual", "_gguf_block_sums")


def _form_nodes(model: onnx.ModelProto) -> list[str]:
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name.endswith(_FORM_SUFFIXES)]


def _quiet_quantizer(config, model: onnx.ModelProto, **kw) -> onnx.ModelProto:
    """ONNX Runtime's MatMulNBitsQuantizer on ``model`` with ``config``, its info lines silenced; the q4_1
    form's float MatMuls excluded."""
    # (ONNX Runtime: imported when it quantises)
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        MatMulNBitsQuantizer,  # (ONNX Runtime: imported when it quantises)
    )

    if kw.get("nodes_to_include") is None:
        kw["nodes_to_exclude"] = _form_nodes(model)

    loggers = [logging.getLogger(n) for n in ("onnxruntime.quantization", "neural_compressor")]
    levels = [q.level for q in loggers]
    for q in loggers:
        q.setLevel(logging.ERROR)  # per-node info lines, the opset-21 warning, k-quant's "install cupy"
    # an all-zero block (a padding row): scale 0, handled; k-quant prints a progress bar on stdout
    with np.errstate(invalid="ignore", divide="ignore"), contextlib.redirect_stdout(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HQQ: torch's "non-writable NumPy array"
        try:
            quantizer = MatMulNBitsQuantizer(model, algo_config=config, **kw)
            quantizer.process()
        finally:
            for q, level in zip(loggers, levels):
                q.setLevel(level)
    return quantizer.model.model


def _rtn(model, ops, block_size, symmetric, accuracy_level, bits=4, nodes=None):
    # (ONNX Runtime: imported when it quantises)
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,  # (ONNX Runtime: imported when it quantises)
    )

    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric,
                                          accuracy_level=accuracy_level, op_types_to_quantize=ops,
                                          quant_axes=(("MatMul", 0), ("Gather", 1)), bits=bits)
    if nodes is not None:
        config.op_types_to_quantize = ()
    return _quiet_quantizer(config, model, nodes_to_include=nodes)


def _matmuls(model: onnx.ModelProto, base_dir=None) -> list[tuple[onnx.NodeProto, np.ndarray]]:
    """The MatMul nodes with a 2-D float32 initializer weight whose K is a whole number of blocks."""
    from opfuse.llm.gguf_blocks import weight_array  # (gguf (the llm extra): imported when a GGUF is read)

    inits = {t.name: t for t in model.graph.initializer}
    found = []
    for node in model.graph.node:
        if (node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in inits
                and not node.name.endswith(_FORM_SUFFIXES)):
            w = weight_array(inits[node.input[1]], base_dir)
            if w.ndim == 2 and w.dtype == np.float32:
                found.append((node, w))
    return found


def _minmax_blocks(w: np.ndarray, block_size: int, integer_zero: bool = False):
    """Per block of ``block_size`` along K of ``w`` [K, N]: (codes [N, blocks, block], d, m [N, blocks]),
    w ~ d * code + m, d = (max - min) / 15, m = min (llama.cpp's Q4_1 rule, the minimum a float)."""
    k, n = w.shape
    blocks = w.T.reshape(n, k // block_size, block_size)
    lo, hi = blocks.min(axis=2), blocks.max(axis=2)
    if integer_zero:  # (as _gptq_blocks' integer_zero)
        lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
    d = ((hi - lo) / 15).astype(np.float32)
    if integer_zero:
        lo = -(d * np.clip(np.rint(-lo / np.where(d == 0, 1, d)), 0, 15).astype(np.float32))
    safe = np.where(d == 0, 1, d)
    codes = np.clip(np.rint((blocks - lo[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    return codes, d, lo.astype(np.float32)


def _gptq_blocks(w: np.ndarray, h: np.ndarray, block_size: int, damp: float = 0.01, integer_zero: bool = False):
    """GPTQ (Frantar et al. 2022) on ``w`` [K, N] with the Hessian ``h`` = E[x x^T] [K, K] of its input:
    rows quantised in order, each one's error spread over the rows not yet quantised through the
    inverse Hessian's Cholesky factor; the grid of each block (d, m as :func:`_minmax_blocks`) is taken
    from the block's weights as updated when the block starts. Returns what ``_minmax_blocks`` does.
    ``integer_zero``: the grid ``d * (code - z)`` with an integer ``z`` in [0, 15] (the range widened to
    hold 0, ``d`` rounded to float32), so ``m = -d * z`` and the written form needs no residual pair."""
    k, n = w.shape
    w = w.astype(np.float64).copy()
    h = h.astype(np.float64).copy()
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[dead, :] = 0
    h[np.diag_indices(k)] += damp * np.mean(np.diag(h))
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T  # upper triangular
    nb = k // block_size
    codes = np.zeros((k, n), np.uint8)
    d_all, m_all = np.zeros((nb, n), np.float64), np.zeros((nb, n), np.float64)
    for b in range(nb):
        i1, i2 = b * block_size, (b + 1) * block_size
        lo, hi = w[i1:i2].min(axis=0), w[i1:i2].max(axis=0)
        d = (hi - lo) / 15
        if integer_zero:
            lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
            d = ((hi - lo) / 15).astype(np.float32).astype(np.float64)
            z = np.clip(np.rint(-lo / np.where(d == 0, 1, d)), 0, 15)
            lo = -(d.astype(np.float32) * z.astype(np.float32)).astype(np.float64)  # (as the writer computes it)
        safe = np.where(d == 0, 1, d)
        err = np.zeros((block_size, n))
        for i in range(block_size):
            row = i1 + i
            q = np.clip(np.rint((w[row] - lo) / safe), 0, 15)
            e = (w[row] - (q * d + lo)) / hinv[row, row]
            w[row:i2] -= np.outer(hinv[row, row:i2], e)
            err[i] = e
            codes[row] = q
        w[i2:] -= hinv[i1:i2, i2:].T @ err
        d_all[b], m_all[b] = d, lo
    codes = codes.T.reshape(n, nb, block_size)
    return codes, d_all.T.astype(np.float32), m_all.T.astype(np.float32)


def _probe_session(model: onnx.ModelProto, wanted: list[str], folder=None):
    """An ONNX Runtime session of ``model`` with ``wanted`` added as outputs (``model`` left as it was).
    ``folder``: the model's weights stay in its external data file there, read by ONNX Runtime alone."""

    import onnxruntime as ort  # (ONNX Runtime: imported when it quantises)

    options = ort.SessionOptions()
    options.log_severity_level = 3
    added = [helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None) for x in wanted]
    model.graph.output.extend(added)
    try:
        if folder is None:
            return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        fd, probe = tempfile.mkstemp(suffix=".onnx", dir=folder)
        os.close(fd)
        try:
            onnx.save(model, probe)  # (its tensors still name the external data file beside it)
            return ort.InferenceSession(probe, options, providers=["CPUExecutionProvider"])
        finally:
            os.unlink(probe)
    finally:
        for _ in added:
            model.graph.output.pop()


def hessians(model: onnx.ModelProto | str, feeds: list[dict], names: set[str] | None = None) -> dict[str, np.ndarray]:
    """E[x x^T] over every row of every calibration feed, for each MatMul input ``x`` (or those in
    ``names``) of ``model``, from one ONNX Runtime run per feed with the inputs added as outputs.
    ``model`` a path: its weights are read by ONNX Runtime from its external data, not loaded here."""

    folder = None
    if not isinstance(model, onnx.ModelProto):
        folder = pathlib.Path(model).parent
        model = onnx.load(str(model), load_external_data=False)
    if names is None:
        inits = {t.name for t in model.graph.initializer}
        transposed = {o for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in inits
                      for o in n.output}  # a tied head: MatMul(x, Transpose(E)), untied later
        names = {n.input[0] for n in model.graph.node
                 if n.op_type == "MatMul" and len(n.input) == 2 and (n.input[1] in inits or n.input[1] in transposed)
                 and not n.name.endswith(_FORM_SUFFIXES)}
    wanted = sorted(names)
    session = _probe_session(model, wanted, folder)
    sums: dict[str, np.ndarray] = {}
    rows = 0
    taken = {i.name for i in session.get_inputs()}  # (the attention step may have dropped position_ids)
    for feed in feeds:
        outs = session.run(wanted, {k: v for k, v in feed.items() if k in taken})
        for x, v in zip(wanted, outs):
            v = v.reshape(-1, v.shape[-1]).astype(np.float64)
            sums[x] = sums.get(x, 0) + v.T @ v
        rows += int(np.prod(outs[0].shape[:-1]))
    return {x: s / rows for x, s in sums.items()}


def quantize_int4(model: onnx.ModelProto, *, block_size: int = BLOCK_SIZE, symmetric: bool = False,
                  accuracy_level: int | None = ACCURACY_LEVEL, embedding: bool = True, embedding_bits: int = 8,
                  algorithm: str = DEFAULT_ALGORITHM, head_bits: int = 4, calibration: list[dict] | None = None,
                  gguf=None, gguf_form: str = "residual",
                  input_hessians: dict[str, np.ndarray] | None = None,
                  fold_norms: bool = FOLD_NORMS, base_dir: str | pathlib.Path | None = None) -> onnx.ModelProto:
    """``model`` with its MatMul (and, with ``embedding``, Gather) weights at 4 bits (module docstring).

    ``algorithm``: one of :data:`ALGORITHMS`; ``gptq`` needs ``calibration`` (feeds of ``model``), or
    ``input_hessians`` measured before (:func:`hessians`, e.g. from the model's file without loading it).
    ``head_bits`` 8: the tied LM head at 8 bits (RTN, symmetric). ``gguf``: a GGUF file (or a
    :class:`opfuse.llm.gguf_blocks.GgufRows`) whose quantised blocks are imported as they are first,
    wherever a weight is that file's rows; the rest goes to ``algorithm``. ``fold_norms``: the RMSNorm
    scales folded into the projections still in float first (:mod:`opfuse.llm.fold_norm`).
    ``base_dir``: ``model`` was loaded without its external data, which is there; each weight is read
    when it is quantised (one in memory at a time, not the whole model), and what is left in float is
    loaded before the model is returned (ONNX Runtime's quantiser, behind ``rtn``, ``hqq``, ``k_quant``
    and 8-bit heads, the norm folding and a calibration run take the model loaded whole: it is, first).
    ``model`` is changed in place and returned (or a new proto, from ONNX Runtime's quantiser)."""
    if algorithm not in ALGORITHMS:
        raise BadInputError(f"int4 algorithm {algorithm!r}: expected one of {', '.join(ALGORITHMS)}")
    if base_dir is not None and (algorithm in ("rtn", "hqq", "k_quant") or head_bits == 8 or fold_norms
                                 or embedding and embedding_bits == 4 or calibration):
        load_external_data_for_model(model, str(base_dir))
        base_dir = None
    heads = untie_head(model, base_dir)
    if gguf is not None:
        from opfuse.llm.gguf_blocks import (  # (gguf (the llm extra): imported when a GGUF is read)
            GgufRows,
            import_blocks,
        )

        rows = gguf if isinstance(gguf, GgufRows) else GgufRows(gguf)
        import_blocks(model, None, form=gguf_form, accuracy_level=accuracy_level, rows=rows, base_dir=base_dir)
    if fold_norms:
        from opfuse.llm.fold_norm import fold_norm_scales, rescale_hessians  # (imported when asked for)

        folded = fold_norm_scales(model)
        if input_hessians is not None and folded:
            input_hessians = rescale_hessians(input_hessians, folded)
    live = {n.name for n in model.graph.node}
    heads = [h for h in heads if h in live]
    if head_bits == 8 and heads:
        model = _rtn(model, ("MatMul",), block_size, True, accuracy_level, bits=8, nodes=heads)
    elif head_bits not in (4, 8):
        raise BadInputError(f"head bits {head_bits}: expected 4 or 8")
    if embedding_bits not in (4, 8):
        raise BadInputError(f"embedding bits {embedding_bits}: expected 4 or 8")
    if algorithm == "rtn" and embedding and embedding_bits == 4:
        return _rtn(model, ("MatMul", "Gather"), block_size, symmetric, accuracy_level)
    if algorithm == "rtn":
        model = _rtn(model, ("MatMul",), block_size, symmetric, accuracy_level)
    elif algorithm == "hqq":
        # (ONNX Runtime: imported when it quantises)
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            HQQWeightOnlyQuantConfig,  # (ONNX Runtime: imported when it quantises)
        )

        model = _quiet_quantizer(HQQWeightOnlyQuantConfig(block_size=block_size, op_types_to_quantize=("MatMul",)),
                                 model)
        if accuracy_level is not None:
            for node in model.graph.node:
                if node.op_type == "MatMulNBits":
                    node.attribute.append(helper.make_attribute("accuracy_level", accuracy_level))
    elif algorithm == "k_quant":
        # (ONNX Runtime: imported when it quantises)
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            KQuantWeightOnlyQuantConfig,  # (ONNX Runtime: imported when it quantises)
        )

        model = _quiet_quantizer(KQuantWeightOnlyQuantConfig(op_types_to_quantize=("MatMul",)), model,
                                 block_size=block_size, accuracy_level=accuracy_level)
    else:  # q4_1, gptq, gptq_int: a minimum per block, written as the GGUF Q4_1 import writes it
        from opfuse.llm.gguf_blocks import write_min_blocks  # (gguf (the llm extra): imported when a GGUF is read)

        found = _matmuls(model, base_dir)
        found = [(n, w) for n, w in found if w.shape[0] % block_size == 0]
        h = {}
        gptq = algorithm.startswith("gptq")
        if gptq and found and not calibration and input_hessians is None:
            raise BadInputError(f"int4 algorithm {algorithm}: needs calibration feeds")
        if gptq and found:
            h = input_hessians if input_hessians is not None else hessians(
                model, calibration, {n.input[0] for n, _ in found})
        replaced = {}
        for node, w in found:
            hessian = h.get(node.input[0])  # (none measured for it: min-max)
            replaced[node.name] = (_gptq_blocks(w, hessian, block_size, integer_zero=algorithm == "gptq_int")
                                   if hessian is not None
                                   else _minmax_blocks(w, block_size, integer_zero=algorithm == "gptq_int"))
        write_min_blocks(model, replaced, block_size, accuracy_level)
    if embedding and embedding_bits == 4:
        model = _rtn(model, ("Gather",), block_size, symmetric, accuracy_level)
    elif embedding:  # a Gather reads a few rows per token: 8 bits cost file size, not time
        _gather8(model, block_size, base_dir)
    if base_dir is not None:  # what is left in float (norm weights, tables), as onnx.load would have read it
        load_external_data_for_model(model, str(base_dir))
    return model


def _gather8(model: onnx.ModelProto, block_size: int, base_dir=None) -> None:
    """Each Gather (axis 0) of a 2-D float32 initializer as GatherBlockQuantized with 8 bits: per block of
    ``block_size`` along the row, ``d = max |w| / 127``, codes ``round(w / d) + 128``, zero point 128
    (GGUF's Q8_0 rule; ONNX Runtime's quantiser writes 4-bit tables only)."""
    # (gguf (the llm extra): imported when a GGUF is read)
    from opfuse.llm.gguf_blocks import _finish, _Writer, weight_array

    inits = {t.name: t for t in model.graph.initializer}
    writer, out_nodes, used_up = _Writer(None), [], set()
    for node in model.graph.node:
        table = weight_array(inits[node.input[0]], base_dir) if (
            node.op_type == "Gather" and node.input[0] in inits) else None
        if (table is None or table.ndim != 2 or table.dtype != np.float32 or table.shape[1] % block_size
                or any(a.name == "axis" and a.i != 0 for a in node.attribute)):
            out_nodes.append(node)
            continue
        blocks = table.reshape(table.shape[0], -1, block_size)
        d = (np.abs(blocks).max(axis=2) / 127).astype(np.float32)
        codes = (np.clip(np.rint(blocks / np.where(d == 0, 1, d)[..., None]), -127, 127) + 128).astype(np.uint8)
        out_nodes.extend(writer.gather(node, "Q8_0", codes, d))
        used_up.add(node.input[0])
    if used_up:
        _finish(model, model.graph, out_nodes, used_up, writer)


def untie_head(model: onnx.ModelProto, base_dir=None) -> list[str]:
    """Give each ``MatMul(x, Transpose(W, perm=[1, 0]))`` of a 2-D initializer ``W`` a transposed
    initializer of its own (the Transpose is removed when nothing else reads it); those MatMuls' names.
    ``base_dir``: where ``W`` is when the model was loaded without its external data."""
    from opfuse.llm.gguf_blocks import weight_array  # (gguf (the llm extra): imported when a GGUF is read)

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    done, made = [], {}
    for node in graph.node:
        if node.op_type != "MatMul" or len(node.input) < 2 or node.input[1] in inits:
            continue
        t = producer.get(node.input[1])
        perm = [list(a.ints) for a in t.attribute if a.name == "perm"] if t is not None else []
        if t is None or t.op_type != "Transpose" or perm not in ([[1, 0]], []) or t.input[0] not in inits:
            continue
        weight = inits[t.input[0]]
        if len(weight.dims) != 2:
            continue
        name = made.get(weight.name)
        if name is None:
            name = made[weight.name] = f"{weight.name}_transposed"
            graph.initializer.append(numpy_helper.from_array(weight_array(weight, base_dir).T.copy(), name))
        node.input[1] = name
        done.append(node.name)
    read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    unused = [n for n in graph.node if n.op_type == "Transpose" and all(o not in read for o in n.output)]
    for n in unused:
        graph.node.remove(n)
    return done


def counts(model: onnx.ModelProto) -> dict[str, int]:
    """Op type -> count in the main graph."""
    return dict(collections.Counter(n.op_type for n in model.graph.node))
