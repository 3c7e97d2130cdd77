"""An INT8 or FP16 classifier from a checkpoint, refused unless it keeps accuracy.

``python -m export.onnx RUN --name NAME-int8 --version 1 --quantize int8 [--quantization static-qdq]``
``python -m export.onnx RUN --name NAME-fp16 --version 1 --quantize fp16``

``fp16`` (for CUDA): every float32 weight and activation of the verified float classifier in
float16 (onnxruntime's float16 converter), its input and output left float32 so that clients and
``config.pbtxt`` see the float model's. Measured here with onnxruntime's CPU provider, which runs
in float32 the float16 nodes it has no kernel for (each result still rounded to float16 in
between), so its figures are close to, not the same as, a GPU's; on a CPU it runs slower than the
float graph. For int8:

The float classifier is exported and verified against PyTorch as ``export.onnx`` does, prepared with
onnxruntime's ``quant_pre_process``, then quantized one of two ways:

- ``dynamic``: int8 weights, 7 bits like static-qdq's (``WEIGHT_RANGE``); each MatMul by a weight
  quantizes its input at run time (``quantize_dynamic``: MatMulInteger; attention's own MatMuls
  stay float). No calibration.
- ``static-qdq`` (the default): int8 weights, one scale per output channel, and uint8 activations in
  QuantizeLinear/DequantizeLinear pairs around the MatMul and Gemm nodes, with activation
  ranges calibrated (min-max) on training images of the run's dataset (its training split, less its
  validation images; a folder dataset's files are read from the directory the run recorded). The
  scales are fixed, so an image gets bit-identical logits whatever it is batched with. Weights take
  7 bits (``reduce_range``): ``WEIGHT_RANGE``, below, says why. The shipped model measured 92.91%
  against the float graph's 92.91% on an AVX2 CPU without VNNI (with 8-bit weights: 92.23% there,
  93.00% with the QDQ nodes run unfused, in float).

Both precisions are measured on the whole test split next to the float graph; the graph is written
only when it is within ``MAX_ACCURACY_DROP`` of it. It ships as its own model (``<NAME>/<version>/
model.onnx``, no attention graph) with ``"precision"`` (``int8`` or ``fp16``) in its metadata, and
for int8 ``"quantization"`` and ``"weight_range"``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)
from onnxruntime.quantization.shape_inference import quant_pre_process
from onnxruntime.transformers.float16 import convert_float_to_float16

from export import onnx_graphs as export_onnx
from export.checkpoint import TrainedCheckpoint, file_sha256
from export.data import Split, load_dataset, normalize, train_validation_split
from export.evaluate import dataset_logits, onnx_runner
from service.contract.probabilities import softmax

PRECISIONS = ("int8", "fp16")
QUANTIZATIONS = ("dynamic", "static-qdq")  # int8's
CALIBRATION_IMAGES = 512
CALIBRATION_BATCH = 32
MAX_ACCURACY_DROP = 0.003  # 0.3 points of test accuracy
# Both methods leave the patch Conv in float: onnxruntime's int8 Conv (ConvInteger, QLinearConv)
# ran slower than its float Conv on this CPU (a random-weight ViT-S/16 at batch 4, per node: 17.4
# against 7.2 ms a call), and the shipped model's static and dynamic int8 measured faster without it
# at the same accuracy (docs/model-repository.md#int8-models).
QUANTIZED_OP_TYPES = ["MatMul", "Gemm"]
# Static activations in uint8: uint8 x int8 is onnxruntime's fast int8 product on x86 without VNNI;
# int8 activations are shifted to it around every product. The shipped model's static int8 ran
# 0.61-0.79x its float graph with int8 activations and 0.87-0.92x with uint8, at the same accuracy.
STATIC_ACTIVATIONS = QuantType.QUInt8
# Weights in 7 bits, -64 to 64, for both methods. Without VNNI, onnxruntime's x86 int8 kernels
# (AVX2's vpmaddubsw; MatMulInteger and ConvInteger too) add two uint8 x int8 products into an
# int16, which saturates past 32,767: 255 x 127 x 2 does, 255 x 64 x 2 does not. With 8-bit weights
# the fused graph's logits were not the QDQ graph's: the shipped checkpoint's static int8 measured
# 93.00% run as written (unfused) and 92.23% through the fused kernels of an AVX2 CPU, where 7-bit
# weights measured 92.94% and 92.90%. Dynamic, on the same CPU, with 8-bit weights: 11 of its 10,000
# test answers differed from the same integers summed without saturation, and a random-weight
# ViT-S/16 (bench/int8_trial.py) agreed with its float graph on 72% of 64 photos where unsaturated
# sums agree on 94%; with 7-bit weights both answer as unsaturated sums do (97% for the ViT-S/16).
# The answer must not depend on the CPU that serves it.
WEIGHT_RANGE = (-64, 64)


class QuantizationError(export_onnx.VerificationError):
    """The int8 or fp16 graph loses too much accuracy; nothing is written."""


class Calibration(CalibrationDataReader):
    """Normalised training images, in batches, for ``quantize_static``."""

    def __init__(self, images: np.ndarray) -> None:
        self.images = images
        self.starts = iter(range(0, len(images), CALIBRATION_BATCH))

    def get_next(self) -> dict | None:
        start = next(self.starts, None)
        if start is None:
            return None
        return {"images": self.images[start : start + CALIBRATION_BATCH]}


def calibration_images(images: torch.Tensor, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` training images drawn without replacement (seeded), in their original order."""
    if not 1 <= count <= len(images):
        raise ValueError(f"--calibration-images must be 1 to {len(images)}, got {count}")
    chosen = np.sort(np.random.default_rng(seed).choice(len(images), count, replace=False))
    return images[torch.from_numpy(chosen)]


