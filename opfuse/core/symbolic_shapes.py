"""Symbolic shape inference: dims that stay names (``batch``, ``seq``) through shape arithmetic.

onnx's inference gives a Reshape whose target is computed from ``Shape`` a fresh unknown
dim for each axis (``unk__18``), so two tensors of the same [batch, seq, heads, size] look
different, and a pattern rule that checks they agree (attention's) refuses. ONNX Runtime's
symbolic shape inference (``onnxruntime.tools.symbolic_shape_infer``, sympy-based) follows
Shape, Gather, Concat and arithmetic and keeps the names: this module runs it and gives the
model's values the dims it found. Nothing in the graph changes.

Best effort: a model it cannot infer (an op it does not know, an inconsistency) keeps the
shapes it had, and the rules that need a shape refuse with their reason.
"""

from __future__ import annotations

__all__ = ["infer_symbolic_shapes", "run_tool", "tool_quiet"]

import contextlib
import logging

import numpy as np
import onnx
import onnx_ir as ir

from opfuse.core.analysis import _inference_proto  # (the same proto onnx's inference reads)
from opfuse.core.dims import ANONYMOUS_PREFIX
from opfuse.core.ort_tools import ort_tool

logger = logging.getLogger(__name__)


def infer_symbolic_shapes(model: ir.Model) -> bool:
    """Give the main graph's values ONNX Runtime's symbolic shapes; whether it ran.

    The tool's ``auto_merge`` makes two dims one where a broadcasting op meets them; that
    is an assumption (the model runs only if they are equal or 1), so when it merges two of
    the model's own input dims (``W1`` and ``W2``: the user may feed different sizes), the
    result is not used at all.
    """
    inputs = {d.value for v in model.graph.inputs if v.shape is not None
              for d in v.shape if not isinstance(d, int) and d.value is not None}
    tool = run_tool(model, auto_merge=True)
    if tool is None:
        return False
    inferred, merges = tool.out_mp_, dict(tool.suggested_merge_)
    if any(k in inputs and v in inputs and k != v for k, v in merges.items()):
        logger.info("symbolic shape inference assumed input dims equal (%s); not used", merges)
        return False
    shapes, dtypes = {}, {}
    for info in (*inferred.graph.value_info, *inferred.graph.output):
        if not info.type.HasField("tensor_type") or not info.type.tensor_type.HasField("shape"):
            continue
        dims = []
        for d in info.type.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.dim_param:
                dims.append(d.dim_param)
            else:
                dims.append(None)
        shapes[info.name] = dims
        dtypes[info.name] = info.type.tensor_type.elem_type
    for value in ir.convenience.create_value_mapping(model.graph).values():
        dims = shapes.get(value.name)
        if dims is None or not _less_known(value.shape, dims):
            continue
        if value.type is None:
            # a value onnx's inference gave no type (an op it does not know): the tool's element
            # type with it, as a shape without a type is no value_info (onnx-ir drops it on
            # saving, with a warning per value)
            if not dtypes[value.name]:
                continue
            value.dtype = ir.DataType(dtypes[value.name])
        value.shape = ir.Shape(dims)
    return True


@contextlib.contextmanager
def tool_quiet():
    """The tool's warnings ("unsupported broadcast") silenced inside, through its own logger
    (with its ``verbose=0``, its only output), whose level is restored on every exit. A
    logger's level is process-wide: another thread's use of the tool meanwhile is silenced
    too, and two calls overlapping on two threads can leave it at ERROR (the later one
    restores the level the earlier set): not reentrant across threads."""
    SymbolicShapeInference = ort_tool("symbolic_shape_infer").SymbolicShapeInference  # (sympy: heavy)

    tool_logger = logging.getLogger(SymbolicShapeInference.__module__)  # (the tool prints nothing itself)
    level = tool_logger.level
    tool_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tool_logger.setLevel(level)


def run_tool(model, *, auto_merge: bool):
    """ONNX Runtime's SymbolicShapeInference run over ``model`` (an ``ir.Model``, or the
    ``ModelProto`` to read) - its ``sympy_data_`` holds the values of shape tensors, its
    ``known_vi_`` the inferred types - or None when it fails. ``auto_merge`` lets it
    assume two dims equal where a broadcast meets them."""
    try:
        with tool_quiet():  # its warnings ("unsupported broadcast") are no user's concern
            # (not its infer_shapes, which writes a file on failure); verbose=0: it logs only warnings
            tool = _tool_class()(2**31 - 1, auto_merge, False, 0)
            tool._preprocess(model if isinstance(model, onnx.ModelProto) else _inference_proto(model))
            while tool.run_:
                tool._infer_impl()
            tool._update_output_from_vi()
    except Exception as e:  # noqa: BLE001 - the tool raises many kinds
        logger.info("symbolic shape inference failed: %s", e)
        return None
    return tool


_TOOL = None


def _tool_class():
    """The tool with one correction (:meth:`_infer_Slice`), made once on first use (sympy: heavy).

    The tool reads a negative constant start or end of a Slice on a symbolic dim ``n`` as
    ``n + start`` without the clamp at 0, so ``x[:, :, -4095:]`` (a sliding-window cache) comes
    out 4095 long, as if ``n >= 4095``; every shape computed from it, and folded into a
    constant, would then be wrong for a shorter ``n``. The corrected handler gives such an
    axis a dim of its own (unknown) unless the index is -1 (any non-empty axis has its last).
    """
    global _TOOL
    if _TOOL is not None:
        return _TOOL
    tool = ort_tool("symbolic_shape_infer")  # (sympy: heavy)
    SymbolicShapeInference, get_opset, is_literal = tool.SymbolicShapeInference, tool.get_opset, tool.is_literal

    class Tool(SymbolicShapeInference):
        def _infer_Slice(self, node):  # noqa: N802 - the tool's own naming
            super()._infer_Slice(node)
            if get_opset(self.out_mp_) <= 9 or len(node.input) < 3:
                return
            starts, ends = self._try_get_value(node, 1), self._try_get_value(node, 2)
            axes = self._try_get_value(node, 3) if len(node.input) > 3 and node.input[3] else None
            if starts is None or ends is None:
                return  # (the tool gave every such axis a dim of its own already)
            starts, ends = list(np.atleast_1d(starts)), list(np.atleast_1d(ends))
            axes = list(np.atleast_1d(axes)) if axes is not None else list(range(len(starts)))
            before = self._get_sympy_shape(node, 0)
            vi = self.known_vi_[node.output[0]]
            after = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
            if len(after) != len(before):
                return
            changed = False
            for axis, start, end in zip(axes, starts, ends):
                axis = int(axis) % len(before)
                assumed = any(is_literal(i) and -self.int_max_ < int(i) < -1 for i in (start, end))
                if assumed and not is_literal(before[axis]):
                    after[axis] = self._new_symbolic_dim_from_output(node, 0, axis)
                    changed = True
            if changed:
                shape = [str(d) if not isinstance(d, int) else d for d in after]
                vi.CopyFrom(onnx.helper.make_tensor_value_info(node.output[0], vi.type.tensor_type.elem_type, shape))

    _TOOL = Tool
    return _TOOL


def _less_known(shape, dims) -> bool:
    """Whether ``dims`` say more than ``shape``: none known, or unnamed dims it names."""
    if shape is None:
        return True
    if len(shape) != len(dims):
        return False
    for old, new in zip(shape, dims):
        if isinstance(old, int):
            continue
        if new is not None and (old.value is None or str(old.value).startswith(ANONYMOUS_PREFIX)):
            return True
    return False
