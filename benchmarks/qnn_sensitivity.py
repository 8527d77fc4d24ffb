"""Where an 8-bit QNN model's error comes from, measured on the HTP: each node's output
alone in 16 bits.

    python benchmarks/qnn_sensitivity.py --model vit            # about 30 s
    python benchmarks/qnn_sensitivity.py --model bert --top 10

The model and its samples are ``benchmarks/qnn.py``'s (draw ``--seed``: ``--calibration``
random samples to calibrate, ``--holdout`` to judge). opfuse quantises it with ``--preset
qnn``; then, for every node, the same calibration is re-quantised with that node's outputs
at 16 bits (the search's ``int16`` keep action) and judged on the HTP. The gain in output
SQNR over the all-8-bit model ranks the nodes: an exact measurement per node, not an
estimate. For an output of rank 3 or more (a transformer's ``[batch, tokens, hidden]``), the
SQNR of each row of its second-last axis (each token) and its share of the output's noise
are printed as well.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import numpy as np
import onnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import qnn  # noqa: E402

from opfuse.targets.qnn.runner import HtpRunner  # noqa: E402
from opfuse.quantization.presets import PRESETS  # noqa: E402
from opfuse.quantization.qdq.quantizer import Quantizer  # noqa: E402
from opfuse.quantization.qdq.sqnr import outputs_db  # noqa: E402
from opfuse.runtime import create_session  # noqa: E402


def _float_model(path, samples, holdout):
    """The float model opfuse quantises (static, folded, prepared), captured from its pipeline."""
    import opfuse
    import opfuse.quantization.pipeline as pipeline

    captured = {}
    real = pipeline.TrialMaker

    class Capture(real):
        def __init__(self, quantizer, float_model, *a, **k):
            captured["float"] = float_model
            super().__init__(quantizer, float_model, *a, **k)

    pipeline.TrialMaker = Capture
    try:
        opfuse.quantize(str(path), samples, preset="qnn", holdout=holdout)
    finally:
        pipeline.TrialMaker = real
    return captured["float"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit", help="a model of benchmarks/qnn.py (vit, bert, resnet18, ...)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calibration", type=int, default=16)
    parser.add_argument("--holdout", type=int, default=32)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="opfuse-qnn-sens-") as tmp:
        ((label, path, traits),) = list(qnn._models([args.model], pathlib.Path(tmp), pathlib.Path.home() / ".cache" / "opfuse-wild"))
        samples = qnn._samples(onnx.load(path), args.calibration + args.holdout, args.seed,
                               wild=traits.get("wild", False), dims=traits.get("dims"))
        calib, held = samples[:args.calibration], samples[args.calibration:]
        float_model = _float_model(path, samples, args.holdout)
        quantizer = Quantizer(float_model, PRESETS["qnn"], calib, tmp, method="auto")
        names = [o.name for o in float_model.graph.output]
        session = create_session(float_model, "disabled")
        references = [session.run(names, s) for s in held]
        htp = HtpRunner()

        def on_htp(keep):
            model = quantizer.quantize(keep, keep_as="int16")
            return htp.outputs(model, held, names)

        base_outputs = on_htp([])
        base = outputs_db(names, references, base_outputs)
        print(f"{label}: all 8-bit, {base:.2f} dB on the HTP ({len(held)} held-out samples, draw {args.seed})")
        gains = []
        for node in float_model.graph.node:
            if node.op_type == "Constant":
                continue
            gains.append((outputs_db(names, references, on_htp([node.name])) - base, node.name, node.op_type))
        gains.sort(reverse=True)
        print(f"one node's outputs in 16 bits, the {args.top} largest gains of {len(gains)}:")
        for gain, name, op in gains[:args.top]:
            print(f"  {gain:+6.2f} dB  {op:<20} {name}")
        for k, name in enumerate(names):
            ref = np.stack([r[k] for r in references])
            got = np.stack([o[k] for o in base_outputs])
            if ref.ndim < 4:  # (samples, then the output's own axes: rows need rank 3)
                continue
            noise = ((ref - got) ** 2).sum()
            print(f"{name}: per row of axis -2 (SQNR, share of the noise)")
            for row in range(ref.shape[-2]):
                r, g = ref[..., row, :], got[..., row, :]
                e = ((r - g) ** 2).sum()
                print(f"  row {row}: {10 * np.log10((r ** 2).sum() / e):6.2f} dB, {e / noise:6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
