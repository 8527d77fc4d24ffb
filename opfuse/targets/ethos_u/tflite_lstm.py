"""ONNX's LSTM in the Ethos-U lowering: a float island of TFLite's UNIDIRECTIONAL_SEQUENCE_LSTM.

What is written (:func:`lstm`, the ``LSTM`` row of ``lower.LOWERINGS``):

- one UNIDIRECTIONAL_SEQUENCE_LSTM per direction, float32 (a float model and an int8 one alike):
  in an int8 model the input is DEQUANTIZE'd first and each direction's output QUANTIZE'd to the
  QDQ model's quantisation of ``Y``. Vela 5.2 runs this LSTM only in its 16x8 form (int16
  activations, int8 weights), so it places the island on the CPU and names its reason; the
  convolutions before it and the layers after it stay int8 on the NPU.
- the reverse direction (``direction="reverse"``, or the second half of ``"bidirectional"``) runs
  on the input reversed in time (REVERSE_V2 along the time axis) and its output is reversed back;
- ``Y`` (ONNX ``[T, D, B, H]``, or ``[B, T, D, H]`` with ``layout=1``) is the directions' outputs
  (``[T, B, H]`` or ``[B, T, H]``) stacked by PACK on axis 3, which is ``Y`` in the lowering's
  NHWC order for ``layout=0``; ``layout=1`` adds a TRANSPOSE ``[0, 3, 2, 1]``.

The algebra (ONNX's gate order is i, o, f, c; TFLite takes each gate's matrices apart):

- ``W[d]`` ``[4H, I]`` split in four rows blocks ``W_i, W_o, W_f, W_c``: TFLite's
  input_to_{input, forget, cell, output}_weights are ``W_i, W_f, W_c, W_o`` (``[H, I]`` each),
  the same for ``R[d]`` (``[H, H]``, recurrent_to_*);
- TFLite has one bias per gate, ONNX two (``Wb`` and ``Rb``, the halves of ``B[d]`` ``[8H]``):
  the gate bias is ``Wb_g + Rb_g``, added in float64 and rounded once to float32;
- the gates' activation is the sigmoid and the cell's and output's the tanh
  (``fused_activation_function=TANH``), ONNX's default ``activations``;
- the state is two variable tensors (``[B, H]`` output state, ``[B, H]`` cell state) that the
  interpreter starts at zero, so ONNX's ``initial_h``/``initial_c`` are accepted when absent or
  constant zeros.

Legality: each refused form is a one-line :class:`~opfuse.targets.ethos_u.tflite_graph.LoweringError`
naming what TFLite's kernel does differently: ``activations`` other than (Sigmoid, Tanh, Tanh),
``clip`` (ONNX clips the gates' inputs, TFLite's ``cell_clip`` the cell state), ``input_forget=1``,
non-zero peepholes ``P``, ``sequence_lens`` other than the full length, non-zero or computed
initial states, and a used ``Y_h`` or ``Y_c`` (only ``Y`` is written).
"""

from __future__ import annotations

__all__ = ["lstm", "gate_tensors"]

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from opfuse.targets.ethos_u.tflite_graph import Lowering, attr
from opfuse.targets.ethos_u.tflite_ops import make_options

OP = schema.BuiltinOperator
OPT = schema.BuiltinOptions
_ONNX_GATES = "iofc"  # ONNX's order of the four row blocks of W, R, Wb and Rb
_TFLITE_GATES = "ifco"  # TFLite's order of input_to_*, recurrent_to_* and the gate biases
_DEFAULT_ACTIVATIONS = ("sigmoid", "tanh", "tanh")


