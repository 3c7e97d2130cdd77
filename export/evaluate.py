"""Accuracy and confusion matrix of a checkpoint or an ONNX model on a dataset's test split.

    python -m export.evaluate runs/fashion-small                     # run directory (best weights)
    python -m export.evaluate runs/fashion-small/model.safetensors   # checkpoint file
    python -m export.evaluate models/fashion-mnist-vit/1/model.onnx  # ONNX file
    python -m export.evaluate models/fashion-mnist-vit               # newest version in a repository

An ONNX model is evaluated exactly as the service would run it: onnxruntime on CPU, inputs scaled and
normalised as its ``vitserve`` metadata says, nothing taken from the PyTorch side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from export.checkpoint import CheckpointError, file_sha256, load_checkpoint, resolve_checkpoint
from export.data import (
    DATASET_CHOICES,
    FOLDER,
    DatasetError,
    DatasetSpec,
    Split,
    get_dataset_spec,
    load_test_split,
    normalize,
    spec_from_metadata,
)
from export.folder import folder_spec
from service.contract.model_repository import (
    ATTENTION_FILE,
    METADATA_KEY,
    ModelLoadError,
    ModelMetadata,
    parse_metadata,
    version_numbers,
)
from service.contract.preprocessing import normalise


class EvaluationError(RuntimeError):
    """The model and the dataset do not fit together, or the model does not describe itself."""


# -- metrics ---------------------------------------------------------------------------------------
def classification_metrics(
    logits: np.ndarray, labels: np.ndarray, class_names: list[str] | tuple[str, ...]
) -> dict:
    """Accuracy, mean cross-entropy, per-class accuracy and confusion matrix (rows: true class)."""
    logits = np.asarray(logits, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    classes = len(class_names)
    if logits.shape != (len(labels), classes):
        raise EvaluationError(
            f"expected logits of shape ({len(labels)}, {classes}), got {logits.shape}"
        )
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probabilities = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = float(-log_probabilities[np.arange(len(labels)), labels].mean())
    predicted = logits.argmax(axis=1)
    confusion = np.zeros((classes, classes), dtype=np.int64)
    np.add.at(confusion, (labels, predicted), 1)
    support = confusion.sum(axis=1)
    correct = int(np.trace(confusion))
    per_class = np.divide(
        np.diag(confusion), support, out=np.zeros(classes, dtype=np.float64), where=support > 0
    )
    return {
        "images": len(labels),
        "correct": correct,
        "accuracy": correct / len(labels),
        "loss": loss,
        "labels": list(class_names),
        "per_class_accuracy": {
            name: float(v) for name, v in zip(class_names, per_class, strict=True)
        },
        "confusion_matrix": confusion.tolist(),
    }


def _check_fits(
    spec: DatasetSpec, channels: int, height: int, width: int, classes: int, source: Path
) -> None:
    expected = (spec.channels, spec.height, spec.width, len(spec.labels))
    if (channels, height, width, classes) != expected:
        raise EvaluationError(
            f"{source}: the model takes {channels}x{height}x{width} images and predicts {classes} "
            f"classes, but {spec.name} has {spec.channels}x{spec.height}x{spec.width} images in "
            f"{len(spec.labels)} classes; pass --dataset for the dataset it was trained on"
        )


def _test_split(spec: DatasetSpec, data_dir: str | Path | None) -> Split:
    return load_test_split(spec, data_dir)


def _onnx_folder_spec(metadata: dict, data_dir: str | Path | None, path: Path) -> DatasetSpec:
    """A folder dataset as an ONNX model describes it, in ``data_dir`` or else the directory its
    metadata records (``data_dir``, written by the export), which the caller passes."""
    if data_dir is None:
        raise EvaluationError(f"{path} was trained on a folder of images; pass --data-dir DIR")
    if not Path(data_dir).is_dir():
        raise EvaluationError(
            f"{path} was trained on the folder {data_dir}, which does not exist here; pass "
            "--data-dir DIR"
        )
    shape, pre = metadata["input"], metadata["preprocessing"]
    return folder_spec(
        data_dir,
        tuple(metadata["labels"]),
        shape["channels"],
        shape["height"],
        shape["width"],
        tuple(pre["mean"]),
        tuple(pre["std"]),
    )


def dataset_logits(
    run: Callable[[np.ndarray], np.ndarray],
    images: np.ndarray,
    prepare: Callable[[np.ndarray], np.ndarray],
    batch_size: int = 256,
) -> np.ndarray:
    """The logits of every image: ``run(prepare(batch))`` over ``images`` in batches, in order.

    The one test-accuracy loop: checkpoints, ONNX files and the export stage's own check use it."""
    outputs = [
        run(prepare(images[start : start + batch_size]))
        for start in range(0, len(images), batch_size)
    ]
    return np.concatenate(outputs)


