"""QDQ insertion with ONNX Runtime's quantiser, and reading the QDQ graph it writes.

:func:`prepare` makes the folded float model ready: every node named (the quantiser and
the mixed-precision search address nodes by name) and the opset raised where the preset
needs it, with onnx's version converter (per-channel DequantizeLinear needs opset 13;
ONNX Runtime's own pre-processing leaves an opset-12 model invalid there).

:class:`Quantizer` calibrates once per method (:data:`CALIBRATION_METHODS`: MinMax, the
99.99th percentile, entropy, and ``auto``: each tensor's range by its own round-trip error,
:mod:`.ranges`; the ranges of every tensor cached in a file) and then writes
as many QDQ models as the mixed-precision search asks for, each keeping a different set
of layers out of int8: in float (``nodes_to_exclude``) or, for ``qnn``, with 16-bit
activations (tensor overrides), or, for the presets whose activations are 16-bit already, with
16-bit weights (int16 symmetric, per channel where the preset's are: weight overrides). For a device whose LSTM is integer (``ROUNDS_LSTM_WEIGHTS``), each
model's LSTM weights are put on that kernel's grid, rounded once from the calibration data
(:mod:`..algorithms.lstm_rounding`). A device with a ``FINISH_QDQ(model) -> notes`` puts each QDQ
model in the form its compiler runs (qnn: :func:`opfuse.targets.qnn.conventions.float_attention_presents`).

How ONNX Runtime's QDQ graph relates to the float one (read by :class:`.layers.QdqLayers`):

- every quantised node keeps its name and op; its float inputs come from
  DequantizeLinear nodes and its outputs go to QuantizeLinear nodes;
- a tensor ``X`` of the float model is ``DequantizeLinear(QuantizeLinear(X))`` in the
  QDQ model, so the value the next layer sees is the DequantizeLinear's output;
- a Relu or Clip after a conv is removed and its range folded into the conv's output
  quantisation; the conv's output then carries the activation's name, and the value
  after DequantizeLinear is the activation's (clamped) value.
"""

from __future__ import annotations

__all__ = ["prepare", "Quantizer", "weight_storage", "WEIGHTED_OPS",
           "CALIBRATION_METHODS", "SampleReader"]

import contextlib
import io
import logging
import pathlib
from collections.abc import Iterable

import numpy as np
import onnx
import onnx.version_converter
import onnxruntime as ort
from onnx import numpy_helper
from onnxruntime import quantization as ortq

from opfuse.errors import BadInputError
from opfuse.quantization.qdq.layers import QDQ_OPS, removed_activations
from opfuse.quantization.presets import Preset
from opfuse.quantization.algorithms.ranges import search_ranges
from opfuse.quantization.algorithms.lstm_rounding import apply_rounded, round_lstm_weights
from opfuse.core.ops import ONNX_DOMAINS, WEIGHTED_OPS, first_line, proto_attr

logger = logging.getLogger(__name__)



