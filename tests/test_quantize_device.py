"""One route to any device: a new NPU is a target module and a device module, and quantize
reaches it through them alone (``Preset.target`` -> ``Target.device``), with no edit of the
pipelines. The NPU here is made up: its device runs the model on ONNX Runtime's CPU and
records what the pipeline asked of it."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import onnx
from onnx import helper

import opfuse
import opfuse.pipeline
import opfuse.quantization
import opfuse.targets
from graphs import model, rng, tensor, vinfo
from opfuse.quantization.presets import PRESETS, BiasCorrection, MixedPrecision, Preset, Ranges

TARGET_MODULE = '''
from opfuse.targets.kernels import Target

TARGET = Target(name="toy-npu", title="a toy NPU", device="toy_npu_device")
'''

DEVICE_MODULE = '''
"""A toy NPU: it runs on ONNX Runtime's CPU and records each call of the device interface."""
import dataclasses

from onnxruntime import quantization as ortq

import numpy as np
from opfuse.runtime import create_session

TITLE = "toy NPU"
NAME = "toy NPU"
CALLS = []


def require_backend():
    CALLS.append("require_backend")


@dataclasses.dataclass
class Options:
    pairs: dict

    @classmethod
    def parse(cls, pairs):
        CALLS.append("parse")
        return cls(dict(pairs or {}))

    def describe(self):
        return f"{len(self.pairs)} option(s)"


def quantizer_config(float_path, float_model, preset, *, reader, sample_reader, method, extra, sixteen, excluded):
    CALLS.append("quantizer_config")
    return dict(calibration_data_reader=reader, quant_format=ortq.QuantFormat.QDQ,
                activation_type=ortq.QuantType.QUInt8, weight_type=ortq.QuantType.QInt8, per_channel=False,
                calibrate_method=method, nodes_to_exclude=excluded,
                extra_options={"WeightSymmetric": True, "ActivationSymmetric": False, **extra})


class _Session:
    def __init__(self, model):
        self.quiet = create_session(model, "all")

    def run(self, feeds, names=None):
        return self.quiet.run(names, feeds)


@dataclasses.dataclass
class _Placement:
    cpu: list


class _Compiled:
    def __init__(self, model):
        self.session, self.placement = _Session(model), _Placement([])

    def discard(self):
        CALLS.append("discard")

    def commit_context(self):
        CALLS.append("commit_context")


def compile(model, report, *, options, require_npu, context, input_values):  # noqa: A001
    CALLS.append("compile")
    return _Compiled(model)


class Runner:
    def __init__(self, options):
        CALLS.append("Runner")

    def outputs(self, model, samples, names):
        session = create_session(model, "all")
        return [session.run(names, s) for s in samples]


@dataclasses.dataclass
class Accuracy:
    htp_vs_float: float
    cpu_vs_float: float
    htp_vs_cpu: float
    outputs: dict


def accuracy(float_model, qdq_model, samples, *, session):
    CALLS.append("accuracy")
    names = [o.name for o in float_model.graph.output]
    reference = create_session(float_model, "disabled")
    f = [reference.run(names, dict(s))[0].astype(np.float64) for s in samples]
    q = [session.run(dict(s), names)[0].astype(np.float64) for s in samples]
    db = 10 * np.log10(sum((a ** 2).sum() for a in f) / sum(((a - b) ** 2).sum() for a, b in zip(f, q)))
    return Accuracy(float(db), float(db), float("inf"), {names[0]: float(db)})
'''


def two_convs() -> onnx.ModelProto:
    r = rng(1)
    nodes = [helper.make_node("Conv", ["x", "W1"], ["y1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "W2"], ["out"], name="conv2", pads=[1, 1, 1, 1])]
    inits = [tensor("W1", r.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)),
             tensor("W2", r.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32))]
    return model(nodes, [vinfo("x", [1, 3, 8, 8])], [vinfo("out", [1, 4, 8, 8])], inits)


def test_a_new_npu_is_a_target_module_and_a_device_module(tmp_path, monkeypatch):
    (tmp_path / "toy_npu_target.py").write_text(textwrap.dedent(TARGET_MODULE))
    (tmp_path / "toy_npu_device.py").write_text(textwrap.dedent(DEVICE_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    # the registry rows a target module adds (opfuse/targets/__init__.py), and a preset naming it
    monkeypatch.setitem(opfuse.targets.TARGET_MODULES, "toy-npu", "toy_npu_target")
    monkeypatch.setitem(opfuse.targets.TARGET_DEFAULT_PASSES, "toy-npu", opfuse.targets.TARGET_DEFAULT_PASSES["onnx"])
    monkeypatch.setattr(opfuse.pipeline, "TARGETS", (*opfuse.pipeline.TARGETS, "toy-npu"))
    monkeypatch.setitem(PRESETS, "toy", Preset("toy", "a toy NPU's int8", "uint8", "int8", per_channel=False,
                                               steps=(Ranges(), BiasCorrection(), MixedPrecision()),
                                               target="toy-npu"))
    r = np.random.default_rng(2)
    samples = [{"x": r.normal(0, 1, (1, 3, 8, 8)).astype(np.float32)} for _ in range(8)]
    q, report = opfuse.quantize(two_convs(), samples, preset="toy", holdout=2, htp_options={"a": "1"},
                                output=tmp_path / "q.onnx")
    calls = sys.modules["toy_npu_device"].CALLS
    assert calls[:2] == ["require_backend", "parse"]  # before any work
    assert {"quantizer_config", "Runner", "compile", "accuracy", "commit_context"} <= set(calls)
    assert calls.index("compile") < calls.index("accuracy") < calls.index("commit_context")
    v = report.verification
    assert v.runtime == "toy NPU (1 option(s))" and v.cpu_qdq_sqnr_db is not None and v.ok
    assert report.quantize_linear > 0 and (tmp_path / "q.onnx").exists()
    assert [s["step"] for s in report.steps] == ["ranges", "bias-correction", "mixed-precision"]
    assert opfuse.quantization.quantize is opfuse.quantize
