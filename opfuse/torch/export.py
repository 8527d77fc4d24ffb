"""Fold on the torch side, export to ONNX, run the ONNX pipeline, check end to end.

    model, report = opfuse.torch.export(net.eval(), (x,), "net.onnx")

Steps: :func:`opfuse.torch.fuse` with ``kernels=False`` (BatchNorm folding only: oneDNN
kernel modules are not exportable, and the ONNX side does its own epilogue fusion), then
``torch.onnx.export(..., dynamo=False)`` (the TorchScript exporter, which handles the fx
GraphModule directly), then :func:`opfuse.optimize` on the exported file. With ``verify``
the final ONNX model also runs on ONNX Runtime with the example inputs and is compared
with the *original* torch model, the one check that covers every step; on a mismatch
:class:`opfuse.errors.VerificationError` is raised and nothing is written.

The returned report is the ONNX pipeline's, with the torch-side records, refusals and
notes in front of its own and the torch passes named "torch:..." in ``passes``.
"""

from __future__ import annotations

__all__ = ["export"]

import dataclasses
import os
import pathlib
import tempfile
import warnings
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn
from torch.utils import _pytree as pytree

from opfuse.errors import VerificationError
from opfuse.pipeline import optimize
from opfuse.report import FusionReport
from opfuse.save import needs_external_data, save_model
from opfuse.torch.fuse import fuse
from opfuse.verify import compare_outputs, run_model


def export(
    model: nn.Module,
    example_inputs: Any,
    path: str | os.PathLike,
    *,
    passes=None,
    verify: bool = True,
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
    dynamic_axes: dict | None = None,
    opset_version: int | None = None,
    **optimize_kw: Any,
):
    """Fold ``model`` (eval mode), export it to ONNX at ``path`` and optimise it there.

    ``passes``, ``verify`` and ``optimize_kw`` go to :func:`opfuse.optimize`;
    ``input_names``, ``output_names``, ``dynamic_axes`` and ``opset_version`` to
    ``torch.onnx.export``. Returns ``(onnx_ir.Model, FusionReport)``.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    folded, torch_report = fuse(model, example_inputs, kernels=False, verify=verify)

    export_kw: dict[str, Any] = {"dynamo": False}
    for key, value in (("input_names", input_names), ("output_names", output_names),
                       ("dynamic_axes", dynamic_axes), ("opset_version", opset_version)):
        if value is not None:
            export_kw[key] = value
    with tempfile.TemporaryDirectory(prefix="opfuse-torch-export-") as tmp:
        raw = pathlib.Path(tmp) / "folded.onnx"
        with torch.no_grad(), warnings.catch_warnings():
            # the TorchScript exporter is chosen on purpose: it takes the fx GraphModule as is
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(folded, example_inputs, str(raw), **export_kw)
        feeds = _feeds(raw, example_inputs)
        onnx_model, report = optimize(raw, passes=passes, verify=verify, inputs=feeds,
                                      output=None, **{"tune": False, **optimize_kw})
        if verify and feeds is not None:
            with torch.no_grad():
                expected = [t.detach().numpy() for t in
                            pytree.tree_leaves(model(*example_inputs))
                            if isinstance(t, torch.Tensor)]
            actual = run_model(onnx_model, feeds)
            names = list(actual)
            if len(names) == len(expected):
                checks = compare_outputs(dict(zip(names, expected)), actual)
                for check in checks:
                    report.verification.outputs.append(
                        dataclasses.replace(check, name=f"{check.name} (vs torch)"))
                bad = next((c for c in checks if not c.ok), None)
                if bad is not None:
                    raise VerificationError(
                        f"the ONNX model differs from the torch model at output '{bad.name}': "
                        f"{bad.problem}; nothing was written", _merge(torch_report, report))
            else:
                report.notes.append("end-to-end check skipped: the ONNX model has "
                                    f"{len(names)} outputs, the torch model {len(expected)}")
        save_model(onnx_model, path, external_data=needs_external_data(onnx_model))
    return onnx_model, _merge(torch_report, report)


def _feeds(raw: pathlib.Path, example_inputs: tuple) -> dict[str, np.ndarray] | None:
    """The example inputs keyed by the exported graph's input names (None if they do not
    line up one to one)."""

    graph = onnx.load(str(raw), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}
    names = [i.name for i in graph.input if i.name not in initializers]
    tensors = [t for t in pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor)]
    if len(names) != len(tensors):
        return None
    return {n: t.detach().cpu().numpy() for n, t in zip(names, tensors)}


def _merge(torch_report: FusionReport, onnx_report: FusionReport) -> FusionReport:
    onnx_report.model = torch_report.model or onnx_report.model
    onnx_report.passes = [f"torch:{p}" for p in torch_report.passes] + list(onnx_report.passes)
    onnx_report.records = list(torch_report.records) + list(onnx_report.records)
    onnx_report.refusals = list(torch_report.refusals) + list(onnx_report.refusals)
    notes = list(torch_report.notes)
    tv = torch_report.verification
    if tv is not None and not tv.skipped:
        worst = max((o.max_scaled_error for o in tv.outputs), default=0.0)
        notes.append(f"torch-side fold verified on the example inputs "
                     f"({'passed' if tv.ok else 'FAILED'}, {worst:.2f} of tolerance)")
    onnx_report.notes = notes + list(onnx_report.notes)
    return onnx_report
