"""The graph builder the built-in networks are written with, and how it calibrates BatchNorm.

A :class:`GraphBuilder` appends ONNX nodes and their initializers one layer at a time
(``conv``, ``batchnorm``, ``relu``, ``relu6``, ``add``, ...) and hands back a
:class:`Value` (a tensor name plus its channel count) to chain the next layer on. Node
names are the torchvision-style module paths the network files pass in; every node's
single output tensor carries the node's own name (the final one can be renamed, e.g. to
``logits``); initializers are ``<node>.weight``, ``<node>.bias``, ``<node>.running_mean``...

Weights are drawn from ``numpy.random.default_rng`` seeded by the caller, so a network is
a deterministic function of its arguments:

- conv weights: He (Kaiming) normal, std = sqrt(2 / fan) with fan_in = C_in/group * k * k
  or fan_out = C_out/group * k * k; conv biases U(-0.1, 0.1);
- Gemm weights N(0, 1/fan_in), biases U(-0.1, 0.1);
- BatchNorm gamma U(0.5, 1.5) (a caller-chosen smaller range for the last BN of a residual
  branch), beta N(0, 0.1), and running statistics *calibrated*: a BatchNormalization's
  running_mean / running_var are the per-channel mean / variance that its input really has
  when the network is fed a standard-normal probe batch, then perturbed a little
  (mean + N(0, 0.1) * std, var * exp(U(-0.2, 0.2))). Each BN therefore roughly
  normalises its input, and activations neither explode nor vanish with depth.

Calibration runs lazily: the probe batch (``CALIBRATION_SHAPE``, fixed, independent of the
model's image size and batch, so those do not change the weights) is pushed through the
nodes appended so far only when a BatchNormalization needs the statistics of its input.
Each node is evaluated as a one-node float32 onnxruntime session, single-threaded; the
measured statistics are rounded to 10 mantissa bits so that the last-bit differences of
different CPUs' kernels do not leak into the weights. A network without BatchNorm (VGG)
never runs a session.

:meth:`GraphBuilder.to_model` casts every initializer to the requested dtype and wraps the
graph in a ModelProto with the oldest IR version that can carry the opset.
"""

from __future__ import annotations

__all__ = ["CALIBRATION_SHAPE", "GraphBuilder", "Value"]

import dataclasses
from typing import Literal

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

# The probe batch BatchNorm statistics are measured on: N, C, H, W.
CALIBRATION_SHAPE = (2, 3, 128, 128)

DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}

# Oldest opset the builder writes: BatchNormalization-9 (no `spatial`), Clip-6 attributes.
MIN_OPSET = 9
# Clip takes min / max as inputs from opset 11 on, as attributes before.
CLIP_INPUTS_OPSET = 11

DEFAULT_GAMMA = (0.5, 1.5)
STAT_MANTISSA_BITS = 10


@dataclasses.dataclass(frozen=True)
class Value:
    """A tensor in the graph being built: its name and its channel count (axis 1)."""

    name: str
    channels: int