def run_training_images(checkpoint: Path, train: Split) -> Split:
    """The images the checkpoint's run trained on: its training split less the validation images
    its settings.json (beside the checkpoint) names; all of them when there is none."""
    settings = checkpoint.parent / "settings.json"
    if not settings.is_file():
        return train
    recorded = json.loads(settings.read_text())
    train, _ = train_validation_split(train, recorded["validation_size"], recorded["seed"])
    return train


@contextlib.contextmanager
def quiet_root_logger() -> Iterator[None]:
    """The quantizer warns through the root logger about every LayerNorm weight it skips."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def quantize_graph(
    graph: onnx.ModelProto, method: str, calibration: np.ndarray | None = None
) -> onnx.ModelProto:
    """``graph`` (float32, logits only) -> its int8 version by ``method``."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    with tempfile.TemporaryDirectory() as work, quiet_root_logger():
        source, prepared, quantized = (Path(work) / f for f in ("f.onnx", "p.onnx", "q.onnx"))
        onnx.save_model(graph, source)
        quant_pre_process(source, prepared)
        if method == "dynamic":
            quantize_dynamic(
                prepared,
                quantized,
                weight_type=QuantType.QInt8,
                reduce_range=True,  # WEIGHT_RANGE
                op_types_to_quantize=QUANTIZED_OP_TYPES,
            )
        else:
            if calibration is None:
                raise ValueError("static quantization needs calibration images")
            quantize_static_qdq(prepared, quantized, calibration)
        return onnx.load(str(quantized))


def float16_graph(graph: onnx.ModelProto) -> onnx.ModelProto:
    """``graph`` (float32) in float16, its input and output still float32 (a Cast at each end)."""
    return convert_float_to_float16(graph, keep_io_types=True)


def quantize_static_qdq(prepared: Path, quantized: Path, calibration: np.ndarray) -> None:
    """Static QDQ: 7-bit weights with one scale per output channel, uint8 activations with ranges fixed
    by min-max calibration, so that an image's answer never depends on the images batched with it
    (dynamic quantization's one scale per batch lets a partner change it: docs/decisions.md#hostile-clients)."""
    quantize_static(
        prepared,
        quantized,
        Calibration(calibration),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=QUANTIZED_OP_TYPES,
        activation_type=STATIC_ACTIVATIONS,
        weight_type=QuantType.QInt8,
        per_channel=True,
        reduce_range=True,  # WEIGHT_RANGE
    )


def logits_of(graph: onnx.ModelProto, images: np.ndarray) -> np.ndarray:
    """A logits graph's logits of normalised images."""
    run = onnx_runner(export_onnx.session_for(graph))
    return dataset_logits(run, images, lambda batch: batch, 500)


def accuracy(graph: onnx.ModelProto, images: np.ndarray, labels: np.ndarray) -> float:
    """Test accuracy of a logits graph on normalised images."""
    return float((logits_of(graph, images).argmax(1) == labels).mean())


def agreement(float_logits: np.ndarray, int8_logits: np.ndarray) -> dict[str, float]:
    """How the int8 graph answers against the float one on the same images: what a shadow trial
    of the int8 version would measure live (top-1 agreement; per image, the largest
    ``|p_int8 - p_float|`` over its classes, its p99 and maximum: the shadow's own softmax)."""
    difference = np.abs(softmax(int8_logits) - softmax(float_logits)).max(axis=1)
    return {
        "top1_agreement": float((int8_logits.argmax(1) == float_logits.argmax(1)).mean()),
        "probability_difference_p99": float(np.percentile(difference, 99)),
        "probability_difference_max": float(difference.max()),
    }


