"""A GGUF's own quantised blocks (Q4_0, Q4_1, Q8_0) as MatMulNBits and GatherBlockQuantized, not requantised.

What it does (:func:`import_blocks`): transformers dequantises every GGUF tensor to float32 before the
export, so the exported graph's weights are the GGUF's dequantised values, bit for bit (transformers
calls the ``gguf`` package's own ``dequantize``; a Llama's q/k rows are permuted, which moves rows, not
values). Each ``MatMul`` weight [K, N] whose N columns are all rows of quantised GGUF tensors, and each
``Gather`` table [V, K] whose rows are, is found by hashing rows (an order-free integer hash of the
float bits, then an exact comparison), and its blocks are written as they are in the file:

- **Q4_0** (``w = d * (q - 8)``, a float16 ``d`` per 32 weights): MatMulNBits, 4 bits, block 32, the
  codes and ``d`` as they are, no zero points (MatMulNBits' default zero point is 8): exact.
- **Q8_0** (``w = d * q``, ``q`` int8): MatMulNBits with 8 bits, codes ``q + 128`` and zero point 128;
  a table: GatherBlockQuantized with 8 bits the same way: exact.
- **Q4_1** (``w = d * q + m``: a float16 scale ``d`` and a float16 minimum ``m`` per 32): MatMulNBits
  computes ``scale * (q - zero_point)``, and ``m`` is rarely a whole multiple of ``d``. Two forms:

  - ``form="float-zp"``: a float zero point ``-m / d`` (the op's schema allows float zero points). Exact to
    float rounding, but ONNX Runtime 1.32's CPU kernel then dequantises the whole weight on every call
    (docs/results/llm.md), so it is not the default.
  - ``form="residual"`` (default): an integer zero point ``z = round(-m / d)`` clipped to [0, 15] in the
    MatMulNBits, and what it leaves out, ``e = m + d * z`` per block and column, added by two small float
    MatMuls: ``y = MatMulNBits(x) + (x @ S) @ E`` where ``S`` [K, K/32] sums each block of ``x`` (0/1) and
    ``E`` [K/32, N] holds ``e``. Since ``sum_k x_k (d (q_k - z) + e) = sum_k x_k (d q_k + m)``, this is the
    GGUF's weight exactly (to float rounding), with the fast uint8-zero-point kernel; ``x @ S`` is shared
    by every weight that reads the same ``x``, and ``S`` is one initializer per ``K`` for every layer.
    Cost: ``E`` is one float per block (1 bit per weight).
    Where every ``e`` is 0 (``m`` a whole multiple of ``d``: blocks written with integer zero points,
    :func:`write_min_blocks`), the pair is not written.

  A Q4_1 table (an embedding) has no exact GatherBlockQuantized form (its zero points are integers of
  the data's type): it is left to the caller.

``accuracy_level`` (4 by default) is written on every MatMulNBits: the CPU kernel then quantises the
activations to int8 per block, which is not exact; the weights are.

Legality: exact for the weights (each replaced weight equals the GGUF's dequantised weight to float
rounding, which the tests check against ``gguf.quants.dequantize``); a MatMul or Gather whose weight is
not found among the file's quantised rows is left as it is, for the requantiser.
"""

from __future__ import annotations

__all__ = ["FORMS", "GGUF_KINDS", "GgufRows", "import_blocks", "weight_array", "write_min_blocks"]

import dataclasses
import pathlib

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper

from opfuse.core.ops import MS_DOMAIN, ONNX_DOMAINS
from opfuse.errors import BadInputError

BLOCK = 32
GGUF_KINDS = ("Q4_0", "Q4_1", "Q8_0")
FORMS = ("residual", "float-zp")


@dataclasses.dataclass
class _Tensor:
    kind: str
    data: np.ndarray  # uint8 [rows, blocks * bytes per block], the file's bytes (memory-mapped)
    row_length: int


def _split(kind: str, raw: np.ndarray):
    """(codes uint8 [rows, blocks, 32] in element order, d float32 [rows, blocks], m float32 or None)."""
    rows = raw.shape[0]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = raw.reshape(rows, -1, size)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d, None
    start = 2 if kind == "Q4_0" else 4
    qs = blocks[..., start:start + 16]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # low nibbles are elements 0-15, high 16-31
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else None
    return codes, d, m


def weight_array(tensor: onnx.TensorProto, base_dir: str | pathlib.Path | None = None) -> np.ndarray:
    """``tensor``'s values; a tensor whose bytes are external data is read from ``base_dir`` without
    loading them into ``tensor`` (numpy_helper.to_array would keep them in the proto): a model loaded
    without its external data then holds one weight in memory at a time."""
    if base_dir is not None and external_data_helper.uses_external_data(tensor):
        copy = onnx.TensorProto()
        copy.CopyFrom(tensor)
        return numpy_helper.to_array(copy, str(base_dir))
    return numpy_helper.to_array(tensor)


