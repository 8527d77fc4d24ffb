"""Output SQNR (ONNX Runtime, all optimisations) and exact match per evaluation rendering of
QDQ models of the case, against the float model as shipped.

    python evaluate.py qdq_base.onnx qdq_fis_lsq_bf.onnx     # names in lib.WORK, or paths
"""
import pathlib
import pickle
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import ocr_text  # noqa: E402
import quantize as qb  # noqa: E402

from lib import WORK  # noqa: E402
from opfuse.runtime import create_session  # noqa: E402

c = pickle.load(open(WORK / "case.pkl", "rb"))
chars = ocr_text.characters(c["path"])
texts = [(r, t) for r in qb.EVAL_RENDERINGS for t, _ in ocr_text.render(r, 100, ocr_text.EVAL_SEED)]


def outputs(path):
    return qb.run_all(create_session(str(path), "all"), c["held"])


def exact(out):
    hits = {}
    for got, (rendering, text) in zip(ocr_text.decode_batch(out[0], chars), texts):
        hits.setdefault(rendering, []).append(got == text)
    return {r: 100 * float(np.mean(v)) for r, v in hits.items()}


reference = outputs(c["path"])
floats = exact(reference)
print("float", " / ".join(f"{v:.0f}" for v in floats.values()), f"({', '.join(floats)})")
for name in sys.argv[1:]:
    path = pathlib.Path(name) if pathlib.Path(name).exists() else WORK / name
    out = outputs(path)
    got = exact(out)
    print(path.name, " / ".join(f"{v:.0f}" for v in got.values()),
          f"worst drop {max(floats[r] - got[r] for r in floats):.0f}, output SQNR {qb.output_db(reference, out):.2f} dB")
