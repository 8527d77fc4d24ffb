"""Torch re-implementation of the PP-OCRv4 rec QDQ backbone (x -> p2o.Add.231), block split,
fake-quant with STE, write-back into the ONNX QDQ model."""
import functools, os, pathlib, pickle, math
import numpy as np, onnx, torch, torch.nn.functional as F
from onnx import numpy_helper as nh
torch.set_num_threads(1)

import opfuse.quantization.sqnr as sq
from opfuse.runtime import create_session as _cs
sq.create_session = functools.partial(_cs, threads=1)   # OutputReference sessions: 1 intra-op thread
from opfuse.quantization.qdq import _removed_activations

END = "p2o.Add.231"   # backbone output (float tensor read by the neck's AveragePool)


def attrs(n):
    return {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}


class Prog:
    """ops: list of dicts in graph order. kinds: fq, conv, add, mul, div, clip, relu, gap, hsig."""

    def __init__(self, fm, qm):
        self.fm, self.qm = fm, qm
        I = {i.name: i for i in qm.graph.initializer}
        FI = {i.name: nh.to_array(i) for i in fm.graph.initializer}
        fnodes = {n.name: n for n in fm.graph.node}
        prod = {o: n for n in qm.graph.node for o in n.output}
        const = {}
        for n in qm.graph.node:
            if n.op_type == "Constant":
                const[n.output[0]] = nh.to_array(n.attribute[0].t)
        def C(name):
            if name in I: return nh.to_array(I[name])
            return const[name]
        removed = _removed_activations(qm, fm)
        # nodes needed for END
        need, stack = set(), [END]
        while stack:
            t = stack.pop()
            n = prod.get(t)
            if n is None or id(n) in need: continue
            need.add(id(n)); stack.extend(i for i in n.input if i)
        self.ops, self.convs = [], {}
        for n in qm.graph.node:
            if id(n) not in need: continue
            op = n.op_type
            if op == "QuantizeLinear":
                continue
            if op == "DequantizeLinear":
                src = n.input[0]
                if src in I:
                    continue  # weight / bias: handled by conv
                q = prod[src]; assert q.op_type == "QuantizeLinear"
                x = q.input[0]
                if x in removed:
                    self.ops.append(dict(kind="relu" if removed[x].op_type == "Relu" else "clipact", x=x, out=x + "@act",
                                         node=removed[x]))
                    x = x + "@act"
                s = float(C(q.input[1])); z = int(C(q.input[2]))
                self.ops.append(dict(kind="fq", x=x, out=n.output[0], s=s, z=z, name=q.input[0],
                                     s_init=q.input[1], dq_s_init=n.input[1]))
                continue
            if op == "Conv":
                a = attrs(n)
                wdq = prod[n.input[1]]; bdq = prod[n.input[2]]
                wq = C(wdq.input[0]).astype(np.float32); ws = C(wdq.input[1]).astype(np.float32)
                bq = C(bdq.input[0]).astype(np.float64); bs = C(bdq.input[1]).astype(np.float64)
                fn = fnodes[n.name]
                self.convs[n.name] = dict(wint=wq, ws=ws, wint_init=wdq.input[0], bint_init=bdq.input[0],
                                          bs_init=bdq.input[1], wfloat=FI[fn.input[1]].astype(np.float32),
                                          bfloat=FI[fn.input[2]].astype(np.float32),
                                          bq=(bq * bs).astype(np.float32))
                k = a.get("kernel_shape")
                pads = a.get("pads", [0] * 4)
                assert pads[0] == pads[2] and pads[1] == pads[3], pads
                self.ops.append(dict(kind="conv", x=n.input[0], out=n.output[0], name=n.name,
                                     stride=tuple(a.get("strides", [1, 1])), pad=(pads[0], pads[1]),
                                     dil=tuple(a.get("dilations", [1, 1])), group=a.get("group", 1)))
                continue
            if op in ("Add", "Mul", "Div"):
                ins = [("t", i) if i not in I and i not in const else ("c", torch.tensor(C(i).astype(np.float32))) for i in n.input]
                self.ops.append(dict(kind=op.lower(), ins=ins, out=n.output[0]))
                continue
            if op == "Clip":
                self.ops.append(dict(kind="clip", x=n.input[0], lo=float(C(n.input[1])), hi=float(C(n.input[2])), out=n.output[0]))
                continue
            if op == "GlobalAveragePool":
                self.ops.append(dict(kind="gap", x=n.input[0], out=n.output[0])); continue
            if op == "HardSigmoid":
                a = attrs(n)
                self.ops.append(dict(kind="hsig", x=n.input[0], out=n.output[0], alpha=a.get("alpha", 0.2), beta=a.get("beta", 0.5)))
                continue
            raise NotImplementedError(op)
        # blocks: a new block starts at each fq that feeds a grouped (depthwise) conv
        feeds = {}
        for i, o in enumerate(self.ops):
            if o["kind"] == "conv" and o["group"] > 1:
                feeds[o["x"]] = True
        starts = [0] + [i for i, o in enumerate(self.ops) if o["kind"] == "fq" and o["out"] in feeds]
        self.blocks = [(a, b) for a, b in zip(starts, starts[1:] + [len(self.ops)])]
        fq_of = {o["out"]: o["name"] for o in self.ops if o["kind"] == "fq"}
        for o in self.ops:
            if o["kind"] == "conv":
                o["xfq"] = fq_of.get(o["x"])
        self.block_io = []
        for a, b in self.blocks:
            made = set(); ins = []
            for o in self.ops[a:b]:
                for t in self._inputs(o):
                    if t not in made and t not in ins: ins.append(t)
                made.add(o["out"])
            later = set(t for o in self.ops[b:] for t in self._inputs(o)) | {END}
            outs = [o["out"] for o in self.ops[a:b] if o["out"] in later]
            self.block_io.append((ins, outs))

    @staticmethod
    def _inputs(o):
        if "ins" in o: return [v for k, v in o["ins"] if k == "t"]
        return [o["x"]]