def _dequantize(kind: str, raw: np.ndarray) -> np.ndarray:
    """The float32 rows transformers sees: the gguf package's own dequantisation."""
    from gguf import GGMLQuantizationType  # (gguf (the llm extra): imported when a GGUF is read)
    from gguf.quants import dequantize  # (gguf (the llm extra): imported when a GGUF is read)

    return dequantize(raw, GGMLQuantizationType[kind])


_MULTIPLIERS: dict[int, np.ndarray] = {}


def _row_hash(values: np.ndarray, axis: int) -> np.ndarray:
    """An order-free uint64 hash of float32 rows (axis=1) or columns (axis=0): sum of bits * random odd
    multipliers, modulo 2**64 (integer sums do not depend on the order they are taken in)."""
    length = values.shape[axis]
    mult = _MULTIPLIERS.get(length)
    if mult is None:
        mult = _MULTIPLIERS[length] = np.random.default_rng(length).integers(1, 2**63, length, dtype=np.uint64) | 1
    bits = values.view(np.uint32)
    out = np.empty(values.shape[1 - axis], np.uint64)
    step = 2048
    for i in range(0, out.size, step):
        part = bits[i:i + step] if axis == 1 else bits[:, i:i + step]
        weights = mult[None, :] if axis == 1 else mult[:, None]
        with np.errstate(over="ignore"):
            out[i:i + step] = (part.astype(np.uint64) * weights).sum(axis=axis, dtype=np.uint64)
    return out


class GgufRows:
    """Every row of a GGUF's Q4_0, Q4_1 and Q8_0 tensors, by the hash of its dequantised values."""

    def __init__(self, path: str | pathlib.Path):
        try:
            from gguf import GGUFReader  # (gguf (the llm extra): imported when a GGUF is read)
        except ImportError as e:  # pragma: no cover - the llm extra installs it
            raise BadInputError("importing a GGUF's blocks needs the gguf package (pip install -e '.[llm]')") from e
        self.tensors: list[_Tensor] = []
        self.index: dict[tuple[int, int], tuple[int, int]] = {}  # (row length, hash) -> (tensor, row)
        for t in GGUFReader(str(path)).tensors:
            kind = t.tensor_type.name
            if kind not in GGUF_KINDS:
                continue
            raw = np.asarray(t.data).reshape(-1, t.data.shape[-1])
            length = int(t.shape[0])  # GGUF shapes are innermost first: the row length
            tensor = len(self.tensors)
            self.tensors.append(_Tensor(kind, raw, length))
            for r, h in enumerate(_row_hash(_dequantize(kind, raw).reshape(raw.shape[0], length), 1).tolist()):
                self.index.setdefault((length, h), (tensor, r))

    def find(self, rows: np.ndarray) -> list[tuple[int, int]] | None:
        """The (tensor, row) of each row of ``rows`` [n, K] float32, all of one quantisation kind; None
        unless every row is found with exactly these values."""
        length = rows.shape[1]
        where = [self.index.get((length, h)) for h in _row_hash(rows, 1).tolist()]
        if any(w is None for w in where) or len({self.tensors[t].kind for t, _ in where}) != 1:
            return None
        kind = self.tensors[where[0][0]].kind
        step = 4096  # (dequantised a slice of rows at a time: a 49152-row head is 113 MB in float32)
        for i in range(0, len(where), step):
            raw = np.stack([self.tensors[t].data[r] for t, r in where[i:i + step]])
            if not np.array_equal(_dequantize(kind, raw).reshape(-1, length), rows[i:i + step]):
                return None  # (a hash is not proof)
        return where

    def blocks(self, where: list[tuple[int, int]]):
        """(kind, codes [n, blocks, 32], d [n, blocks], m [n, blocks] or None) of the rows ``where``."""
        kind = self.tensors[where[0][0]].kind
        raw = np.stack([self.tensors[t].data[r] for t, r in where])
        return (kind, *_split(kind, raw))


