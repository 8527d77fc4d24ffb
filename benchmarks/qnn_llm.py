"""A decoder LLM whole on QNN's HTP: prefill and decode step compiled, quantised, and a greedy generation loop.

    python benchmarks/qnn_llm.py --model smollm2-135m --variants float,w8a16,w4a16,ort-w8a16 --json qnn_llm.json
    python benchmarks/qnn_llm.py --model llama --variants float           # the corpus' tiny random Llama
    python benchmarks/qnn_llm.py --model smollm2-135m --opset 23 ...       # the export upgraded first

The deployment (static shapes, as QNN deployments of LLMs fix them): batch 1; the prefill a chunk of
``--seq`` tokens (default 64), the prompt left-padded into it; the decode step ``--past`` cached positions
(default 255) plus one new token, so a 256-position context. The KV cache is a fixed-size input: after
the prefill its presents fill the cache's last ``--seq`` slots (the rest zeros, masked), and after each
decode step the present [.., past + 1, ..] drops its oldest slot to become the next past; the position is
data (``position_ids``: the real tokens before), the mask says which slots hold tokens. Every position
stays below the context, the bound ``rotary-table`` reads off the bound dims.

Each graph of the export (``benchmarks/decoders.py``'s dynamo export, cached) goes through the command a
user runs, in a child process:

    float   opfuse optimize G.onnx -o O.onnx --target qnn --require-npu --dim batch=1 --dim past_seq=255
            --context O_ctx.onnx              (the prefill: --dim seq=64)
    w8a16   opfuse quantize G.onnx -o O.onnx --preset qnn-a16-per-channel --calibration C.npz --require-npu
            --dim ... --context O_ctx.onnx --reconstruct off --no-bias-correction
    w4a16   the same with --preset qnn-w4a16
    w8a16-min28  w8a16 with --min-sqnr 28 (any DB; w4a16-minDB too): the layers that cost most kept with 16-bit
            weights by the mixed-precision search until the output SQNR reaches DB; for a decoder's hundreds of
            MatMuls the search measures the costliest --search-candidates (default 6) at a time, and walks
            --max-steps (default 6) steps at most (each trial quantises the whole model)
    ort-w8a16  ONNX Runtime's documented flow on the same export and calibration: the shapes fixed,
            ``get_qnn_qdq_config`` (uint16 activations, int8 symmetric per-channel weights, as the
            w8a16 preset asks it) and ``quantize``; opened on the HTP as it is (fallbacks counted).

Calibration is real text through the real model: ``--calibration-prompts`` chat prompts (not the ones
generated from), tokenised with the GGUF's tokenizer (transformers, as ``real_llm`` loads it); the
prefill samples are those prompts, the decode samples the caches, tokens and positions the fp32 export
on the CPU produces while it generates from them (steps 1, 5, 10, 15).

The loop: 5 chat prompts x 16 tokens (the prefill's argmax, then 15 decode steps), greedy, on the HTP,
against the export in float32 on ONNX Runtime's CPU running the same loop. Reported per variant: the
tokens that agree position by position (free-running, so a token after a divergence counts against),
the steps whose argmax agrees on the same context (the CPU replays the HTP's own inputs), and the
logits' SQNR at each step (10 log10(|cpu|^2 / |cpu - htp|^2), over the vocabulary, on the same inputs).
For the corpus' random Llama the prompts are random token ids.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path[1:1] = [str(HERE.parent)]

import decoders  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a neural network is in one sentence.",
    "Give me three tips for staying focused while studying.",
    "What is 12 times 7?",
]
CALIBRATION_PROMPTS = [
    "Tell me a fun fact about octopuses.",
    "How do I boil an egg?",
    "Summarise the plot of Romeo and Juliet.",
    "What are the primary colours?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Name a famous painting by Van Gogh.",
    "Suggest a name for a pet cat.",
]
DECODE_CALIBRATION_STEPS = (1, 5, 10, 15)
# beside the corpus: a one-layer Llama at the corpus' sizes, for a quick run of the whole loop
EXTRA = {"llama-1l": decoders.Decoder("llama-1l", "LlamaConfig", "LlamaForCausalLM",
                                      dict(decoders.LLAMA, num_hidden_layers=1))}
PRESETS = {"w8a16": "qnn-a16-per-channel", "w4a16": "qnn-w4a16"}


def _cli(args: list[str], log: pathlib.Path) -> dict:
    """Run ``python -m opfuse ARGS`` in a child process; exit code, seconds, the stderr's last lines."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "opfuse", *args], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "OPFUSE_SUPERVISED_CHILD"})
    log.write_text(f"$ opfuse {' '.join(args)}\n{done.stdout}\n{done.stderr}")
    return {"exit": done.returncode, "seconds": round(time.perf_counter() - start, 1),
            "stderr": done.stderr.strip().splitlines()[-3:]}


