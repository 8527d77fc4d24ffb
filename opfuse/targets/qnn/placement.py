"""QNN's compile log, read: each node's validation, the partitions, the nodes left on the CPU.

Two sources, both captured by :func:`opfuse.targets.qnn.backend.open_session`:

1. **Placement** - ONNX Runtime's record of the execution provider of each node
   (``get_provider_graph_assignment_info()``): a list of subgraphs, each an EP name and its
   nodes. The QNN subgraphs are the partitions QNN compiles; the CPU subgraphs' nodes are
   the fallbacks, under their own names (the NHWC layout transformation renames only the
   nodes QNN took, ``conv`` -> ``conv_token_1``, and adds Transposes around them).
2. **Validation** - the QNN provider's verbose log. For every node unit (one node, or a
   QDQ group DQ -> op -> Q) it writes::

       ... LogNodeSupport] Validation FAILED for 1 nodes in OrtNodeUnit (Erf) :
       <TAB>Operator type: Erf Node name: erf Node index: 1
       <TAB>REASON : Operators of type `Erf` are not supported by QNN EP.Erf node ...

   once before the layout transformation ("GetCapability pass 1") and once after it. A
   node's reason is the last FAILED record under its name.

A model node is **on QNN** when it is not on the CPU and the log saw it (validated or
placed); **removed** when neither saw it (ONNX Runtime's own optimisations folded it before
placement); **on the CPU** when a CPU subgraph holds it. Each CPU node is a
:class:`Fallback` with QNN's reason and, where opfuse knows one, the fix: from the model
where the reason does not say enough (an ``If`` and its branches, whose condition a
``--constant-input`` decides: :mod:`.branches`), else from the reason (:data:`FIXES`).
"""

from __future__ import annotations

__all__ = ["NodeCheck", "Fallback", "Placement", "FIXES", "is_log_line", "parse_validation"]

import dataclasses
import re
from collections.abc import Iterable, Sequence

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_VALIDATION = re.compile(r"Validation (PASSED|FAILED) for (\d+) nodes in OrtNodeUnit \(([^)]*)\)")
_NODE = re.compile(r"^\s*Operator type: (\S+) Node name: (.*?) Node index: (\d+)\s*$")
_REASON = re.compile(r"^\s*REASON\s*:\s*(.*)$")
_PASS = re.compile(r"GetCapability pass (\d+)")
_ERROR = re.compile(r"\[E:onnxruntime|\bERROR\b|QNN_COMMON_ERROR|error code", re.IGNORECASE)
QNN_EP = "QNNExecutionProvider"

# (a phrase of QNN's reason, what the user can do): the first match is the fix shown
FIXES: tuple[tuple[str, str], ...] = (
    ("Cannot get shape", "QNN compiles static shapes only: bind every symbolic dimension with --dim NAME=VALUE "
                         "(in quantize, the calibration samples' shapes bind them)"),
    ("Dynamic shape", "QNN compiles static shapes only: bind every symbolic dimension with --dim NAME=VALUE"),
    ("Operators of type `Erf`", "an Erf outside a GELU has no QNN op; opfuse fuses the Erf form of GELU into "
                                "Gelu for --target qnn, so this Erf is not part of one"),
    ("data type", "QNN's HTP runs quantised (8/16-bit) or float16 arithmetic: quantise the model "
                  "(opfuse quantize --preset qnn)"),
    ("Unsupported data type", "quantise the model (opfuse quantize --preset qnn)"),
    # ONNX Runtime's decoder fusions (a model exported for its CPU provider): the standard forms run whole
    ("`SkipSimplifiedLayerNormalization`", "QNN runs the Add and RMSNormalization (opset 23) it fuses; write "
                                           "them separately (opfuse writes RMSNorm so for --target qnn)"),
    ("`SkipLayerNormalization`", "QNN runs the Add and LayerNormalization it fuses; write them separately"),
    ("not com.microsoft.RotaryEmbedding", "QNN runs the standard RotaryEmbedding (opset 23): opfuse writes "
                                          "rotary so for --target qnn --opset 23"),
    ("GroupQueryAttention filtered off", "QNN runs the standard Attention (opset 23) with past_key/past_value "
                                         "and fewer key heads: opfuse writes attention so for --target qnn --opset 23"),
)


def is_log_line(line: str) -> bool:
    """Whether the capture keeps ``line`` (the verbose log also dumps every tensor)."""
    return ("LogNodeSupport" in line or "GetCapability pass" in line or line.startswith("\t")
            or bool(_ERROR.search(line)))


@dataclasses.dataclass(frozen=True)
class NodeCheck:
    """QNN's validation of one node: passed, or its reason."""

    name: str
    op_type: str
    passed: bool
    reason: str = ""
    unit: str = ""  # the node unit it was validated in ("Conv": a QDQ group around a Conv)
    stage: int = 1  # 1: before the NHWC layout transformation, 2: after

    @property
    def label(self) -> str:
        return f"{self.name} ({self.op_type})"


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A node that runs on the CPU, with QNN's reason and the fix opfuse knows."""

    name: str
    op_type: str
    reason: str
    fix: str = ""

    def sentence(self) -> str:
        why = f"QNN: {self.reason}" if self.reason else "QNN gave no reason in its log"
        return f"{self.name} ({self.op_type}) runs on the CPU; {why}" + (f"; fix: {self.fix}" if self.fix else "")


