"""The device interface of the ``qnn`` target (:attr:`opfuse.targets.kernels.Target.device`).

A target whose compiler opfuse can run names a module like this one; both pipelines reach the
device through it alone, without knowing which device it is (``optimize`` in
:mod:`opfuse.pipeline`, ``quantize`` in :mod:`opfuse.quantization.pipeline`, for a preset
whose ``target`` names this target). Adding an NPU is a target module and a module like
this one, with every name below:

- ``TITLE`` - the device as the report names where the model ran ("QNN HTP backend"), and
  ``NAME`` as a note names it ("the tuning output SQNR on the HTP");
- ``require_backend()`` - the backend is installed, or one line with the install command (exit 2);
- ``Options.parse(pairs)`` - the backend's options from ``--htp KEY=VALUE`` pairs (an object
  with ``describe()``, the options in words);
- ``compile(model, report, options=, require_npu=, context=, input_values=)`` - the compile
  log, as the report's ``device`` section (:func:`opfuse.targets.qnn.compile.compile_on_htp`); it has
  ``session`` (with ``quiet``, an ``InferenceSession``-like view for a caller's metric),
  ``placement.cpu`` (the nodes left on the CPU), ``discard()`` and ``commit_context()``;
- ``quantizer_config(float_path, float_model, preset, reader=, sample_reader=, method=,
  extra=, sixteen=, excluded=)`` - the keyword arguments of ONNX Runtime's
  ``quantize_static`` by the device's quantisation conventions (:mod:`opfuse.targets.qnn.conventions`);
- ``FINISH_QDQ(model) -> notes`` (optional) - each QDQ model the quantiser writes, put in the form the
  device's compiler runs, in place (qnn: :func:`opfuse.targets.qnn.conventions.float_attention_presents`);
- ``Runner(options)`` - runs models on the device: ``outputs(model, samples, names)``, the
  guards of AdaRound and bias correction (:mod:`opfuse.targets.qnn.runner`);
- ``accuracy(float_model, qdq_model, samples, session=)`` - the held-out SQNRs against the
  float model (``htp_vs_float``, ``cpu_vs_float``, ``htp_vs_cpu``, ``outputs`` per output).
"""

from opfuse.targets.qnn.backend import HtpOptions as Options
from opfuse.targets.qnn.backend import require_backend
from opfuse.targets.qnn.compile import compile_on_htp as compile  # noqa: A001 - the interface's name
from opfuse.targets.qnn.conventions import float_attention_presents as FINISH_QDQ  # noqa: N812 (the interface's name)
from opfuse.targets.qnn.conventions import quantizer_config
from opfuse.targets.qnn.conventions import wants_ranges as WANTS_RANGES  # noqa: N812 (a model's question)
from opfuse.targets.qnn.runner import HtpRunner as Runner
from opfuse.targets.qnn.runner import htp_accuracy as accuracy

TITLE = "QNN HTP backend"
NAME = "HTP"

__all__ = ["TITLE", "NAME", "Options", "require_backend", "compile", "quantizer_config", "WANTS_RANGES", "FINISH_QDQ",
           "Runner", "accuracy"]
