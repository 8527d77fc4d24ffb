"""ONNX Runtime's tools are loaded without their package's __init__, which imports torch wherever it is
installed (about 0.5 GB resident and seconds of start-up in every run that infers symbolic shapes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_symbolic_shapes_and_static_shapes_do_not_import_torch():
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import onnx_ir as ir
        from onnx import TensorProto, helper
        from opfuse.core.symbolic_shapes import run_tool
        from opfuse.prepare.static_shapes import make_static
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
        graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
        model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
        assert run_tool(model, auto_merge=True) is not None
        make_static(model, {"batch": 1, "seq": 3})
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
