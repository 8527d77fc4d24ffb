import numpy as np, onnxruntime as ort, time
from onnx import helper as h, TensorProto as T, numpy_helper as nh
rng = np.random.default_rng(0)
L = 30
def model(form, kb, n):
    nodes, inits = [], []
    outs = []
    for i in range(L):
        e = (rng.standard_normal((kb, n)) * 1e-3).astype(np.float32)
        if form == "fp32":
            inits.append(nh.from_array(e, f"e{i}")); nodes.append(h.make_node("MatMul", ["s", f"e{i}"], [f"y{i}"]))
        elif form == "nbits8":
            blk = 16 if kb <= 16 else 32
            nb = -(-kb // blk)
            ep = np.zeros((nb * blk, n), np.float32); ep[:kb] = e
            b = ep.T.reshape(n, nb, blk)
            sc = (np.abs(b).max(axis=2) / 127 + 1e-30).astype(np.float32)
            q = (np.clip(np.rint(b / sc[..., None]), -127, 127) + 128).astype(np.uint8)
            inits += [nh.from_array(q, f"q{i}"), nh.from_array(sc, f"sc{i}"), nh.from_array(np.full((n, nb), 128, np.uint8), f"z{i}")]
            nodes.append(h.make_node("MatMulNBits", ["s", f"q{i}", f"sc{i}", f"z{i}"], [f"y{i}"], domain="com.microsoft",
                                     K=kb, N=n, bits=8, block_size=blk, accuracy_level=4))
        outs.append(f"y{i}")
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("s", T.FLOAT, [1, 1, kb])],
                     [h.make_tensor_value_info(o, T.FLOAT, None) for o in outs], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
so = ort.SessionOptions(); so.intra_op_num_threads = 1; so.log_severity_level = 3
for kb, n in ((18, 960), (18, 3072), (48, 576)):
    x = {"s": rng.standard_normal((1, 1, kb)).astype(np.float32)}
    r = {}
    ref = None
    for form in ("fp32", "nbits8", "fp32", "nbits8"):
        s = ort.InferenceSession(model(form, kb, n).SerializeToString(), so, providers=["CPUExecutionProvider"])
        for _ in range(10): s.run(None, x)
        ts = []
        for _ in range(100):
            t = time.perf_counter(); s.run(None, x); ts.append(time.perf_counter() - t)
        r.setdefault(form, []).append(round(np.median(ts) * 1e6 / L, 2))
    print(kb, n, r, "us per node")
