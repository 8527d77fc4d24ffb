"""The device interface of the ``qnn`` target (:attr:`opfuse.targets.kernels.Target.device`).

A target whose compiler opfuse can run names a module like this one; the pipeline compiles
the optimised model through it without knowing which device it is:

- ``require_backend()`` - the backend is installed, or one line with the install command (exit 2);
- ``Options.parse(pairs)`` - the backend's options from ``--htp KEY=VALUE`` pairs;
- ``compile(model, report, options=, require_npu=, context=)`` - the compile log, as the
  report's ``device`` section (:func:`opfuse.qnn.compile.compile_on_htp`).
"""

from opfuse.qnn.backend import HtpOptions as Options
from opfuse.qnn.backend import require_backend
from opfuse.qnn.compile import compile_on_htp as compile  # noqa: A001 - the interface's name

__all__ = ["Options", "require_backend", "compile"]
