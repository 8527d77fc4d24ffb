"""The case: PP-OCRv4 rec as benchmarks/quantize.py renders it, folded as opfuse folds it,
and its baseline QDQ model (opfuse's cpu preset, --calibrate auto, no bias correction or
AdaRound: ONNX Runtime's quantiser with opfuse's ranges), all written to lib.WORK.

    python case.py        # about a minute, after the wheel cache exists
    python case.py 1      # calibration draw 1 (benchmarks/quantize.py --calibration-draws: seed 1002)
"""
import logging
import pathlib
import pickle
import sys
import tempfile
import warnings

import onnx
import onnx_ir as ir

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import quantize as qb  # noqa: E402

from lib import BASE, FLOAT, WORK  # noqa: E402
from opfuse.load import load_model  # noqa: E402
from opfuse.passes import DEFAULT_PASSES  # noqa: E402
from opfuse.pipeline import optimize  # noqa: E402
from opfuse.quantization.presets import PRESETS  # noqa: E402
from opfuse.quantization.qdq import Quantizer, prepare  # noqa: E402
from opfuse.quantization.sqnr import OutputReference  # noqa: E402

logging.getLogger().setLevel(logging.ERROR)
warnings.simplefilter("ignore")
WORK.mkdir(parents=True, exist_ok=True)
DRAW = int(sys.argv[1]) if len(sys.argv) > 1 else 0
case = qb.ocr_case(qb.DEFAULT_CACHE, WORK, "ppocrv4", 100, DRAW)  # 64 bold-mixed lines; 100 per evaluation rendering
pickle.dump({"path": str(case.path), "calib": case.calibration, "held": case.held_out}, open(WORK / "case.pkl", "wb"))
work, _ = load_model(case.path)
folded, _ = optimize(work, passes=list(DEFAULT_PASSES), target="onnx", inputs=case.held_out[0], compile_for_device=False)
float_model, _ = prepare(ir.serde.serialize_model(folded), PRESETS["cpu"])
onnx.save(float_model, FLOAT)
tune = list(case.calibration)[:48]
with tempfile.TemporaryDirectory() as tmp:
    base = Quantizer(float_model, PRESETS["cpu"], tune, tmp, method="auto").quantize([], keep_as="float")
onnx.save(base, BASE)
print("baseline output SQNR on the 48 tuning lines", round(OutputReference(float_model, tune).sqnr(base), 2), "dB;",
      "written to", WORK)
