"""The ``opfuse llm`` subcommand's flags and what it prints (the work is :func:`opfuse.llm.convert`).

    opfuse llm SOURCE -o DIR [--precision fp32|int4] [--block-size 32] [--symmetric] [--no-verify]
                             [--attention gqa|exported]

Exit 0 with one summary line per step; bad input (no such SOURCE, not a GGUF or a folder with
config.json, an encoder-decoder) is one line on stderr and exit 2 (``opfuse.cli.main`` maps the
errors). Importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

__all__ = ["add_parser", "run"]

import argparse
import time


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("llm", help="a causal LM (GGUF file or Hugging Face folder) to a folder onnxruntime-genai "
                                   "runs: model.onnx, genai_config.json, tokenizer")
    p.add_argument("source", help="a .gguf file or a Hugging Face folder (config.json and weights)")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="the folder to write (model.onnx with its weights in model.onnx.data, genai_config.json, "
                        "tokenizer.json, tokenizer_config.json)")
    p.add_argument("--precision", choices=("fp32", "int4"), default="fp32",
                   help="fp32, or int4 weight-only: MatMul weights as com.microsoft.MatMulNBits, the embedding "
                        "as GatherBlockQuantized, round-to-nearest (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=32, choices=(16, 32, 64, 128, 256),
                   help="int4: weights per scale along K (default: %(default)s)")
    p.add_argument("--symmetric", action="store_true", help="int4: no zero points (default: a zero point per block)")
    p.add_argument("--attention", choices=("gqa", "exported"), default="gqa",
                   help="gqa: each layer's attention as com.microsoft.GroupQueryAttention (rotary inside, the cache "
                        "shared between past and present), verified against the graph as exported on unpadded "
                        "inputs, kept as exported where it is not that form; exported: as exported "
                        "(default: %(default)s)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip running the export and the optimised graph on ONNX Runtime side by side")
    return p


def run(args) -> int:
    # (torch and transformers, through the conversion: only when the command runs)
    from opfuse.llm import convert

    start = time.perf_counter()
    done = convert(args.source, args.output, args.precision, verify=not args.no_verify,
                   block_size=args.block_size, symmetric=args.symmetric, attention=args.attention)
    print(f"optimised: {done.optimize_summary}")
    print(f"attention: {done.attention}")
    if done.precision == "int4":
        print(f"left in float: {len(done.not_quantized)} MatMul/Gather nodes (activations on both sides: "
              "attention scores and values, index gathers)")
    print(f"wrote {done.summary()} in {time.perf_counter() - start:.1f} s")
    return 0
