"""Signal-to-quantisation-noise ratio: how far the QDQ model's values are from the float ones.

    SQNR = 10 * log10( sum f^2 / sum (q - f)^2 )   in dB, over every element of every sample

the definition of ONNX Runtime's ``qdq_loss_debug.compute_signal_to_quantization_noice_ratio``
(20 log10 of the norm ratio), accumulated sample by sample instead of keeping every tensor
of every sample in memory as its ``collect_activations`` does (a MobileNetV2 at 224x224
holds about 30 MB of activations per sample).

Where values are compared follows ONNX Runtime's matching (``create_activation_matching``):
a float tensor ``X`` against the QDQ model's value after ``DequantizeLinear`` (what the next
layer reads). :func:`measure` runs both models with the wanted tensors exposed as extra
outputs, with graph optimisations off so every tensor exists.

A layer's **cost** is the noise it adds: its output's noise-to-signal ratio minus its
worst input's (per channel, :meth:`Accumulator.channel_db`), shown as the SQNR that noise
alone would have (lower is costlier). A graph input counts as its quantised self (the
layer's input DequantizeLinear). The mixed-precision search keeps the costliest layers
out of int8.

An SQNR judges a quantisation only where the float outputs span the int8 output's steps. An
output's step is the larger of its ``DequantizeLinear``'s scale and, where a bounded op writes
it (an op with an ``output_range`` in :data:`opfuse.core.ops.OPS`: a Sigmoid's or Softmax's
probabilities in [0, 1]), 1/256 of that op's range: the finest step an int8 probability has
(TFLite fixes a LOGISTIC's and a SOFTMAX's output scale at 1/256). Where the float model's
outputs on the samples are smaller than one step (a text detector's probability map on random
inputs: about 1e-6, nothing detected anywhere), what the SQNR measures is the error in the
bounded op's saturated tail, far below what an int8 output resolves, whatever the quantiser
did. :func:`below_output_step` says when that is so.

**Padded samples.** A sample whose attention mask (a rank-2 input named ``*attention_mask*``, of 0 and 1)
holds zeros is a padded batch: a decoder's prompt left-padded into a fixed-size prefill. Its values at
padded positions are undefined (:mod:`opfuse.verify`, "Padded batches": the export's guard, Attention-23 on
ONNX Runtime's CPU and on an NPU each give their own at a fully masked query) and reach no real token, so
every SQNR here counts such a sample only where it is defined (:func:`defined_in`,
:func:`opfuse.verify.inputs.defined_positions`: the elements at real positions); a sample without padding
counts whole.
"""

from __future__ import annotations

__all__ = ["three_way", "sqnr_db", "Accumulator", "measure", "output_sqnr", "Runner", "OutputReference",
           "outputs_db", "padding_of", "defined_in",
           "layer_costs", "layer_pairs", "below_output_step", "output_steps"]

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from opfuse.core.ops import OpInfo, OpKind, op_info
from opfuse.quantization.calibration import run_sample
from opfuse.quantization.qdq.layers import QdqLayer, exposed
from opfuse.runtime import create_session
from opfuse.verify.inputs import defined_positions

INFINITE = 200.0  # dB shown for an exact match

