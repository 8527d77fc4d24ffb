"""The torch programs block reconstruction (:mod:`.reconstruction`) runs: the QDQ model as
ONNX Runtime wrote it, fake-quantised, and the float model it was made from.

:class:`QdqProgram` interprets the QDQ graph node by node (:mod:`.torch_ops`):

- an activation's QuantizeLinear computes ``s * (clip(round(x / s) + z, lo, hi) - z)`` with
  a straight-through gradient through ``round`` (to x and, LSQ, to s), and the
  DequantizeLinear that reads it passes that value on; a per-tensor scale is a learnable
  key, shared by the quantisers on both sides of an op that only moves values (the op
  table's INJECTIVE kind: Reshape, Transpose...) that ONNX Runtime gave one scale;
- a learnable layer's weight DequantizeLinear (:func:`.adaround.weight_sites`) reads the weight
  the caller passes; any other constant DequantizeLinear is its dequantised value;
- the int32 bias of a layer whose input scale is learned is re-quantised to
  ``s_x * s_w`` as it will be written (straight through the rounding);
- every other node is its torch function (:mod:`.torch_ops`: the default domain, and the
  ONNX Runtime contrib ops its own tools write); the first node that has none ends the
  program.

A tensor that depends on no QuantizeLinear (a mask, a shape) is computed once per sample
(:meth:`QdqProgram.static_values`). Each compute output has the float model's tensor of the
same name as its target; ONNX Runtime renames a layer's output that is a graph output, and
its DequantizeLinear carries the float name. ONNX Runtime also removes a Relu or Clip after
a layer (the quantiser's range clips instead): :meth:`QdqProgram.activated` applies it
before a block output is compared with the float model's; one it has no torch function for
ends the program at that layer (its output has nothing to be compared with).

:class:`FloatProgram` runs the float model in torch for the targets and their output
sensitivities (ONNX Runtime gives the targets where torch cannot run the model).
"""

from __future__ import annotations

__all__ = ["Block", "QdqProgram", "FloatProgram"]

import dataclasses
import math

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from opfuse.core.algebra import dequantize
from opfuse.core.analysis import opset_of
from opfuse.quantization.algorithms.adaround import weight_sites
from opfuse.quantization.qdq.layers import QdqLayers, exposed
from opfuse.quantization.qdq.sqnr import CHANNEL_FIRST
from opfuse.quantization.interpreter.ops import Unsupported, node_function
from opfuse.runtime import create_session
from opfuse.core.ops import OpKind, op_kind, proto_attr, weight_spec

LAYERS_PER_BLOCK = 2
PROBES = 2  # Hutchinson probes per sample for the output sensitivities


@dataclasses.dataclass
class Block:
    nodes: list  # the QDQ graph's nodes it runs: compute nodes and the Q/DQ/Constant on their inputs, in order
    layers: list[str]  # its learned layers
    quantizers: list[str]  # its activation QuantizeLinear nodes
    outputs: list[str]  # its compute outputs read after it: the loss's tensors
    hands_on: list[str]  # every tensor it makes that is read after it
    needed_after: set  # every tensor read after it


