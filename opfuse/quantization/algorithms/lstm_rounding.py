"""An LSTM's weights on the grid of an integer LSTM kernel, rounded with GPTQ's error feedback.

For a target whose LSTM is integer where ONNX Runtime's quantiser leaves it float (the ``ethos-u``
device: TFLite's 8x8->16 UNIDIRECTIONAL_SEQUENCE_LSTM, :mod:`opfuse.targets.ethos_u.tflite_lstm`).
That kernel reads one scale per gate matrix (``params.scale`` of each input_to_* and recurrent_to_*
tensor: no per-channel form), so a matrix's largest weight sets the step of all 512x512 others;
rounded to nearest, that is what costs ddddocr's recogniser its integer LSTM (docs/results/ethos_u.md).

The grid: each gate's input matrix (a row block ``W[d]`` ``[H, I]`` of ONNX's ``W``, gates i, o, f, c)
and recurrent matrix (``R[d]`` ``[H, H]``) int8 symmetric with ``s = max|M| / 127``, the lowering's.

The rounding (GPTQ, Frantar et al. 2022, on that fixed grid): the columns of ``M`` are rounded one at
a time and each column's error is spread onto the columns not yet rounded through the inverse of
``Hs = E[x x^T] + damp`` (damped more when the data are fewer than the columns: :data:`DAMP_FEW`),
``x`` the matrix's input on the calibration samples: the LSTM's input ``X`` for ``W``, the float
LSTM's previous hidden state for ``R`` (``Y`` one step back in the direction's order, zero before the
first step). That minimises ``E||(M - Mq) x||^2`` column by column instead of
``||M - Mq||^2`` entry by entry. The column holding ``max|M|`` goes first, so it lands on ``±127``
exactly and nothing else passes it (clipped): ``max|Mq| / 127`` is ``s`` again, and the lowering's
round to nearest of ``Mq`` gives back these integers.

Written: the QDQ model's ``W`` and ``R`` become those values (float32 on the grid), so ONNX Runtime
runs its float LSTM with the integer weights the TFLite will have (:func:`apply_rounded`).

Legality: an LSTM whose ``W`` and ``R`` are initializers of the float model; any other is left as it
is, with the reason in the returned records. A gate matrix of at most 255 distinct values is int8
already (a dynamic int8 LSTM dequantised, as ddddocr's common_old, one scale per direction): it is
left as the model has it, whose few levels Vela's weight compression keeps small (re-rounded, they
cost cycles for no SQNR: docs/results/measurements.md).
"""

from __future__ import annotations

__all__ = ["round_lstm_weights", "apply_rounded", "gptq_round", "DAMP", "DAMP_FEW"]

import numpy as np
import onnx
from onnx import numpy_helper

from opfuse.core.ops import proto_attr

# The Hessian's damping, times the mean of its diagonal: GPTQ's 0.01 with at least DENSE input vectors per
# column, DAMP_FEW with fewer. An LSTM's calibration may give fewer vectors than columns (ddddocr common: 6 tuning
# samples x 40 steps = 240 for 512): the estimate is rank deficient and 0.01 fits the rounding to the
# calibration's subspace; a stronger damping holds the rounding nearer the grid's own (the measurements that chose
# 0.3: docs/results/measurements.md). With many vectors (the tests' tail: 256 for 24 columns) 0.01 does best.
DAMP, DAMP_FEW, DENSE = 0.01, 0.3, 2
MAX_VECTORS = 4096  # input vectors per matrix the Hessian is estimated from


def gptq_round(m: np.ndarray, x: np.ndarray, damp: float | None = None) -> np.ndarray:
    """``m`` ``[rows, cols]`` rounded to int8 symmetric with one scale ``max|m| / 127`` (returned as
    the integers), each column's error spread onto the later columns by ``x`` ``[n, cols]``'s Hessian
    (damped by ``damp``; by default :data:`DAMP`, or :data:`DAMP_FEW` with fewer than ``DENSE`` vectors
    per column)."""
    m = np.asarray(m, np.float64)
    if damp is None:
        damp = DAMP if len(x) >= DENSE * m.shape[1] else DAMP_FEW
    peak = float(np.max(np.abs(m))) if m.size else 0.0
    if peak == 0.0:
        return np.zeros(m.shape, np.int8)
    scale = peak / 127.0
    first = int(np.unravel_index(np.argmax(np.abs(m)), m.shape)[1])
    order = np.array([first, *(j for j in range(m.shape[1]) if j != first)])
    x = np.asarray(x, np.float64)[:, order]
    hessian = x.T @ x / max(len(x), 1)
    hessian += damp * max(float(np.mean(np.diag(hessian))), 1e-12) * np.eye(len(hessian))
    upper = np.linalg.cholesky(np.linalg.inv(hessian)).T  # GPTQ's Cholesky form of H^-1
    w = m[:, order].copy()
    q = np.zeros(w.shape)
    for j in range(w.shape[1]):
        q[:, j] = np.clip(np.round(w[:, j] / scale), -127, 127)
        err = (w[:, j] - q[:, j] * scale) / upper[j, j]
        w[:, j + 1:] -= np.outer(err, upper[j, j + 1:])
    out = np.empty_like(q)
    out[:, order] = q
    return out.astype(np.int8)