def fake_quant(x, s, z, lo=0, hi=255):
    """round(x/s)+z clamped, dequantised; straight-through inside the range, zero grad outside."""
    q = torch.clamp(torch.round(x / s) + z, lo, hi)
    y = (q - z) * s
    return x + (y - x).detach() if not isinstance(s, torch.Tensor) or not s.requires_grad else y


def lsq_fake_quant(x, s, z, lo=0, hi=255):
    """LSQ: gradient to s through round with STE."""
    v = x / s
    r = v + (torch.round(v) - v).detach()
    q = torch.clamp(r + z, lo, hi)
    return (q - z) * s


def run(prog, env, a, b, weights, mode="q", drop=0.0, act_scales=None, requant_bias=False):
    """Run ops[a:b] on env (dict name -> tensor). weights: conv name -> tensor (float weight to use).
    mode 'q': fake quant on; 'f': float (fq identity). drop: QDrop probability of skipping each element's fq."""
    for o in prog.ops[a:b]:
        k = o["kind"]
        if k == "fq":
            x = env[o["x"]]
            if mode == "f":
                y = x
            else:
                if act_scales is not None and o["name"] in act_scales:
                    y = lsq_fake_quant(x, act_scales[o["name"]], o["z"])
                else:
                    y = fake_quant(x, o["s"], o["z"])
                if drop > 0:
                    y = torch.where(torch.rand_like(x) < drop, x, y)
            env[o["out"]] = y
        elif k == "conv":
            c = prog.convs[o["name"]]
            w = weights[o["name"]]
            b = c["bfloat"] if mode == "f" else c["bq"]
            if requant_bias and mode == "q" and act_scales is not None and o.get("xfq") in act_scales:
                # int32 bias at scale x_scale * w_scale, as write_back stores it (STE through the rounding)
                bf = torch.as_tensor(c["bfloat"]); bs = act_scales[o["xfq"]] * torch.as_tensor(c["ws"])
                b = bf + (torch.round(bf / bs) * bs - bf).detach()
            env[o["out"]] = F.conv2d(env[o["x"]], w, torch.as_tensor(b), o["stride"], o["pad"], o["dil"], o["group"])
        elif k in ("add", "mul", "div"):
            xs = [env[v] if t == "t" else v for t, v in o["ins"]]
            env[o["out"]] = xs[0] + xs[1] if k == "add" else xs[0] * xs[1] if k == "mul" else xs[0] / xs[1]
        elif k == "clip":
            env[o["out"]] = torch.clamp(env[o["x"]], o["lo"], o["hi"])
        elif k == "relu":
            env[o["out"]] = torch.relu(env[o["x"]])
        elif k == "gap":
            env[o["out"]] = env[o["x"]].mean((2, 3), keepdim=True)
        elif k == "hsig":
            env[o["out"]] = torch.clamp(o["alpha"] * env[o["x"]] + o["beta"], 0, 1)
        else:
            raise NotImplementedError(k)
    return env


