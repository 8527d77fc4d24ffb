# per-node cost of the Q4_1 residual pair (block-sum MatMul, residual MatMul, Add) vs alternatives, M=1
import numpy as np, onnxruntime as ort, time
from onnx import helper as h, TensorProto as T, numpy_helper as nh
K, N, L = 576, 960, 120
rng = np.random.default_rng(0)
def build(form):
    nodes, inits = [], []
    inp = h.make_tensor_value_info("x", T.FLOAT, [1, 1, K])
    bs = np.zeros((K, K // 32), np.float32)
    for k in range(K): bs[k, k // 32] = 1
    inits.append(nh.from_array(bs, "bs"))
    cur = "x"
    for i in range(L):
        m = rng.standard_normal((K // 32, K)).astype(np.float32) * 1e-3
        inits.append(nh.from_array(m, f"m{i}"))
        if form == "pair":
            nodes += [h.make_node("MatMul", [cur, "bs"], [f"s{i}"]), h.make_node("MatMul", [f"s{i}", f"m{i}"], [f"r{i}"]),
                      h.make_node("Add", [cur, f"r{i}"], [f"y{i}"])]
        elif form == "reduce":
            nodes += [h.make_node("Reshape", [cur, "shp"], [f"v{i}"]), h.make_node("ReduceSum", [f"v{i}", "ax"], [f"s{i}"], keepdims=0),
                      h.make_node("MatMul", [f"s{i}", f"m{i}"], [f"r0{i}"]), h.make_node("Reshape", [f"r0{i}", "shp2"], [f"r{i}"]),
                      h.make_node("Add", [cur, f"r{i}"], [f"y{i}"])]
        elif form == "add":
            nodes += [h.make_node("Add", [cur, "c"], [f"y{i}"])]
        cur = f"y{i}"
    inits += [nh.from_array(np.array([1, 1, K // 32, 32], np.int64), "shp"), nh.from_array(np.array([-1], np.int64), "ax"),
              nh.from_array(np.array([1, 1, K], np.int64), "shp2"), nh.from_array(np.zeros(K, np.float32), "c")]
    g = h.make_graph(nodes, form, [inp], [h.make_tensor_value_info(cur, T.FLOAT, None)], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
x = {"x": rng.standard_normal((1, 1, K)).astype(np.float32)}
for threads in (1, 2):
    res = {}
    for form in ("pair", "reduce", "add", "pair"):
        so = ort.SessionOptions(); so.intra_op_num_threads = threads
        s = ort.InferenceSession(build(form).SerializeToString(), so, providers=["CPUExecutionProvider"])
        for _ in range(20): s.run(None, x)
        ts = []
        for _ in range(200):
            t = time.perf_counter(); s.run(None, x); ts.append(time.perf_counter() - t)
        res.setdefault(form, []).append(np.median(ts) * 1e6 / L)
    print(threads, {k: [round(v, 2) for v in vs] for k, vs in res.items()}, "us per projection")
