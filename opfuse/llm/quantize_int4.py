"""int4 weight-only quantisation of an exported LLM by ONNX Runtime's own ``matmul_nbits_quantizer``.

What it does (:func:`quantize_int4`):

- Every ``MatMul`` whose second input is a 2-D initializer becomes ``com.microsoft.MatMulNBits``:
  4 bits, blocks of ``block_size`` (32) along K, a float scale per block and, by default, a 4-bit zero
  point per block (``symmetric=True``: none, the zero point is 8); ``accuracy_level`` 4 (the CPU kernel
  quantises the activations to int8 per block and uses int8 dot products).
- Every ``Gather`` of an initializer (the token embedding) becomes ``com.microsoft.GatherBlockQuantized``
  with the same blocks along the hidden axis. The quantizer then declares opset 21 and IR version 10
  (int4 tensors need them); the exported graph's ops mean the same at 21 for what it contains, and
  ONNX Runtime loads the result (the tests run it).
- The algorithm is round-to-nearest: ``DefaultWeightOnlyQuantConfig``, the quantizer's block-wise
  min/max RTN, which writes MatMulNBits and GatherBlockQuantized itself. Its ``RTNWeightOnlyQuantConfig``
  (the Intel Neural Compressor port) takes no Gather and no block size of its own, so it is not used.

What it does not quantise: a MatMul whose weight is not a 2-D initializer (attention's Q.K^T and
P.V, whose both sides are activations), a weight reached through another node (a Transpose or a
Cast left in front of it), and every op that is not MatMul or Gather (norm weights, rotary tables).
One exception to the first: a tied LM head is ``MatMul(x, Transpose(E))`` of the embedding's matrix
``E``, which the clean-up leaves unfolded (folding would store a second float copy);
:func:`untie_head` gives that MatMul a transposed copy of ``E`` of its own first, so the head becomes
a MatMulNBits beside the embedding's GatherBlockQuantized (two int4 copies of one matrix, each an
eighth of the float one; one shared copy would need a MatMulNBits-layout Gather, not written).

Legality: not exact: each weight is replaced by its nearest point on a 4-bit grid per block, so the
outputs change. The tests check that the rewrite equals the dequantised weights' MatMul/Gather
(the quantiser's own arithmetic), not the float model.
"""

from __future__ import annotations

__all__ = ["ACCURACY_LEVEL", "BLOCK_SIZE", "counts", "quantize_int4"]

import collections
import logging

import numpy as np
import onnx

BLOCK_SIZE = 32
ACCURACY_LEVEL = 4


def quantize_int4(model: onnx.ModelProto, *, block_size: int = BLOCK_SIZE, symmetric: bool = False,
                  accuracy_level: int | None = ACCURACY_LEVEL, embedding: bool = True) -> onnx.ModelProto:
    """``model`` with its MatMul (and, with ``embedding``, Gather) weights at 4 bits (module docstring).

    ``model`` is changed in place and returned."""
    # (ONNX Runtime's quantizer pulls its own dependencies: only when int4 is asked for)
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    untie_head(model)
    ops = ("MatMul", "Gather") if embedding else ("MatMul",)
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric,
                                          accuracy_level=accuracy_level, op_types_to_quantize=ops,
                                          quant_axes=(("MatMul", 0), ("Gather", 1)), bits=4)
    quiet = logging.getLogger("onnxruntime.quantization")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its per-node info lines and the opset-21 warning (module docstring)
    with np.errstate(invalid="ignore", divide="ignore"):  # an all-zero block (a padding row): scale 0, handled
        try:
            quantizer = MatMulNBitsQuantizer(model, algo_config=config)
            quantizer.process()
        finally:
            quiet.setLevel(level)
    return quantizer.model.model


def untie_head(model: onnx.ModelProto) -> int:
    """Give each ``MatMul(x, Transpose(W, perm=[1, 0]))`` of a 2-D initializer ``W`` a transposed
    initializer of its own (the Transpose is removed when nothing else reads it); how many."""
    # (ONNX Runtime's quantizer pulls its own dependencies: only when int4 is asked for)
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    done, made = 0, {}
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
            graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(weight).T.copy(), name))
        node.input[1] = name
        done += 1
    read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    unused = [n for n in graph.node if n.op_type == "Transpose" and all(o not in read for o in n.output)]
    for n in unused:
        graph.node.remove(n)
    return done


def counts(model: onnx.ModelProto) -> dict[str, int]:
    """Op type -> count in the main graph."""
    return dict(collections.Counter(n.op_type for n in model.graph.node))