def _pack4(codes: np.ndarray) -> np.ndarray:
    """[..., 32] codes 0-15 -> [..., 16] bytes, element 2i in the low nibble (MatMulNBits' order)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _pack4_zero_points(zp: np.ndarray) -> np.ndarray:
    """[N, blocks] 0-15 -> [N, ceil(blocks / 2)] bytes, as MatMulNBits reads them."""
    n, blocks = zp.shape
    if blocks % 2:
        zp = np.concatenate([zp, np.full((n, 1), 8, np.uint8)], axis=1)
    return (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)


class _Writer:
    def __init__(self, accuracy_level: int | None):
        self.accuracy_level = accuracy_level
        self.new_inits: list[onnx.TensorProto] = []
        self.block_sums: dict[tuple[str, int], str] = {}  # (x, K) -> the output of x @ S, once per x
        self.selectors: dict[tuple[int, int], str] = {}  # (K, block) -> S, one initializer for every layer

    def init(self, array: np.ndarray, name: str) -> str:
        self.new_inits.append(numpy_helper.from_array(array, name))
        return name

    def selector(self, k: int, block: int) -> str:
        """The 0/1 matrix S [K, K/block] that sums each block of an input, written once per shape: every
        layer's block sums read the same initializer, so a decode step reads it from cache, not once per
        projection from memory."""
        name = self.selectors.get((k, block))
        if name is None:
            selector = np.zeros((k, k // block), np.float32)
            selector[np.arange(k), np.arange(k) // block] = 1.0
            name = self.selectors[(k, block)] = self.init(selector, f"gguf_block_selector_{k}_{block}")
        return name

    def matmul(self, node, kind, codes, d, m, form) -> list[onnx.NodeProto]:
        n, blocks, block = codes.shape
        k = blocks * block
        name, x, y = node.name or node.output[0], node.input[0], node.output[0]
        attrs = {"K": k, "N": n, "bits": 8 if kind == "Q8_0" else 4, "block_size": block}
        if self.accuracy_level is not None:
            attrs["accuracy_level"] = self.accuracy_level
        before, after, zero_points = [], [], None
        if kind == "Q8_0":
            zero_points = np.full((n, blocks), 128, np.uint8)
        elif kind == "Q4_1" and form == "float-zp":
            flat = d == 0  # w = m throughout: scale 1, codes 0, zero point -m
            codes = np.where(flat[..., None], 0, codes).astype(np.uint8)
            zero_points = np.where(flat, -m, -m / np.where(flat, 1, d)).astype(np.float32)
            d = np.where(flat, 1, d).astype(np.float32)
        elif kind == "Q4_1":
            z = np.where(d == 0, 0, np.clip(np.rint(-m / np.where(d == 0, 1, d)), 0, 15)).astype(np.uint8)
            zero_points = _pack4_zero_points(z)
            residual = np.ascontiguousarray((m + d * z.astype(np.float32)).T.astype(np.float32))  # [blocks, N]
        if kind == "Q4_1" and form == "residual" and np.any(residual != 0):  # (none: an integer zero point)
            sums = self.block_sums.get((x, k))
            if sums is None:
                sums = self.block_sums[(x, k)] = f"{name}_gguf_block_sums"
                before.append(helper.make_node("MatMul", [x, self.selector(k, block)], [sums],
                                               name=f"{name}_gguf_block_sums"))
            part = f"{name}_gguf_nbits"
            after = [helper.make_node("MatMul", [sums, self.init(residual, f"{name}_gguf_residual")],
                                      [f"{name}_gguf_residual_out"], name=f"{name}_gguf_residual"),
                     helper.make_node("Add", [part, f"{name}_gguf_residual_out"], [y], name=f"{name}_gguf_add")]
            y = part
        packed = codes if kind == "Q8_0" else _pack4(codes)
        inputs = [x, self.init(packed, f"{name}_gguf_{kind}"), self.init(d, f"{name}_gguf_scales")]
        if zero_points is not None:
            inputs.append(self.init(zero_points, f"{name}_gguf_zero_points"))
        main = helper.make_node("MatMulNBits", inputs, [y], name=f"{name}_gguf", domain=MS_DOMAIN, **attrs)
        return [*before, main, *after]

    def gather(self, node, kind, codes, d) -> list[onnx.NodeProto]:
        rows, blocks, block = codes.shape
        name = node.name or node.output[0]
        attrs = {"bits": 8, "block_size": block, "gather_axis": 0, "quantize_axis": 1}
        if kind == "Q4_0":
            # uint4 data with zero point 8: GatherBlockQuantized's 4-bit form
            data = helper.make_tensor(f"{name}_gguf_{kind}", onnx.TensorProto.UINT4, [rows, blocks * block],
                                      _pack4(codes).tobytes(), raw=True)
            eights = np.full((rows * blocks + 1) // 2, 0x88, np.uint8)  # uint4 tensors pack the flat array
            zp = helper.make_tensor(f"{name}_gguf_zero_points", onnx.TensorProto.UINT4, [rows, blocks],
                                    eights.tobytes(), raw=True)
            self.new_inits += [data, zp]
            attrs["bits"] = 4
            inputs = [data.name, node.input[1], self.init(d, f"{name}_gguf_scales"), zp.name]
        else:  # Q8_0
            inputs = [self.init(codes.reshape(rows, -1), f"{name}_gguf_{kind}"), node.input[1],
                      self.init(d, f"{name}_gguf_scales"),
                      self.init(np.full((rows, blocks), 128, np.uint8), f"{name}_gguf_zero_points")]
        return [helper.make_node("GatherBlockQuantized", inputs, list(node.output), name=f"{name}_gguf",
                                 domain=MS_DOMAIN, **attrs)]


def _finish(model: onnx.ModelProto, graph, out_nodes, used_up, writer) -> None:
    graph.ClearField("node")
    graph.node.extend(out_nodes)
    still_read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    keep = [t for t in graph.initializer if t.name not in used_up or t.name in still_read]
    kept = {t.name for t in keep}
    graph.ClearField("initializer")  # (a block selector an earlier writer left is the same matrix: kept once)
    graph.initializer.extend(keep + [t for t in writer.new_inits if t.name not in kept])
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    for o in model.opset_import:
        if o.domain in ONNX_DOMAINS and o.version < 21:
            o.version = 21
    model.ir_version = max(model.ir_version, 10)


def write_min_blocks(model: onnx.ModelProto, blocks: dict[str, tuple], block_size: int,
                     accuracy_level: int | None = 4, form: str = "residual") -> None:
    """Replace each MatMul named in ``blocks`` by the Q4_1-style blocks given for it, ``(codes [N, blocks,
    block_size] 0-15, d [N, blocks], m [N, blocks])`` meaning ``w = d * code + m`` (a float minimum),
    written as :func:`import_blocks` writes a GGUF's Q4_1 (``form``). ``model`` is changed in place."""
    if not blocks:
        return
    graph = model.graph
    writer = _Writer(accuracy_level)
    out_nodes, used_up = [], set()
    for node in graph.node:
        if node.op_type == "MatMul" and node.name in blocks:
            codes, d, m = blocks[node.name]
            assert codes.shape[2] == block_size
            out_nodes.extend(writer.matmul(node, "Q4_1", codes, d, m, form))
            used_up.add(node.input[1])
        else:
            out_nodes.append(node)
    _finish(model, graph, out_nodes, used_up, writer)


