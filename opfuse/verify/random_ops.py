"""Ops that draw random numbers: which nodes they are, and copies in which each draws from a fixed seed.

A model with a ``RandomNormal(Like)``, ``RandomUniform(Like)``, ``Multinomial`` or
``Bernoulli`` node, or a ``Dropout`` in training mode (its ``training_mode`` input true, or
not a constant), computes different numbers on every run unless the node has a ``seed``
attribute (a VITS voice draws its noise with two ``RandomNormalLike``; the length of its
output follows the draw). Comparing two runs of such a model compares two draws.

How verification makes them comparable (:func:`seed_random_nodes`):

1. In **private copies** of both models, each such node without a ``seed`` gets one, a
   function of the node's name alone (:func:`seed_for`), so the same node draws the same
   numbers in the original and in the rewritten model (rewrites never touch these nodes,
   and unnamed nodes are labelled before any rewrite). A node that has a seed keeps it.
2. ONNX Runtime's random kernels keep their generator between runs of one session, so
   both models run in **fresh sessions, on the same input sets in the same order**: the
   k-th run of each draws the same numbers.
3. The written model keeps its own attributes (the copies are private; a model derived
   from a seeded copy, as ``opfuse quantize`` quantises one, drops the seeds given:
   :func:`drop_given_seeds`).

The ``seed`` attribute is a float for the random ops and an int for Dropout (ONNX's schemas).
"""

from __future__ import annotations

__all__ = ["RANDOM_OPS", "draws_random", "random_nodes", "seed_for", "seed_random_nodes", "drop_given_seeds",
           "describe_random"]

import zlib
from collections import Counter

import onnx_ir as ir

from opfuse.core.analysis import Constant, find_constant, iter_scopes
from opfuse.core.ops import is_onnx

# op -> the type of its ``seed`` attribute (the draw itself is the op's own rule)
RANDOM_OPS: dict[str, ir.AttributeType] = {
    "RandomNormal": ir.AttributeType.FLOAT,
    "RandomNormalLike": ir.AttributeType.FLOAT,
    "RandomUniform": ir.AttributeType.FLOAT,
    "RandomUniformLike": ir.AttributeType.FLOAT,
    "Multinomial": ir.AttributeType.FLOAT,
    "Bernoulli": ir.AttributeType.FLOAT,
    "Dropout": ir.AttributeType.INT,
}
TRAINING_MODE_INPUT = 2  # Dropout(data, ratio, training_mode), opset 12 on


def draws_random(node: ir.Node) -> bool:
    """Whether ``node`` draws random numbers at run time."""
    if not is_onnx(node) or node.op_type not in RANDOM_OPS:
        return False
    if node.op_type != "Dropout":
        return True
    if len(node.inputs) <= TRAINING_MODE_INPUT or node.inputs[TRAINING_MODE_INPUT] is None:
        return False  # inference mode: an Identity (older opsets have no training input)
    mode = find_constant(node.inputs[TRAINING_MODE_INPUT])
    return not (isinstance(mode, Constant) and not bool(mode.array.reshape(-1)[0]))


def random_nodes(model: ir.Model) -> list[ir.Node]:
    """Every node of every graph of ``model`` that draws random numbers, in graph order."""
    return [node for scope in iter_scopes(model) for node in scope.graph if draws_random(node)]


def seed_for(node: ir.Node) -> int:
    """The seed given to ``node``: a function of its name only (so equal in both models)."""
    return zlib.crc32(f"{node.op_type}/{node.name}".encode()) & 0x7FFF_FFFF


def seed_random_nodes(model: ir.Model) -> dict[str, int | float | None]:
    """Give every random node of ``model`` (a private copy: it is changed) a fixed seed.

    Returns node name -> the seed it draws from (None: it kept its own).
    """
    given: dict[str, int | float | None] = {}
    for node in random_nodes(model):
        if "seed" in node.attributes:
            given[node.name] = None
            continue
        seed = seed_for(node)
        if RANDOM_OPS[node.op_type] is ir.AttributeType.INT:
            node.attributes["seed"] = ir.AttrInt64("seed", seed)
        else:
            node.attributes["seed"] = ir.AttrFloat32("seed", float(seed))
        given[node.name] = seed
    return given


def drop_given_seeds(model: ir.Model, seeded: dict[str, int | float | None]) -> None:
    """Remove the seeds :func:`seed_random_nodes` gave (by node name) from a model derived
    from the seeded copy, so the model written keeps the attributes it came with."""
    given = {name for name, seed in seeded.items() if seed is not None}
    for node in random_nodes(model):
        if node.name in given:
            node.attributes.pop("seed", None)


def describe_random(seeded: dict[str, int | float | None], ops: Counter) -> str:
    """One sentence for the report: which random ops there are and how they were compared."""
    shown = ", ".join(f"{n} {op}" for op, n in sorted(ops.items()))
    names = ", ".join(f"'{n}'" for n in list(seeded)[:4]) + (", ..." if len(seeded) > 4 else "")
    fixed = sum(1 for s in seeded.values() if s is not None)
    how = (f"{fixed} given a fixed seed from its name in private copies of both models (the written "
           "model keeps its own attributes)" if fixed else "all have their own seed")
    kept = len(seeded) - fixed
    return (f"random ops: {shown} ({names}) draw random numbers; {how}"
            + (f", {kept} kept their own seed" if fixed and kept else "")
            + "; both models ran in fresh sessions on the same input sets in the same order, so each "
            "draws the same numbers")
