"""Accuracy on the NPU's own arithmetic: samples run on the HTP backend, SQNR three ways.

What ONNX Runtime's CPU computes for a QDQ graph is not what the HTP computes (it
requantises inside fused ops, rounds differently, runs some float ops in fp16): the two
differ (by how much on MobileNetV2: docs/results/measurements.md). So for the ``qnn`` preset the
held-out SQNR is measured on the HTP's outputs (:func:`htp_accuracy`), with the CPU-QDQ
figure beside it:

- **HTP vs float**: the QDQ model on the HTP against the float model on the CPU (the figure
  ``quantize --preset qnn`` judges ``--min-sqnr`` by);
- **CPU-QDQ vs float**: the same QDQ model on ONNX Runtime's CPU (what the usual flow reports);
- **HTP vs CPU-QDQ**: how far the two runtimes of the same QDQ graph are apart.

:class:`HtpRunner` is the runner a search can take (model, samples -> outputs on the HTP;
one compile per model), and :func:`int16_activation_overrides` the QNN way of keeping a
layer: its output activations in 16 bits (``get_qnn_qdq_config``'s ``init_overrides``),
never a float island, which QNN's guide says silently changes numerics.
"""

from __future__ import annotations

__all__ = ["HtpAccuracy", "HtpRunner", "htp_accuracy", "int16_activation_overrides"]

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx

from opfuse.targets.qnn.backend import HtpOptions, HtpSession, open_session
from opfuse.quantization.qdq.sqnr import three_way


@dataclasses.dataclass
class HtpAccuracy:
    """Output SQNR (dB) over the held-out samples, three ways (module docstring)."""

    samples: int
    htp_vs_float: float
    cpu_vs_float: float
    htp_vs_cpu: float
    outputs: dict[str, float]  # per output, HTP vs float

    @property
    def difference(self) -> float:
        """HTP minus CPU-QDQ, each against float (negative: the NPU is worse than the CPU says)."""
        return self.htp_vs_float - self.cpu_vs_float

    def sentence(self) -> str:
        return (f"on the HTP {self.htp_vs_float:.1f} dB against float; ONNX Runtime's CPU QDQ "
                f"{self.cpu_vs_float:.1f} dB ({self.difference:+.1f} dB on the HTP); HTP and CPU QDQ agree to "
                f"{self.htp_vs_cpu:.1f} dB ({self.samples} held-out sample(s))")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "difference": self.difference}


class HtpRunner:
    """Runs models on the HTP backend: ``outputs(model, samples)`` compiles once per call."""

    def __init__(self, options: HtpOptions | None = None, *, strict: bool = False):
        self.options = options or HtpOptions()
        self.strict = strict

    def session(self, model) -> HtpSession:
        return open_session(model, self.options, strict=self.strict)

    def outputs(self, model, samples: Iterable[Mapping[str, np.ndarray]], names: Sequence[str] | None = None,
                session: HtpSession | None = None) -> list[list[np.ndarray]]:
        session = session or self.session(model)
        return [session.run(sample, names) for sample in samples]


def htp_accuracy(float_model: onnx.ModelProto, qdq_model: onnx.ModelProto, samples: Sequence[Mapping[str, np.ndarray]],
                 *, session: HtpSession | None = None, runner: HtpRunner | None = None) -> HtpAccuracy:
    """The three SQNRs of ``qdq_model`` over ``samples`` (``session``: an HTP session of it
    already open; else ``runner`` compiles one)."""
    names = [o.name for o in float_model.graph.output]
    runner = runner or HtpRunner()
    samples = [dict(s) for s in samples]
    on_htp = runner.outputs(qdq_model, samples, names, session=session)
    return HtpAccuracy(len(samples), *three_way(float_model, qdq_model, samples, on_htp, names))


def int16_activation_overrides(float_model: onnx.ModelProto, nodes: Iterable[str]) -> dict[str, list[dict]]:
    """``get_qnn_qdq_config(init_overrides=...)`` keeping ``nodes`` with 16-bit output activations."""
    from onnxruntime.quantization import QuantType  # (the quantiser: heavy, on use)

    wanted = set(nodes)
    return {o: [{"quant_type": QuantType.QUInt16}] for n in float_model.graph.node if n.name in wanted
            for o in n.output if o}