# what runs a candidate model: ``runner(model, samples) -> every graph output per sample``
Runner = Callable[[onnx.ModelProto, Sequence[Mapping[str, np.ndarray]]], list[list[np.ndarray]]]


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise), within +-:data:`INFINITE`; a NaN or infinite sum (a model
    that computes NaN or overflows) is the worst, never a pass."""
    if not (math.isfinite(signal) and math.isfinite(noise)):
        return -INFINITE
    if noise <= 0.0:
        return INFINITE
    if signal <= 0.0:
        return -INFINITE
    return min(INFINITE, 10.0 * math.log10(signal / noise))


def padding_of(sample: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """The sample's attention mask ([rows, T] of 0 and 1, a rank-2 input named ``*attention_mask*``; the
    encoder's before a decoder's) when it holds a 0; None when the sample pads nothing."""
    for name in sorted((n for n in sample if "attention_mask" in n.lower()), key=lambda n: "decoder" in n.lower()):
        value = np.asarray(sample[name])
        if value.ndim == 2 and value.size and not value.all() and np.isin(value, (0, 1)).all():
            return value
    return None


def defined_in(sample: Mapping[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray | None:
    """Where a tensor of ``shape`` computed from ``sample`` is defined (module docstring); None: everywhere."""
    mask = padding_of(sample)
    return None if mask is None else defined_positions(tuple(shape), mask)


class Accumulator:
    """Running sums of f^2 and (q - f)^2 per name, in total and per channel.

    The per-channel form (:meth:`channel_db`) judges a layer by its channels alike: the
    energy SQNR of a tensor is that of its loudest channels, so a layer whose per-tensor
    weights wipe out its quiet channels (one large channel sets the scale) would look fine
    at its own output and the next layer would take the blame.
    """

    def __init__(self):
        self.signal: dict[str, float] = {}
        self.noise: dict[str, float] = {}
        self._channel_signal: dict[str, np.ndarray] = {}
        self._channel_noise: dict[str, np.ndarray] = {}

    def add(self, name: str, reference: np.ndarray, approx: np.ndarray, axis: int | None = None,
            where: np.ndarray | None = None) -> None:
        """``where``: the elements that count (a padded sample's defined ones), the rest as 0 in both."""
        f = np.asarray(reference, dtype=np.float64)
        q = np.asarray(approx, dtype=np.float64)
        if f.shape != q.shape:
            raise ValueError(f"{name}: shapes {f.shape} and {q.shape} differ")
        if where is not None:
            f, q = np.where(where, f, 0.0), np.where(where, q, 0.0)
        f2, e2 = f * f, (q - f) ** 2
        self.signal[name] = self.signal.get(name, 0.0) + float(np.sum(f2))
        self.noise[name] = self.noise.get(name, 0.0) + float(np.sum(e2))
        if axis == -1 and f.ndim >= 4:
            axis = 1  # an NCHW tensor around an element-wise layer
        if axis is not None and f.ndim >= 2:
            axes = tuple(a for a in range(f.ndim) if a != axis % f.ndim)
            cs, cn = f2.sum(axis=axes), e2.sum(axis=axes)
            if name in self._channel_signal and self._channel_signal[name].shape == cs.shape:
                cs, cn = cs + self._channel_signal[name], cn + self._channel_noise[name]
            self._channel_signal[name], self._channel_noise[name] = cs, cn

    def db(self, name: str) -> float:
        return sqnr_db(self.signal[name], self.noise[name])

    def channel_db(self, name: str) -> float:
        """SQNR of the mean noise-to-signal ratio over the channels that carry signal
        (each capped at 1: a channel cannot be worse than all noise)."""
        if name not in self._channel_signal:
            return self.db(name)
        s, n = self._channel_signal[name], self._channel_noise[name]
        live = s > 1e-12 * max(float(s.max()), 1e-300)
        if not live.any():
            return self.db(name)
        ratio = float(np.minimum(n[live] / s[live], 1.0).mean())
        if not math.isfinite(ratio):
            return -INFINITE
        return INFINITE if ratio <= 0 else min(INFINITE, -10.0 * math.log10(ratio))

    def total_db(self, names: Iterable[str]) -> float:
        names = list(names)
        return sqnr_db(sum(self.signal[n] for n in names), sum(self.noise[n] for n in names))


def measure(
    float_model: onnx.ModelProto,
    qdq_model: onnx.ModelProto,
    samples: Iterable[Mapping[str, np.ndarray]],
    pairs: Mapping[str, tuple],
    *,
    qdq_level: str = "disabled",
    first_index: int = 0,
) -> Accumulator:
    """SQNR accumulators for ``pairs`` (label -> (float tensor, QDQ tensor[, channel
    axis])) over ``samples`` (numbered from ``first_index`` in messages)."""
    float_names = sorted({p[0] for p in pairs.values()})
    qdq_names = sorted({p[1] for p in pairs.values()})
    ref = create_session(exposed(float_model, float_names), "disabled")
    got = create_session(exposed(qdq_model, qdq_names), qdq_level)
    acc = Accumulator()
    for index, sample in enumerate(samples, first_index):
        f = dict(zip(float_names, run_sample(ref, float_names, dict(sample), index)))
        q = dict(zip(qdq_names, got.run(qdq_names, dict(sample))))
        for label, (fn, qn, *axis) in pairs.items():
            acc.add(label, f[fn], q[qn], axis[0] if axis else None, where=defined_in(sample, np.shape(f[fn])))
    return acc


def output_sqnr(float_model: onnx.ModelProto, qdq_model: onnx.ModelProto, samples, *, qdq_level="disabled",
                first_index: int = 0):
    """(per-output SQNR in dB, SQNR over all outputs) of the graph outputs."""
    names = [o.name for o in float_model.graph.output]
    acc = measure(float_model, qdq_model, samples, {n: (n, n) for n in names}, qdq_level=qdq_level,
                  first_index=first_index)
    return {n: acc.db(n) for n in names}, acc.total_db(names)


def outputs_db(names: Sequence[str], references, outputs, samples: Sequence[Mapping] | None = None) -> float:
    """SQNR in dB over every graph output ``names`` of every sample: ``references`` and
    ``outputs`` hold one list of arrays per sample, in the order of ``names``; ``samples`` (the
    inputs, in the same order): a padded one counts where defined."""
    acc = Accumulator()
    for index, (ref, got) in enumerate(zip(references, outputs)):
        sample = samples[index] if samples is not None else {}
        for name, f, q in zip(names, ref, got):
            acc.add(name, f, q, where=defined_in(sample, np.shape(f)))
    return acc.total_db(names)


class OutputReference:
    """The one scorer of candidate QDQ models: the float model's graph outputs on a set of
    samples, computed once (by ONNX Runtime's CPU at ``level``), and :meth:`sqnr`, the output
    SQNR of a candidate against them over every output and sample.

    A candidate runs on ``runner`` (:data:`Runner`), ONNX Runtime's CPU when None; a backend
    whose numerics differ (an NPU's) passes its own, and whatever judges through this object
    (the mixed-precision search's ranking, acceptance and stopping; AdaRound's, bias
    correction's and block reconstruction's "did the output SQNR rise") is then judged on it.
    :meth:`head` and :meth:`on` give the same reference on fewer samples or another runner,
    without running the float model again."""

    def __init__(self, float_model: onnx.ModelProto, samples, level: str = "disabled",
                 runner: Runner | None = None):
        self.samples = [dict(s) for s in samples]
        self.names = [o.name for o in float_model.graph.output]
        self.runner = runner
        session = create_session(float_model, level)
        self.values = [run_sample(session, self.names, s, i) for i, s in enumerate(self.samples)]

    def _like(self, samples: list, values: list, runner: Runner | None) -> "OutputReference":
        like = object.__new__(OutputReference)
        like.samples, like.names, like.values, like.runner = samples, self.names, values, runner
        return like

    def head(self, count: int) -> "OutputReference":
        """The same reference on its first ``count`` samples (nothing is run again)."""
        return self._like(self.samples[:count], self.values[:count], self.runner)

    def on(self, runner: Runner | None) -> "OutputReference":
        """The same reference with candidates run by ``runner`` (None: ONNX Runtime's CPU)."""
        return self._like(self.samples, self.values, runner)

    def sqnr(self, qdq_model: onnx.ModelProto, level: str = "disabled") -> float:
        """SQNR over all outputs and samples of ``qdq_model``, in dB: run by the runner, or by
        ONNX Runtime's CPU at ``level`` without one."""
        if self.runner is not None:
            outputs = self.runner(qdq_model, self.samples)
        else:
            session = create_session(qdq_model, level)
            outputs = [run_sample(session, self.names, s, i) for i, s in enumerate(self.samples)]
        return outputs_db(self.names, self.values, outputs, self.samples)


def output_steps(float_model: onnx.ModelProto, qdq_model: onnx.ModelProto) -> dict[str, float]:
    """Graph output -> one int8 step of it (module docstring): the scale of the ``DequantizeLinear``
    that writes it in ``qdq_model`` (its largest), or 1/256 of the ``output_range`` of the op that
    writes it in ``float_model``, whichever is larger; outputs with neither are left out."""
    constants = {t.name: t for t in qdq_model.graph.initializer}
    constants.update({n.output[0]: a.t for n in qdq_model.graph.node if n.op_type == "Constant"
                      for a in n.attribute if a.name == "value"})
    outputs = {o.name for o in qdq_model.graph.output}
    steps = {n.output[0]: float(np.max(np.abs(numpy_helper.to_array(constants[n.input[1]]))))
             for n in qdq_model.graph.node
             if n.op_type == "DequantizeLinear" and n.output[0] in outputs and n.input[1] in constants}
    for node in float_model.graph.node:
        for name in set(node.output) & outputs:
            bounds = (op_info(node) or OpInfo(OpKind.OPAQUE)).output_range
            if bounds is not None:
                steps[name] = max(steps.get(name, 0.0), (bounds[1] - bounds[0]) / 256)
    return steps


def below_output_step(float_model: onnx.ModelProto, qdq_model: onnx.ModelProto, samples) -> str | None:
    """A sentence when every graph output of ``float_model`` on ``samples`` has an RMS below one
    int8 step of the quantised output (module docstring: the SQNR then cannot judge), else None."""
    steps = output_steps(float_model, qdq_model)
    names = [o.name for o in float_model.graph.output]
    if not samples or not names or any(n not in steps for n in names):
        return None
    session = create_session(float_model, "disabled")
    squares = dict.fromkeys(names, 0.0)
    count = dict.fromkeys(names, 0)
    for i, sample in enumerate(samples):
        for name, value in zip(names, run_sample(session, names, dict(sample), i)):
            value = np.asarray(value, np.float64)
            squares[name] += float(np.sum(value * value))
            count[name] += value.size
    rms = {n: math.sqrt(squares[n] / max(count[n], 1)) for n in names}
    if any(rms[n] >= steps[n] for n in names):
        return None
    shown = ", ".join(f"{n}: RMS {rms[n]:.2g} under a step of {steps[n]:.2g}" for n in names[:3])
    return (f"the float model's outputs on these {len(samples)} sample(s) are below one int8 step of the "
            f"output ({shown}), so the SQNR measures errors finer than an int8 output resolves and cannot "
            "judge the quantisation; calibrate and verify on inputs that exercise the model (real samples)")


def layer_costs(layers: list[QdqLayer], acc: Accumulator) -> dict[str, tuple[float, float]]:
    """name -> (SQNR of its output, SQNR of the noise it adds), in dB, from an accumulator
    over the values labelled ``in:TENSOR`` and ``out:TENSOR`` (:func:`layer_pairs`).

    The noise a layer adds is its output's noise-to-signal ratio minus its worst
    input's, both per channel: noise ratios add up through a network roughly linearly,
    their decibels do not (the first layer's drop from an exact input is large in dB and
    small in what reaches the output).
    """
    result = {}
    for layer in layers:
        outs = [acc.channel_db(f"out:{f}") for f, _ in layer.outputs if f"out:{f}" in acc.signal]
        if not outs:
            continue
        ins = [acc.channel_db(f"in:{f}") for f, _ in layer.inputs if f"in:{f}" in acc.signal]
        out_db = min(outs)
        added = 10 ** (-out_db / 10) - (10 ** (-min(ins) / 10) if ins else 0.0)
        result[layer.name] = (out_db, INFINITE if added <= 0 else min(INFINITE, -10 * math.log10(added)))
    return result


def layer_pairs(layers: list[QdqLayer]) -> dict[str, tuple[str, str, int]]:
    """label -> (float tensor, QDQ tensor, channel axis) for every layer's inputs and
    outputs: axis 1 around convolutions (NCHW), the last axis elsewhere (a MatMul's
    features; axis 1 too for rank 4 and more)."""
    pairs = {}
    for layer in layers:
        axis = 1 if layer.op_type in CHANNEL_FIRST else -1
        for f, q in layer.inputs:
            pairs.setdefault(f"in:{f}", (f, q, axis))
        for f, q in layer.outputs:
            pairs.setdefault(f"out:{f}", (f, q, axis))
    return pairs


CHANNEL_FIRST = ("Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool", "Resize",
                 "BatchNormalization", "InstanceNormalization")


def three_way(float_model: onnx.ModelProto, qdq_model: onnx.ModelProto, samples: Sequence[Mapping[str, np.ndarray]],
              on_device: Sequence[Sequence[np.ndarray]], names: Sequence[str]
              ) -> tuple[float, float, float, dict[str, float]]:
    """A device's run of ``qdq_model`` judged three ways over ``samples`` (``on_device``: its
    outputs ``names`` per sample): the device against float, the QDQ model on ONNX Runtime's
    CPU (all optimisations: its int8 kernels) against float, and the device against that CPU
    run; with the device against float per output. The float reference runs unoptimised."""
    reference = create_session(float_model, "disabled")
    cpu = create_session(qdq_model, "all")
    device_float, cpu_float, device_cpu = Accumulator(), Accumulator(), Accumulator()
    for sample, device in zip(samples, on_device):
        f = reference.run(list(names), dict(sample))
        q = cpu.run(list(names), dict(sample))
        for name, fv, qv, dv in zip(names, f, q, device):
            where = defined_in(sample, np.shape(fv))
            device_float.add(name, fv, dv, where=where)
            cpu_float.add(name, fv, qv, where=where)
            device_cpu.add(name, qv, dv, where=where)
    return (device_float.total_db(names), cpu_float.total_db(names), device_cpu.total_db(names),
            {n: device_float.db(n) for n in names})