def nearest_weights(prog):
    return {n: torch.tensor(c["wint"] * c["ws"].reshape(-1, 1, 1, 1)) for n, c in prog.convs.items()}


def float_weights(prog):
    return {n: torch.tensor(c["wfloat"]) for n, c in prog.convs.items()}


def sqnr(f, q):
    f = np.asarray(f, np.float64); q = np.asarray(q, np.float64)
    return 10 * math.log10((f * f).sum() / max(((q - f) ** 2).sum(), 1e-300))


# where case.py writes the case, the folded float model and the baseline QDQ model
WORK = pathlib.Path(os.environ.get("OPFUSE_BRECQ_WORK", pathlib.Path.home() / ".cache" / "opfuse-brecq"))
FLOAT = WORK / "float.onnx"
BASE = WORK / "qdq_base.onnx"


def load_case():
    """(64 calibration lines of the calibration rendering, 500 evaluation lines: 100 of each
    of the five evaluation renderings), as benchmarks/quantize.py renders them."""
    c = pickle.load(open(WORK / "case.pkl", "rb"))
    return list(c["calib"]), list(c["held"])


def write_back(qm, prog, ints, act_scales=None):
    """A copy of qm with conv integer weights `ints` (name -> int array) and optionally new
    activation scales (fq name -> float), biases requantised where the input scale changed."""
    m = onnx.ModelProto(); m.CopyFrom(qm)
    I = {i.name: i for i in m.graph.initializer}
    def put(name, arr):
        I[name].CopyFrom(nh.from_array(arr, name))
    for n, w in ints.items():
        put(prog.convs[n]["wint_init"], np.asarray(w).astype(np.int8))
    if act_scales:
        prod = {o: n for n in m.graph.node for o in n.output}
        for o in prog.ops:
            if o["kind"] == "fq" and o["name"] in act_scales:
                s = np.float32(act_scales[o["name"]])
                put(o["s_init"], np.array(s, np.float32)); put(o["dq_s_init"], np.array(s, np.float32))
        # every Q/DQ reading the same scale initializer name got updated; now requantise biases
        for op in prog.ops:
            if op["kind"] != "conv": continue
            c = prog.convs[op["name"]]
            fq = next(x for x in prog.ops if x.get("out") == op["x"])
            xs = np.float32(act_scales.get(fq["name"], fq["s"]))
            bs = (xs * c["ws"]).astype(np.float32)
            put(c["bs_init"], bs)
            put(c["bint_init"], np.clip(np.rint(c["bfloat"].astype(np.float64) / bs), -2**31, 2**31 - 1).astype(np.int32))
    return m


def requantise_bias(prog, conv_op, x_scale):
    """c["bq"] as write_back stores the int32 bias for input scale x_scale."""
    c = prog.convs[conv_op["name"]]
    bs = (np.float32(x_scale) * c["ws"]).astype(np.float32)
    ints = np.clip(np.rint(c["bfloat"].astype(np.float64) / bs), -2**31, 2**31 - 1)
    c["bq"] = (ints * bs.astype(np.float64)).astype(np.float32)