def gate_tensors(w: np.ndarray, r: np.ndarray, b: np.ndarray | None, hidden: int):
    """One direction's ONNX ``W`` ``[4H, I]``, ``R`` ``[4H, H]``, ``B`` ``[8H]`` (or None) as TFLite's
    four input weights, four recurrent weights and four gate biases, each list in TFLite's order
    (input, forget, cell, output); the biases are ``Wb + Rb`` in float64, rounded once to float32."""
    rows = {g: slice(k * hidden, (k + 1) * hidden) for k, g in enumerate(_ONNX_GATES)}
    bias = np.zeros(8 * hidden) if b is None else b.astype(np.float64).reshape(-1)
    inputs = [np.ascontiguousarray(w[rows[g]], np.float32) for g in _TFLITE_GATES]
    recurrent = [np.ascontiguousarray(r[rows[g]], np.float32) for g in _TFLITE_GATES]
    biases = [(bias[rows[g]] + bias[4 * hidden:][rows[g]]).astype(np.float32) for g in _TFLITE_GATES]
    return inputs, recurrent, biases


def _input(node, i: int) -> str:
    return node.input[i] if len(node.input) > i else ""


def _check(L: Lowering, node, directions: int, steps: int) -> None:
    """Refuse, with TFLite's reason, every form the float UNIDIRECTIONAL_SEQUENCE_LSTM does not compute."""
    acts = attr(node, "activations")
    if acts is not None:
        names = tuple((a.decode() if isinstance(a, bytes) else a).lower() for a in acts)
        if names != _DEFAULT_ACTIVATIONS * directions:
            raise L.refuse(f"activations {list(names)}: TFLite's LSTM runs the sigmoid on its gates and one "
                           "fused activation (tanh) on the cell and the output")
    if attr(node, "clip") is not None:
        raise L.refuse("clip: ONNX clips the gates' inputs, TFLite's cell_clip clips the cell state")
    if attr(node, "input_forget", 0):
        raise L.refuse("input_forget=1 (a coupled input gate) is not lowered; TFLite's CIFG form drops the "
                       "input gate's weights and Vela does not run it")
    if attr(node, "layout", 0) not in (0, 1):
        raise L.refuse(f"layout={attr(node, 'layout')}")
    lens = _input(node, 4)
    if lens:
        if not L.is_constant(lens) or np.any(L.constant(lens) != steps):
            raise L.refuse("sequence_lens shorter than the sequence (or computed): TFLite's LSTM runs every "
                           "step of every batch row; pad the sequences and drop sequence_lens")
    for i, what in ((5, "initial_h"), (6, "initial_c")):
        name = _input(node, i)
        if name and (not L.is_constant(name) or np.any(L.constant(name) != 0)):
            raise L.refuse(f"a non-zero or computed {what}: TFLite's LSTM state is a variable tensor the "
                           "interpreter starts at zero")
    peep = _input(node, 7)
    if peep and (not L.is_constant(peep) or np.any(L.constant(peep) != 0)):
        raise L.refuse("peephole weights P (TFLite's LSTM takes them, but Vela does not run them and they are "
                       "not lowered)")
    for i, what in ((1, "Y_h"), (2, "Y_c")):
        name = node.output[i] if len(node.output) > i else ""
        if name and (L.consumers.get(name) or name in L.g.output_names):
            raise L.refuse(f"its output {what} is used: only Y (every step's hidden state) is written; "
                           f"take the last step of Y instead")


def _float_tensor(L: Lowering, name: str, array: np.ndarray) -> int:
    return L.w.tensor(name, array.shape, np.float32, data=np.asarray(array, np.float32))


def _float_temp(L: Lowering, name: str, shape) -> int:
    return L.w.tensor(name, shape, np.float32)


def _reverse(L: Lowering, source: int, axis: int, name: str) -> int:
    out = _float_temp(L, name, L.w.shape(source))
    axes = L.int_tensor(f"{name}/axis", [axis])
    L.w.op(OP.REVERSE_V2, [source, axes], [out], make_options(schema.ReverseV2OptionsT), OPT.ReverseV2Options)
    return out