def prepare(proto: onnx.ModelProto, preset: Preset) -> tuple[onnx.ModelProto, list[str]]:
    """(a private copy named and at the preset's opset, notes)."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    notes = []
    _name_nodes(model)
    added = _give_biases(model)
    if added:
        notes.append(f"{added} Conv/Gemm without a bias got a zero one, so bias correction has one to adjust")
    opset = next((o.version for o in model.opset_import if o.domain in ONNX_DOMAINS), None)
    if opset is not None and opset < preset.min_opset:
        try:
            model = onnx.version_converter.convert_version(model, preset.min_opset)
        except Exception as e:  # noqa: BLE001 - the converter raises many kinds
            raise BadInputError(
                f"the {preset.name} preset needs opset {preset.min_opset} (the model has {opset}) and "
                f"onnx's version converter cannot upgrade it: {first_line(e, 160)}"
                + ("; try --preset per-tensor" if preset.per_channel else "")
            ) from None
        notes.append(f"opset upgraded {opset} -> {preset.min_opset} with onnx's version converter: "
                     f"the {preset.name} preset's QDQ needs it")
    _name_nodes(model)  # after the converter, which writes its nodes anew
    device = preset.device() if preset.target else None
    if device is not None and hasattr(device, "prepare_float"):  # the device's own rewrite (ethos-u: RSQRT form)
        notes.extend(device.prepare_float(model))
    renamed = _free_quantiser_names(model)
    if renamed:
        notes.append(f"{renamed} tensor(s) renamed before quantising (e.g. {renamed_example(model)}): ONNX "
                     "Runtime's static quantiser names the scale of a tensor T 'T_scale' (and 'T_zero_point', "
                     "...), names this model already uses (its dynamic quantiser's); left as they were, the QDQ "
                     "graph it writes reads its own outputs, a cycle it reports as 'Graph is not a DAG'")
    return model, notes


# what ONNX Runtime's quantisers append to a tensor's name for the values and nodes they add
QUANTISER_SUFFIXES = ("_scale", "_zero_point", "_quantized", "_QuantizeLinear", "_DequantizeLinear",
                      "_QuantizeLinear_Output", "_DequantizeLinear_Output")
RENAMED_SUFFIX = "_opfuse"


def _free_quantiser_names(model: onnx.ModelProto) -> int:
    """Renames every tensor (and node) of the main graph called T + a quantiser suffix for
    some tensor T of the graph, so ONNX Runtime's names for the values it adds are free.
    Graph inputs and outputs keep their names (the caller feeds and reads them). Returns
    how many tensors were renamed."""
    graph = model.graph
    tensors = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    tensors.update(o for n in graph.node for o in n.output if o)
    fixed = {i.name for i in graph.input} | {o.name for o in graph.output}
    taken = {t + suffix for t in tensors for suffix in QUANTISER_SUFFIXES}
    clash = sorted(t for t in tensors & taken if t not in fixed)
    if not clash:
        return 0
    used = set(tensors)
    mapping = {}
    for name in clash:
        new = name + RENAMED_SUFFIX
        while new in used or new in taken:
            new += "_"
        used.add(new)
        mapping[name] = new
    _rename(graph, mapping)
    for node in graph.node:
        if node.name in taken:
            node.name += RENAMED_SUFFIX
    return len(mapping)


def renamed_example(model: onnx.ModelProto) -> str:
    return next((o for n in model.graph.node for o in n.output if o.endswith(RENAMED_SUFFIX)), "")


def _rename(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Renames tensors in ``graph`` and every subgraph that reads them from outer scope."""
    for node in graph.node:
        node.input[:] = [mapping.get(i, i) for i in node.input]
        node.output[:] = [mapping.get(o, o) for o in node.output]
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                inner = {k: v for k, v in mapping.items()
                         if k not in {i.name for i in sub.input} | {i.name for i in sub.initializer}}
                _rename(sub, inner)
    for tensor in graph.initializer:
        tensor.name = mapping.get(tensor.name, tensor.name)
    for info in graph.value_info:
        info.name = mapping.get(info.name, info.name)


def _name_nodes(model: onnx.ModelProto) -> None:
    used = {n.name for n in model.graph.node if n.name}
    count = 0
    for node in model.graph.node:
        if not node.name:
            while f"{node.op_type}_{count}" in used:
                count += 1
            node.name = f"{node.op_type}_{count}"
            used.add(node.name)


def _give_biases(model: onnx.ModelProto) -> int:
    """A zero bias for every Conv and Gemm whose weight is an initializer and that has none."""
    inits = {i.name: i for i in model.graph.initializer}
    used = {i.name for i in model.graph.initializer} | {o for n in model.graph.node for o in n.output}
    added = 0
    for node in model.graph.node:
        if node.domain not in ONNX_DOMAINS or node.op_type not in ("Conv", "Gemm") or len(node.input) < 2:
            continue
        if len(node.input) > 2 and node.input[2]:
            continue
        weight = inits.get(node.input[1])
        if weight is None or weight.data_type != onnx.TensorProto.FLOAT:
            continue
        if node.op_type == "Conv":
            channels = weight.dims[0]
        else:
            trans_b = proto_attr(node, "transB", 0)
            channels = weight.dims[0] if trans_b else weight.dims[1]
        name = f"{node.name}.zero_bias"
        while name in used:
            name += "_"
        used.add(name)
        model.graph.initializer.append(numpy_helper.from_array(np.zeros(channels, np.float32), name))
        while len(node.input) < 3:
            node.input.append("")
        node.input[2] = name
        added += 1
    return added


