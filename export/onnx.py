"""Turn a checkpoint into a verified, self-describing model repository entry.

``python -m export.onnx runs/x/model.safetensors --name fashion-mnist-vit --version 1 --repo models/``

Writes (Triton layout, see docs/model-repository.md)::

    <repo>/<name>/config.pbtxt               serving settings (kept if present)
    <repo>/<name>/<version>/model.onnx       classifier (logits only)
    <repo>/<name>/<version>/attention.onnx   same weights, logits + every layer's attention maps
    <repo>/<name>/<version>/labels.txt       one class label per line

Nothing is written unless both graphs pass the ONNX checker and match PyTorch on real images at
batch sizes 1, 7 and 64 (export/onnx_graphs.py). ``--quantize int8`` (or ``fp16``) writes an int8
(or float16) classifier instead (export/quantize.py).

CHECKPOINT may also be another library's checkpoint directory (export/importers/): a Hugging Face
ViT or DeiT saved with ``save_pretrained`` (with its ``preprocessor_config.json``), or a timm
``vit_*`` / ``deit_*`` checkpoint in timm's hub layout. Its version is written the same way, with
its labels and preprocessing taken from the checkpoint, seeded images for the check against
PyTorch, and ``<repo>/<name>/MODEL_CARD.md`` naming the source.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import onnx

from export import quantize
from export.checkpoint import CheckpointError, TrainedCheckpoint, file_sha256, load_trained
from export.cli import version_number
from export.data import DatasetError, load_test_split, normalize
from export.importers import card as import_card
from export.importers import is_imported, load_imported, probe_images
from export.onnx_graphs import (
    VerificationError,
    build_graphs,
    classifier_graph,
    describe,
    graph_document,
    measure_accuracy,
    verify,
    verify_batch_sizes,
    with_metadata,
)
from export.repository import RepositoryError, checked_version, new_version_dir, write_version

__all__ = ["build_graphs", "classifier_graph", "export_model", "main"]


def export_model(
    checkpoint: str | Path,
    name: str,
    version: int,
    repo: str | Path,
    data_dir: str | Path | None = None,
    overwrite: bool = False,
    measure: bool = True,
    candidate: bool = False,
    quantization: quantize.Quantization | None = None,
) -> dict:
    """Export, verify and write a checkpoint; returns the version's path and the figures.
    ``candidate``: the new version starts as the served version's candidate (``write_version``).
    ``quantization``: an int8 or fp16 classifier instead of the float graphs (export/quantize.py),
    always measured."""
    checked_version(version)  # before anything is read or built
    if is_imported(checkpoint):
        if quantization is not None:
            raise CheckpointError(
                f"{checkpoint}: --quantize measures on a vitserve run's test split (int8 "
                "calibrates on its training images); an imported checkpoint exports in float32"
            )
        return export_imported(checkpoint, name, version, repo, overwrite, candidate)
    trained = load_trained(checkpoint)
    new_version_dir(repo, name, version, overwrite)
    if quantization is None:
        files, figures = float_graphs(trained, name, version, data_dir, measure)
    else:
        files, figures = quantize.reduced_classifier(trained, name, version, data_dir, quantization)
    shape = trained.model.config.image_shape
    written = write_version(
        Path(repo), name, version, files, trained.labels, shape, overwrite, candidate
    )
    return {"path": str(written), **figures}


def float_graphs(
    trained: TrainedCheckpoint,
    name: str,
    version: int,
    data_dir: str | Path | None,
    measure: bool,
) -> tuple[dict[str, onnx.ModelProto], dict]:
    """The classifier and attention graphs by file name, verified and described, and the figures
    (test accuracy unless not ``measure``, and the verification against PyTorch)."""
    model, spec = trained.model, trained.spec
    count = max(verify_batch_sizes(model.config))
    test = load_test_split(spec, data_dir)
    images = normalize(test.images, spec)
    graphs = build_graphs(model)
    # A small folder dataset may hold fewer test images than the largest batch checked: repeat them.
    repeats = -(-count // max(1, len(images)))
    figures = verify(model, graphs, images[:count].repeat(repeats, 1, 1, 1)[:count])
    accuracy = measure_accuracy(graphs.classifier, images, test.labels) if measure else None
    sha = file_sha256(trained.path)
    for graph_name, proto in (("classifier", graphs.classifier), ("attention", graphs.attention)):
        document = describe(
            model,
            spec,
            trained.labels,
            name,
            version,
            graph_name,
            accuracy,
            len(test) if measure else None,
            sha,
        )
        with_metadata(proto, document)
    files = {"model.onnx": graphs.classifier, "attention.onnx": graphs.attention}
    return files, {"test_accuracy": accuracy, "verification": figures}


def export_imported(
    source: str | Path,
    name: str,
    version: int,
    repo: str | Path,
    overwrite: bool = False,
    candidate: bool = False,
) -> dict:
    """Export, verify and write another library's checkpoint, and its model card."""
    new_version_dir(repo, name, version, overwrite)
    imported = load_imported(source)
    model = imported.model
    # Refused here, before the graphs are built, when even two images would not fit.
    count = max(verify_batch_sizes(model.config))
    graphs = build_graphs(model)
    images = probe_images(model, imported.preprocessing, count)
    figures = verify(model, graphs, images)
    for graph_name, proto in (("classifier", graphs.classifier), ("attention", graphs.attention)):
        document = graph_document(
            *(model, imported.preprocessing, imported.labels, name, version, graph_name),
            imported.weights_sha256,
            source=imported.source,
        )
        with_metadata(proto, document)
    files = {"model.onnx": graphs.classifier, "attention.onnx": graphs.attention}
    shape = model.config.image_shape
    written = write_version(
        Path(repo), name, version, files, imported.labels, shape, overwrite, candidate
    )
    card = Path(repo) / name / "MODEL_CARD.md"
    card.write_text(import_card.render(imported, Path(source), name, version, figures))
    return {
        "path": str(written),
        "source": imported.source,
        "preprocessing": imported.preprocessing,
        "verification": figures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m export.onnx",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "checkpoint",
        help="a .safetensors checkpoint, a run directory, or a Hugging Face or timm checkpoint "
        "directory",
    )
    parser.add_argument("--name", required=True, help="model name in the repository")
    parser.add_argument(
        "--version", required=True, type=version_number, help="integer version, 1 or more"
    )
    parser.add_argument("--repo", default="models", help="model repository directory")
    parser.add_argument("--data-dir", default=None, help="dataset directory (real test images)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing version")
    parser.add_argument("--skip-accuracy", action="store_true", help="do not measure test accuracy")
    parser.add_argument(
        "--candidate",
        action="store_true",
        help="write the new version as the candidate of the version served now: it is shadowed on "
        "every live request and answers none until promoted (python -m service.promote)",
    )
    quantize.add_arguments(parser)
    args = parser.parse_args(argv)
    if not args.name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        parser.error(f"--name may hold letters, digits, '-', '_' and '.', got {args.name!r}")
    try:
        result = export_model(
            args.checkpoint,
            args.name,
            args.version,
            args.repo,
            args.data_dir,
            args.overwrite,
            measure=not args.skip_accuracy,
            candidate=args.candidate,
            quantization=quantize.from_arguments(args),
        )
    except (
        VerificationError,
        CheckpointError,
        DatasetError,
        RepositoryError,
        OSError,  # FileExistsError, or a write that failed (the staged files are removed)
    ) as error:
        print(f"export failed, nothing written: {error}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    if "source" in result:  # an import: which labels it was given, and why
        print(f"labels: {result['source']['labels']}", file=sys.stderr)
    if args.candidate:
        print(
            f"version {args.version} of {args.name} is the candidate: every live request is also run "
            f"on it and compared (GET /models/{args.name}/shadow); it answers none until promoted: "
            f"python -m service.promote --model {args.name} --min-agreement 0.97 --min-requests 500 "
            "--max-latency-ratio 1.5",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
