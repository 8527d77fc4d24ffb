"""Block reconstruction (BRECQ/QDrop-style) of the PP-OCRv4 rec QDQ backbone.
usage: python brecq.py --tag NAME [--iters 1000] [--batch 8] [--lam 10] [--lr 3e-3] [--drop 0.5] [--lsq] [--no-round]"""
import argparse, time, json, math
import numpy as np, onnx, torch
from lib import *
from opfuse.quantization.sqnr import OutputReference

ap = argparse.ArgumentParser()
ap.add_argument("--tag", required=True)
ap.add_argument("--iters", type=int, default=1000)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--lam", type=float, default=10.0)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--drop", type=float, default=0.5)
ap.add_argument("--lsq", action="store_true", help="also learn activation scales (log-scale, Adam)")
ap.add_argument("--lsq-lr", type=float, default=1e-3)
ap.add_argument("--no-round", action="store_true", help="keep ORT rounding (only with --lsq)")
ap.add_argument("--ntune", type=int, default=48)
ap.add_argument("--blocks", type=int, default=99)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--fisher", action="store_true", help="weight each channel's squared error by the float model's output sensitivity diag(J^T J)")
ap.add_argument("--probes", type=int, default=2)
ap.add_argument("--bias-fix", action="store_true", help="with --lsq: train and propagate with the int32 bias requantised to the learned input scale (as written)")
args = ap.parse_args()
torch.manual_seed(args.seed)
T0 = time.time()
ZETA, GAMMA = 1.1, -0.1
fm = onnx.load(FLOAT); qm = onnx.load(BASE)
p = Prog(fm, qm)
calib, held = load_case()
tune = calib[:args.ntune]
X = torch.tensor(np.concatenate([c["x"] for c in tune]))
Wf = float_weights(p); Wn = nearest_weights(p)
ints = {n: c["wint"].copy() for n, c in p.convs.items()}
act_scales = {}
cur_q = {"x": X}; cur_f = {"x": X}
log = []
chw = {}
if args.fisher:
    from floatnet import FloatNet
    net = FloatNet(fm)
    tf = time.time()
    targets = [io[1][0] for io in p.block_io]
    acc = {t: 0 for t in targets}
    for i in range(0, X.shape[0], 8):
        xb = X[i:i + 8].clone().requires_grad_(True)
        env = net.forward(xb)
        o = env[net.out]
        for k in range(args.probes):
            u = torch.randn_like(o)
            g = torch.autograd.grad((o * u).sum(), [env[t] for t in targets], retain_graph=k < args.probes - 1)
            for t, gt in zip(targets, g):
                acc[t] = acc[t] + (gt.double() ** 2).sum((0, 2, 3))
    for t in targets:
        w = acc[t] / acc[t].mean()
        chw[t] = w.float().reshape(1, -1, 1, 1)
    print("fisher sec", round(time.time() - tf, 1), {t: (round(float(chw[t].min()), 4), round(float(chw[t].max()), 1)) for t in targets[:4]}, flush=True)


def err(y, t, out):
    d = (y - t) ** 2
    return (d * chw[out]).mean() if out in chw else d.mean()


def hsig(v):
    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0, 1)


def batched(fn, env, n, bs=8):
    outs = None
    for i in range(0, n, bs):
        o = fn({k: v[i:i + bs] for k, v in env.items()})
        outs = (outs or []) + [o]
    return torch.cat(outs)


