"""Where PP-OCRv4 rec's int8 errors sit: the CTC time steps over the text, or over the blank padding.

    python experiments/ocr_padding/probe.py --seed 1002

Quantises PP-OCRv4 rec with ``opfuse.quantize`` (cpu preset, no flags) on 64 bold-mixed lines
drawn with ``--seed`` (``benchmarks/quantize.py --calibration-draws``' draws are seeds 2, 1002,
2002), then reads the 100 lines of each evaluation rendering of ``benchmarks/quantize.py``.
Each line is resized to height 48 and padded with zeros to width 320
(``benchmarks/ocr_text.preprocess``). The time steps whose receptive field starts right of the
resized image are the padding. Per rendering it prints the output SQNR over the text steps
and over the padding steps, the padding's share of the squared error, and the wrong lines
that decode right when the padding steps are dropped: those failed only because the int8
model emitted characters where the float model read blank.
"""

import argparse
import logging
import math
import pathlib
import sys
import tempfile
import warnings


ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ocr_text  # noqa: E402
import quantize as bench  # noqa: E402

import opfuse  # noqa: E402
from opfuse.runtime import create_session  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=ocr_text.CALIBRATION_SEED, help="calibration lines' seed")
    parser.add_argument("--cache", type=pathlib.Path, default=bench.DEFAULT_CACHE)
    args = parser.parse_args()
    logging.getLogger().setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    path = ocr_text.rec_model(args.cache, "ppocrv4")
    chars = ocr_text.characters(path)
    lines = ocr_text.render(bench.CALIBRATION_RENDERING, 64, args.seed)
    calibration = [{"x": ocr_text.preprocess(image)} for _, image in lines]
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "int8.onnx"
        opfuse.quantize(str(path), calibration, output=out, overwrite=True)
        floating, quantised = create_session(str(path), "all"), create_session(str(out), "all")
        for rendering in bench.EVAL_RENDERINGS:
            err = {"text": 0.0, "padding": 0.0}
            sig = {"text": 0.0, "padding": 0.0}
            wrong = wrong_for_padding = 0
            for text, image in ocr_text.render(rendering, 100, ocr_text.EVAL_SEED):
                x = ocr_text.preprocess(image)
                f = floating.run(None, {"x": x})[0][0]  # [time steps, classes]
                q = quantised.run(None, {"x": x})[0][0]
                end = int(math.ceil(f.shape[0] * ocr_text.resized_width(image) / ocr_text.WIDTH))
                e, s = ((q - f) ** 2).sum(axis=1), (f * f).sum(axis=1)
                err["text"] += e[:end].sum()
                err["padding"] += e[end:].sum()
                sig["text"] += s[:end].sum()
                sig["padding"] += s[end:].sum()
                if ocr_text.decode_batch(q[None], chars)[0] != text:
                    wrong += 1
                    wrong_for_padding += ocr_text.decode_batch(q[None, :end], chars)[0] == text
            db = {k: 10 * math.log10(sig[k] / max(err[k], 1e-30)) for k in err}
            share = err["padding"] / (err["padding"] + err["text"])
            print(f"seed {args.seed} {rendering}: output SQNR over the text {db['text']:.1f} dB, over the padding "
                  f"{db['padding']:.1f} dB ({share:.0%} of the error); {wrong} lines wrong, {wrong_for_padding} of them "
                  "right without the padding steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