def _activations(float_model: onnx.ModelProto, samples: list[dict], names: list[str]) -> list[list[np.ndarray]]:
    from opfuse.runtime import create_session  # (ONNX Runtime: only when an LSTM is rounded)

    model = onnx.ModelProto()
    model.CopyFrom(float_model)
    have = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in have)
    session = create_session(model)
    return [session.run(names, dict(s)) for s in samples]


def round_lstm_weights(float_model: onnx.ModelProto, samples: list[dict]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Each LSTM's ``W`` and ``R`` rounded on the integer kernel's grid from the float model's
    activations on ``samples``: ``{initializer name: float32 values}`` and one record per LSTM."""
    inits = {t.name: t for t in float_model.graph.initializer}
    lstms = [n for n in float_model.graph.node if n.op_type == "LSTM"]
    records, wanted = [], []
    for node in lstms:
        if node.input[1] not in inits or node.input[2] not in inits:
            records.append(f"{node.name}: W or R is computed, not an initializer; its weights are left as they are")
        else:
            wanted.append(node)
    if not wanted:
        return {}, records
    names = [n for node in wanted for n in (node.input[0], node.output[0])]
    runs = _activations(float_model, samples, names)
    rounded = {}
    for k, node in enumerate(wanted):
        layout = proto_attr(node, "layout", 0)
        direction = proto_attr(node, "direction", b"forward")
        direction = direction.decode() if isinstance(direction, bytes) else direction
        xs = [r[2 * k] for r in runs]
        ys = [r[2 * k + 1] for r in runs]
        if layout == 1:  # [B, T, I] -> [T, B, I]; [B, T, D, H] -> [T, D, B, H]
            xs = [x.transpose(1, 0, 2) for x in xs]
            ys = [y.transpose(1, 2, 0, 3) for y in ys]
        w, r = numpy_helper.to_array(inits[node.input[1]]), numpy_helper.to_array(inits[node.input[2]])
        hidden = r.shape[-1]
        x_rows = np.concatenate([x.reshape(-1, x.shape[-1]) for x in xs])[:MAX_VECTORS]
        new_w, new_r = np.array(w, np.float32), np.array(r, np.float32)
        rounded_count = kept = 0
        for d in range(w.shape[0]):
            backward = direction == "reverse" or d == 1
            h_prev = []
            for y in ys:  # [T, D, B, H]: the state each step read
                h = y[:, d]
                zero = np.zeros_like(h[:1])
                h_prev.append(np.concatenate([h[1:], zero]) if backward else np.concatenate([zero, h[:-1]]))
            h_rows = np.concatenate([h.reshape(-1, hidden) for h in h_prev])[:MAX_VECTORS]
            for g in range(4):
                rows = slice(g * hidden, (g + 1) * hidden)
                for matrix, inputs, out in ((w[d, rows], x_rows, new_w), (r[d, rows], h_rows, new_r)):
                    if len(np.unique(matrix)) <= 255:  # int8 already: the model's own weights
                        kept += 1
                        continue
                    scale = float(np.max(np.abs(matrix))) / 127.0
                    out[d, rows] = gptq_round(matrix, inputs).astype(np.float64) * scale
                    rounded_count += 1
        if rounded_count:
            rounded[node.input[1]], rounded[node.input[2]] = new_w, new_r
        done = (f"{rounded_count} gate matrices of W and R rounded on one int8 scale each (GPTQ, {len(x_rows)} "
                f"input vectors)") if rounded_count else ""
        left = f"{kept} left as they are, int8 already (at most 255 values)" if kept else ""
        records.append(f"{node.name}: " + "; ".join(p for p in (done, left) if p))
    return rounded, records


def apply_rounded(model: onnx.ModelProto, rounded: dict[str, np.ndarray]) -> None:
    """The initializers of ``model`` named in ``rounded`` replaced by its values (in place)."""
    for t in model.graph.initializer:
        if t.name in rounded:
            t.CopyFrom(numpy_helper.from_array(rounded[t.name].astype(np.float32), t.name))
