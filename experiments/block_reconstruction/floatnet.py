"""Float interpreter of the whole folded ONNX model in torch (for output sensitivities)."""
import numpy as np, onnx, torch, torch.nn.functional as F
from onnx import numpy_helper as nh
from lib import attrs


class FloatNet:
    def __init__(self, fm):
        self.nodes = list(fm.graph.node)
        self.init = {i.name: torch.tensor(nh.to_array(i).copy()) for i in fm.graph.initializer}
        self.out = fm.graph.output[0].name

    def forward(self, x, grab=()):
        env = dict(self.init); env["x"] = x
        grab = set(grab)
        for n in self.nodes:
            a = attrs(n); op = n.op_type
            I = [env[i] if i else None for i in n.input]
            if op == "Constant":
                r = torch.tensor(nh.to_array(n.attribute[0].t).copy())
            elif op == "Conv":
                p = a.get("pads", [0, 0, 0, 0])
                r = F.conv2d(I[0], I[1], I[2] if len(I) > 2 else None, a.get("strides", [1, 1]), (p[0], p[1]),
                             a.get("dilations", [1, 1]), a.get("group", 1))
            elif op == "Add": r = I[0] + I[1]
            elif op == "Sub": r = I[0] - I[1]
            elif op == "Mul": r = I[0] * I[1]
            elif op == "Div": r = I[0] / I[1]
            elif op == "Pow": r = I[0] ** I[1]
            elif op == "Sqrt": r = torch.sqrt(I[0])
            elif op == "Clip": r = torch.clamp(I[0], float(I[1]), float(I[2]))
            elif op == "Relu": r = torch.relu(I[0])
            elif op == "Sigmoid": r = torch.sigmoid(I[0])
            elif op == "HardSigmoid": r = torch.clamp(a.get("alpha", 0.2) * I[0] + a.get("beta", 0.5), 0, 1)
            elif op == "GlobalAveragePool": r = I[0].mean((2, 3), keepdim=True)
            elif op == "AveragePool":
                assert not any(a.get("pads", [0])) 
                r = F.avg_pool2d(I[0], a["kernel_shape"], a["strides"])
            elif op == "MatMul": r = I[0] @ I[1]
            elif op == "Softmax": r = torch.softmax(I[0], a.get("axis", -1))
            elif op == "ReduceMean": r = I[0].mean(tuple(a["axes"]), keepdim=bool(a.get("keepdims", 1)))
            elif op == "Transpose": r = I[0].permute(*a["perm"])
            elif op == "Shape": r = torch.tensor(list(I[0].shape), dtype=torch.int64)
            elif op == "Cast": r = I[0].to(torch.int64 if a["to"] == 7 else torch.int32 if a["to"] == 6 else torch.float32)
            elif op == "Slice":
                data, st, en = I[0], I[1].tolist(), I[2].tolist()
                axes = I[3].tolist() if len(I) > 3 and I[3] is not None else list(range(len(st)))
                steps = I[4].tolist() if len(I) > 4 and I[4] is not None else [1] * len(st)
                idx = [slice(None)] * data.dim()
                for s, e, ax, sp in zip(st, en, axes, steps):
                    dim = data.shape[ax]
                    s = max(min(s + dim if s < 0 else s, dim), 0); e = max(min(e + dim if e < 0 else e, dim), 0)
                    assert sp == 1
                    idx[ax] = slice(s, e)
                r = data[tuple(idx)]
            elif op == "Concat": r = torch.cat([t.reshape(-1).to(torch.int64) if t.dtype != torch.float32 else t for t in I], a["axis"]) if I[0].dtype != torch.float32 else torch.cat(I, a["axis"])
            elif op == "Reshape":
                shp = [int(v) for v in I[1].tolist()]
                shp = [I[0].shape[i] if v == 0 else v for i, v in enumerate(shp)]
                r = I[0].reshape(shp)
            elif op == "Squeeze":
                axes = I[1].tolist() if len(I) > 1 and I[1] is not None else a.get("axes")
                r = I[0]
                for ax in sorted([ax % r.dim() for ax in axes], reverse=True): r = r.squeeze(ax)
            elif op == "Flatten":
                ax = a.get("axis", 1); r = I[0].reshape(int(np.prod(I[0].shape[:ax])), -1)
            else:
                raise NotImplementedError(op)
            env[n.output[0]] = r
        return env
