"""The README's command examples run: every line of a fenced ``sh`` block that starts with
``opfuse `` is run through the real command line, so the README cannot drift from the CLI.

The files the examples name are substituted: ``model.onnx`` is ResNet-18 at 32x32 with a symbolic
batch, built as the built-in one is (:mod:`opfuse.models.resnet`: its stem, BasicBlocks and head) at
a quarter of its widths (:func:`quarter_resnet18`), ``calib.npz`` 32 samples of its input in
the layout ``--calibration`` reads, and every other file a fresh path under ``tmp_path``. The
examples in :data:`ON_A_SMALL_GRAPH` run on a two-conv graph instead (Conv+BN+Relu+Conv+BN,
8 channels, 16x16), each with its reason: what they fit takes minutes on ResNet-18. An example
asserts that the command runs as written and writes a valid model, which does not depend on the
widths; at full width (11 M weights) every serialisation, session and weight quantisation of the
quantize examples cost about 16 times as much.
The commands run in process (``opfuse.cli.main``); a quantize example that does not name
``--reconstruct`` runs with ``--reconstruct off`` appended, as every quantize test of another
step asks (block reconstruction takes minutes on ResNet-18; ``tests/test_reconstruction.py``
runs the default path end to end on a small graph). Each must exit 0, and each
``-o`` file must exist and be a valid model. Examples that cannot run here are in
:data:`PARSED_ONLY`, each with its reason: argparse must accept them, which is all the README
can promise without running them.
"""

from __future__ import annotations

import pathlib
import re
import shlex

import numpy as np
import onnx
import pytest
from onnx import helper

import extras
from graphs import bn_node, bn_params, model, rng, tensor, vinfo
from opfuse.cli import build_parser, main
from opfuse.models import resnet
from opfuse.models._builder import GraphBuilder

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"

# example (as written in the README) -> why it is only parsed, not run
PARSED_ONLY = {
    "opfuse bench": "the chapter's ablation on the built-in ResNet-50 at 224x224: minutes of timing",
    "opfuse llm SmolLM2-135M-Instruct.Q4_1.gguf -o smol-int4 --precision int4":
        "a real LLM from a wheel (tests/test_llm.py runs the command on a tiny Llama built in code)",
}
# example -> why it runs on the two-conv graph rather than on ResNet-18
ON_A_SMALL_GRAPH = {
    "opfuse quantize model.onnx -o m.pt.onnx --calibration calib.npz --preset per-tensor":
        "the preset's AdaRound fits every layer: about 8 minutes on ResNet-18",
    "opfuse quantize model.onnx -o m.qnn.onnx --calibration calib.npz --preset qnn --require-npu":
        "bias correction is judged on the HTP's emulation: about 90 s on ResNet-18",
}


