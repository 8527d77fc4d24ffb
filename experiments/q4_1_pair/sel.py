import numpy as np, onnxruntime as ort, time
from onnx import helper as h, TensorProto as T, numpy_helper as nh
rng = np.random.default_rng(0)
L = 30
def model(shared):
    nodes, inits, outs = [], [], []
    for k in (576, 1536):
        s = np.zeros((k, k // 32), np.float32); s[np.arange(k), np.arange(k) // 32] = 1
        inits.append(nh.from_array(s, f"S{k}"))
    for i in range(L):
        for j, k in enumerate((576, 576, 576, 1536)):
            name = f"S{k}"
            if not shared:
                s = np.zeros((k, k // 32), np.float32); s[np.arange(k), np.arange(k) // 32] = 1
                name = f"S{k}_{i}_{j}"; inits.append(nh.from_array(s, name))
            nodes.append(h.make_node("MatMul", [f"x{k}", name], [f"y{i}_{j}"])); outs.append(f"y{i}_{j}")
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info(f"x{k}", T.FLOAT, [1, 1, k]) for k in (576, 1536)],
                     [h.make_tensor_value_info(o, T.FLOAT, None) for o in outs], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
so = ort.SessionOptions(); so.intra_op_num_threads = 1; so.log_severity_level = 3
x = {f"x{k}": rng.standard_normal((1, 1, k)).astype(np.float32) for k in (576, 1536)}
r = {}
for shared in (False, True, False, True):
    s = ort.InferenceSession(model(shared).SerializeToString(), so, providers=["CPUExecutionProvider"])
    for _ in range(10): s.run(None, x)
    ts = []
    for _ in range(100):
        t = time.perf_counter(); s.run(None, x); ts.append(time.perf_counter() - t)
    r.setdefault(shared, []).append(round(np.median(ts) * 1e3, 3))
print(r, "ms per step (120 block-sum MatMuls)")
