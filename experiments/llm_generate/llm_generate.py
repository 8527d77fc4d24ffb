"""Generate from folders ``opfuse llm`` wrote: greedy tokens against transformers' fp32, decode tokens/s.

    python experiments/llm_generate/llm_generate.py SOURCE FOLDER [FOLDER ...] [--threads 1] [--rounds 7]

SOURCE is what the folders were converted from (a GGUF file or a Hugging Face folder); transformers
loads it in float32 (a GGUF dequantised) and is the reference. For each chat prompt of :data:`PROMPTS`
(the tokenizer's chat template, generation prompt added), with transformers' token ids fed to every
runtime:

- **greedy agreement**: transformers' first ``--new`` (32) greedy tokens (fewer where it ends with the
  end-of-sequence token, which genai's sequence does not keep), and each folder's from onnxruntime-genai; printed:
  how many of the first tokens agree before the first difference (or "all N" when equal), and the
  steps of transformers' own run whose top two logits are within 1e-3 of each other (near ties).
- **decode tokens/s** (``--rounds`` rounds, one thread unless ``--threads``): after the prompt is
  appended (prefill, not timed in the decode figure), ``--decode`` (64) calls of
  ``generate_next_token``, timed together; decode tokens/s = 64 / that time. Every folder is loaded
  twice (A and A'), and each round runs every session once in a rotating order; the A/A' ratio of
  each folder is the noise floor of the comparison. Printed: median, min-max, and the load average.

Measurements go to docs/results/llm.md with this command; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

from opfuse.llm.genai import greedy

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
]


def _load_reference(source: pathlib.Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, kw = (str(source.parent), {"gguf_file": source.name}) if source.is_file() else (str(source), {})
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).eval()
    return model, AutoTokenizer.from_pretrained(where, **kw)


def _reference_greedy(model, ids: list[int], new: int) -> tuple[list[int], list[int]]:
    """transformers' greedy tokens, and the steps whose top two logits are within 1e-3."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    ties, tokens = [], out.sequences[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    if tokens and tokens[-1] in eos:  # genai's sequence ends before the end-of-sequence token
        tokens = tokens[:-1]
    for step, scores in enumerate(out.scores):
        top = torch.topk(scores[0], 2).values
        if float(top[0] - top[1]) < 1e-3:
            ties.append(step)
    return tokens, ties


def _model(folder: str, threads: int):
    import onnxruntime_genai as og

    config = og.Config(folder)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads,
                                                                           "inter_op_num_threads": 1}}}}))
    return og.Model(config)


def _decode_seconds(model, ids: list[int], decode: int) -> float:
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + decode, min_length=len(ids) + decode, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)  # prefill: not in the decode time
    start = time.perf_counter()
    for _ in range(decode):
        generator.generate_next_token()
    return time.perf_counter() - start


def _agree(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=pathlib.Path)
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7, help="0: greedy agreement only")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--decode", type=int, default=64)
    args = parser.parse_args(argv)

    reference, tokenizer = _load_reference(args.source)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in PROMPTS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    expected = [_reference_greedy(reference, ids, args.new) for ids in prompts]
    del reference
    print(f"transformers fp32 ({args.source.name}): near ties (top two within 1e-3) at steps "
          f"{[t for _, t in expected]}")
    print(f"  prompt 0: {tokenizer.decode(expected[0][0])!r}")
    models = {}
    for folder in args.folders:
        models[folder] = _model(folder, args.threads)
        import onnxruntime_genai as og

        genai_ids = [int(t) for t in og.Tokenizer(models[folder]).encode(
            tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                          tokenize=False))]
        agree = []
        for ids, (want, _) in zip(prompts, expected):
            got = greedy(models[folder], ids, args.new)
            agree.append(f"all {len(want)}" if got == want else _agree(got, want))
        first = greedy(models[folder], prompts[0], args.new)
        print(f"{folder}: greedy tokens equal to transformers' before the first difference, per prompt: {agree}; genai's tokenizer gives transformers' ids: {genai_ids == prompts[0]}")
        print(f"  prompt 0: {tokenizer.decode(first)!r}")
    if args.rounds < 1:
        return 0
    sessions = [(f, tag, models[f] if tag == "A" else _model(f, args.threads)) for f in args.folders for tag in "AB"]
    times: dict[tuple[str, str], list[float]] = {(f, t): [] for f, t, _ in sessions}
    ids = prompts[0]
    for r in range(args.rounds):
        order = sessions[r % len(sessions):] + sessions[:r % len(sessions)]
        for folder, tag, model in order:
            times[(folder, tag)].append(_decode_seconds(model, ids, args.decode))
    print(f"decode, {args.decode} tokens after a {len(ids)}-token chat prompt, {args.threads} thread(s), "
          f"{args.rounds} rounds; load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    for folder in args.folders:
        for tag in "AB":
            rates = [args.decode / t for t in times[(folder, tag)]]
            print(f"  {folder} ({'A' if tag == 'A' else 'A/A copy'}): tokens/s median {statistics.median(rates):.1f}, "
                  f"min-max {min(rates):.1f}-{max(rates):.1f}")
        ratios = [a / b for a, b in zip(times[(folder, 'A')], times[(folder, 'B')])]
        print(f"  {folder}: A/A time ratio median {statistics.median(ratios):.3f}, "
              f"min-max {min(ratios):.3f}-{max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
