"""What the ONNX-in-torch interpreter's two halves share: the function type, the refusal
(:class:`Unsupported`), the attribute reader that remembers what it read, and the readers of
optional, integer and float inputs. :mod:`.torch_ops` (the table and the element-wise, shape
and reduction builders) and :mod:`.torch_nn_ops` (the neural-network builders) both import
this module, and neither imports the other back.
"""

from __future__ import annotations

__all__ = ["Function", "Unsupported"]

from collections.abc import Callable
from typing import Any, NoReturn

import onnx
import torch
from onnx import helper

Function = Callable[[list], Any]  # what a builder returns: one output, or a list of them (Split)


class Unsupported(Exception):
    """The node cannot be interpreted here; ``str(e)`` is one short reason, e.g.
    "Resize mode 'cubic' is not interpreted"."""


class _Attributes:
    """A node's attributes as Python values (strings decoded), remembering which were read."""

    def __init__(self, node: onnx.NodeProto, opset: int):
        self.op = node.op_type
        self.opset = opset
        self.node = node
        self._values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        self._read: set[str] = set()

    def __call__(self, name: str, default=None):
        self._read.add(name)
        value = self._values.get(name, default)
        return value.decode() if isinstance(value, bytes) else value

    def choice(self, name: str, default, allowed):
        value = self(name, default)
        if value not in allowed:
            self.refuse(f"{name} {value!r}")
        return value

    def ignore(self, *names: str) -> None:
        """Attributes that change nothing at inference (Dropout's seed, BatchNorm's momentum)."""
        self._read.update(names)

    def refuse(self, what: str) -> NoReturn:
        raise Unsupported(f"{self.op} {what} is not interpreted")

    def unread(self) -> list[str]:
        return sorted(set(self._values) - self._read)


def _output_name(op: str, opset: int, index: int) -> str:
    try:
        return onnx.defs.get_schema(op, opset, "").outputs[index].name
    except (onnx.defs.SchemaError, IndexError):
        return str(index)


def _optional(xs: list, index: int):
    return xs[index] if index < len(xs) else None


def _ints(t: torch.Tensor | None) -> list[int] | None:
    return None if t is None else [int(v) for v in t.reshape(-1).tolist()]


def _floats(t: torch.Tensor | None) -> list[float] | None:
    return None if t is None else [float(v) for v in t.reshape(-1).tolist()]


def _item(t: torch.Tensor | None, default):
    return default if t is None else t.reshape(-1)[0].item()
