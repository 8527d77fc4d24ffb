"""60 chained SkipSimplifiedLayerNormalization nodes on [1, 1, 576] (SmolLM2's decode step: two per
layer, 30 layers) with their mean and inv_std_var outputs named (as onnxscript's fusion rule writes
them) against unnamed (as opfuse's clean-up now writes them when nothing reads them), ONNX Runtime's CPU
EP at 1 thread, interleaved rounds; microseconds per node, median (min-max) of 15 rounds of 200 runs."""

import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

HIDDEN, NODES = 576, 60


def model(named: bool) -> bytes:
    nodes, prev = [], "x"
    gamma = onnx.numpy_helper.from_array(np.random.default_rng(0).random(HIDDEN).astype(np.float32), "g")
    for i in range(NODES):
        outputs = [f"y{i}", f"m{i}" if named else "", f"v{i}" if named else "", f"s{i}"]
        nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [prev, "skip", "g"], outputs,
                                      domain="com.microsoft", epsilon=1e-5))
        prev = f"s{i}"
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, HIDDEN]) for n in ("x", "skip")]
    graph = helper.make_graph(nodes, "g", info,
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, 1, HIDDEN])], [gamma])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)]).SerializeToString()


def main() -> None:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sessions = {k: ort.InferenceSession(model(k), options, providers=["CPUExecutionProvider"])
                for k in ("named", "unnamed")}
    rng = np.random.default_rng(1)
    feeds = {n: rng.random((1, 1, HIDDEN), dtype=np.float32) for n in ("x", "skip")}
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(15):
        for k, s in sessions.items():
            start = time.perf_counter()
            for _ in range(200):
                s.run(None, feeds)
            times[k].append((time.perf_counter() - start) / 200 / NODES * 1e6)
    for k, t in times.items():
        print(f"{k:8s} us/node {np.median(t):.2f} ({min(t):.2f}-{max(t):.2f})")


if __name__ == "__main__":
    main()