class SampleReader(ortq.CalibrationDataReader):
    """ONNX Runtime's calibration reader over a list of feed dicts (rewindable)."""

    def __init__(self, samples):
        self._samples = list(samples)
        self._it = iter(self._samples)

    def get_next(self):
        return next(self._it, None)

    def __len__(self):
        return len(self._samples)

    def rewind(self):
        self._it = iter(self._samples)


# --calibrate: how activation ranges are read off the calibration data
CALIBRATION_METHODS = {
    "minmax": (ortq.CalibrationMethod.MinMax, {}),  # the full range seen: one outlier widens every step
    "percentile": (ortq.CalibrationMethod.Percentile, {"CalibPercentile": 99.99}),  # clips the rarest 0.01%
    "entropy": (ortq.CalibrationMethod.Entropy, {}),  # KL divergence of the histograms (TensorRT's choice)
    # each tensor's own best range by its round-trip error (opfuse.quantization.algorithms.ranges), written as a
    # MinMax cache: the candidates are MinMax, the 99.99th percentile and ranges clipped inside MinMax
    "auto": (ortq.CalibrationMethod.MinMax, {}),
}
SEARCHED_METHODS = ("auto",)  # ranges opfuse computes from MinMax's, not ONNX Runtime's calibrators


class Quantizer:
    """ONNX Runtime's static quantiser for one float model, preset and calibration set.

    Each calibration method's ranges are computed once (cached in ``workdir``), whatever
    number of QDQ models the search asks for; ``method`` selects the one in use.
    """

    def __init__(self, float_model: onnx.ModelProto, preset: Preset, samples, workdir: str | pathlib.Path,
                 method: str = "minmax"):
        self.preset = preset
        self.workdir = pathlib.Path(workdir)
        self.float_model = float_model
        self.float_path = self.workdir / "float.onnx"  # ONNX Runtime's quantiser reads a file
        onnx.save(float_model, self.float_path, save_as_external_data=float_model.ByteSize() > 2**30)
        self.samples = list(samples)
        self.method = method
        self.trials = 0
        self.range_choices: list = []  # auto: the range chosen per tensor (opfuse.quantization.algorithms.ranges)
        self._calibrating = False  # the pass that writes the calibration cache for a device that reads it
        self._lstm_weights: dict | None = None  # a device with an integer LSTM: its W and R, rounded once
        self.lstm_records: list[str] = []
        self.device_notes: list[str] = []  # what the device's own QDQ form changed (its FINISH_QDQ), once each

    @property
    def cache(self) -> pathlib.Path:
        return self.workdir / f"calibration-{self.method}.json"

    def quantize(self, keep: Iterable[str] = (), keep_as: str | None = None) -> onnx.ModelProto:
        """A QDQ model with the nodes named in ``keep`` out of int8 (see the module docstring):
        ``keep_as`` "float" (excluded), "int16" (16-bit activations) or "int16-weights" (their weights
        in int16); by default the preset's."""
        keep = sorted(set(keep))
        keep_as = keep_as or self.preset.keep_as
        if self.method in SEARCHED_METHODS and not self.cache.exists():
            self._search_ranges()
        elif self._wants_ranges() and not self.cache.exists():
            self._calibrating = True  # a first pass writes the cache the device's configuration reads
            try:
                self.quantize()
            finally:
                self._calibrating = False
        out = self.workdir / f"qdq_{self.trials}.onnx"
        self.trials += 1
        kwargs = self._config(keep, keep_as)
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)  # its advice to pre-process: opfuse has folded and prepared the model
        ort.set_default_logger_severity(3)  # its calibration sessions log every unused initializer
        try:  # its histogram calibrators print progress to stdout, which may be a --json - stream
            with contextlib.redirect_stdout(io.StringIO()):
                ortq.quantize_static(str(self.float_path), str(out), calibration_cache_path=str(self.cache),
                                     **kwargs)
        except Exception as e:  # noqa: BLE001 - the quantiser raises many kinds
            raise BadInputError(f"ONNX Runtime's quantiser failed on this model ({self.method} "
                                f"calibration): {first_line(e, 200)}") from None
        finally:
            root.setLevel(level)
            # the runtime's default: ONNX Runtime has no getter, so a caller's own setting cannot be restored
            # (its quantiser opens its calibration sessions with no SessionOptions to pass a level through)
            ort.set_default_logger_severity(2)
        model = onnx.load(out)
        out.unlink()
        _restore_removed_activations(model, self.float_model)
        self._round_lstm_weights(model)
        finish = getattr(self.preset.device(), "FINISH_QDQ", None)
        if finish is not None:  # the form of the QDQ graph the device's compiler runs (qnn: Attention's presents)
            self.device_notes += [n for n in finish(model) if n not in self.device_notes]
        if keep and keep_as == "float":
            _read_float_inputs(model, set(keep), self.float_model)
        return model

    def _round_lstm_weights(self, model: onnx.ModelProto) -> None:
        """For a device whose LSTM is integer (its ``ROUNDS_LSTM_WEIGHTS``), the LSTMs' ``W`` and ``R``
        on its grid, rounded from the calibration data once (:mod:`..algorithms.lstm_rounding`), in place."""
        if not getattr(self.preset.device(), "ROUNDS_LSTM_WEIGHTS", False):
            return
        if self._lstm_weights is None:
            if not any(n.op_type == "LSTM" for n in self.float_model.graph.node):
                self._lstm_weights = {}
                return
            self._lstm_weights, self.lstm_records = round_lstm_weights(self.float_model, self.samples)
        if self._lstm_weights:
            apply_rounded(model, self._lstm_weights)

    def _search_ranges(self) -> None:
        """The auto cache: MinMax's ranges (a first quantisation writes them), each tensor's
        clipping range then chosen by its own round-trip error."""
        from onnxruntime.quantization.calibrate import load_tensors_data, save_tensors_data  # (only the auto cache)

        method, calibrating = self.method, self._calibrating
        self.method, self._calibrating = "minmax", True
        try:
            if not self.cache.exists():
                self.quantize()
            minmax = load_tensors_data(self.cache)
        finally:
            self.method, self._calibrating = method, calibrating
        ranges, self.range_choices = search_ranges(self.float_model, self.samples, minmax)
        save_tensors_data(ranges, self.cache)

    def _config(self, keep: list[str], keep_as: str) -> dict:
        preset = self.preset
        reader = SampleReader(self.samples) if not self.cache.exists() else None
        sixteen = keep if keep_as == "int16" else []
        excluded = keep if keep_as == "float" else []
        wide = self._weights_of(keep) if keep_as == "int16-weights" else {}
        method, extra = CALIBRATION_METHODS[self.method]
        device = preset.device()
        if device is not None:  # the device's own conventions (for qnn: get_qnn_qdq_config)
            more = {"ranges": self._cached_ranges()} if self._wants_ranges() else {}
            if wide:
                more["sixteen_weights"] = wide
            return device.quantizer_config(self.float_path, self.float_model, preset, reader=reader,
                                           sample_reader=SampleReader(self.samples), method=method, extra=extra,
                                           sixteen=self._outputs_of(sixteen), excluded=excluded, **more)
        return dict(
            calibration_data_reader=reader,
            quant_format=ortq.QuantFormat.QDQ,
            activation_type=ortq.QuantType.QUInt8,
            weight_type=ortq.QuantType.QInt8 if preset.weight == "int8" else ortq.QuantType.QUInt8,
            per_channel=preset.per_channel,
            calibrate_method=CALIBRATION_METHODS[self.method][0],
            op_types_to_quantize=list(preset.op_types) if preset.op_types else None,
            nodes_to_exclude=excluded,
            extra_options={"WeightSymmetric": True, "ActivationSymmetric": False, **CALIBRATION_METHODS[self.method][1],
                           **({"TensorQuantOverrides": {
                               **{t: [{"quant_type": ortq.QuantType.QUInt16}] for t in self._outputs_of(sixteen)},
                               **{w: [{"quant_type": ortq.QuantType.QInt16, "symmetric": True,
                                       **({"axis": axis} if preset.per_channel else {})}]
                                  for w, axis in wide.items()}}} if sixteen or wide else {})},
        )

    def _wants_ranges(self) -> bool:
        """Whether the preset's device configures the quantiser from the calibrated ranges
        (its ``WANTS_RANGES``: the ``ethos-u`` device, for the quantisations TFLite fixes; or a function of the
        float model: the ``qnn`` device, for a decoder's masked scores)."""
        device = self.preset.device()
        wants = getattr(device, "WANTS_RANGES", False)
        if callable(wants):
            wants = wants(self.float_model)
        return bool(wants) and not self._calibrating

    def _cached_ranges(self):
        """The calibration cache's ranges (ONNX Runtime's ``TensorsData``), None before it is written."""
        from onnxruntime.quantization.calibrate import load_tensors_data  # (only a device that reads ranges)

        return load_tensors_data(self.cache) if self.cache.exists() else None

    def _weights_of(self, names: list[str]) -> dict[str, int]:
        """{weight initializer: its output-channel axis} of the named layers (Conv, ConvTranspose, Gemm,
        MatMul): what keeping them with 16-bit weights quantises in int16."""
        wanted = set(names)
        inits = {i.name: len(i.dims) for i in self.float_model.graph.initializer}
        out = {}
        for node in self.float_model.graph.node:
            if node.name in wanted and node.op_type in WEIGHTED_OPS and len(node.input) > 1 \
                    and node.input[1] in inits:
                if node.op_type == "Conv":
                    axis = 0
                elif node.op_type == "Gemm":
                    axis = 0 if proto_attr(node, "transB", 0) else 1
                else:  # MatMul's [K, N] (its last axis), ConvTranspose's [C_in, C_out / group, ...]
                    axis = 1 if node.op_type == "ConvTranspose" else inits[node.input[1]] - 1
                out[node.input[1]] = axis
        return out

    def _outputs_of(self, names: list[str]) -> list[str]:
        wanted = set(names)
        return [o for n in self.float_model.graph.node if n.name in wanted for o in n.output if o]


