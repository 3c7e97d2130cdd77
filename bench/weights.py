"""The PyTorch model behind an exported ONNX file: config from the metadata, weights from the initializers.

The exporter keeps most parameter names (``blocks.0.norm1.weight``, ``head.bias``, ...) but stores each
``nn.Linear`` weight pre-transposed under a generated name (``val_8``) as the constant input of a MatMul.
Those are matched in order: the state dict lists the missing weights in the order the forward pass uses
them, and the graph lists its MatMuls in that same order. The result is then checked against
onnxruntime on random images, so a wrong match can never go unnoticed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

from export.config import ViTConfig
from export.model import VisionTransformer

METADATA_KEY = "vitserve"


class WeightsError(RuntimeError):
    pass


def read_metadata(model: onnx.ModelProto) -> dict:
    props = {p.key: p.value for p in model.metadata_props}
    if METADATA_KEY not in props:
        raise WeightsError(f"the ONNX file has no {METADATA_KEY!r} metadata")
    return json.loads(props[METADATA_KEY])


def torch_from_onnx(path: str | Path) -> tuple[VisionTransformer, dict]:
    """A PyTorch ViT with the ONNX file's weights, in eval mode, and the file's metadata."""
    proto = onnx.load(str(path))
    metadata = read_metadata(proto)
    model = VisionTransformer(ViTConfig.from_dict(metadata["model_config"])).eval()
    initializers = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    state = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in initializers:
            value = initializers[name]
            if tuple(value.shape) != tuple(tensor.shape):
                raise WeightsError(f"{name}: ONNX {value.shape} vs PyTorch {tuple(tensor.shape)}")
            loaded[name] = torch.from_numpy(value.copy())
    missing = [name for name in state if name not in loaded]
    matmul_weights = []
    for node in proto.graph.node:
        if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1:
            constant = node.input[1]
            if constant in initializers and constant not in state:
                matmul_weights.append(constant)
    if len(missing) != len(matmul_weights):
        raise WeightsError(
            f"{len(missing)} parameters have no named initializer ({missing[:6]}...) but the graph has "
            f"{len(matmul_weights)} unnamed MatMul weights"
        )
    for name, constant in zip(missing, matmul_weights, strict=True):
        value = initializers[constant].T
        if tuple(value.shape) != tuple(state[name].shape):
            raise WeightsError(
                f"{name}: expected {tuple(state[name].shape)}, the next MatMul weight {constant} is "
                f"{value.shape} transposed"
            )
        loaded[name] = torch.from_numpy(np.ascontiguousarray(value))
    model.load_state_dict(loaded, strict=True)
    check_against_onnxruntime(model, proto)
    return model, metadata


def check_against_onnxruntime(
    model: VisionTransformer, proto: onnx.ModelProto, batch: int = 4, tolerance: float = 1e-3
) -> float:
    """Max absolute logit difference between PyTorch and onnxruntime; raises above ``tolerance``."""
    c = model.config
    images = np.random.default_rng(0).standard_normal(
        (batch, c.in_channels, c.image_height, c.image_width), dtype=np.float32
    )
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    (expected,) = session.run(None, {session.get_inputs()[0].name: images})[:1]
    with torch.inference_mode():
        actual = model(torch.from_numpy(images)).numpy()
    difference = float(np.abs(actual - expected).max())
    scale = max(1.0, float(np.abs(expected).max()))
    if difference > tolerance * scale:
        raise WeightsError(
            f"PyTorch built from the ONNX initializers disagrees with onnxruntime by {difference:.3g}"
        )
    return difference
