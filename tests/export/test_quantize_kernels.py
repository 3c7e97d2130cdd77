"""The int8 graphs answer through onnxruntime's int8 kernels as their integers say, on the shipped
checkpoint: the static one as it does run as written (QuantizeLinear/DequantizeLinear around float
nodes), the dynamic one as its MatMulInteger nodes do with their sums taken in float.

Without VNNI, the x86 kernels add pairs of uint8 x int8 products in int16 and saturate with 8-bit
weights (export/quantize.py, ``WEIGHT_RANGE``): the shipped checkpoint's static int8 lost 0.7 points
of test accuracy on such a CPU and none where the products cannot saturate.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from export import onnx_graphs, quantize
from export.checkpoint import load_trained
from export.data import load_dataset, normalize
from tests.support import made_once

SHIPPED_CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "fashion-small-stage3"
TEST_IMAGES = 500


@pytest.fixture(scope="module")
def shipped(tmp_path_factory) -> Path:
    """A directory holding the shipped checkpoint's float classifier (``float.onnx``), its static
    and dynamic int8 classifiers (``static-qdq.onnx``, ``dynamic.onnx``, quantized as the export
    does, the static one calibrated on 128 normalised training images drawn as the export draws
    them) and 500 normalised test images (``images.npy``); made once for every xdist worker."""

    def make(directory: Path) -> None:
        trained = load_trained(SHIPPED_CHECKPOINT)
        train, test = load_dataset(trained.spec, None)
        train = quantize.run_training_images(trained.path, train)
        chosen = quantize.calibration_images(train.images, 128)
        calibration = normalize(chosen, trained.spec).numpy()
        graph = onnx_graphs.classifier_graph(trained.model)
        onnx.save(graph, directory / "float.onnx")
        static = quantize.quantize_graph(graph, "static-qdq", calibration)
        onnx.save(static, directory / "static-qdq.onnx")
        onnx.save(quantize.quantize_graph(graph, "dynamic"), directory / "dynamic.onnx")
        images = normalize(test.images[:TEST_IMAGES], trained.spec).numpy()
        np.save(directory / "images.npy", images)

    return made_once(tmp_path_factory, "shipped-int8", make)


@pytest.fixture(scope="module")
def shipped_int8(shipped) -> tuple[onnx.ModelProto, np.ndarray]:
    """The shipped checkpoint's static int8 classifier and the test images."""
    return onnx.load(str(shipped / "static-qdq.onnx")), np.load(shipped / "images.npy")


@pytest.fixture(scope="module")
def shipped_dynamic(shipped) -> tuple[onnx.ModelProto, np.ndarray]:
    """The shipped checkpoint's dynamic int8 classifier and the test images."""
    return onnx.load(str(shipped / "dynamic.onnx")), np.load(shipped / "images.npy")


def logits(graph: onnx.ModelProto, images: np.ndarray, level: ort.GraphOptimizationLevel):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 3
    session = ort.InferenceSession(graph.SerializeToString(), options, ["CPUExecutionProvider"])
    return session.run(None, {"images": images})[0]


def test_static_weights_fit_the_range_no_cpu_saturates(shipped_int8):
    """On any CPU: every int8 weight (a constant a DequantizeLinear reads) lies in WEIGHT_RANGE."""
    int8, _ = shipped_int8
    constants = {i.name: numpy_helper.to_array(i) for i in int8.graph.initializer}
    weights = [
        constants[node.input[0]]
        for node in int8.graph.node
        if node.op_type == "DequantizeLinear"
        and node.input[0] in constants
        and constants[node.input[0]].dtype == np.int8
    ]
    assert len(weights) >= 6 * 6 + 1  # q, k, v, projection, fc1, fc2 a block, and the head
    low, high = quantize.WEIGHT_RANGE
    assert min(int(w.min()) for w in weights) >= low
    assert max(int(w.max()) for w in weights) <= high


def test_static_activations_are_uint8_and_the_patch_conv_float(shipped_int8):
    """x86's fast int8 product takes uint8 activations; the patch Conv ran faster in float
    (export/quantize.py, ``QUANTIZED_OP_TYPES`` and ``STATIC_ACTIVATIONS``)."""
    int8, _ = shipped_int8
    constants = {i.name: numpy_helper.to_array(i) for i in int8.graph.initializer}
    activation_zero_points = [
        constants[node.input[2]]
        for node in int8.graph.node
        if node.op_type == "QuantizeLinear" and node.input[0] not in constants
    ]
    assert len(activation_zero_points) >= 6 * 6 + 1
    assert all(z.dtype == np.uint8 for z in activation_zero_points)
    produced_by = {out: node for node in int8.graph.node for out in node.output}
    (conv,) = [node for node in int8.graph.node if node.op_type == "Conv"]
    assert all(
        name not in produced_by or produced_by[name].op_type != "DequantizeLinear"
        for name in conv.input
    )


