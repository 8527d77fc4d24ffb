"""The ``opfuse llm`` subcommand's flags and what it prints (the work is :func:`opfuse.llm.convert`).

    opfuse llm SOURCE -o DIR [--precision fp32|int4] [--block-size 32] [--symmetric] [--no-verify]
               [--int4-algorithm rtn|k_quant|hqq|q4_1|gptq] [--head-bits 4|8] [--embedding-bits 4|8]
               [--no-gguf-blocks]
               [--attention gqa|exported]

Exit 0 with one summary line per step; bad input (no such SOURCE, not a GGUF or a folder with
config.json, an encoder-decoder) is one line on stderr and exit 2 (``opfuse.cli.main`` maps the
errors). Importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

__all__ = ["add_parser", "run"]

import argparse
import time

# (no numpy, onnx or ONNX Runtime: quantize_int4 imports them at module level; the names are plain data)
ALGORITHMS = ("rtn", "k_quant", "hqq", "q4_1", "gptq", "gptq_int")
DEFAULT_ALGORITHM = "gptq"  # measured best: docs/results/llm.md
FOLD_NORMS = False  # as opfuse.llm.quantize_int4's


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("llm", help="a causal LM (GGUF file or Hugging Face folder) to a folder onnxruntime-genai "
                                   "runs: model.onnx, genai_config.json, tokenizer")
    p.add_argument("source", help="a .gguf file or a Hugging Face folder (config.json and weights)")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="the folder to write (model.onnx with its weights in model.onnx.data, genai_config.json, "
                        "tokenizer.json, tokenizer_config.json)")
    p.add_argument("--precision", choices=("fp32", "int4"), default="fp32",
                   help="fp32, or int4 weight-only: MatMul weights as com.microsoft.MatMulNBits, the embedding "
                        "as GatherBlockQuantized (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=32, choices=(16, 32, 64, 128, 256),
                   help="int4: weights per scale along K (default: %(default)s)")
    p.add_argument("--symmetric", action="store_true",
                   help="int4, --int4-algorithm rtn: no zero points (default: a zero point per block)")
    p.add_argument("--int4-algorithm", choices=ALGORITHMS, default=None,
                   help="int4: how weights are rounded (default: %s): rtn (ONNX Runtime's min-max, integer zero "
                        "points), k_quant and hqq (ONNX Runtime's; hqq writes float zero points, which its CPU "
                        "kernel runs slowly), q4_1 (min-max with a float minimum, as GGUF's Q4_1), gptq "
                        "(calibrated on standard-library docstrings), gptq_int (gptq with integer zero points: "
                        "fewer nodes)" % DEFAULT_ALGORITHM)
    p.add_argument("--head-bits", type=int, choices=(4, 8), default=4,
                   help="int4: bits of the LM head's MatMulNBits (default: %(default)s)")
    p.add_argument("--embedding-bits", type=int, choices=(4, 8), default=8,
                   help="int4: bits of the token embedding's GatherBlockQuantized (default: %(default)s; it reads "
                        "a few rows per token, so 8 bits cost file size, not time)")
    p.add_argument("--no-gguf-blocks", action="store_true",
                   help="int4 from a GGUF: requantise every weight from float instead of importing the file's "
                        "Q4_0/Q4_1/Q8_0 blocks as they are (the default: exact)")
    p.add_argument("--fold-norms", action=argparse.BooleanOptionalAction, default=None,
                   help="int4: fold each RMSNorm's scale into the projections that read it before quantising, "
                        "where they are still in float (default: %s)" % ("on" if FOLD_NORMS else "off"))
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
                   block_size=args.block_size, symmetric=args.symmetric, algorithm=args.int4_algorithm,
                   head_bits=args.head_bits, embedding_bits=args.embedding_bits,
                   gguf_blocks=not args.no_gguf_blocks, attention=args.attention,
                   fold_norms=FOLD_NORMS if args.fold_norms is None else args.fold_norms)
    print(f"optimised: {done.optimize_summary}")
    print(f"attention: {done.attention}")
    if done.precision == "int4":
        print(f"left in float: {len(done.not_quantized)} MatMul/Gather nodes (activations on both sides: "
              "attention scores and values, index gathers)")
    print(f"wrote {done.summary()} in {time.perf_counter() - start:.1f} s")
    return 0
