"""Qualcomm's HTP (Hexagon NPU) through ONNX Runtime's QNN execution provider.

``onnxruntime-qnn`` (the ``opfuse[qnn]`` extra) ships QNN's HTP backend, which compiles a
graph and runs it with the NPU's arithmetic (emulated on x86 Linux). It loads into
ONNX Runtime as a plugin execution provider. This package owns:

- :mod:`.backend` - whether the backend is installed, the HTP options (SoC, architecture,
  VTCM), opening a session on it (strict: no CPU fallback) and capturing its compile log;
- :mod:`.placement` - reading that log: each node's validation (passed, or QNN's reason),
  the nodes on QNN, its partitions and the nodes left on the CPU, with the fix opfuse
  knows for each reason;
- :mod:`.runner` - running samples on the HTP (outputs, SQNR against float and against
  ONNX Runtime's CPU QDQ);
- :mod:`.compile` - the compile step and the EPContext model (``--context FILE``);
- :mod:`.conventions` - how ONNX Runtime's quantiser is configured for the HTP;
- :mod:`.device` - the interface both pipelines reach the HTP through (``Target.device``).

The target as data (what QNN runs as one op, what must be unfused) is
:mod:`opfuse.targets.qnn`.
"""