def _read_float_inputs(model: onnx.ModelProto, keep: set[str], float_model: onnx.ModelProto) -> None:
    """Layers kept in float read their inputs before the int8 round trip (in place).

    Excluding a node from ONNX Runtime's quantiser leaves ``DequantizeLinear`` in front
    of it, and at ``ORT_ENABLE_BASIC`` and above the runtime's ``WeightBiasQuantization``
    pass then quantises the float weight of a Conv, ConvTranspose or Gemm whose input
    comes from a per-tensor DequantizeLinear (symmetric int8, per tensor): the layer would
    run in int8 after all. So a kept layer reads the tensor the QuantizeLinear reads. Where
    the quantiser removed an activation (its range folded into the Q), that activation is
    applied again, a copy of the float model's node. Q/DQ pairs nothing reads any more go.
    """
    producer = {o: n for n in model.graph.node for o in n.output}
    removed = removed_activations(model, float_model)
    float_inits = {i.name: i for i in float_model.graph.initializer}
    have = {i.name for i in model.graph.initializer}
    copies: dict[str, str] = {}
    added: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if node.name not in keep:
            continue
        for index, name in enumerate(node.input):
            dq = producer.get(name)
            if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] in have:
                continue
            q = producer.get(dq.input[0])
            if q is None or q.op_type != "QuantizeLinear":
                continue
            source = q.input[0]
            if source not in copies:
                copies[source] = source
                if source in removed:
                    act = _activation_copy(model, removed[source], source, float_inits, have)
                    added.append(act)
                    copies[source] = act.output[0]
            node.input[index] = copies[source]
    _insert_after_inputs(model, added)
    _drop_unread_qdq(model)




