"""Float islands in the int8 Ethos-U lowering: ops the quantiser left float, between DEQUANTIZE and QUANTIZE.

Small graphs built in code (``test_ethos_u_lower``'s helpers and int8 tolerance): the QDQ model
ONNX Runtime writes when it is not told to quantise some op types, on ONNX Runtime, against its
TFLite lowered with ``float_islands=True`` in LiteRT; without it the lowering refuses. Vela (U55-128)
compiles it and leaves the float ops to the CPU, naming its reason.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import onnx
import pytest
from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
import numpy as np
import extras
from test_ethos_u_lower import (_feeds, _Reader, assert_int8_close, output_scales, run_ort, run_tflite,
                                tflite_ops, unary_graph)
from test_ethos_u_norm import layer_norm_graph, rewritten

from opfuse.targets.ethos_u.lower import LoweringError, lower_to_tflite


def quantise_only(model: onnx.ModelProto, op_types: list[str], tmp_path: Path) -> onnx.ModelProto:
    src, dst = tmp_path / "float.onnx", tmp_path / "qdq.onnx"
    onnx.save(model, src)
    quantize_static(str(src), str(dst), _Reader(model), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True,
                    op_types_to_quantize=op_types,
                    extra_options={"WeightSymmetric": True, "ActivationSymmetric": False})
    return onnx.load(dst)


CASES = {
    # a Tanh after a quantised Conv: DEQUANTIZE, float TANH, a float graph output
    "tanh_left_float": (lambda: unary_graph("Tanh"), ["Conv"], {"DEQUANTIZE", "TANH"}),
    # a LayerNorm in RSQRT form with ReduceMean, Sub and Pow not listed: a float chain, QUANTIZE into the Mul
    "layer_norm_chain_left_float": (lambda: rewritten(layer_norm_graph()), ["MatMul", "Mul", "Add"],
                                    {"DEQUANTIZE", "MEAN", "SUB", "RSQRT", "QUANTIZE"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_op_left_float_runs_in_float_between_dequantize_and_quantize(case, tmp_path):
    build, op_types, expected = CASES[case]
    qdq = quantise_only(build(), op_types, tmp_path)
    with pytest.raises(LoweringError, match="is not quantised"):
        lower_to_tflite(qdq)
    tfl = lower_to_tflite(qdq, float_islands=True)
    assert expected <= set(tflite_ops(tfl))
    feeds = _feeds(qdq)
    if all(output_scales(tfl)):  # int8 outputs: within the lowering's int8 tolerance
        assert_int8_close(tfl, qdq, feeds)
    else:  # a float output (the island's): its int8 inputs are exact, then float32 on both runtimes
        for e, g in zip(run_ort(qdq, feeds), run_tflite(tfl, feeds)):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_vela_leaves_the_float_ops_to_the_cpu_with_its_reason(tmp_path):
    build, op_types, _ = CASES["layer_norm_chain_left_float"]
    tfl = tmp_path / "islands.tflite"
    tfl.write_bytes(lower_to_tflite(quantise_only(build(), op_types, tmp_path), float_islands=True))
    result = subprocess.run([*extras.vela(), "--accelerator-config", "ethos-u55-128", str(tfl),
                             "--output-dir", str(tmp_path / "vela")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    # the island's four ops (DEQUANTIZE, MEAN and SUB in float, QUANTIZE from float) and nothing else
    assert "CPU operators = 4 " in result.stdout, result.stdout
    for op in ("DEQUANTIZE", "MEAN", "SUB", "QUANTIZE"):
        assert f"operator: {op}," in result.stdout, result.stdout


def test_the_runner_reads_a_square_output_as_nhwc(tmp_path):
    """The Tanh case's output is [1, 6, 6, 6] (C == H == W: NHWC and NCHW have one shape); the
    device's runner (``TfliteSession``) transposes it all the same, as the lowering wrote it NHWC."""
    from opfuse.targets.ethos_u.runner import TfliteSession

    qdq = quantise_only(unary_graph("Tanh"), ["Conv"], tmp_path)
    feeds = _feeds(qdq)
    session = TfliteSession(lower_to_tflite(qdq, float_islands=True), qdq)
    np.testing.assert_allclose(session.run(None, feeds)[0], run_ort(qdq, feeds)[0], rtol=1e-5, atol=1e-5)