def _direction(L: Lowering, node, x: int, d: int, hidden: int, time_major: bool, prefix: str) -> int:
    """One UNIDIRECTIONAL_SEQUENCE_LSTM over float ``x``: its float output ``[T, B, H]`` (or ``[B, T, H]``)."""
    w, r = L.constant(node.input[1])[d], L.constant(node.input[2])[d]
    b = L.constant(node.input[3])[d] if _input(node, 3) else None
    inputs, recurrent, biases = gate_tensors(w, r, b, hidden)
    batch = L.w.shape(x)[1 if time_major else 0]
    ids = [x]
    ids += [_float_tensor(L, f"{prefix}/input_to_{g}", a) for g, a in zip(("input", "forget", "cell", "output"),
                                                                          inputs)]
    ids += [_float_tensor(L, f"{prefix}/recurrent_to_{g}", a)
            for g, a in zip(("input", "forget", "cell", "output"), recurrent)]
    ids += [-1, -1, -1]  # no peepholes
    ids += [_float_tensor(L, f"{prefix}/{g}_gate_bias", a) for g, a in zip(("input", "forget", "cell", "output"),
                                                                           biases)]
    ids += [-1, -1]  # no projection
    for state in ("output_state", "cell_state"):
        index = _float_temp(L, f"{prefix}/{state}", [batch, hidden])
        L.w._tensors[index].isVariable = True
        ids.append(index)
    ids += [-1, -1, -1, -1]  # no layer normalisation
    steps_shape = L.w.shape(x)[:2]
    out = _float_temp(L, f"{prefix}/y", [*steps_shape, hidden])
    options = make_options(schema.UnidirectionalSequenceLSTMOptionsT, timeMajor=time_major,
                           fusedActivationFunction=schema.ActivationFunctionType.TANH)
    L.w.op(OP.UNIDIRECTIONAL_SEQUENCE_LSTM, ids, [out], options, OPT.UnidirectionalSequenceLSTMOptions)
    return out


def lstm(L: Lowering, node) -> None:
    """ONNX LSTM -> one float UNIDIRECTIONAL_SEQUENCE_LSTM per direction (see the module docstring)."""
    direction = attr(node, "direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    directions = 2 if direction == "bidirectional" else 1
    x = L.value(node.input[0])
    if len(x.shape) != 3:
        raise L.refuse(f"an LSTM input of rank {len(x.shape)} (ONNX's is [T, B, I] or [B, T, I])")
    time_major = attr(node, "layout", 0) == 0
    hidden = int(attr(node, "hidden_size", L.constant(node.input[2]).shape[-1]))
    _check(L, node, directions, x.shape[0 if time_major else 1])
    prefix = node.name or node.output[0]
    source = x.index
    if L.g.quantised:  # the island: int8 in, float LSTM, int8 out
        source = _float_temp(L, f"{prefix}/x_float", L.w.shape(x.index))
        L.w.op(OP.DEQUANTIZE, [x.index], [source])
    time_axis = 0 if time_major else 1
    outs = []
    for d in range(directions):
        backward = direction == "reverse" or d == 1
        name = f"{prefix}/{'backward' if backward else 'forward'}"
        seq = _reverse(L, source, time_axis, f"{name}/x_reversed") if backward else source
        y = _direction(L, node, seq, d, hidden, time_major, name)
        outs.append(_reverse(L, y, time_axis, f"{name}/y_in_time") if backward else y)
    y_onnx = L.new_value(node.output[0])  # [T, D, B, H] (or [B, T, D, H]), stored NHWC
    steps = L.w.shape(outs[0])[:2]
    packed = y_onnx if time_major else L.temp(y_onnx, f"{prefix}/y_packed", shape=(*steps, hidden, directions),
                                               layout=(0, 1, 2, 3))
    parts = []
    for d, y in enumerate(outs):
        if L.g.quantised:
            q = L.w.tensor(f"{prefix}/y{d}_int8", L.w.shape(y), np.int8, quant=y_onnx.quant)
            L.w.op(OP.QUANTIZE, [y], [q])
            y = q
        parts.append(y)
    L.w.op(OP.PACK, parts, [packed.index], make_options(schema.PackOptionsT, valuesCount=len(parts), axis=3),
           OPT.PackOptions)
    if not time_major:  # [B, T, H, D] -> Y's NHWC order [B, D, H, T]
        perm = L.int_tensor(f"{prefix}/perm", [0, 3, 2, 1])
        L.w.op(OP.TRANSPOSE, [packed.index, perm], [y_onnx.index], make_options(schema.TransposeOptionsT),
               OPT.TransposeOptions)