for bi, ((a, b), (ins, outs)) in enumerate(zip(p.blocks, p.block_io)):
    t0 = time.time()
    assert len(outs) == 1
    out = outs[0]
    convs = [o["name"] for o in p.ops[a:b] if o["kind"] == "conv"]
    fqs = [o["name"] for o in p.ops[a:b] if o["kind"] == "fq"]
    n = X.shape[0]
    with torch.no_grad():
        tgt = batched(lambda e: run(p, e, a, b, Wf, "f")[out], {t: cur_f[t] for t in ins}, n)
        qin = {t: cur_q[t] for t in ins}
        def q_out(W, scales=None):
            return batched(lambda e: run(p, e, a, b, W, "q", act_scales=scales, requant_bias=args.bias_fix)[out], qin, n)
        base = q_out(Wn)
        e_near = float(err(base, tgt, out))
        plain_near = float(((base - tgt) ** 2).mean())
    sig = float((tgt ** 2).mean())
    # parameters
    V, base_int, sc = {}, {}, {}
    for c in convs:
        s = torch.tensor(p.convs[c]["ws"]).reshape(-1, 1, 1, 1)
        w = Wf[c]
        fl = torch.floor(w / s)
        rest = torch.clamp(w / s - fl, 1e-4, 1 - 1e-4)
        V[c] = (-torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1)).clone().requires_grad_(True)
        base_int[c], sc[c] = fl, s
    logs = {}
    if args.lsq:
        for o in p.ops[a:b]:
            if o["kind"] == "fq":
                logs[o["name"]] = torch.tensor(math.log(o["s"]), dtype=torch.float32, requires_grad=True)
    params = [] if args.no_round else [{"params": list(V.values()), "lr": args.lr}]
    if logs:
        params.append({"params": list(logs.values()), "lr": args.lsq_lr})

    def soft_weights(hard=False):
        W = {}
        for c in convs:
            if args.no_round:
                W[c] = Wn[c]; continue
            h = (hsig(V[c]) >= 0.5).float() if hard else hsig(V[c])
            W[c] = sc[c] * torch.clamp(base_int[c] + h, -127, 127)
        return W

    opt = torch.optim.Adam(params)
    warm = int(args.iters * 0.2)
    for step in range(args.iters):
        idx = torch.randint(0, n, (args.batch,))
        env = {t: v[idx] for t, v in qin.items()}
        W = soft_weights()
        scales = {k: torch.exp(v) for k, v in logs.items()} if logs else None
        y = run(p, env, a, b, W, "q", drop=args.drop, act_scales=scales, requant_bias=args.bias_fix)[out]
        rec = err(y, tgt[idx], out) / e_near
        loss = rec
        if step >= warm and not args.no_round:
            beta = 2 + (20 - 2) * (1 - (step - warm) / max(1, args.iters - warm))
            reg = sum((1 - (2 * hsig(V[c]) - 1).abs() ** beta).sum() for c in convs) / sum(V[c].numel() for c in convs)
            loss = loss + args.lam * reg
        opt.zero_grad(); loss.backward(); opt.step()
    with torch.no_grad():
        Wh = soft_weights(hard=True)
        scales = {k: float(torch.exp(v)) for k, v in logs.items()} if logs else None
        res = q_out({**Wn, **Wh}, {k: torch.tensor(v) for k, v in scales.items()} if scales else None)
        e_new = float(err(res, tgt, out))
        plain_new = float(((res - tgt) ** 2).mean())
        soft_frac = float(sum(((hsig(V[c]) > 0.01) & (hsig(V[c]) < 0.99)).sum() for c in convs) / sum(V[c].numel() for c in convs))
        flips = 0; total = 0
        for c in convs:
            if args.no_round: continue
            wi = torch.clamp(base_int[c] + (hsig(V[c]) >= 0.5).float(), -127, 127).numpy()
            flips += int((wi != p.convs[c]["wint"]).sum()); total += wi.size
            ints[c] = wi
            Wn[c] = Wh[c]  # later blocks see the learned weights
        if scales:
            act_scales.update(scales)
            for o in p.ops[a:b]:
                if o["kind"] == "fq":
                    o["s"] = scales[o["name"]]  # later runs use the learned scale
            if args.bias_fix:
                for o in p.ops:
                    if o["kind"] == "conv" and o.get("xfq") in scales:
                        requantise_bias(p, o, scales[o["xfq"]])
                    # (bias in torch stays the float-equivalent of ORT's; write_back requantises it)
    cur_q = {out: res}; cur_f = {out: tgt}
    rec = dict(block=bi, convs=convs, near_db=10 * math.log10(sig / plain_near), new_db=10 * math.log10(sig / plain_new), weighted_gain_db=10 * math.log10(e_near / e_new),
               flips=flips / max(total, 1), soft_left=soft_frac, sec=round(time.time() - t0, 1))
    log.append(rec)
    print(json.dumps(rec), flush=True)
    if bi + 1 >= args.blocks:
        break

train_sec = time.time() - T0
m = write_back(qm, Prog(fm, qm), ints, act_scales if args.lsq else None)
onnx.save(m, WORK / f"qdq_{args.tag}.onnx")
ref = OutputReference(fm, tune if args.ntune == 48 else calib[:48]); href = OutputReference(fm, held[:64])
r = dict(tag=args.tag, args=vars(args), tune_db=ref.sqnr(m), held64_db=href.sqnr(m), train_sec=round(train_sec, 1),
         total_sec=round(time.time() - T0, 1))
print(json.dumps(r), flush=True)
json.dump(dict(result=r, blocks=log), open(WORK / f"res_{args.tag}.json", "w"), indent=1)