class QdqProgram:
    """The QDQ graph as steps torch runs, and how its tensors map to the float model's."""

    def __init__(self, float_model: onnx.ModelProto, qdq: onnx.ModelProto):
        self.opset = _opset(qdq)
        self.inits = {i.name: i for i in qdq.graph.initializer}
        self.producer = {o: n for n in qdq.graph.node for o in n.output}
        self.shared: dict = {}  # initializer values as torch tensors, loaded once
        float_names = {o for n in float_model.graph.node for o in n.output} | {i.name for i in float_model.graph.input}
        layers = QdqLayers(float_model, qdq)
        self.sites = {s.name: s for s in weight_sites(layers, {})}
        self.site_of_weight = {s.initializer: s for s in self.sites.values()}
        self.activations = {}  # tensor -> (function, constant inputs) of the Relu/Clip the quantiser removed
        unapplied: dict[str, Unsupported] = {}  # tensor -> why its removed Relu/Clip cannot be applied
        for tensor, act in layers.removed_activations().items():
            try:
                self.activations[tensor] = (node_function(act, _opset(float_model)),
                                            [_constant(float_model, name) for name in act.input[1:]])
            except Unsupported as e:  # its layer cannot be compared with the float model: the program stops there
                unapplied[tensor] = Unsupported(f"the {act.op_type} '{act.name}' the quantiser removed after it "
                                                f"cannot be applied ({e})")
        self.constants: dict[str, np.ndarray] = {}  # DQ of a constant (not a learned weight), Constant nodes
        self.functions = {}  # id(compute node) -> torch function
        self.steps = []  # (kind, node): quantize, alias (the DQ of an activation), constant, compute
        self.stopped = ""
        self.scale_values: dict[str, float] = {}  # scale key -> ONNX Runtime's scale
        self.scale_key: dict[str, str] = {}  # QuantizeLinear name -> its scale's key
        self.quant_of = {}  # QuantizeLinear name -> (scale array, zero, lo, hi, axis)
        self.dependent: set[str] = set()  # tensors that depend on a QuantizeLinear
        for node in qdq.graph.node:
            if node.op_type == "QuantizeLinear" and node.input[0] not in self.inits:
                self._quantizer(node)
                kind = "quantize"
            elif node.op_type == "DequantizeLinear" and node.input[0] in self.inits:
                kind = "constant"
                if node.input[0] not in self.site_of_weight:
                    self.constants[node.output[0]] = _dequantize(node, self.inits)
            elif node.op_type == "DequantizeLinear" and getattr(self.producer.get(node.input[0]), "op_type", "") \
                    == "QuantizeLinear":
                kind = "alias"
            elif node.op_type == "Constant":
                kind = "constant"
                self.constants[node.output[0]] = _constant_node(node)
            else:
                try:
                    self.functions[id(node)] = node_function(node, self.opset)
                    for o in node.output:
                        if o in unapplied:
                            raise unapplied[o]
                except Unsupported as e:
                    self.stopped = f"{node.name or node.op_type}: {e}"
                    break
                kind = "compute"
            if kind == "quantize" or (kind != "constant" and any(i in self.dependent for i in node.input)):
                self.dependent.update(node.output)
            self.steps.append((kind, node))
        self.target: dict[str, str] = {}  # QDQ tensor -> the float model's tensor holding its target value
        for kind, node in self.steps:
            if kind == "compute":
                self.target.update({o: o for o in node.output if o in float_names})
        for kind, node in self.steps:  # a layer's output the quantiser renamed: its DQ carries the float name
            if kind == "alias" and node.output[0] in float_names:
                self.target.setdefault(self._source(node.output[0]), node.output[0])
        self.graph_sources = {self._source(o.name) for o in qdq.graph.output}  # with what the steps do not reach
        self.graph_sources |= {self._source(i) for n in list(qdq.graph.node)[len(self.steps):] for i in n.input}
        readers: dict[str, list] = {}
        for n in qdq.graph.node:
            for i in n.input:
                readers.setdefault(i, []).append(n)
        self.quantised = {t for t, rs in readers.items() if rs and all(r.op_type == "QuantizeLinear" for r in rs)}
        self.scale_initializers = {  # QuantizeLinear name -> the scale initializers of it and its DQs
            q: sorted(n for n in {node.input[1]} | {r.input[1] for r in readers.get(node.output[0], [])
                                                    if r.op_type == "DequantizeLinear"} if n in self.inits)
            for _, node in self.steps for q in [node.name] if q in self.scale_key}
        self.bias_of = self._bias_scales()  # layer -> (bias input index, its input's scale key, weight scale)

    def _bias_scales(self) -> dict:
        """Layer -> (its bias input's index, its input's scale key, its weight scale as a float64
        tensor): what a learned input scale rewrites in the int32 bias."""
        bias_of = {}
        nodes = {n.name: n for _, n in self.steps}
        for site in self.sites.values():
            node = nodes.get(site.name)
            if node is None or site.bias_initializers is None or site.x_scale is None:
                continue
            index = next((k for k, name in enumerate(node.input)
                          if getattr(self.producer.get(name), "input", [""])[0] == site.bias_initializers[0]), None)
            q_x = self.producer.get(self._source_node_input(node.input[0]))
            key = self.scale_key.get(q_x.name) if q_x is not None else None
            if index is not None and key is not None:
                w_dq = self.producer[node.input[1]]

                bias_of[site.name] = (index, key, torch.from_numpy(
                    numpy_helper.to_array(self.inits[w_dq.input[1]]).astype(np.float64)))
        return bias_of

    def _source_node_input(self, name: str) -> str:
        """The QuantizeLinear output a DequantizeLinear output ``name`` reads ("" if none)."""
        dq = self.producer.get(name)
        return dq.input[0] if dq is not None and dq.op_type == "DequantizeLinear" else ""

    def _source(self, name: str) -> str:
        """The tensor a compute node really reads through a Q/DQ pair (``name`` itself otherwise)."""
        q = self.producer.get(self._source_node_input(name))
        return q.input[0] if q is not None and q.op_type == "QuantizeLinear" else name

    def _quantizer(self, node) -> None:
        scale = numpy_helper.to_array(self.inits[node.input[1]]) if node.input[1] in self.inits else None
        zero = numpy_helper.to_array(self.inits[node.input[2]]) \
            if len(node.input) > 2 and node.input[2] in self.inits else np.zeros((), np.uint8)
        info = np.iinfo(zero.dtype)
        axis = proto_attr(node, "axis", 1)
        self.quant_of[node.name] = (scale, zero.astype(np.float64), float(info.min), float(info.max), axis)
        if scale is None or scale.size != 1 or not float(scale.reshape(())) > 0:
            return  # per-axis (or computed, or zero) activation scales stay as they are
        key = node.input[1]
        layout = self.producer.get(node.input[0])
        if layout is not None and op_kind(layout) == OpKind.INJECTIVE and layout.input:
            q = self.producer.get(self._source_node_input(layout.input[0]))
            if q is not None and q.name in self.scale_key and math.isclose(
                    self.scale_values[self.scale_key[q.name]], float(scale.reshape(())), rel_tol=1e-6):
                key = self.scale_key[q.name]  # one scale on both sides of a layout op
        self.scale_values.setdefault(key, float(scale.reshape(())))
        self.scale_key[node.name] = key

    def integers(self, site) -> np.ndarray:
        """The layer's integer weight as ONNX Runtime (or an earlier step) wrote it."""
        return numpy_helper.to_array(self.inits[site.initializer]).astype(np.float64)

    def fixed_weights(self) -> dict:
        """Every learnable weight's DQ output as written (initializer -> torch tensor)."""

        return {s.initializer: torch.tensor((self.integers(s) - s.to_own(s.zero)) * s.to_own(s.scale),
                                            dtype=torch.float32) for s in self.sites.values()}

    def static_values(self, sample) -> dict:
        """The sample's inputs and every tensor that depends on no QuantizeLinear."""

        env = {k: torch.from_numpy(np.asarray(v)) for k, v in sample.items()}
        for kind, node in self.steps:
            if kind == "compute" and not any(o in self.dependent for o in node.output):
                for o, v in zip(node.output, self.functions[id(node)]([self._read(env, i) for i in node.input])):
                    env[o] = v
            elif kind == "constant" and node.output[0] in self.constants:
                env[node.output[0]] = self._constant(node.output[0])
        return env

    def _constant(self, name):
        if name not in self.shared:
            self.shared[name] = torch.from_numpy(np.array(self.constants[name]))
        return self.shared[name]

    def _read(self, env, name):
        if not name:
            return None
        if name in env:
            return env[name]
        if name not in self.shared and name in self.inits:
            self.shared[name] = torch.from_numpy(numpy_helper.to_array(self.inits[name]).copy())
        return self.shared[name]

    def blocks(self) -> list[Block]:
        """The compute nodes that depend on a QuantizeLinear, grouped into blocks (module docstring)."""
        compute = [node for kind, node in self.steps if kind == "compute" and node.output[0] in self.dependent]
        if not compute:
            return []
        reads = [[self._source(i) for i in node.input if i and self._source(i) in self.dependent] for node in compute]
        last_read = {t: k for k, names in enumerate(reads) for t in names}
        last_read.update({t: len(compute) for t in self.graph_sources})
        made_at = {o: k for k, node in enumerate(compute) for o in node.output}
        spans, start, layers = [], 0, 0
        for k, node in enumerate(compute[:-1]):
            layers += node.name in self.sites
            if layers < LAYERS_PER_BLOCK:
                continue
            crossing = [t for t, at in made_at.items() if at <= k < last_read.get(t, -1)]
            if not crossing or any(t not in self.target or t not in self.quantised for t in crossing):
                continue  # a cut where each crossing tensor has a float target and is quantised
            if len(crossing) > 1 and layers < 4 * LAYERS_PER_BLOCK:
                continue  # a cut more tensors cross: only when the block grew long
            spans.append((start, k + 1))
            start, layers = k + 1, 0
        if spans and not any(n.name in self.sites for n in compute[start:]):
            spans[-1] = (spans[-1][0], len(compute))
        else:
            spans.append((start, len(compute)))
        blocks = []
        for a, b in spans:
            members = {id(n) for n in compute[a:b]}
            feeding = set()  # the Q/DQ/Constant steps on the block's inputs
            for node in compute[a:b]:
                for name in node.input:
                    p = self.producer.get(name)
                    if p is not None and p.op_type in ("DequantizeLinear", "Constant"):
                        feeding.add(id(p))
                        q = self.producer.get(p.input[0]) if p.input else None
                        if q is not None and q.op_type == "QuantizeLinear" and q.name in self.quant_of:
                            feeding.add(id(q))
            nodes = [n for _, n in self.steps if id(n) in members or id(n) in feeding]
            later = {t for names in reads[b:] for t in names} | self.graph_sources
            needed = later | {i for n in compute[b:] for i in n.input}
            made = {o for n in nodes for o in n.output}
            outputs = [o for n in compute[a:b] for o in n.output if o in later and o in self.target]
            if outputs:
                blocks.append(Block(nodes, [n.name for n in compute[a:b] if n.name in self.sites],
                                     [n.name for n in nodes if n.op_type == "QuantizeLinear" and n.name in self.quant_of],
                                     outputs, sorted(made & needed), needed))
        return blocks

    def scale_read_by(self, node) -> str | None:
        """The key of the learned scale ``node`` reads when :meth:`run` runs it: a
        QuantizeLinear's own, or a layer's input scale, to which its int32 bias is requantised."""
        if node.op_type == "QuantizeLinear":
            return self.scale_key.get(node.name)
        return self.bias_of[node.name][1] if node.name in self.bias_of else None

    def run(self, env, nodes, weights, scales):
        """Runs ``nodes`` on ``env`` (name -> tensor): weight DQ outputs from ``weights``
        (initializer -> tensor), activation scales from ``scales`` (key -> tensor)."""

        for node in nodes:
            op = node.op_type
            if op == "QuantizeLinear":
                x = env[node.input[0]]
                scale, zero, lo, hi, axis = self.quant_of[node.name]
                key = self.scale_key.get(node.name)
                if key is not None:
                    s, z = scales[key], float(zero)
                else:
                    shape = [1] * x.dim()
                    if scale.size > 1:
                        shape[axis % x.dim()] = -1
                    s = torch.from_numpy(scale.astype(np.float64).reshape(shape))
                    z = torch.from_numpy(np.asarray(zero, np.float64).reshape(shape))
                v = x / s
                v = v + (torch.round(v) - v).detach()  # straight through the rounding (LSQ)
                y = ((torch.clamp(v + z, lo, hi) - z) * s).to(x.dtype)
                env[node.output[0]] = y
            elif op == "DequantizeLinear" and node.input[0] in self.site_of_weight:
                env[node.output[0]] = weights[node.input[0]]
            elif node.output[0] in self.constants:
                env[node.output[0]] = self._constant(node.output[0])
            elif op == "DequantizeLinear":
                env[node.output[0]] = env[node.input[0]]
            else:
                args = [self._read(env, i) for i in node.input]
                if node.name in self.bias_of:
                    index, key, w_scale = self.bias_of[node.name]
                    step = scales[key] * w_scale  # the int32 bias as written for the learned input scale
                    v = args[index].double() / step
                    args[index] = ((v + (torch.round(v) - v).detach()) * step).to(args[index].dtype)
                for o, v in zip(node.output, self.functions[id(node)](args)):
                    env[o] = v
        return env

    def activated(self, tensor, value):
        """``value`` of a layer whose Relu/Clip the quantiser removed, with it applied."""

        act = self.activations.get(tensor)
        if act is None:
            return value
        fn, constants = act
        return fn([value, *[None if c is None else torch.from_numpy(np.array(c)) for c in constants]])[0]

    def values(self, integers, scales) -> dict[str, np.ndarray]:
        """The initializers to write: learned integers, scales, and the int32 biases
        re-quantised to their input's new scale."""
        out = {name: q.astype(self.site_of_weight[name].dtype) for name, q in integers.items()}
        for node_name, key in self.scale_key.items():
            if key in scales:
                for name in self.scale_initializers[node_name]:
                    old = numpy_helper.to_array(self.inits[name])
                    out[name] = np.asarray(scales[key], dtype=old.dtype).reshape(old.shape)
        for layer, (_, key, w_scale) in self.bias_of.items():
            if key not in scales:
                continue
            int_name, scale_name = self.sites[layer].bias_initializers
            old_scale = numpy_helper.to_array(self.inits[scale_name])
            bias = numpy_helper.to_array(self.inits[int_name]).astype(np.float64) * old_scale.astype(np.float64)
            new_scale = (np.float32(scales[key]) * w_scale.numpy().astype(np.float32)).astype(old_scale.dtype)
            new_scale = new_scale.reshape(old_scale.shape)
            out[scale_name] = new_scale
            out[int_name] = np.clip(np.rint(bias / new_scale.astype(np.float64)), -2 ** 31, 2 ** 31 - 1).astype(np.int32)
        return out


