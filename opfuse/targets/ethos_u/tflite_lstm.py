"""ONNX's LSTM in the Ethos-U lowering: TFLite's UNIDIRECTIONAL_SEQUENCE_LSTM, one per direction.

What is written (:func:`lstm`, the ``LSTM`` row of ``lower.LOWERINGS``):

- a float model: one float32 UNIDIRECTIONAL_SEQUENCE_LSTM per direction;
- an int8 model: TFLite's integer LSTM (8x8->16): int8 input and hidden state in the QDQ model's
  quantisations of ``X`` and ``Y``, int8 weights symmetric per matrix, int32 gate biases at the
  input-to-gate product's scale, the gates in Q3.12, an int16 cell state whose power-of-two scale
  covers the sequence length (:func:`_quantised_state`). ONNX Runtime's quantiser leaves the LSTM
  float, so these integers are this module's: each gate matrix rounded to nearest at ``max|M| / 127``.
  The ``ethos-u`` preset's quantiser has put ``W`` and ``R`` on that grid already, rounded from the
  calibration data (GPTQ, :mod:`opfuse.quantization.algorithms.lstm_rounding`), and the same rounding
  here gives back its integers. (The kernel reads one scale per weight tensor, and without layer
  normalisation it fixes the four gate intermediates at Q3.12 whatever they say; the fifth, the
  hidden state, is ``Y``'s quantisation, which the recurrent input reads.) Vela 5.2 unrolls it onto
  the NPU of every Ethos-U.
  (A float LSTM between a DEQUANTIZE and a QUANTIZE is no way out: Vela 5.2 refuses the whole
  TFLite, "UNIDIRECTIONAL_SEQUENCE_LSTM ... does not have valid TFLite semantics: IFM must be INT8
  or INT16"; and LiteRT runs no 16x8 form, int16 activations, to check one against.)
- the reverse direction (``direction="reverse"``, or the second half of ``"bidirectional"``) runs
  on the input reversed in time and its output is reversed back, each reversal an UNPACK and a
  PACK in reverse order (Vela's REVERSE_V2 is not on the U55: "Unsupported reverse mask");
- ``Y`` (ONNX ``[T, D, B, H]``, or ``[B, T, D, H]`` with ``layout=1``) is the directions' outputs
  (``[T, B, H]`` or ``[B, T, H]``) stacked by PACK on axis 3, which is ``Y`` in the lowering's
  NHWC order for ``layout=0``; ``layout=1`` adds a TRANSPOSE ``[0, 3, 2, 1]``.

The algebra (ONNX's gate order is i, o, f, c; TFLite takes each gate's matrices apart):

- ``W[d]`` ``[4H, I]`` split in four row blocks ``W_i, W_o, W_f, W_c``: TFLite's
  input_to_{input, forget, cell, output}_weights are ``W_i, W_f, W_c, W_o`` (``[H, I]`` each),
  the same for ``R[d]`` (``[H, H]``, recurrent_to_*);
- TFLite has one bias per gate, ONNX two (``Wb`` and ``Rb``, the halves of ``B[d]`` ``[8H]``):
  the gate bias is ``Wb_g + Rb_g``, added in float64 and rounded once (to float32, or to int32);
- the gates' activation is the sigmoid and the cell's and output's the tanh
  (``fused_activation_function=TANH``), ONNX's default ``activations``;
- the state is two variable tensors (``[B, H]`` output state, ``[B, H]`` cell state) that the
  interpreter starts at zero, so ONNX's ``initial_h``/``initial_c`` are accepted when absent or
  constant zeros. TFLite keeps a variable tensor across invocations (a stream's state), so a caller
  running independent sequences resets them before each run (LiteRT's
  ``Interpreter.reset_all_variables``, TFLite Micro's ``MicroInterpreter::ResetVariableTensors``),
  as :class:`~opfuse.targets.ethos_u.runner.TfliteSession` does.

Legality: each refused form is a one-line :class:`~opfuse.targets.ethos_u.tflite_graph.LoweringError`
naming what TFLite's kernel does differently: ``activations`` other than (Sigmoid, Tanh, Tanh),
``clip`` (ONNX clips the gates' inputs, TFLite's ``cell_clip`` the cell state), ``input_forget=1``,
non-zero peepholes ``P``, ``sequence_lens`` other than the full length, non-zero or computed
initial states, and a used ``Y_h`` or ``Y_c`` (only ``Y`` is written).
"""

from __future__ import annotations

__all__ = ["lstm", "gate_tensors"]

import math

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from opfuse.core.ops import proto_attr
from opfuse.targets.ethos_u.tflite_graph import Lowering, Value
from opfuse.targets.ethos_u.tflite_ops import make_options
from opfuse.targets.ethos_u.tflite_writer import Quant

OP = schema.BuiltinOperator
OPT = schema.BuiltinOptions
_ONNX_GATES = "iofc"  # ONNX's order of the four row blocks of W, R, Wb and Rb
_TFLITE_GATES = "ifco"  # TFLite's order of input_to_*, recurrent_to_* and the gate biases
_DEFAULT_ACTIVATIONS = ("sigmoid", "tanh", "tanh")