def import_blocks(model: onnx.ModelProto, gguf_path: str | pathlib.Path, *, form: str = "residual",
                  accuracy_level: int | None = 4, rows: GgufRows | None = None,
                  base_dir: str | pathlib.Path | None = None) -> dict[str, int]:
    """Replace each MatMul/Gather whose weight is a GGUF's quantised rows by the blocks themselves
    (module docstring); ``model`` is changed in place. Returns {kind: weights replaced}. ``base_dir``:
    where the external data of a model loaded without it is (:func:`weight_array`).

    The graph's opset is raised to 21 and its IR version to 10 when a 4-bit table is written (int4
    tensors need them), as ONNX Runtime's quantiser does."""
    if form not in FORMS:
        raise BadInputError(f"GGUF Q4_1 form {form!r}: expected one of {', '.join(FORMS)}")
    rows = rows or GgufRows(gguf_path)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    writer = _Writer(accuracy_level)
    done: dict[str, int] = {}
    out_nodes, used_up = [], set()
    for node in graph.node:
        replaced = None
        if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in inits:
            w = weight_array(inits[node.input[1]], base_dir)
            if w.ndim == 2 and w.dtype == np.float32 and w.shape[0] % BLOCK == 0:
                where = rows.find(np.ascontiguousarray(w.T))
                if where is not None:
                    kind, codes, d, m = rows.blocks(where)
                    replaced = writer.matmul(node, kind, codes, d, m, form)
                    used_up.add(node.input[1])
        elif node.op_type == "Gather" and node.input[0] in inits and not any(
                a.name == "axis" and a.i != 0 for a in node.attribute):
            table = weight_array(inits[node.input[0]], base_dir)
            if table.ndim == 2 and table.dtype == np.float32 and table.shape[1] % BLOCK == 0:
                where = rows.find(table)
                if where is not None and rows.tensors[where[0][0]].kind in ("Q4_0", "Q8_0"):
                    kind, codes, d, _ = rows.blocks(where)
                    replaced = writer.gather(node, kind, codes, d)
                    used_up.add(node.input[0])
        if replaced is None:
            out_nodes.append(node)
        else:
            out_nodes.extend(replaced)
            kind = rows.tensors[where[0][0]].kind
            done[kind] = done.get(kind, 0) + 1
    if done:
        _finish(model, graph, out_nodes, used_up, writer)
    return done
