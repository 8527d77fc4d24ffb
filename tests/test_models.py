"""Tests for opfuse.models: the built-in networks are valid, runnable, sane and deterministic."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from opfuse.models import BUILTIN_MODELS, build

SMALL_IMAGE = 64

EXPECTED_OPS = {
    "resnet18": {
        "Conv": 20, "BatchNormalization": 20, "Relu": 17, "Add": 8,
        "MaxPool": 1, "GlobalAveragePool": 1, "Flatten": 1, "Gemm": 1,
    },
    "resnet50": {
        "Conv": 53, "BatchNormalization": 53, "Relu": 49, "Add": 16,
        "MaxPool": 1, "GlobalAveragePool": 1, "Flatten": 1, "Gemm": 1,
    },
    "mobilenetv2": {
        "Conv": 52, "BatchNormalization": 52, "Clip": 35, "Add": 10,
        "GlobalAveragePool": 1, "Flatten": 1, "Gemm": 1,
    },
    "vgg": {"Conv": 8, "Relu": 9, "MaxPool": 5, "GlobalAveragePool": 1, "Flatten": 1, "Gemm": 2},
}

# BatchNorms with epsilon 1e-3: the stem and the first BN of each stage (row for MobileNetV2).
WIDE_EPSILON_COUNT = {"resnet18": 5, "resnet50": 5, "mobilenetv2": 8}


@functools.lru_cache(maxsize=None)
def small_model(name: str, **kwargs) -> onnx.ModelProto:
    """One shared build per argument set; tests must not mutate it."""
    return build(name, image_size=SMALL_IMAGE, **kwargs)


def run(model: onnx.ModelProto, batch: int = 2, seed: int = 0) -> np.ndarray:
    input_type = model.graph.input[0].type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(input_type.elem_type)
    size = input_type.shape.dim[2].dim_value
    x = np.random.default_rng(seed).standard_normal((batch, 3, size, size)).astype(dtype)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"input": x})
    return logits


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def attribute(node: onnx.NodeProto, name: str):
    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def nodes_by_name(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {node.name: node for node in model.graph.node}


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_checks_and_runs_with_sane_logits(name):
    model = small_model(name)
    onnx.checker.check_model(model, full_check=True)
    logits = run(model)
    assert logits.shape == (2, 1000)
    assert np.isfinite(logits).all()
    assert 0.1 <= logits.std() <= 100


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_exact_op_counts(name):
    assert Counter(node.op_type for node in small_model(name).graph.node) == EXPECTED_OPS[name]


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_names_are_unique_and_readable(name):
    model = small_model(name)
    node_names = [node.name for node in model.graph.node]
    outputs = [out for node in model.graph.node for out in node.output]
    assert all(node_names) and len(set(node_names)) == len(node_names)
    assert all(outputs) and len(set(outputs)) == len(outputs)
    assert [i.name for i in model.graph.input] == ["input"]
    assert [o.name for o in model.graph.output] == ["logits"]
    assert model.producer_name == "opfuse.models"
    assert model.doc_string
    for node in model.graph.node:
        weights = [i for i in node.input if i.startswith(f"{node.name}.")]
        if node.op_type == "BatchNormalization":
            params = ("weight", "bias", "running_mean", "running_var")
            assert weights == [f"{node.name}.{p}" for p in params]
        if node.op_type in ("Conv", "Gemm"):
            assert weights[0] == f"{node.name}.weight"


def test_resnet_module_paths_and_v15_stride():
    nodes = nodes_by_name(small_model("resnet50"))
    for name in (
        "conv1", "bn1", "relu", "maxpool", "layer1.0.conv1", "layer1.0.bn1", "layer1.0.relu1",
        "layer1.0.add", "layer1.0.downsample.0", "layer1.0.downsample.1", "layer4.2.relu3",
        "avgpool", "flatten", "fc",
    ):
        assert name in nodes, name
    assert nodes["layer2.0.add"].input == ["layer2.0.bn3", "layer2.0.downsample.1"]
    assert nodes["layer2.1.add"].input == ["layer2.1.bn3", "layer2.0.relu3"]
    # v1.5: the stride sits on the 3x3 conv, not on the first 1x1.
    assert attribute(nodes["layer2.0.conv1"], "strides") == [1, 1]
    assert attribute(nodes["layer2.0.conv2"], "strides") == [2, 2]
    assert attribute(nodes["layer2.0.downsample.0"], "strides") == [2, 2]
    convs = [n for n in nodes.values() if n.op_type == "Conv"]
    assert all(len(n.input) == 2 for n in convs), "convs have no bias"


def test_mobilenet_depthwise_and_relu6():
    model = small_model("mobilenetv2")
    nodes = nodes_by_name(model)
    depthwise = nodes["features.2.conv.1.0"]
    assert attribute(depthwise, "group") == 96
    assert initializers(model)["features.2.conv.1.0.weight"].shape == (96, 1, 3, 3)
    clip = nodes["features.2.conv.1.2"]
    assert clip.op_type == "Clip" and clip.input[0] == "features.2.conv.1.1"
    bounds = initializers(model)
    assert (bounds[clip.input[1]], bounds[clip.input[2]]) == (0.0, 6.0)
    # the projection conv has no activation
    assert nodes["features.3.add"].input == ["features.2.conv.3", "features.3.conv.3"]


def test_vgg_convs_have_bias_and_relu():
    model = small_model("vgg")
    consumers = {node.input[0]: node for node in model.graph.node}
    for node in model.graph.node:
        if node.op_type == "Conv":
            assert len(node.input) == 3
            assert consumers[node.output[0]].op_type == "Relu"


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "mobilenetv2"])
def test_batchnorm_statistics_are_realistic(name):
    model = small_model(name)
    weights = initializers(model)
    epsilons = []
    for node in model.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        assert [a.name for a in node.attribute] == ["epsilon"], "epsilon is always explicit"
        epsilons.append(attribute(node, "epsilon"))
        gamma, beta, mean, var = (weights[i] for i in node.input[1:])
        assert np.all((gamma > 0.1) & (gamma < 1.6))
        assert np.abs(beta).max() < 1.0 and np.any(beta != 0)
        assert np.all(var > 0) and not np.allclose(var, 1.0)
        assert not np.allclose(mean, 0.0)
    wide = [e for e in epsilons if e == pytest.approx(1e-3)]
    assert len(wide) == WIDE_EPSILON_COUNT[name]
    assert len(wide) + sum(e == pytest.approx(1e-5) for e in epsilons) == len(epsilons)
    assert model.graph.node[1].op_type == "BatchNormalization"
    stem_bn = model.graph.node[1]
    assert attribute(stem_bn, "epsilon") == pytest.approx(1e-3), "the stem BN is one of them"


@pytest.mark.parametrize("name", ["resnet50", "mobilenetv2"])
def test_activations_neither_explode_nor_vanish(name):
    model = onnx.ModelProto()
    model.CopyFrom(small_model(name))
    watched = [n.output[0] for n in model.graph.node if n.op_type in ("BatchNormalization", "Add")]
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(v) for v in watched)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(3).standard_normal((2, 3, SMALL_IMAGE, SMALL_IMAGE))
    x = x.astype(np.float32)
    values = session.run(watched, {"input": x})
    stds = {v: float(a.std()) for v, a in zip(watched, values)}
    assert all(0.1 < s < 10 for s in stds.values()), stds


def test_same_seed_same_bytes_other_seed_other_weights():
    first = small_model("resnet18").SerializeToString(deterministic=True)
    again = build("resnet18", image_size=SMALL_IMAGE).SerializeToString(deterministic=True)
    assert first == again
    other = initializers(build("resnet18", image_size=SMALL_IMAGE, seed=1))
    base = initializers(small_model("resnet18"))
    assert other.keys() == base.keys()
    assert not np.array_equal(other["conv1.weight"], base["conv1.weight"])
    assert not np.array_equal(other["layer1.0.bn1.running_var"], base["layer1.0.bn1.running_var"])


def test_weights_do_not_depend_on_image_size_or_batch():
    base = initializers(small_model("mobilenetv2"))
    other = initializers(build("mobilenetv2", image_size=96, batch=4))
    assert base.keys() == other.keys()
    assert all(np.array_equal(base[k], other[k]) for k in base)


def test_symbolic_batch_runs_with_any_batch():
    model = small_model("mobilenetv2")
    for value in (model.graph.input[0], model.graph.output[0]):
        assert value.type.tensor_type.shape.dim[0].dim_param == "batch"
    assert run(model, batch=1).shape == (1, 1000)
    assert run(model, batch=3).shape == (3, 1000)


def test_static_batch_and_options():
    model = build("vgg", batch=2, image_size=32, num_classes=10)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 2
    assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim] == [2, 10]
    onnx.checker.check_model(model, full_check=True)
    assert run(model).shape == (2, 10)


@pytest.mark.parametrize("name", ["resnet18", "mobilenetv2", "vgg"])
def test_float16_runs_and_is_finite(name):
    model = small_model(name, dtype="float16")
    onnx.checker.check_model(model, full_check=True)
    assert all(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer)
    logits = run(model)
    assert logits.dtype == np.float16
    assert np.isfinite(logits).all()
    assert 0.1 <= logits.astype(np.float32).std() <= 100


@pytest.mark.parametrize("opset", [9, 13])
def test_mobilenet_older_opsets(opset):
    model = small_model("mobilenetv2", opset=opset)
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == opset
    clips = [n for n in model.graph.node if n.op_type == "Clip"]
    if opset < 11:
        assert all(len(c.input) == 1 for c in clips)
        assert all((attribute(c, "min"), attribute(c, "max")) == (0.0, 6.0) for c in clips)
    else:
        assert all(len(c.input) == 3 for c in clips)
    logits = run(model)
    assert np.isfinite(logits).all() and 0.1 <= logits.std() <= 100
    # the opset changes how Clip is written, not the network
    np.testing.assert_allclose(logits, run(small_model("mobilenetv2")), rtol=1e-4, atol=1e-4)


def test_default_opset_is_17():
    assert small_model("resnet18").opset_import[0].version == 17


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="resnet18.*resnet50.*mobilenetv2.*vgg"):
        build("alexnet")


@pytest.mark.parametrize(
    "kwargs", [{"dtype": "bfloat16"}, {"batch": 0}, {"batch": ""}, {"image_size": 16}, {"opset": 7}]
)
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        build("vgg", **kwargs)