def _placement(report_path: pathlib.Path) -> dict:
    """QNN's placement and the rewrites of interest, from an opfuse report."""
    if not report_path.exists():
        return {}
    report = json.loads(report_path.read_text())
    device = report.get("device") or {}
    text = json.dumps(report)
    out = {"device": {k: v for k, v in device.items() if k in ("summary", "compile_seconds", "strict_open",
                                                                 "partitions", "on_cpu", "context")}}
    verification = report.get("verification") or {}
    out["sqnr_db"] = {k: verification.get(k) for k in ("sqnr_db", "cpu_qdq_sqnr_db", "min_sqnr_db")}
    kept = [r["name"] for r in report.get("layers", []) if r.get("precision") == "int16 weights"]
    if kept or report.get("search_stopped"):
        out["kept_16bit_weights"], out["search_stopped"] = kept, report.get("search_stopped")
    out["rotary_tables"] = text.count("rotary Cos/Sin->table")
    out["mask_fills"] = text.count('"mask fill->-65504"') + text.count('"attention mask fill->-32768"')
    return out


class Shapes:
    """The deployment's static shapes, read from the export's config."""

    def __init__(self, decoder, past: int, seq: int):
        config = decoder.config
        self.layers = config["num_hidden_layers"]
        self.kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
        self.head_dim = config["hidden_size"] // config["num_attention_heads"]
        self.past, self.seq = past, seq

    def cache(self) -> dict:
        return {f"past_key_values.{i}.{kv}": np.zeros((1, self.kv_heads, self.past, self.head_dim), np.float32)
                for i in range(self.layers) for kv in ("key", "value")}

    def dims(self, graph: str) -> list[str]:
        return ["batch=1", f"past_seq={self.past}"] if graph == "decode" else ["batch=1", f"seq={self.seq}"]


PAD = 2  # the padding's token id: masked, so any; not 0, whose embedding a random corpus model zeroes (below)


def prefill_feeds(ids: list[int], seq: int) -> dict:
    """A prompt left-padded into the prefill chunk. The padding token is :data:`PAD`, not 0: the corpus
    models' pad_token_id 0 has a zero embedding, so the padded rows' RMSNorm divides by sqrt(eps), and a
    quantised Add rounds eps to 0 (on the CPU the Reciprocal then saturates; on the HTP it gives other
    numbers, which swamp the output's SQNR though those rows are never read)."""
    pad = seq - len(ids)
    if pad < 0:
        raise ValueError(f"a prompt of {len(ids)} tokens does not fit the {seq}-token prefill")
    mask = np.array([[0] * pad + [1] * len(ids)], np.int64)
    return {"input_ids": np.array([[PAD] * pad + list(ids)], np.int64), "attention_mask": mask,
            "position_ids": np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int64)}


def generate(prefill, decode, ids: list[int], shapes: Shapes, tokens: int, record=None) -> dict:
    """Greedy: the prefill's argmax, then ``tokens - 1`` decode steps over the fixed-size cache.
    ``prefill``/``decode``: feeds -> {name: array}. Returns the tokens, each step's logits and feeds."""
    feeds = prefill_feeds(ids, shapes.seq)
    out = prefill(feeds)
    steps = [(feeds, out["logits"][0, -1])]
    past = shapes.cache()
    for name in past:
        present = out[name.replace("past_key_values", "present")]
        past[name][:, :, -shapes.seq:] = present
    past_mask = np.zeros(shapes.past, np.int64)
    past_mask[-shapes.seq:] = feeds["attention_mask"][0]
    real = len(ids)
    generated = [int(np.argmax(steps[0][1]))]
    for _ in range(tokens - 1):
        feeds = {"input_ids": np.array([[generated[-1]]], np.int64),
                 "attention_mask": np.concatenate([past_mask, [1]])[None].astype(np.int64),
                 "position_ids": np.array([[real]], np.int64), **past}
        out = decode(feeds)
        steps.append((feeds, out["logits"][0, -1]))
        generated.append(int(np.argmax(steps[-1][1])))
        past = {name: out[name.replace("past_key_values", "present")][:, :, 1:].copy() for name in past}
        past_mask = feeds["attention_mask"][0, 1:]
        real += 1
    return {"tokens": generated, "steps": steps}