@dataclass(frozen=True)
class Quantization:
    """What ``--quantize`` writes: ``precision``, one of ``PRECISIONS``; for int8, ``method``, one
    of ``QUANTIZATIONS``, and how many training images calibrate static-qdq."""

    method: str = "static-qdq"
    calibration_count: int = CALIBRATION_IMAGES
    precision: str = "int8"

    @property
    def name(self) -> str:
        """How a refusal names it: ``int8 (static-qdq)`` or ``fp16``."""
        return f"int8 ({self.method})" if self.precision == "int8" else self.precision


def reduced_classifier(
    trained: TrainedCheckpoint,
    name: str,
    version: int,
    data_dir: str | Path | None,
    quantization: Quantization,
) -> tuple[dict[str, onnx.ModelProto], dict]:
    """The int8 or fp16 classifier by file name, described, and the figures: the float classifier
    is verified against PyTorch and converted, and both are measured on the test split; refused
    (QuantizationError) when the conversion loses more than ``MAX_ACCURACY_DROP``."""
    model, spec, precision = trained.model, trained.spec, quantization.precision
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    int8 = precision == "int8"
    method = quantization.method if int8 else None
    train, test = load_dataset(spec, data_dir)
    images = normalize(test.images, spec)
    graphs = export_onnx.build_graphs(model)
    count = max(export_onnx.verify_batch_sizes(model.config))
    figures = export_onnx.verify(model, graphs, images[:count])
    calibration = None
    if method == "static-qdq":
        train = run_training_images(trained.path, train)
        chosen = calibration_images(train.images, quantization.calibration_count)
        calibration = normalize(chosen, spec).numpy()
    if int8:
        reduced = quantize_graph(graphs.classifier, method, calibration)
    else:
        reduced = float16_graph(graphs.classifier)
    test_images, test_labels = images.numpy(), test.labels.numpy()
    float_logits = logits_of(graphs.classifier, test_images)
    reduced_logits = logits_of(reduced, test_images)
    float_accuracy = float((float_logits.argmax(1) == test_labels).mean())
    reduced_accuracy = float((reduced_logits.argmax(1) == test_labels).mean())
    result = {
        "precision": precision,
        "quantization": method,
        "calibration_images": quantization.calibration_count if calibration is not None else None,
        "float_test_accuracy": float_accuracy,
        "float_agreement": agreement(float_logits, reduced_logits),
        "test_accuracy": reduced_accuracy,
        "test_images": len(test),
        "verification": figures,
    }
    if float_accuracy - reduced_accuracy > MAX_ACCURACY_DROP:
        raise QuantizationError(
            f"{quantization.name} test accuracy {100 * reduced_accuracy:.2f}% is more than "
            f"{100 * MAX_ACCURACY_DROP:.1f} points below the float graph's "
            f"{100 * float_accuracy:.2f}%: {json.dumps(result)}"
        )
    document = export_onnx.describe(
        model,
        spec,
        trained.labels,
        name,
        version,
        "classifier",
        reduced_accuracy,
        len(test),
        file_sha256(trained.path),
    )
    document.update(
        precision=precision,
        quantization=method,
        calibration_images=result["calibration_images"],
        weight_range=list(WEIGHT_RANGE) if int8 else None,
        float_test_accuracy=float_accuracy,
        float_agreement=result["float_agreement"],
        attention_graph=None,
    )
    export_onnx.with_metadata(reduced, document)
    return {"model.onnx": reduced}, result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--quantize`` and its options, for ``python -m export.onnx``."""
    parser.add_argument(
        "--quantize",
        choices=PRECISIONS,
        default=None,
        help="write an int8 classifier, or an fp16 one for CUDA (logits only), instead of the "
        "float graphs",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="static-qdq",
        help="how to quantize int8 (default: static-qdq, whose answers do not depend on batch "
        "partners)",
    )
    parser.add_argument(
        "--calibration-images",
        type=int,
        default=CALIBRATION_IMAGES,
        help=f"training images that calibrate static-qdq (default {CALIBRATION_IMAGES})",
    )


def from_arguments(args: argparse.Namespace) -> Quantization | None:
    """``add_arguments``' options as a ``Quantization``; None without ``--quantize``."""
    if not args.quantize:
        return None
    return Quantization(args.quantization, args.calibration_images, args.quantize)