class FloatProgram:
    """The float model in torch: its tensors' values, and their output sensitivities."""

    def __init__(self, float_model: onnx.ModelProto):
        self.model = float_model
        self.inits = {i.name: numpy_helper.to_array(i) for i in float_model.graph.initializer}
        self.outputs = [o.name for o in float_model.graph.output]
        self.functions = []
        self.unsupported = ""
        opset = _opset(float_model)
        for node in float_model.graph.node:
            try:
                self.functions.append((node, node_function(node, opset)))
            except Unsupported as e:
                self.unsupported = f"{node.name or node.op_type} ({e})"
                break
        self.conv_like = {o for n in float_model.graph.node if n.op_type in CHANNEL_FIRST for o in n.output}

    def _run(self, sample, probes=None):
        env = {k: torch.from_numpy(v.copy()) for k, v in self.inits.items()}
        env.update({k: torch.from_numpy(np.asarray(v)) for k, v in sample.items()})
        for node, fn in self.functions:
            for o, v in zip(node.output, fn([env.get(i) if i else None for i in node.input])):
                if probes is not None and o in probes and v.is_floating_point():
                    probes[o] = torch.zeros_like(v, requires_grad=True)
                    v = v + probes[o]
                env[o] = v
        return env

    def multiply_accumulates(self, sample) -> int:
        """The multiply-accumulates of the model's weighted layers (the op table's weight
        specs: Conv, ConvTranspose, Gemm, MatMul) on ``sample``."""
        env = self._run(sample)
        total = 0
        for node, _ in self.functions:
            spec = weight_spec(node)
            if spec is None or len(node.input) <= spec.weight:
                continue
            x, y, w = env[node.input[0]], env[node.output[0]], env[node.input[spec.weight]]
            if spec.layout == "oihw":  # each output element reads one filter
                total += y.numel() * w[0].numel()
            elif spec.layout == "iohw":  # each input element scatters one filter row
                total += x.numel() * w[0].numel()
            else:  # a product over the inner axis
                total += y.numel() * (x.shape[-1] if x.dim() else 1)
        return int(total)

    def values(self, samples, names) -> list[dict]:
        """Per sample, the float model's values of ``names`` (ONNX Runtime computes them
        where torch cannot)."""

        if self.unsupported:
            session = create_session(exposed(self.model, names), "disabled")
            return [{n: torch.from_numpy(np.asarray(v)) for n, v in zip(names, session.run(names, s))}
                    for s in samples]
        with torch.no_grad():
            return [{n: env[n] for n in names} for env in map(self._run, samples)]

    def channel_axis(self, name: str, rank: int) -> int:
        """Channels: axis 1 of an NCHW tensor, the last axis of a sequence's features."""
        return 1 if rank >= 4 or (rank == 3 and name in self.conv_like) else rank - 1

    def sensitivities(self, samples, names, generator) -> tuple[dict, str]:
        """Per tensor, each channel's share of diag(J^T J) of the float outputs (mean 1);
        ({}, why not) when the float model cannot be differentiated here."""

        if self.unsupported:
            return {}, f"the float model is not interpreted in torch past {self.unsupported}"
        sums, ranks = {}, {}
        for sample in samples:
            probes = dict.fromkeys(names)
            env = self._run(sample, probes)
            outs = [env[o] for o in self.outputs if o in env and env[o].is_floating_point()]
            used = [n for n in names if probes[n] is not None]
            if not outs or not used:
                return {}, "no float output depends on the quantised tensors"
            for k in range(PROBES):
                total = sum((o * torch.randn(o.shape, generator=generator, dtype=o.dtype)).sum() for o in outs)
                grads = torch.autograd.grad(total, [probes[n] for n in used], retain_graph=k < PROBES - 1,
                                            allow_unused=True)
                for n, g in zip(used, grads):
                    if g is not None and g.dim():
                        ranks[n] = g.dim()
                        axis = self.channel_axis(n, g.dim())
                        sums[n] = sums.get(n, 0) + (g.double() ** 2).sum(tuple(d for d in range(g.dim()) if d != axis))
        weights = {}
        for n, acc in sums.items():
            mean = float(acc.mean())
            if mean > 0:
                shape = [1] * ranks[n]
                shape[self.channel_axis(n, ranks[n])] = -1
                weights[n] = (acc / mean).float().reshape(shape)
        return weights, ""



def _dequantize(node, inits) -> np.ndarray:
    """A DequantizeLinear of initializers, as its output (in its scale's dtype)."""
    q, s = (numpy_helper.to_array(inits[name]) for name in node.input[:2])
    z = numpy_helper.to_array(inits[node.input[2]]) if len(node.input) > 2 and node.input[2] in inits else 0
    if s.size > 1:
        shape = [1] * q.ndim
        shape[proto_attr(node, "axis", 1) % q.ndim] = -1
        s, z = s.reshape(shape), np.reshape(z, shape)
    return dequantize(q, z, s, s.dtype)


def _opset(model: onnx.ModelProto) -> int:
    return opset_of({o.domain: o.version for o in model.opset_import})


def _constant_node(node) -> np.ndarray:
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        return np.asarray(helper.get_attribute_value(a), np.float32 if a.name.startswith("value_float") else np.int64)
    raise ValueError("a Constant node without a value")


def _constant(model: onnx.ModelProto, name: str):
    if not name:
        return None
    for i in model.graph.initializer:
        if i.name == name:
            return numpy_helper.to_array(i)
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output[0] == name:
            return _constant_node(n)
    return None
