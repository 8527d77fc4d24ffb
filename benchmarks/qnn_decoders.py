"""The decode steps and prefills of ``benchmarks/decoders.py`` on QNN's HTP: placement and numbers.

    python benchmarks/qnn_decoders.py --models llama --graphs decode,prefill
    python benchmarks/qnn_decoders.py --models llama,qwen2,phi3,mistral,gpt2,gptj --past 127 --seq 64

Each graph (dynamo export, cached as ``benchmarks/decoders.py`` caches it) goes through
``opfuse.optimize(..., target="qnn")`` at batch 1 with ``past_seq`` (decode) or ``seq`` (prefill)
bound, as ``opfuse optimize --target qnn --dim batch=1 --dim past_seq=127`` does; the row gives QNN's
placement (nodes on the HTP, on the CPU with QNN's reason, partitions). Then the compiled model runs
on the HTP (float graphs in float16) on left-padded inputs, against the original on ONNX Runtime's
CPU: the worst |diff| over the outputs, relative to each output's largest magnitude, for the logits
and the presents separately (a prefill's logits at the real positions only: the padded ones are
never read). Decode: ``padding`` of the past_seq + 1 mask positions zero, the new token at position
past - padding; prefill: the first ``padding`` tokens zero, positions counted from the first real one.

``--angles``: the rotary angles alone, ``Cos``/``Sin`` of ``position * inv_freq`` (positions 0..N-1,
head dim 32, as Llama's exports compute them) on the HTP against the CPU: where the keys' error comes from.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path[1:1] = [str(HERE.parent)]

import decoders  # noqa: E402


def _inputs(shapes: dict, graph: str, padding: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    total = shapes["attention_mask"][1]
    mask = np.ones((1, total), np.int64)
    mask[:, :padding] = 0
    out = {"attention_mask": mask}
    if graph == "decode":
        out["input_ids"] = rng.integers(3, 1000, (1, 1))
        out["position_ids"] = np.array([[total - 1 - padding]])
    else:
        seq = shapes["input_ids"][1]
        out["input_ids"] = rng.integers(3, 1000, (1, seq))
        out["position_ids"] = np.maximum(np.arange(seq) - padding, 0)[None]
    for name, shape in shapes.items():
        if name.startswith("past_key_values."):
            out[name] = rng.standard_normal(shape).astype(np.float32)
    return {k: v.astype(np.int64) if v.dtype.kind == "i" else v for k, v in out.items()}


def _worst(expected: dict, actual: dict, graph: str, padding: int) -> tuple[float, float]:
    """(logits, presents): the largest max |diff| / max |expected| over those outputs."""
    logits = presents = 0.0
    for name, x in expected.items():
        y = actual[name]
        scale = float(np.abs(x).max()) or 1.0
        if name == "logits":
            if graph == "prefill":
                x, y = x[:, padding:], y[:, padding:]
            logits = max(logits, float(np.abs(x - y).max()) / scale)
        else:
            presents = max(presents, float(np.abs(x - y).max()) / scale)
    return logits, presents


def run(model: str, graph: str, past: int, seq: int, paddings: list[int]) -> None:
    import onnx
    import onnx_ir as ir
    import onnxruntime as ort

    import opfuse
    from opfuse.targets.qnn.backend import open_session

    path, error = decoders.exported(decoders.MODELS[model], "dynamo", graph, decoders.DEFAULT_CACHE)
    if path is None:
        print(f"{model} {graph}: not exported ({error})")
        return
    dims = {"batch": 1, **({"past_seq": past} if graph == "decode" else {"seq": seq})}
    optimised, report = opfuse.optimize(str(path), target="qnn", dims=dims, tune=False)
    placement = report.device.placement
    print(f"{model} {graph} ({', '.join(f'{k}={v}' for k, v in dims.items())}): {placement.summary()}")
    for node in placement.fallbacks:
        print(f"    on the CPU: {node}")
    proto = onnx.load(str(path))
    cpu = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in cpu.get_outputs()]
    with tempfile.TemporaryDirectory(prefix="qnn-decoders-") as tmp:
        written = pathlib.Path(tmp) / "model.onnx"
        ir.save(optimised, written, external_data="model.onnx.data")
        compiled = onnx.load(str(written), load_external_data=False)
        htp = open_session(str(written), strict=placement.all_on_npu)
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in compiled.graph.input}
    for padding in paddings:
        feeds = _inputs(shapes, graph, padding, seed=padding)
        expected = dict(zip(names, cpu.run(None, feeds)))
        actual = dict(zip(names, htp.run(feeds)))
        logits, presents = _worst(expected, actual, graph, padding)
        print(f"    padding {padding:3d}: HTP vs CPU, max |diff| / scale: logits {logits:.1e}, presents {presents:.1e}")


def angles(lengths=(64, 128), head_dim=32) -> None:
    """Cos and Sin of positions x inverse frequencies, computed in the graph, on the HTP vs the CPU."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from opfuse.targets.qnn.backend import open_session

    inv = (1 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    for n in lengths:
        nodes = [helper.make_node("Cast", ["pos"], ["pf"], to=TensorProto.FLOAT),
                 helper.make_node("Unsqueeze", ["pf", "axis"], ["pu"]),
                 helper.make_node("Mul", ["pu", "inv"], ["angle"]),
                 helper.make_node("Cos", ["angle"], ["cos"]), helper.make_node("Sin", ["angle"], ["sin"]),
                 helper.make_node("Identity", ["angle"], ["angles"])]
        outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, n, head_dim // 2])
                   for o in ("angles", "cos", "sin")]
        graph = helper.make_graph(nodes, "angles", [helper.make_tensor_value_info("pos", TensorProto.INT64, [1, n])],
                                  outputs, [numpy_helper.from_array(inv, "inv"),
                                            numpy_helper.from_array(np.array([-1], np.int64), "axis")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        model.ir_version = 10
        feeds = {"pos": np.arange(n)[None].astype(np.int64)}
        cpu = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        htp = open_session(model, strict=True).run(feeds)
        print(f"positions 0..{n - 1}: HTP vs CPU, max |diff|: "
              + ", ".join(f"{o} {np.abs(x - y).max():.3f}" for o, x, y in zip(("angles", "cos", "sin"), cpu, htp)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama")
    parser.add_argument("--graphs", default="decode,prefill")
    parser.add_argument("--past", type=int, default=127, help="past_seq of the decode step (default 127)")
    parser.add_argument("--seq", type=int, default=64, help="tokens of the prefill (default 64)")
    parser.add_argument("--angles", action="store_true", help="only the rotary angles' Cos/Sin (module docstring)")
    args = parser.parse_args()
    if args.angles:
        angles()
        return
    for model in args.models.split(","):
        for graph in args.graphs.split(","):
            paddings = [0, 20, args.past] if graph == "decode" else [0, 10, args.seq - 1]
            run(model, graph, args.past, args.seq, paddings)


if __name__ == "__main__":
    main()