def _restore_removed_activations(model: onnx.ModelProto, float_model: onnx.ModelProto) -> None:
    """Readers the quantiser does not see get back the activation it removed (in place).

    ONNX Runtime's QDQ quantiser drops a Relu or Clip after a quantised layer (the
    QuantizeLinear's range clips instead) and gives the layer's output the activation's
    name; it rewrites the readers it knows to the DequantizeLinear. A branch of an If or
    Loop that reads the tensor from the outer scope is not one of them: it would read the
    values before the activation (silero_vad_half: docs/results/measurements.md). Those readers, and
    any main-graph node other than the QuantizeLinear still reading it, read a copy of the
    float model's activation instead.
    """
    removed = removed_activations(model, float_model)
    if not removed:
        return
    readers = [(n, i) for n in model.graph.node if n.op_type != "QuantizeLinear"
               for i, name in enumerate(n.input) if name in removed]
    readers += [(n, i) for g in _subgraphs(model.graph) for n in g.node for i, name in enumerate(n.input)
                if name in removed]
    if not readers:
        return
    float_inits = {i.name: i for i in float_model.graph.initializer}
    have = {i.name for i in model.graph.initializer}
    copies: dict[str, onnx.NodeProto] = {}
    for node, index in readers:
        source = node.input[index]
        if source not in copies:
            copies[source] = _activation_copy(model, removed[source], source, float_inits, have, suffix="activated")
        node.input[index] = copies[source].output[0]
    _insert_after_inputs(model, list(copies.values()))