def onnx_runner(
    session, input_name: str = "images", logits_name: str = "logits"
) -> Callable[[np.ndarray], np.ndarray]:
    """``run`` for :func:`dataset_logits`; a graph with a fixed batch axis gets its last batch padded."""
    (fixed,) = [i.shape[0] for i in session.get_inputs() if i.name == input_name] or [None]
    fixed = fixed if isinstance(fixed, int) and fixed > 0 else None

    def run(batch: np.ndarray) -> np.ndarray:
        count = len(batch)
        if fixed and count < fixed:
            batch = np.concatenate(
                [batch, np.zeros((fixed - count, *batch.shape[1:]), batch.dtype)]
            )
        return session.run([logits_name], {input_name: batch})[0][:count]

    return run


# -- checkpoints -----------------------------------------------------------------------------------
@torch.inference_mode()
def checkpoint_logits(
    model: torch.nn.Module,
    split: Split,
    spec: DatasetSpec,
    batch_size: int = 256,
    device: torch.device | None = None,
) -> np.ndarray:
    """float32 logits of a model on a split, in float32 (no autocast: the numbers ONNX must match)."""
    device = device or next(model.parameters()).device
    model.eval()
    return dataset_logits(
        lambda batch: model(torch.from_numpy(batch).to(device)).float().cpu().numpy(),
        split.images.numpy(),
        lambda pixels: normalize(torch.from_numpy(pixels), spec).numpy(),
        batch_size,
    )


def evaluate_checkpoint(
    path: str | Path,
    dataset: str | None = None,
    data_dir: str | Path | None = None,
    batch_size: int = 256,
    device: str | torch.device | None = None,
) -> dict:
    """Metrics of a checkpoint (file or run directory) on the test split of its dataset."""
    path = resolve_checkpoint(path)
    model, metadata = load_checkpoint(path)
    known = dataset is None or dataset == FOLDER  # a folder's spec travels in the checkpoint
    spec = spec_from_metadata(metadata) if known else get_dataset_spec(dataset)
    config = model.config
    _check_fits(
        spec, config.in_channels, config.image_height, config.image_width, config.num_classes, path
    )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    test = _test_split(spec, data_dir)
    started = time.perf_counter()
    logits = checkpoint_logits(model, test, spec, batch_size, torch.device(device))
    results = classification_metrics(logits, test.labels.numpy(), json.loads(metadata["labels"]))
    return {
        "source": str(path),
        "format": "checkpoint",
        "sha256": file_sha256(path),
        "dataset": spec.name,
        "split": "test",
        "seconds": round(time.perf_counter() - started, 3),
        **results,
    }