class GraphBuilder:
    """Appends layers to one ONNX graph; see the module docstring for the weight recipe."""

    def __init__(self, *, seed: int, opset: int, in_channels: int = 3) -> None:
        if opset < MIN_OPSET:
            raise ValueError(f"opset {opset} is too old: the built-in models need >= {MIN_OPSET}")
        weight_seed, probe_seed = np.random.SeedSequence(seed).spawn(2)
        self.rng = np.random.default_rng(weight_seed)
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, np.ndarray] = {}
        self.input = Value("input", in_channels)

        self._channels: dict[str, int] = {self.input.name: in_channels}
        self._node_names: set[str] = set()
        self._probe_input = np.random.default_rng(probe_seed).standard_normal(
            (CALIBRATION_SHAPE[0], in_channels, *CALIBRATION_SHAPE[2:]), dtype=np.float32
        )
        self._probes: dict[str, np.ndarray] | None = None  # filled on first need
        self._evaluated = 0  # nodes[:_evaluated] have their probe outputs in _probes

    # ----------------------------------------------------------------------------- layers

    def conv(
        self,
        x: Value,
        name: str,
        out_channels: int,
        kernel: int,
        *,
        stride: int = 1,
        group: int = 1,
        bias: bool = False,
        fan: Literal["fan_in", "fan_out"] = "fan_out",
    ) -> Value:
        """Conv with 'same'-style padding kernel // 2, He-normal weight, optional bias."""
        if x.channels % group or out_channels % group:
            raise ValueError(
                f"{name}: channels {x.channels}->{out_channels} not divisible by group {group}"
            )
        fan_size = (x.channels if fan == "fan_in" else out_channels) // group * kernel * kernel
        weight_shape = (out_channels, x.channels // group, kernel, kernel)
        weight = self.rng.normal(0.0, np.sqrt(2.0 / fan_size), weight_shape)
        inputs = [self._weight(f"{name}.weight", weight)]
        if bias:
            inputs.append(self._weight(f"{name}.bias", self.rng.uniform(-0.1, 0.1, out_channels)))
        pad = kernel // 2
        return self._append(
            "Conv", [x.name, *inputs], name, out_channels,
            kernel_shape=[kernel, kernel], strides=[stride, stride],
            pads=[pad, pad, pad, pad], dilations=[1, 1], group=group,
        )

    def batchnorm(
        self,
        x: Value,
        name: str,
        *,
        epsilon: float = 1e-5,
        gamma: tuple[float, float] = DEFAULT_GAMMA,
    ) -> Value:
        """Inference BatchNormalization whose running statistics are calibrated on the probe."""
        mean, var = self._channel_statistics(x)
        c = x.channels
        scale = self.rng.uniform(*gamma, c)
        shift = self.rng.normal(0.0, 0.1, c)
        running_mean = mean + self.rng.normal(0.0, 0.1, c) * np.sqrt(var)
        running_var = var * np.exp(self.rng.uniform(-0.2, 0.2, c))
        inputs = [
            self._weight(f"{name}.weight", scale),
            self._weight(f"{name}.bias", shift),
            self._weight(f"{name}.running_mean", running_mean),
            self._weight(f"{name}.running_var", running_var),
        ]
        return self._append("BatchNormalization", [x.name, *inputs], name, c, epsilon=epsilon)

    def relu(self, x: Value, name: str) -> Value:
        return self._append("Relu", [x.name], name, x.channels)

    def relu6(self, x: Value, name: str) -> Value:
        """ReLU6 as Clip(0, 6): constant inputs from opset 11, attributes before."""
        if self.opset >= CLIP_INPUTS_OPSET:
            bounds = [
                self._weight("relu6.min", np.array(0.0)),
                self._weight("relu6.max", np.array(6.0)),
            ]
            return self._append("Clip", [x.name, *bounds], name, x.channels)
        return self._append("Clip", [x.name], name, x.channels, min=0.0, max=6.0)

    def add(self, a: Value, b: Value, name: str) -> Value:
        if a.channels != b.channels:
            raise ValueError(f"{name}: cannot add {a.channels} and {b.channels} channels")
        return self._append("Add", [a.name, b.name], name, a.channels)

    def maxpool(self, x: Value, name: str, kernel: int, *, stride: int, pad: int = 0) -> Value:
        return self._append(
            "MaxPool", [x.name], name, x.channels,
            kernel_shape=[kernel, kernel], strides=[stride, stride], pads=[pad, pad, pad, pad],
        )

    def global_average_pool(self, x: Value, name: str) -> Value:
        return self._append("GlobalAveragePool", [x.name], name, x.channels)

    def flatten(self, x: Value, name: str) -> Value:
        return self._append("Flatten", [x.name], name, x.channels, axis=1)

    def gemm(self, x: Value, name: str, out_features: int, *, output: str | None = None) -> Value:
        """Fully connected layer, torch.nn.Linear layout: weight [out, in], transB=1, bias."""
        weight = self.rng.normal(0.0, np.sqrt(1.0 / x.channels), (out_features, x.channels))
        inputs = [
            self._weight(f"{name}.weight", weight),
            self._weight(f"{name}.bias", self.rng.uniform(-0.1, 0.1, out_features)),
        ]
        return self._append("Gemm", [x.name, *inputs], name, out_features, output=output, transB=1)

    # ------------------------------------------------------------------------------ model

    def to_model(
        self,
        output: Value,
        *,
        graph_name: str,
        doc_string: str,
        batch: int | str,
        image_size: int,
        dtype: str,
        producer_version: str = "",
    ) -> onnx.ModelProto:
        """The finished ModelProto with every initializer cast to ``dtype``."""
        elem_type = DTYPES[dtype]
        np_dtype = helper.tensor_dtype_to_np_dtype(elem_type)
        graph = helper.make_graph(
            self.nodes,
            graph_name,
            [helper.make_tensor_value_info(
                self.input.name, elem_type, [batch, self.input.channels, image_size, image_size])],
            [helper.make_tensor_value_info(output.name, elem_type, [batch, output.channels])],
            initializer=[
                numpy_helper.from_array(array.astype(np_dtype), name)
                for name, array in self.initializers.items()
            ],
            doc_string=doc_string,
        )
        opset_imports = [helper.make_opsetid("", self.opset)]
        model = helper.make_model(
            graph,
            opset_imports=opset_imports,
            ir_version=helper.find_min_ir_version_for(opset_imports),
            producer_name="opfuse.models",
            producer_version=producer_version,
            doc_string=doc_string,
        )
        return model

    # --------------------------------------------------------------------------- plumbing

    def _weight(self, name: str, array: np.ndarray) -> str:
        """Registers a float initializer (kept in float32 until ``to_model``); returns its name."""
        if name in self.initializers:
            return name  # shared constant such as relu6.min
        self.initializers[name] = np.asarray(array, dtype=np.float32)
        return name

    def _append(
        self, op_type: str, inputs: list[str], name: str, channels: int,
        *, output: str | None = None, **attributes,
    ) -> Value:
        if name in self._node_names:
            raise ValueError(f"duplicate node name {name!r}")
        output = output or name
        if output in self._channels or output in self.initializers:
            raise ValueError(f"duplicate tensor name {output!r}")
        self._node_names.add(name)
        self._channels[output] = channels
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=name, **attributes))
        return Value(output, channels)

    def _channel_statistics(self, x: Value) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel mean and variance of ``x`` on the probe batch, rounded (see module doc)."""
        probe = self._probe(x).astype(np.float64)
        axes = (0, *range(2, probe.ndim))
        mean = _round_mantissa(probe.mean(axis=axes))
        var = _round_mantissa(np.maximum(probe.var(axis=axes), 1e-6))
        return mean, var

    def _probe(self, x: Value) -> np.ndarray:
        """The value of ``x`` on the probe batch, evaluating appended nodes in order as needed."""
        if self._probes is None:
            self._probes = {self.input.name: self._probe_input}
        while x.name not in self._probes:
            node = self.nodes[self._evaluated]
            self._probes[node.output[0]] = self._evaluate(node)
            self._evaluated += 1
        return self._probes[x.name]

    def _evaluate(self, node: onnx.NodeProto) -> np.ndarray:
        """Runs one node as a float32 onnxruntime session on the probes of its inputs."""
        feeds = {name: self._probes[name] for name in node.input if name in self._probes}
        constants = [
            numpy_helper.from_array(self.initializers[name], name)
            for name in node.input if name not in self._probes
        ]
        graph = helper.make_graph(
            [node],
            f"probe_{node.name}",
            [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in feeds],
            [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)],
            initializer=constants,
        )
        opset_imports = [helper.make_opsetid("", self.opset)]
        model = helper.make_model(
            graph, opset_imports=opset_imports,
            ir_version=helper.find_min_ir_version_for(opset_imports),
        )
        session = ort.InferenceSession(
            model.SerializeToString(), _probe_session_options(), providers=["CPUExecutionProvider"]
        )
        return session.run(None, feeds)[0]


def _probe_session_options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return options


def _round_mantissa(x: np.ndarray, bits: int = STAT_MANTISSA_BITS) -> np.ndarray:
    """Rounds to ``bits`` mantissa bits, so tiny kernel-dependent differences disappear."""
    mantissa, exponent = np.frexp(x)
    return np.ldexp(np.round(mantissa * (1 << bits)) / (1 << bits), exponent)