def _subgraphs(graph: onnx.GraphProto):
    """Every graph nested in ``graph``'s nodes (If branches, Loop and Scan bodies), at any depth."""
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else
                        attr.graphs if attr.type == onnx.AttributeProto.GRAPHS else []):
                yield sub
                yield from _subgraphs(sub)


def _activation_copy(model: onnx.ModelProto, original: onnx.NodeProto, source: str, float_inits, have: set,
                     suffix: str = "float") -> onnx.NodeProto:
    """A copy of the float model's activation ``original`` reading ``source`` (its constant
    operands brought along); the caller inserts it."""
    act = onnx.NodeProto()
    act.CopyFrom(original)
    act.name = f"{original.name or original.op_type}_{suffix}"
    act.input[0] = source
    act.output[0] = f"{source}_{suffix}"
    for extra in act.input[1:]:
        if extra and extra not in have and extra in float_inits:
            model.graph.initializer.append(float_inits[extra])
            have.add(extra)
    return act


def _insert_after_inputs(model: onnx.ModelProto, added: list[onnx.NodeProto]) -> None:
    """Each node of ``added`` goes right after the node that computes its first input."""
    if not added:
        return
    nodes = list(model.graph.node)
    for act in added:
        at = next((i + 1 for i, n in enumerate(nodes) if act.input[0] in n.output), 0)
        nodes.insert(at, act)
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _drop_unread_qdq(model: onnx.ModelProto) -> None:
    while True:
        read = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
        dead = [n for n in model.graph.node if n.op_type in QDQ_OPS and not any(o in read for o in n.output)]
        if not dead:
            break
        for n in dead:
            model.graph.node.remove(n)
    read = {i for n in model.graph.node for i in n.input}
    kept = [i for i in model.graph.initializer if i.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def weight_storage(float_model: onnx.ModelProto, qdq: onnx.ModelProto) -> tuple[int, int]:
    """(weight elements stored as 8-bit integers, all weight elements) of the Conv,
    ConvTranspose, Gemm and MatMul layers: a weight is an initializer input (other than a
    bias) of such a node in the float model."""
    float_inits = {i.name: i for i in float_model.graph.initializer}
    total, weights = 0, set()
    for node in float_model.graph.node:
        if node.op_type in WEIGHTED_OPS and node.domain in ONNX_DOMAINS:
            for name in node.input[:2]:
                if name in float_inits and name not in weights:
                    weights.add(name)
                    total += int(np.prod(float_inits[name].dims, dtype=np.int64))
    eight_bit = 0
    inits = {i.name: i for i in qdq.graph.initializer}
    for node in qdq.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            tensor = inits[node.input[0]]
            original = node.output[0].removesuffix("_DequantizeLinear_Output")
            if original in weights and tensor.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8):
                eight_bit += int(np.prod(tensor.dims, dtype=np.int64))
    return eight_bit, total