# -- ONNX ------------------------------------------------------------------------------------------
def onnx_session(path: Path, threads: int | None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime raises its own exception types per failure
        raise EvaluationError(f"{path}: onnxruntime cannot load it ({error})") from error


def read_onnx_metadata(session, path: Path) -> ModelMetadata:
    """The model's ``vitserve`` metadata, read and checked by the service's own reader."""
    graph = "attention" if path.name == ATTENTION_FILE else "classifier"
    try:
        return parse_metadata(session.get_modelmeta().custom_metadata_map, path, graph)
    except ModelLoadError as error:
        raise EvaluationError(str(error)) from error


def onnx_dataset_spec(
    session, path: Path, dataset: str | None = None, data_dir: str | Path | None = None
) -> DatasetSpec:
    """The dataset an ONNX model names (or ``dataset``); a folder in ``data_dir``, else in the
    directory its metadata records."""
    metadata = read_onnx_metadata(session, path)
    name = dataset or metadata.dataset
    if not name:
        raise EvaluationError(f"{path}: the metadata names no dataset; pass --dataset")
    if name != FOLDER:
        return get_dataset_spec(name)
    provenance = json.loads(session.get_modelmeta().custom_metadata_map[METADATA_KEY])
    data_dir = data_dir or provenance.get("data_dir")
    return _onnx_folder_spec(metadata.model_dump(), data_dir, path)


def evaluate_onnx(
    path: str | Path,
    dataset: str | None = None,
    data_dir: str | Path | None = None,
    batch_size: int = 256,
    threads: int | None = None,
) -> dict:
    """Metrics of an ONNX model (classifier or attention graph) on a dataset's test split."""
    path = Path(path)
    if not path.is_file():
        raise EvaluationError(f"{path}: no such ONNX file")
    session = onnx_session(path, threads)
    metadata = read_onnx_metadata(session, path)
    provenance = json.loads(session.get_modelmeta().custom_metadata_map[METADATA_KEY])
    spec = onnx_dataset_spec(session, path, dataset, data_dir)
    shape = metadata.input
    _check_fits(spec, shape.channels, shape.height, shape.width, metadata.num_classes, path)
    polarity = metadata.preprocessing.polarity
    if polarity != spec.polarity:
        raise EvaluationError(
            f"{path}: the model expects {polarity} images, {spec.name} holds {spec.polarity} ones"
        )
    inputs = [i.name for i in session.get_inputs()]
    if shape.name not in inputs:
        raise EvaluationError(
            f"{path}: the metadata names input {shape.name!r}, the graph has {inputs}"
        )
    outputs = [o.name for o in session.get_outputs()]
    if metadata.outputs.logits not in outputs:
        raise EvaluationError(
            f"{path}: the metadata names output {metadata.outputs.logits!r}, the graph has {outputs}"
        )
    run = onnx_runner(session, shape.name, metadata.outputs.logits)
    fixed = session.get_inputs()[inputs.index(shape.name)].shape[0]
    if isinstance(fixed, int) and fixed > 0:
        batch_size = fixed  # a graph without a dynamic batch axis: its last batch is padded

    test = _test_split(spec, data_dir)
    started = time.perf_counter()
    logits = dataset_logits(
        run,
        test.images.numpy(),
        lambda pixels: normalise(pixels, metadata.preprocessing),
        batch_size,
    )
    results = classification_metrics(logits, test.labels.numpy(), metadata.labels)
    return {
        "source": str(path),
        "format": "onnx",
        "sha256": file_sha256(path),
        "dataset": spec.name,
        "split": "test",
        "seconds": round(time.perf_counter() - started, 3),
        "metadata_test_accuracy": metadata.test_accuracy,
        "checkpoint_sha256": provenance.get("checkpoint_sha256"),
        "precision": provenance.get("precision", "float32"),
        "quantization": provenance.get("quantization"),
        "calibration_images": provenance.get("calibration_images"),
        "float_test_accuracy": provenance.get("float_test_accuracy"),
        "float_agreement": provenance.get("float_agreement"),
        "weight_range": provenance.get("weight_range"),
        "onnxruntime_fusions": provenance.get("onnxruntime_fusions"),
        "exported_with_onnxruntime": provenance.get("tools", {}).get("onnxruntime"),
        **results,
    }


# -- command line ----------------------------------------------------------------------------------
def resolve_source(source: str | Path) -> tuple[str, Path]:
    """("checkpoint" | "onnx", file) for a checkpoint, run directory, ONNX file or repository entry."""
    source = Path(source)
    if source.is_dir():
        if (source / "model.safetensors").is_file():
            return "checkpoint", source / "model.safetensors"
        if (source / "model.onnx").is_file():
            return "onnx", source / "model.onnx"
        versions = [
            v for v in version_numbers(source) if (source / str(v) / "model.onnx").is_file()
        ]
        if versions:
            return "onnx", source / str(versions[-1]) / "model.onnx"
        raise EvaluationError(
            f"{source}: holds neither model.safetensors, model.onnx nor a <version>/model.onnx"
        )
    if not source.exists():
        raise EvaluationError(f"{source}: no such file or directory")
    if source.suffix == ".onnx":
        return "onnx", source
    if source.suffix == ".safetensors":
        return "checkpoint", source
    raise EvaluationError(
        f"{source}: expected a .safetensors checkpoint, a run directory or an .onnx model"
    )


def format_results(results: dict) -> str:
    labels = results["labels"]
    confusion = results["confusion_matrix"]
    width = max(5, len(str(max(max(row) for row in confusion))) + 1)
    name_width = min(14, max(len(label) for label in labels))
    lines = [
        f"{results['source']} ({results['format']}, sha256 {results['sha256'][:12]})",
        f"{results['dataset']} {results['split']} split, {results['images']} images: "
        f"accuracy {100 * results['accuracy']:.2f}% ({results['correct']}/{results['images']}), "
        f"loss {results['loss']:.4f}",
    ]
    if results.get("metadata_test_accuracy") is not None:
        lines.append(
            f"the model's metadata claims test accuracy {100 * results['metadata_test_accuracy']:.2f}%"
        )
    lines += [
        "",
        "confusion matrix (rows: true class, columns: predicted class)",
        " " * (name_width + 4)
        + "".join(f"{i:>{width}}" for i in range(len(labels)))
        + "  accuracy",
    ]
    for index, (label, row) in enumerate(zip(labels, confusion, strict=True)):
        accuracy = results["per_class_accuracy"][label]
        lines.append(
            f"{index:>2} {label[:name_width]:<{name_width}} "
            + "".join(f"{count:>{width}}" for count in row)
            + f"  {100 * accuracy:7.2f}%"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m export.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", help="checkpoint (.safetensors or run directory) or ONNX model")
    parser.add_argument(
        "--dataset",
        choices=sorted(DATASET_CHOICES),
        default=None,
        help="dataset to evaluate on (default: the one the model names)",
    )
    parser.add_argument("--data-dir", default=None, help="directory of the dataset's files")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads (torch and onnxruntime)"
    )
    parser.add_argument(
        "--json", type=Path, default=None, dest="json_out", help="also write the results here"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        kind, path = resolve_source(args.source)
        if kind == "onnx":
            results = evaluate_onnx(
                path, args.dataset, args.data_dir, args.batch_size, args.threads
            )
        else:
            results = evaluate_checkpoint(path, args.dataset, args.data_dir, args.batch_size)
    except (EvaluationError, CheckpointError, DatasetError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_results(results))
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
