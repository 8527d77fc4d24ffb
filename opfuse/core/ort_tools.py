"""ONNX Runtime's Python tools (``onnxruntime.tools``: symbolic shape inference, the model utilities),
loaded without their package's ``__init__``, which imports torch wherever it is installed (for a
PyTorch export helper opfuse does not use): measured, about 0.5 GB of resident memory and seconds of
start-up added to every run that infers symbolic shapes (a decoder's attention checks). Each tool is
a module of its own (absolute imports only), loaded from its file under a private name; where the
package is already imported, its own module is used.
"""

from __future__ import annotations

__all__ = ["ort_tool"]

import importlib.util
import os
import sys
import threading
from types import ModuleType

_LOCK = threading.Lock()


def ort_tool(name: str) -> ModuleType:
    """``onnxruntime.tools.<name>`` (``symbolic_shape_infer``, ``onnx_model_utils``), loaded once."""
    public = f"onnxruntime.tools.{name}"
    if public in sys.modules:
        return sys.modules[public]
    private = f"opfuse.core._ort_tools.{name}"
    with _LOCK:
        if private in sys.modules:
            return sys.modules[private]
        package = importlib.util.find_spec("onnxruntime")
        path = os.path.join(list(package.submodule_search_locations)[0], "tools", f"{name}.py")
        spec = importlib.util.spec_from_file_location(private, path)
        if spec is None or spec.loader is None or not os.path.isfile(path):
            return importlib.import_module(public)  # (another layout: the package's own import)
        module = importlib.util.module_from_spec(spec)
        sys.modules[private] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[private]
            raise
        return module
