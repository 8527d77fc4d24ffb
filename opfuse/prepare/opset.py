"""Raising a model's opset: onnx's version converter, opt-in (``opfuse optimize --opset N``).

A standard op a pattern becomes may need a newer opset than the model has
(LayerNormalization 17, Gelu 20, RMSNormalization and Attention 23, Swish 24). opfuse never
raises the opset on its own: ``--opset N`` asks for it, and the converter's adapters rewrite
the ops whose signature changed (ReduceMean's axes become an input at 18...). The upgrade
is checked with the rewrites: verification runs the original against the result.

A lower ``N`` than the model's is refused (opfuse does not lower opsets), as is a model
the converter cannot upgrade (one line with its reason).
"""

from __future__ import annotations

__all__ = ["upgrade_opset"]

import onnx
import onnx.version_converter
import onnx_ir as ir

from opfuse.core.analysis import opset_of
from opfuse.errors import BadInputError
from opfuse.core.ops import first_line


def upgrade_opset(model: ir.Model, opset: int) -> tuple[ir.Model, str | None]:
    """``model`` at default-domain ``opset`` (a new model when converted), and a note."""
    current = opset_of(model.opset_imports)
    if opset < current:
        raise BadInputError(f"--opset {opset} is below the model's opset {current}; opfuse does not lower opsets")
    if opset == current:
        return model, None
    if opset > onnx.defs.onnx_opset_version():
        raise BadInputError(f"--opset {opset}: this onnx knows opsets up to {onnx.defs.onnx_opset_version()}")
    ir.external_data.load_to_model(model)  # the converter reads a proto: weights in memory
    try:
        proto = onnx.version_converter.convert_version(ir.serde.serialize_model(model), opset)
    except Exception as e:  # noqa: BLE001 - the converter raises many kinds
        raise BadInputError(f"onnx's version converter cannot raise the model from opset {current} to "
                            f"{opset}: {first_line(e, 200)}") from None
    return ir.serde.deserialize_model(proto), f"opset raised {current} -> {opset} with onnx's version converter (--opset)"