def _runner(session):
    names = [o.name for o in session.get_outputs()] if hasattr(session, "get_outputs") else None

    def run(feeds):
        if names is not None:
            return dict(zip(names, session.run(names, feeds)))
        return session(feeds)
    return run


def _cpu_session(path: pathlib.Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _htp_session(path: pathlib.Path):
    from opfuse.targets.qnn.backend import open_session

    session = open_session(str(path))
    inner = session.session
    names = [o.name for o in inner.get_outputs()]

    def run(feeds):
        return dict(zip(names, session.run(feeds, names)))
    placement = session.placement
    return run, {"on_htp": len(placement.on_qnn), "nodes": len(placement.model_nodes),
                 "partitions": len(placement.partitions), "compile_s": round(session.compile_seconds, 1),
                 "cpu": [f"{f.name} ({f.op_type}): {f.reason}"[:200] for f in placement.fallbacks][:10],
                 "cpu_count": len(placement.fallbacks)}


def sqnr(reference: np.ndarray, actual: np.ndarray) -> float:
    noise = float(np.sum((reference.astype(np.float64) - actual) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(reference.astype(np.float64) ** 2)) / noise)


def prompts_tokens(model: str, count: int, prompts: list[str], work: pathlib.Path, seq: int) -> list[list[int]]:
    """Chat prompts tokenised with the model's own tokenizer (GGUF, via transformers); random ids for a
    corpus model with random weights. Cached in the work folder."""
    cache = work / f"tokens-{hashlib.sha1(json.dumps(prompts[:count]).encode()).hexdigest()[:10]}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    if model == "smollm2-135m":
        import real_llm
        from transformers import AutoTokenizer

        path, why = real_llm.gguf_file()
        if path is None:
            raise RuntimeError(why)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        out = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in prompts[:count]]
        out = [list(map(int, ids["input_ids"] if isinstance(ids, dict) else ids)) for ids in out]
    else:
        rng = np.random.default_rng(len(prompts[0]))
        out = [rng.integers(3, 1000, int(rng.integers(seq // 4, seq))).tolist() for _ in prompts[:count]]
    cache.write_text(json.dumps(out))
    return out


def calibration(paths: dict, shapes: Shapes, ids: list[list[int]], work: pathlib.Path) -> dict[str, pathlib.Path]:
    """{graph: npz} of real samples: the prefill's prompts, the decode steps the fp32 export takes on them."""
    out = {g: work / f"calibration-{g}.npz" for g in ("prefill", "decode")}
    if all(p.exists() for p in out.values()):
        return out
    prefill, decode = _runner(_cpu_session(paths["prefill"])), _runner(_cpu_session(paths["decode"]))
    samples = {"prefill": [], "decode": []}
    for prompt in ids:
        run = generate(prefill, decode, prompt, shapes, max(DECODE_CALIBRATION_STEPS) + 1)
        samples["prefill"].append(run["steps"][0][0])
        samples["decode"] += [run["steps"][s][0] for s in DECODE_CALIBRATION_STEPS]
    for graph, rows in samples.items():
        np.savez(out[graph], **{k: np.stack([r[k] for r in rows]) for k in rows[0]})
    return out


def build(variant: str, model: str, paths: dict, shapes: Shapes, work: pathlib.Path, npz: dict | None,
          search: tuple[int, int] = (6, 6)) -> dict:
    """The two compiled graphs of ``variant`` (paths), and how the commands went; ``search``: the
    mixed-precision search's (candidates per ranking, steps) of a ``-minDB`` variant."""
    row: dict = {"graphs": {}}
    preset, _, target = variant.partition("-min")
    for graph in ("prefill", "decode"):
        out, ctx = work / f"{variant}-{graph}.onnx", work / f"{variant}-{graph}_ctx.onnx"
        report = work / f"{variant}-{graph}.report.json"
        dims = [a for d in shapes.dims(graph) for a in ("--dim", d)]
        if variant == "float":
            args = ["optimize", str(paths[graph]), "-o", str(out), "--target", "qnn", "--require-npu", *dims,
                    "--context", str(ctx), "--report", str(report), "--no-tune", "--overwrite", "-q"]
        elif preset in PRESETS:
            args = ["quantize", str(paths[graph]), "-o", str(out), "--preset", PRESETS[preset], "--calibration",
                    str(npz[graph]), "--require-npu", *dims, "--context", str(ctx), "--report", str(report),
                    "--reconstruct", "off", "--no-bias-correction", "--overwrite", "-q"]
            if target:
                args += ["--min-sqnr", target, "--search-candidates", str(search[0]), "--max-steps", str(search[1])]
        else:
            raise ValueError(variant)
        done = {"command": "opfuse " + " ".join(a if not a.startswith("/") else pathlib.Path(a).name for a in args)}
        if not out.exists():
            done.update(_cli(args, work / f"{variant}-{graph}.log"))
        else:
            done["cached"] = True
        done.update(_placement(report))
        done["written"] = out.exists()
        row["graphs"][graph] = done
    return row


def upgraded(path: pathlib.Path, opset: int, out: pathlib.Path) -> pathlib.Path:
    """The export at ``opset`` (opfuse's own upgrade, as ``--opset`` runs it), written once beside the work."""
    if not out.exists():
        import onnx_ir as ir

        from opfuse.prepare.opset import upgrade_opset

        model, note = upgrade_opset(ir.load(str(path)), opset)
        print(f"{path.parent.name}: {note or 'already at opset ' + str(opset)}", flush=True)
        ir.save(model, str(out), external_data=out.name + ".data")
    return out


def ort_flow(paths: dict, shapes: Shapes, npz: dict, work: pathlib.Path) -> dict:
    """ONNX Runtime's documented QNN flow on the same export and calibration (w8a16 types)."""
    import onnx

    from opfuse.prepare.static_shapes import make_static_proto
    from opfuse.quantization.presets import PRESETS as OPFUSE_PRESETS
    from opfuse.targets.qnn.probe import quantize_like_qnn_flow

    row: dict = {"graphs": {}}
    for graph in ("prefill", "decode"):
        out = work / f"ort-w8a16-{graph}.onnx"
        entry: dict = {}
        if not out.exists():
            start = time.perf_counter()
            try:
                dims = dict(d.split("=") for d in shapes.dims(graph))
                fixed, _ = make_static_proto(onnx.load(str(paths[graph])), {k: int(v) for k, v in dims.items()})
                data = np.load(npz[graph])
                samples = [{k: data[k][i] for k in data.files} for i in range(len(data[data.files[0]]))]
                qdq = quantize_like_qnn_flow(fixed, samples, preset=OPFUSE_PRESETS["qnn-a16-per-channel"])
                onnx.save(qdq, str(out), save_as_external_data=True, location=out.name + ".data")
                entry["quantize_s"] = round(time.perf_counter() - start, 1)
            except Exception as e:  # noqa: BLE001 (the flow's failure is a result)
                entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        entry["written"] = out.exists()
        row["graphs"][graph] = entry
    return row


def loop(paths: dict, compiled: dict, shapes: Shapes, ids: list[list[int]], tokens: int, reference: list) -> dict:
    """The greedy loop on the HTP; its agreement with the CPU's fp32 run (``reference``)."""
    runs = {}
    for graph in ("prefill", "decode"):
        runs[graph], runs[graph + "_placement"] = _htp_session(compiled[graph])
    cpu = {g: _runner(_cpu_session(paths[g])) for g in ("prefill", "decode")}
    row = {"placement": {g: runs[g + "_placement"] for g in ("prefill", "decode")}, "prompts": []}
    agree = same_context = total = 0
    start = time.perf_counter()
    for prompt, ref in zip(ids, reference):
        run = generate(runs["prefill"], runs["decode"], prompt, shapes, tokens)
        step_sqnr, argmax_same = [], []
        for i, (feeds, logits) in enumerate(run["steps"]):
            expected = (cpu["prefill"] if i == 0 else cpu["decode"])(feeds)["logits"][0, -1]
            step_sqnr.append(round(sqnr(expected, logits), 2))
            argmax_same.append(int(np.argmax(expected)) == int(np.argmax(logits)))
        matched = [a == b for a, b in zip(run["tokens"], ref)]
        agree += sum(matched)
        same_context += sum(argmax_same)
        total += len(matched)
        row["prompts"].append({"tokens": run["tokens"], "reference": ref, "agree": sum(matched),
                               "argmax_same_context": sum(argmax_same), "sqnr_per_step": step_sqnr})
    row["seconds"] = round(time.perf_counter() - start, 1)
    row["token_agreement"] = f"{agree}/{total}"
    row["argmax_same_context"] = f"{same_context}/{total}"
    every = [s for p in row["prompts"] for s in p["sqnr_per_step"]]
    row["sqnr_median"] = round(float(np.median(every)), 2)
    row["sqnr_min"] = round(float(np.min(every)), 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default="float,w8a16,w4a16,ort-w8a16")
    parser.add_argument("--past", type=int, default=255)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--calibration-prompts", type=int, default=len(CALIBRATION_PROMPTS))
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path.home() / ".cache" / "opfuse-qnn-llm",
                        help="where the compiled graphs, calibration and logs are kept (re-runs reuse them)")
    parser.add_argument("--no-loop", action="store_true", help="compile only")
    parser.add_argument("--opset", type=int, help="upgrade each export to this opset first (23: RMSNormalization, "
                        "Attention and RotaryEmbedding are written as the standard ops QNN runs)")
    parser.add_argument("--search-candidates", type=int, default=6,
                        help="a -minDB variant's search: candidates measured per ranking (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=6,
                        help="a -minDB variant's search: walk steps at most (default: %(default)s)")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    decoder = {**decoders.MODELS, **EXTRA}[args.model]
    work = args.work / f"{args.model}-p{args.past}-s{args.seq}" / (f"opset{args.opset}" if args.opset else "")
    work.mkdir(parents=True, exist_ok=True)
    paths = {}
    for graph in ("prefill", "decode"):
        path, error = decoders.exported(decoder, "dynamo", graph, decoders.DEFAULT_CACHE)
        if path is None:
            sys.exit(f"{args.model} {graph}: not exported ({error})")
        paths[graph] = upgraded(path, args.opset, work / f"export-{graph}.onnx") if args.opset else path
    shapes = Shapes(decoder, args.past, args.seq)
    result = {"model": args.model, "past": args.past, "seq": args.seq, "tokens": args.tokens,
              "shapes": {"prefill": f"input_ids/attention_mask/position_ids [1, {args.seq}] -> logits [1, {args.seq}, "
                                    f"V], present.i.key/value [1, {shapes.kv_heads}, {args.seq}, {shapes.head_dim}]",
                         "decode": f"input_ids/position_ids [1, 1], attention_mask [1, {args.past + 1}], "
                                   f"past_key_values.i.key/value [1, {shapes.kv_heads}, {args.past}, "
                                   f"{shapes.head_dim}] x {2 * shapes.layers} -> logits [1, 1, V], present.i.key/value "
                                   f"[1, {shapes.kv_heads}, {args.past + 1}, {shapes.head_dim}]"},
              "variants": {}}
    print(json.dumps(result["shapes"], indent=1), flush=True)
    ids = prompts_tokens(args.model, args.prompts, PROMPTS, work, args.seq)
    variants = args.variants.split(",")
    npz = None
    if any(v != "float" for v in variants):
        cal_ids = prompts_tokens(args.model, len(CALIBRATION_PROMPTS), CALIBRATION_PROMPTS, work, args.seq)
        npz = calibration(paths, shapes, cal_ids, work)
    reference = None
    if not args.no_loop:
        cpu = {g: _runner(_cpu_session(paths[g])) for g in ("prefill", "decode")}
        reference = [generate(cpu["prefill"], cpu["decode"], p, shapes, args.tokens)["tokens"] for p in ids]
        result["reference_tokens"] = reference
    for variant in variants:
        print(f"== {variant}", flush=True)
        row = ort_flow(paths, shapes, npz, work) if variant.startswith("ort-") else build(
            variant, args.model, paths, shapes, work, npz, (args.search_candidates, args.max_steps))
        compiled = {g: work / f"{variant}-{g}.onnx" for g in ("prefill", "decode")}
        if not args.no_loop and all(p.exists() for p in compiled.values()):
            try:
                row["loop"] = loop(paths, compiled, shapes, ids, args.tokens, reference)
            except Exception as e:  # noqa: BLE001 (a session that does not open or run is a result)
                row["loop"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        result["variants"][variant] = row
        print(json.dumps(row, indent=1, default=str)[:4000], flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