def gate_tensors(w: np.ndarray, r: np.ndarray, b: np.ndarray | None, hidden: int):
    """One direction's ONNX ``W`` ``[4H, I]``, ``R`` ``[4H, H]``, ``B`` ``[8H]`` (or None) as TFLite's
    four input weights, four recurrent weights and four gate biases, each list in TFLite's order
    (input, forget, cell, output); the biases are ``Wb + Rb`` in float64 (the caller rounds them once)."""
    rows = {g: slice(k * hidden, (k + 1) * hidden) for k, g in enumerate(_ONNX_GATES)}
    bias = np.zeros(8 * hidden) if b is None else b.astype(np.float64).reshape(-1)
    inputs = [np.ascontiguousarray(w[rows[g]], np.float32) for g in _TFLITE_GATES]
    recurrent = [np.ascontiguousarray(r[rows[g]], np.float32) for g in _TFLITE_GATES]
    biases = [bias[rows[g]] + bias[4 * hidden:][rows[g]] for g in _TFLITE_GATES]
    return inputs, recurrent, biases


def _input(node, i: int) -> str:
    return node.input[i] if len(node.input) > i else ""


def _check(L: Lowering, node, directions: int, steps: int) -> None:
    """Refuse, with the reason, every form TFLite's UNIDIRECTIONAL_SEQUENCE_LSTM computes otherwise."""
    acts = proto_attr(node, "activations")
    if acts is not None:
        names = tuple((a.decode() if isinstance(a, bytes) else a).lower() for a in acts)
        if names != _DEFAULT_ACTIVATIONS * directions:
            raise L.refuse(f"activations {list(names)}: TFLite's LSTM runs the sigmoid on its gates and one "
                           "fused activation (tanh) on the cell and the output")
    if proto_attr(node, "clip") is not None:
        raise L.refuse("clip: ONNX clips the gates' inputs, TFLite's cell_clip clips the cell state")
    if proto_attr(node, "input_forget", 0):
        raise L.refuse("input_forget=1 (a coupled input gate) is not lowered; TFLite's CIFG form drops the "
                       "input gate's weights and Vela does not run it")
    if proto_attr(node, "layout", 0) not in (0, 1):
        raise L.refuse(f"layout={proto_attr(node, 'layout')}")
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


def _quantised_state(steps: int) -> Quant:
    """The int16 cell state's quantisation: a power of two (TFLite's integer LSTM shifts by it) whose
    range covers ``steps``, the most ``|c|`` can reach (``|c_t| <= |c_{t-1}| + 1``)."""
    return _quant(2.0 ** math.ceil(math.log2(max(steps, 1) / 32767)))


def _quant(scale: float, zero_point: int = 0) -> Quant:
    return Quant(np.array([scale]), np.array([zero_point], np.int64), 0)


def _weight(L: Lowering, name: str, real: np.ndarray, quantised: bool) -> tuple[int, float]:
    """A gate matrix: float32, or int8 symmetric per tensor (TFLite's integer LSTM takes one scale per
    matrix); returns its tensor and scale."""
    if not quantised:
        return L.w.tensor(name, real.shape, np.float32, data=real.astype(np.float32)), 1.0
    peak = float(np.max(np.abs(real))) if real.size else 0.0
    scale = peak / 127.0 if peak > 0 else 1.0
    data = np.clip(np.round(real.astype(np.float64) / scale), -127, 127).astype(np.int8)
    return L.w.tensor(name, data.shape, np.int8, data=data, quant=_quant(scale)), scale


def _reverse(L: Lowering, source: int, axis: int, name: str, dtype, quant: Quant | None) -> int:
    """``source`` reversed along ``axis`` as UNPACK then PACK in reverse order: two moves Vela runs on
    every Ethos-U (its REVERSE_V2 is not on the U55: "Unsupported reverse mask")."""
    shape = L.w.shape(source)
    step_shape = [n for k, n in enumerate(shape) if k != axis]
    steps = [L.w.tensor(f"{name}/step{t}", step_shape, dtype, quant=quant) for t in range(shape[axis])]
    L.w.op(OP.UNPACK, [source], steps, make_options(schema.UnpackOptionsT, num=len(steps), axis=axis),
           OPT.UnpackOptions)
    out = L.w.tensor(name, shape, dtype, quant=quant)
    L.w.op(OP.PACK, steps[::-1], [out], make_options(schema.PackOptionsT, valuesCount=len(steps), axis=axis),
           OPT.PackOptions)
    return out