def readme_commands() -> list[str]:
    blocks = re.findall(r"^```sh\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    return [" ".join(shlex.split(line, comments=True)) for line in lines if line.startswith("opfuse ")]


COMMANDS = readme_commands()


def test_the_readme_has_examples_of_every_command():
    assert {c.split()[1] for c in COMMANDS} >= {"optimize", "inspect", "quantize", "bench"}
    assert set(PARSED_ONLY) | set(ON_A_SMALL_GRAPH) <= set(COMMANDS), "an example listed here left the README"


def two_convs() -> onnx.ModelProto:
    r = rng(0)
    inits = [tensor("W1", r.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32)),
             tensor("W2", r.normal(0, 0.3, (8, 8, 3, 3)).astype(np.float32))]
    inits += bn_params("bn1", 8, 1) + bn_params("bn2", 8, 2)
    nodes = [helper.make_node("Conv", ["x", "W1"], ["y1"], name="conv1", pads=[1, 1, 1, 1]),
             bn_node("bn1", "y1", "z1"), helper.make_node("Relu", ["z1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "W2"], ["y2"], name="conv2", pads=[1, 1, 1, 1]),
             bn_node("bn2", "y2", "out")]
    return model(nodes, [vinfo("x", ["batch", 3, 16, 16])], [vinfo("out", ["batch", 8, 16, 16])], inits)


def quarter_resnet18(widths: tuple[int, ...] = (16, 32, 64, 128)) -> onnx.ModelProto:
    """ResNet-18 (:func:`opfuse.models.resnet.resnet18`: the 7x7 stem, BN, Relu, MaxPool, BasicBlocks
    [2, 2, 2, 2], GlobalAveragePool, the Gemm head) with ``widths`` for its stages' (64, 128, 256, 512)
    and the first for the stem's 64; 32x32, 10 classes, a symbolic batch."""
    graph = GraphBuilder(seed=0, opset=17)
    x = graph.conv(graph.input, "conv1", widths[0], 7, stride=2)
    x = graph.maxpool(graph.relu(graph.batchnorm(x, "bn1", epsilon=resnet.WIDE_EPSILON), "relu"), "maxpool", 3,
                      stride=2, pad=1)
    for stage, width in enumerate(widths, start=1):
        for index in range(2):
            x = resnet._basic_block(graph, x, f"layer{stage}.{index}", width, 2 if stage > 1 and index == 0 else 1, 1)
    logits = graph.gemm(graph.flatten(graph.global_average_pool(x, "avgpool"), "flatten"), "fc", 10, output="logits")
    return graph.to_model(logits, graph_name="resnet18", doc_string="ResNet-18 at a quarter of its widths",
                          batch="batch", image_size=32, dtype="float32")


def _files(where: pathlib.Path, network: onnx.ModelProto, shape: tuple[int, ...]) -> dict:
    where.mkdir()
    path, calib = where / "model.onnx", where / "calib.npz"
    onnx.save(network, path)
    samples = np.random.default_rng(0).standard_normal((32, 1, *shape)).astype(np.float32)
    np.savez(calib, **{network.graph.input[0].name: samples})
    return {"model.onnx": path, "calib.npz": calib}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    where = tmp_path_factory.mktemp("readme")
    return {"resnet18": _files(where / "resnet18", quarter_resnet18(), (3, 32, 32)),
            "two-convs": _files(where / "two-convs", two_convs(), (3, 16, 16))}


def _substituted(command: str, files: dict, tmp_path: pathlib.Path) -> tuple[list[str], list[pathlib.Path]]:
    args, outputs = [], []
    words = command.split()[1:]
    for i, word in enumerate(words):
        if word in files:
            word = str(files[word])
        elif re.fullmatch(r"[\w.-]+\.(onnx|json|npz|tflite)", word):
            word = str(tmp_path / word)
            if i > 0 and words[i - 1] in ("-o", "--output", "--context"):
                outputs.append(pathlib.Path(word))
        args.append(word)
    if args[0] == "quantize" and "--reconstruct" not in args:
        args += ["--reconstruct", "off"]  # (module docstring)
    return args, outputs


@pytest.mark.parametrize("command", COMMANDS)
def test_a_readme_example_runs(command, files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a file the substitution missed is written there, never into the checkout
    args, outputs = _substituted(command, files["two-convs" if command in ON_A_SMALL_GRAPH else "resnet18"], tmp_path)
    if command in PARSED_ONLY:
        parsed = build_parser().parse_args(args)
        assert parsed.command == args[0]
        return
    if "--target qnn" in command or "--preset qnn" in command:
        extras.require("onnxruntime_qnn")
    if "ethos-u" in command:
        extras.require("ethosu.vela")
        extras.require("ai_edge_litert")
    rc = main(args)
    captured = capsys.readouterr()
    assert rc == 0, f"{command}\n{captured.out[-2000:]}\n{captured.err[-2000:]}"
    for path in outputs:
        if path.suffix == ".tflite":  # Vela's compiled model: a TFLite flatbuffer
            assert path.read_bytes()[4:8] == b"TFL3", path
        else:
            onnx.checker.check_model(onnx.load(path))
