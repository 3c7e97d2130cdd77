"""The report of a training run: test metrics and plots, written next to the weights.

    python -m export.report runs/fashion-small [--data-dir DIR]

Reads ``RUN_DIR/model.safetensors`` (the best weights), ``RUN_DIR/metrics.csv`` and
``RUN_DIR/settings.json``; writes ``results.json`` (test accuracy, cross-entropy without label
smoothing, per-class accuracy, confusion matrix), ``curves.png``,
``confusion_matrix.png`` and ``attention_gallery.png`` (test images with their attention rollout and
the last layer's heads).

    python -m export.report runs/fashion-small --attention-dir runs/fashion-small/attention --images 8

also writes, for 8 test images, the attention of every layer and head and the rollout as PNG files
(export/attention_images.py).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import torch

from export.checkpoint import load_checkpoint, resolve_checkpoint
from export.cli import command_parser, exit_status
from export.data import Split, load_test_split, normalize, spec_from_metadata
from export.evaluate import checkpoint_logits, classification_metrics
from export.model import VisionTransformer
from service.contract.attention_maps import attention_map

GALLERY_SIZE = 10


def read_metrics(path: Path) -> list[dict[str, float]]:
    """Rows of metrics.csv as numbers; a repeated epoch (a resumed run) keeps its last row."""
    with path.open(newline="") as handle:
        rows = [{key: float(value) for key, value in row.items()} for row in csv.DictReader(handle)]
    by_epoch = {int(row["epoch"]): row for row in rows}
    return [by_epoch[epoch] for epoch in sorted(by_epoch)]


def plot_curves(
    rows: list[dict[str, float]],
    path: Path,
    settings: dict | None = None,
    restarts: tuple[float, ...] = (),
    best: dict[str, float] | None = None,
    best_label: str | None = None,
) -> None:
    """Loss and accuracy per epoch; ``settings`` (the run's settings.json) explains the numbers.

    ``restarts`` are the epochs after which a later run (``--init-from``) took over with a new
    learning-rate schedule. ``best`` is the row of the kept checkpoint (default: lowest val loss),
    named ``best_label`` in the title (default: "epoch N").
    """
    epochs = [row["epoch"] for row in rows]
    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for axis, metric, title in (
        (loss_axis, "loss", "loss"),
        (accuracy_axis, "accuracy", "accuracy"),
    ):
        axis.plot(epochs, [row[f"train_{metric}"] for row in rows], marker=".", label="train")
        axis.plot(epochs, [row[f"val_{metric}"] for row in rows], marker=".", label="validation")
        axis.set_xlabel("epoch")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend()
    for restart in restarts:
        for axis in (loss_axis, accuracy_axis):
            axis.axvline(restart + 0.5, color="tab:red", linestyle=":", linewidth=1.0)
    best = best or min(rows, key=lambda row: row["val_loss"])
    loss_axis.axvline(best["epoch"], color="grey", linestyle="--", linewidth=0.8)
    accuracy_axis.axvline(best["epoch"], color="grey", linestyle="--", linewidth=0.8)
    notes = []
    if restarts:
        notes.append("dotted: learning-rate restarts")
    settings = settings or {}
    if settings.get("label_smoothing"):
        notes.append(f"losses with label smoothing {settings['label_smoothing']:g}")
    if settings.get("augment"):
        notes.append("train metrics on augmented images")
    best_label = best_label or f"epoch {int(best['epoch'])}"
    figure.suptitle(
        f"kept checkpoint: {best_label}, validation loss {best['val_loss']:.4f} "
        f"(accuracy {100 * best['val_accuracy']:.2f}%)" + ("\n" + "; ".join(notes) if notes else "")
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_confusion(results: dict, path: Path) -> None:
    confusion = np.asarray(results["confusion_matrix"])
    labels = results["labels"]
    classes = len(labels)
    support = confusion.sum(axis=1, keepdims=True)
    fraction = confusion / np.maximum(support, 1)
    size = max(5.0, 0.6 * classes + 2)
    figure, axis = plt.subplots(figsize=(size + 1, size))
    image = axis.imshow(fraction, cmap="Blues", vmin=0, vmax=1)
    figure.colorbar(image, ax=axis, fraction=0.046, pad=0.04, label="fraction of the true class")
    if classes <= 20:
        axis.set_xticks(range(classes), labels, rotation=45, ha="right")
        axis.set_yticks(range(classes), labels)
        for row in range(classes):
            for column in range(classes):
                if confusion[row, column]:
                    axis.text(
                        column,
                        row,
                        str(confusion[row, column]),
                        ha="center",
                        va="center",
                        fontsize=8,
                        color="white" if fraction[row, column] > 0.5 else "black",
                    )
    axis.set_xlabel("predicted class")
    axis.set_ylabel("true class")
    axis.set_title(
        f"{results['dataset']} test: accuracy {100 * results['accuracy']:.2f}% "
        f"({results['correct']}/{results['images']})"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def gallery_indices(labels: torch.Tensor, count: int = GALLERY_SIZE) -> list[int]:
    """The first test image of each class in class order, then the next images, ``count`` in all."""
    from export.attention_images import pick_indices

    return pick_indices(labels, count)


@torch.inference_mode()
def plot_attention_gallery(
    model: VisionTransformer, split: Split, indices: list[int], spec, path: Path
) -> None:
    config = model.config
    device = next(model.parameters()).device
    images = split.images[indices]
    logits, attention = model.forward_with_attention(normalize(images, spec).to(device))
    attention = attention.float().cpu().numpy()
    predicted = logits.argmax(dim=1).cpu().tolist()
    last, pooling, grid = config.depth - 1, config.pooling, config.grid
    rollout = [
        attention_map(a, method="rollout", layer=last, head=None, pooling=pooling, grid=grid)
        for a in attention
    ]
    heads = [
        [
            attention_map(a, method="raw", layer=last, head=h, pooling=pooling, grid=grid)
            for h in range(config.heads)
        ]
        for a in attention
    ]

    columns = 2 + config.heads
    figure, axes = plt.subplots(
        len(indices), columns, figsize=(1.7 * columns, 1.8 * len(indices)), squeeze=False
    )
    extent = (-0.5, config.image_width - 0.5, config.image_height - 0.5, -0.5)
    for row, index in enumerate(indices):
        picture = images[row].permute(1, 2, 0).numpy()
        show = {"cmap": "gray", "vmin": 0, "vmax": 255} if picture.shape[2] == 1 else {}
        picture = picture[..., 0] if picture.shape[2] == 1 else picture
        truth, guess = spec.labels[int(split.labels[index])], spec.labels[predicted[row]]
        axes[row, 0].imshow(picture, **show)
        axes[row, 0].set_ylabel(
            f"true: {truth}\npred: {guess}", fontsize=7, color="black" if truth == guess else "red"
        )
        axes[row, 1].imshow(picture, **show)
        axes[row, 1].imshow(
            rollout[row], cmap="inferno", alpha=0.6, extent=extent, interpolation="bilinear"
        )
        for head in range(config.heads):
            axes[row, 2 + head].imshow(heads[row][head], cmap="viridis", interpolation="nearest")
    titles = ["image", "rollout"] + [
        f"layer {config.depth} head {h + 1}" for h in range(config.heads)
    ]
    for column, title in enumerate(titles):
        axes[0, column].set_title(title, fontsize=8)
    for axis in axes.flat:
        axis.set_xticks([])
        axis.set_yticks([])
    pooled = "class-token row" if config.pooling == "token" else "mean over all query tokens"
    figure.suptitle(f"attention per patch ({pooled})", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(
    run_dir: str | Path,
    data_dir: str | Path | None = None,
    attention_dir: str | Path | None = None,
    attention_images: int = GALLERY_SIZE,
) -> dict:
    """Evaluate the run's best checkpoint on the test split and write results.json and the plots.

    ``data_dir`` defaults to the one the run was trained from (its settings.json), then to the
    dataset's default directory. With ``attention_dir``, the attention of every layer and head and
    the rollout for ``attention_images`` test images are written there (export/attention_images.py).
    """
    run_dir = Path(run_dir)
    settings_path = run_dir / "settings.json"
    settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
    if data_dir is None:
        data_dir = settings.get("data_dir")
    checkpoint = resolve_checkpoint(run_dir / "model.safetensors")
    model, metadata = load_checkpoint(checkpoint)
    spec = spec_from_metadata(metadata)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    test = load_test_split(spec, data_dir)

    logits = checkpoint_logits(model, test, spec, device=device)
    results = {
        "checkpoint": str(checkpoint),
        "dataset": spec.name,
        "split": "test",
        "parameters": model.num_parameters(),
        "epoch": int(metadata["epoch"]) if "epoch" in metadata else None,
        "val_loss": float(metadata["val_loss"]) if "val_loss" in metadata else None,
        "val_accuracy": float(metadata["val_accuracy"]) if "val_accuracy" in metadata else None,
        **classification_metrics(logits, test.labels.numpy(), json.loads(metadata["labels"])),
    }
    written = []
    metrics_path = run_dir / "metrics.csv"
    if metrics_path.is_file():
        plot_curves(read_metrics(metrics_path), run_dir / "curves.png", settings)
        written.append("curves.png")
    else:
        print(f"{metrics_path} does not exist: no learning curves", file=sys.stderr)
    plot_confusion(results, run_dir / "confusion_matrix.png")
    indices = gallery_indices(test.labels)
    plot_attention_gallery(model, test, indices, spec, run_dir / "attention_gallery.png")
    written += ["confusion_matrix.png", "attention_gallery.png"]
    if attention_dir is not None:
        # Imported here: the attention images use the service's maps (service/contract/attention_maps.py).
        from export.attention_images import write_attention_dir

        chosen = gallery_indices(test.labels, attention_images)
        write_attention_dir(model, test, chosen, spec, Path(attention_dir))
        results["attention_dir"] = str(attention_dir)
        results["attention_test_indices"] = chosen
        print(f"wrote the attention of {len(chosen)} test images to {attention_dir}", flush=True)
    results["gallery_test_indices"] = indices
    results["plots"] = written
    (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(
        f"{spec.name} test accuracy {100 * results['accuracy']:.2f}% "
        f"({results['correct']}/{results['images']}), loss {results['loss']:.4f}; "
        f"wrote results.json, {', '.join(written)} to {run_dir}",
        flush=True,
    )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("export.report", __doc__)
    parser.add_argument("run_dir", type=Path, help="run directory holding model.safetensors")
    parser.add_argument("--data-dir", default=None, help="directory of the dataset's files")
    parser.add_argument(
        "--attention-dir",
        type=Path,
        default=None,
        help="also write every layer's and head's attention and the rollout, per test image, here",
    )
    parser.add_argument(
        "--images", type=int, default=GALLERY_SIZE, help="test images in --attention-dir"
    )
    args = parser.parse_args(argv)
    if args.images < 1:
        parser.error(f"--images must be at least 1, got {args.images}")
    return exit_status(
        lambda: write_report(args.run_dir, args.data_dir, args.attention_dir, args.images)
    )


if __name__ == "__main__":
    raise SystemExit(main())