def test_fused_kernels_answer_as_the_graph_is_written(shipped_int8):
    """On this CPU: the fused int8 kernels' logits against the QDQ graph run unfused. Measured on 500
    test images with 7-bit weights: 99.6% top-1 agreement, largest difference 0.25 (logits of mean
    magnitude 0.91), mean 0.012; with 8-bit weights on an AVX2 CPU without VNNI: 97.7%, 3.27 and
    0.074. The fused kernels round differently, so the two are close, not equal."""
    int8, images = shipped_int8
    fused = logits(int8, images, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    written = logits(int8, images, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    assert (fused.argmax(1) == written.argmax(1)).mean() >= 0.99
    assert np.abs(fused - written).max() <= 1.0
    assert np.abs(fused - written).mean() <= 0.03


INTEGER_OPS = {"MatMulInteger": "MatMul", "ConvInteger": "Conv"}


def summed_in_float(int8: onnx.ModelProto) -> onnx.ModelProto:
    """``int8`` with each MatMulInteger and ConvInteger replaced by its float op on the same integers,
    zero points subtracted, cast back to int32: the int8 graph's answer where no sum saturates
    (float32 holds the sums exactly up to 2^24; past that it rounds by a unit or two)."""
    rewritten = onnx.ModelProto.FromString(int8.SerializeToString())
    nodes = []
    for node in rewritten.graph.node:
        if node.op_type not in INTEGER_OPS:
            nodes.append(node)
            continue
        inputs = [*node.input, "", "", ""][:4]  # x, w, x_zero_point, w_zero_point
        operands = []
        for side, (values, zero_point) in enumerate(
            [(inputs[0], inputs[2]), (inputs[1], inputs[3])]
        ):
            name = f"{node.output[0]}/float{side}"
            nodes.append(helper.make_node("Cast", [values], [name], to=TensorProto.FLOAT))
            if zero_point:
                nodes.append(
                    helper.make_node("Cast", [zero_point], [f"{name}/zp"], to=TensorProto.FLOAT)
                )
                nodes.append(helper.make_node("Sub", [name, f"{name}/zp"], [f"{name}/centred"]))
                name = f"{name}/centred"
            operands.append(name)
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        summed = f"{node.output[0]}/summed"
        nodes.append(helper.make_node(INTEGER_OPS[node.op_type], operands, [summed], **attributes))
        nodes.append(helper.make_node("Cast", [summed], [node.output[0]], to=TensorProto.INT32))
    del rewritten.graph.node[:]
    rewritten.graph.node.extend(nodes)
    return rewritten


def test_dynamic_weights_fit_the_range_no_cpu_saturates(shipped_dynamic):
    """On any CPU: every int8 weight (a constant a MatMulInteger or ConvInteger reads) lies in
    WEIGHT_RANGE."""
    int8, _ = shipped_dynamic
    constants = {i.name: numpy_helper.to_array(i) for i in int8.graph.initializer}
    weights = [
        constants[node.input[1]]
        for node in int8.graph.node
        if node.op_type in INTEGER_OPS and node.input[1] in constants
    ]
    assert len(weights) >= 6 * 6 + 1  # q, k, v, projection, fc1, fc2 a block, and the head
    assert not any(node.op_type == "ConvInteger" for node in int8.graph.node)
    assert all(w.dtype == np.int8 for w in weights)
    low, high = quantize.WEIGHT_RANGE
    assert min(int(w.min()) for w in weights) >= low
    assert max(int(w.max()) for w in weights) <= high


def test_dynamic_kernels_answer_as_unsaturated_sums(shipped_dynamic):
    """On this CPU: the dynamic graph's logits, fused as served, against the same integers summed in
    float. Measured on the 10,000 test images with 7-bit weights: 100% top-1 agreement, largest
    difference 0.0024, mean 2.5e-7 (float rounding); with 8-bit weights on an AVX2 CPU without
    VNNI: 99.89%, 0.22 and 0.0066."""
    int8, images = shipped_dynamic
    fused = logits(int8, images, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    unsaturated = logits(summed_in_float(int8), images, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    assert (fused.argmax(1) == unsaturated.argmax(1)).all()
    assert np.abs(fused - unsaturated).max() <= 0.01
    assert np.abs(fused - unsaturated).mean() <= 1e-4