def _direction(L: Lowering, node, x: Value, seq: int, d: int, hidden: int, time_major: bool, prefix: str,
               y_quant: Quant | None) -> int:
    """One UNIDIRECTIONAL_SEQUENCE_LSTM over ``seq`` (float, or int8 in ``x``'s quantisation): its
    output ``[T, B, H]`` (or ``[B, T, H]``), float or int8 in ``y_quant``."""
    quantised = y_quant is not None
    w, r = L.constant(node.input[1])[d], L.constant(node.input[2])[d]
    b = L.constant(node.input[3])[d] if _input(node, 3) else None
    inputs, recurrent, biases = gate_tensors(w, r, b, hidden)
    gates = ("input", "forget", "cell", "output")
    ids, input_scales = [seq], []
    for g, a in zip(gates, inputs):
        index, scale = _weight(L, f"{prefix}/input_to_{g}", a, quantised)
        ids.append(index)
        input_scales.append(scale)
    ids += [_weight(L, f"{prefix}/recurrent_to_{g}", a, quantised)[0] for g, a in zip(gates, recurrent)]
    ids += [-1, -1, -1]  # no peepholes
    for g, a, w_scale in zip(gates, biases, input_scales):
        if quantised:  # int32 at the input-to-gate product's scale (the integer kernel adds it there)
            scale = float(x.quant.scale[0]) * w_scale
            data = np.round(a / scale).astype(np.int32)
            ids.append(L.w.tensor(f"{prefix}/{g}_gate_bias", data.shape, np.int32, data=data, quant=_quant(scale)))
        else:
            ids.append(L.w.tensor(f"{prefix}/{g}_gate_bias", a.shape, np.float32, data=a.astype(np.float32)))
    ids += [-1, -1]  # no projection
    batch = L.w.shape(seq)[1 if time_major else 0]
    steps = L.w.shape(seq)[0 if time_major else 1]
    states = ((np.int8, y_quant), (np.int16, _quantised_state(steps))) if quantised else ((np.float32, None),) * 2
    for state, (dtype, quant) in zip(("output_state", "cell_state"), states):
        index = L.w.tensor(f"{prefix}/{state}", [batch, hidden], dtype, quant=quant)
        L.w._tensors[index].isVariable = True
        ids.append(index)
    ids += [-1, -1, -1, -1]  # no layer normalisation
    out = L.w.tensor(f"{prefix}/y", [*L.w.shape(seq)[:2], hidden], np.int8 if quantised else np.float32,
                     quant=y_quant)
    options = make_options(schema.UnidirectionalSequenceLSTMOptionsT, timeMajor=time_major,
                           fusedActivationFunction=schema.ActivationFunctionType.TANH)
    L.w.op(OP.UNIDIRECTIONAL_SEQUENCE_LSTM, ids, [out], options, OPT.UnidirectionalSequenceLSTMOptions)
    if quantised:  # the integer kernel's intermediates: the four gates in Q3.12, the hidden state as Y
        L.w._operators[-1].intermediates = [
            *(L.w.tensor(f"{prefix}/{g}_gate_q3.12", [1], np.int16, quant=_quant(2.0 ** -12)) for g in gates),
            L.w.tensor(f"{prefix}/hidden", [1], np.int8, quant=y_quant)]
    return out


def lstm(L: Lowering, node) -> None:
    """ONNX LSTM -> one UNIDIRECTIONAL_SEQUENCE_LSTM per direction (see the module docstring)."""
    direction = proto_attr(node, "direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    directions = 2 if direction == "bidirectional" else 1
    x = L.value(node.input[0])
    if len(x.shape) != 3:
        raise L.refuse(f"an LSTM input of rank {len(x.shape)} (ONNX's is [T, B, I] or [B, T, I])")
    time_major = proto_attr(node, "layout", 0) == 0
    hidden = int(proto_attr(node, "hidden_size", L.constant(node.input[2]).shape[-1]))
    _check(L, node, directions, x.shape[0 if time_major else 1])
    prefix = node.name or node.output[0]
    y_onnx = L.new_value(node.output[0])  # [T, D, B, H] (or [B, T, D, H]), stored NHWC
    dtype = np.int8 if L.g.quantised else np.float32
    time_axis = 0 if time_major else 1
    outs = []
    for d in range(directions):
        backward = direction == "reverse" or d == 1
        name = f"{prefix}/{'backward' if backward else 'forward'}"
        seq = _reverse(L, x.index, time_axis, f"{name}/x_reversed", dtype, x.quant) if backward else x.index
        y = _direction(L, node, x, seq, d, hidden, time_major, name, y_onnx.quant)
        outs.append(_reverse(L, y, time_axis, f"{name}/y_in_time", dtype, y_onnx.quant) if backward else y)
    steps = L.w.shape(outs[0])[:2]
    packed = y_onnx if time_major else L.temp(y_onnx, f"{prefix}/y_packed", shape=(*steps, hidden, directions),
                                               layout=(0, 1, 2, 3))
    L.w.op(OP.PACK, outs, [packed.index], make_options(schema.PackOptionsT, valuesCount=len(outs), axis=3),
           OPT.PackOptions)
    if not time_major:  # [B, T, H, D] -> Y's NHWC order [B, D, H, T]
        perm = L.int_tensor(f"{prefix}/perm", [0, 3, 2, 1])
        L.w.op(OP.TRANSPOSE, [packed.index, perm], [y_onnx.index], make_options(schema.TransposeOptionsT),
               OPT.TransposeOptions)