def fix_for(reason: str) -> str:
    return next((fix for phrase, fix in FIXES if phrase.lower() in reason.lower()), "")


def parse_validation(lines: Iterable[str]) -> list[NodeCheck]:
    """Every node validation record of the log, in order."""
    checks: list[NodeCheck] = []
    stage, pending, verdict, unit = 1, [], None, ""

    def flush(reason: str = "") -> None:
        nonlocal pending, verdict
        for op, name in pending:
            checks.append(NodeCheck(name, op, verdict == "PASSED", reason, unit, stage))
        pending, verdict = [], None

    for raw in lines:
        line = _ANSI.sub("", raw)
        if m := _PASS.search(line):
            flush()
            stage = int(m.group(1))
        elif m := _VALIDATION.search(line):
            flush()
            verdict, unit = m.group(1), m.group(3)
        elif verdict and (m := _NODE.match(line)):
            pending.append((m.group(1), m.group(2)))
        elif verdict and (m := _REASON.match(line)):
            flush(m.group(1).strip())
        elif verdict and not line.startswith("\t"):
            flush()
    flush()
    return checks


@dataclasses.dataclass
class Placement:
    """Where each node runs on the HTP backend, and why a node did not go to QNN."""

    checks: list[NodeCheck]
    partitions: list[list[tuple[str, str]]]  # QNN's subgraphs: (name, op type) as placed
    cpu: list[tuple[str, str]]  # the nodes of the CPU subgraphs
    model_nodes: list[tuple[str, str]]  # the model's own nodes, (name, op type)
    errors: list[str] = dataclasses.field(default_factory=list)  # the log's error lines
    # node name -> a fix that needs the model, not QNN's reason (an If a binding removes: .branches)
    fixes: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_log(cls, log: Sequence[str], assignment: Iterable, model_nodes: list[tuple[str, str]]) -> Placement:
        """``assignment``: ``get_provider_graph_assignment_info()``'s subgraphs."""
        partitions, cpu = [], []
        for sub in assignment:
            nodes = [(n.name, n.op_type) for n in sub.get_nodes()]
            if sub.ep_name == QNN_EP:
                partitions.append(nodes)
            else:
                cpu.extend(nodes)
        errors = [_ANSI.sub("", line).strip() for line in log if _ERROR.search(line) and "REASON" not in line]
        return cls(parse_validation(log), partitions, cpu, model_nodes, errors)

    # -- queries ---------------------------------------------------------------------------
    def failed_checks(self) -> list[NodeCheck]:
        """The last FAILED validation of each node that has one, in log order."""
        last: dict[str, NodeCheck] = {}
        for c in self.checks:
            if not c.passed:
                last[c.name] = c
        return list(last.values())

    def reason(self, name: str) -> str:
        return next((c.reason for c in reversed(self.checks) if c.name == name and not c.passed), "")

    @property
    def fallbacks(self) -> list[Fallback]:
        out = []
        for name, op in self.cpu:
            reason = self.reason(name)
            out.append(Fallback(name, op, reason, self.fixes.get(name) or fix_for(reason)))
        return out

    @property
    def on_qnn(self) -> list[str]:
        """The model's nodes that QNN runs."""
        if not self.model_nodes:
            return [name for part in self.partitions for name, _ in part]
        cpu = {name for name, _ in self.cpu}
        return [name for name, _ in self.model_nodes if name not in cpu and name in self._seen()]

    @property
    def removed(self) -> list[str]:
        """The model's nodes that neither the log nor the placement saw (folded by ONNX Runtime)."""
        seen = self._seen() | {name for name, _ in self.cpu}
        return [name for name, _ in self.model_nodes if name not in seen]

    def _seen(self) -> set[str]:
        return {c.name for c in self.checks} | {name for part in self.partitions for name, _ in part}

    @property
    def all_on_npu(self) -> bool:
        return not self.cpu and bool(self.partitions)

    def summary(self) -> str:
        total = len(self.model_nodes) or len(self.on_qnn) + len(self.cpu)
        parts = [f"{len(self.on_qnn)} of {total} nodes on the HTP in {len(self.partitions)} partition(s)",
                 f"{len(self.cpu)} on the CPU"]
        if self.removed:
            parts.append(f"{len(self.removed)} removed by ONNX Runtime before placement")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return {
            "summary": self.summary(),
            "nodes": len(self.model_nodes),
            "on_qnn": len(self.on_qnn),
            "partitions": len(self.partitions),
            "partition_sizes": [len(p) for p in self.partitions],
            "on_cpu": [dataclasses.asdict(f) for f in self.fallbacks],
            "removed": self.removed,
            "failed_validation": [dataclasses.asdict(c) for c in self.failed_checks()],
            "errors": self.errors,
        }
