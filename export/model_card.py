"""Write MODEL_CARD.md for a repository entry from its training run and its ONNX evaluation.

``python -m export.model_card runs/fashion-small --entry models/fashion-mnist-vit``

Every figure in the card is read from files the run and the evaluation wrote: metrics.csv (training
time, curves), results.json (the PyTorch checkpoint on the test split) and a fresh evaluation of the
ONNX file (the accuracy the service will deliver).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
from pathlib import Path

from export.checkpoint import file_sha256, read_metadata, resolve_checkpoint
from export.evaluate import evaluate_onnx
from export.report import write_report
from export.train import TrainSettings

CARD_PLOTS = ("curves.png", "confusion_matrix.png", "attention_gallery.png")


def train_command(settings: dict) -> str:
    """The ``python -m export.train`` command that reproduces a run's settings."""
    defaults = TrainSettings()
    flags = {
        "preset": "--preset",
        "dataset": "--dataset",
        "data_dir": "--data-dir",
        "epochs": "--epochs",
        "batch_size": "--batch-size",
        "learning_rate": "--lr",
        "min_learning_rate": "--min-lr",
        "weight_decay": "--weight-decay",
        "warmup_epochs": "--warmup-epochs",
        "label_smoothing": "--label-smoothing",
        "clip_grad_norm": "--clip-grad-norm",
        "patience": "--patience",
        "validation_size": "--validation-size",
        "train_limit": "--train-limit",
        "seed": "--seed",
        "threads": "--threads",
    }
    parts = ["python -m export.train"]
    for key, flag in flags.items():
        value = settings.get(key)
        if key in ("preset", "dataset") or (value is not None and value != getattr(defaults, key)):
            parts.append(f"{flag} {value}")
    if settings.get("compile"):
        parts.append("--compile")
    if settings.get("augment") is False:
        parts.append("--no-augment")
    parts.append("--out runs/NAME")
    return " ".join(parts)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def newest_version(entry: Path) -> Path:
    versions = sorted(
        (p for p in entry.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
    )
    if not versions:
        raise FileNotFoundError(f"{entry}: no version directories")
    return versions[-1]


def percent(value: float) -> str:
    return f"{100 * value:.2f}%"


def render(
    entry: Path,
    version_dir: Path,
    onnx_results: dict,
    results: dict,
    rows: list[dict],
    settings: dict,
    state: dict | None,
    model_config: dict,
) -> str:
    labels = onnx_results["labels"]
    seconds = sum(float(r["seconds"]) for r in rows)
    epochs_done = len(rows)
    planned = settings.get("epochs")
    finished = state is not None and (
        state.get("epoch", 0) >= planned
        or state.get("epochs_without_improvement", 0) >= settings.get("patience", 10**9)
    )
    best = min(rows, key=lambda r: float(r["val_loss"])) if rows else None
    lines = [
        f"# Model card: {entry.name}, version {version_dir.name}",
        "",
        "A Vision Transformer trained from scratch by `python -m export.train`, exported and verified "
        "by `python -m export.onnx`. Every figure below was read from the run's files and a fresh "
        "evaluation of the ONNX file by `python -m export.model_card`.",
        "",
        "## Result",
        "",
        f"- **Test accuracy of `{version_dir.name}/model.onnx`: "
        f"{percent(onnx_results['accuracy'])}** ({onnx_results['correct']} of "
        f"{onnx_results['images']} {onnx_results['dataset']} test images), measured with onnxruntime.",
        f"- PyTorch checkpoint on the same split: {percent(results['accuracy'])} "
        f"(cross-entropy {results['loss']:.4f}).",
        f"- Reproduce: `python -m export.evaluate {entry}/{version_dir.name}/model.onnx`",
        f"- ONNX file sha256: `{onnx_results['sha256']}`",
        "",
        "## Model",
        "",
        f"- Preset `{settings.get('preset')}`, {results['parameters']:,} parameters: "
        f"`{json.dumps(model_config, sort_keys=True)}`.",
        f"- Checkpoint from epoch {results.get('epoch')}, the lowest validation loss "
        f"({results.get('val_loss')}; validation accuracy {results.get('val_accuracy')}).",
        "",
        "## Training",
        "",
        "```",
        train_command(settings),
        "```",
        "",
        f"- Epochs run: {epochs_done} of {planned} planned"
        + (
            ""
            if finished
            else " (the run is not finished: it resumes with "
            "`python -m export.train --resume RUN_DIR`)"
        )
        + ".",
        f"- Training time on this machine: {seconds / 60:.1f} minutes of wall-clock time "
        f"({cpu_name()}, {os.cpu_count()} cores, PyTorch threads {settings.get('threads')}), "
        "shared with other work, so it is an upper bound.",
    ]
    if best is not None:
        lines.append(
            f"- Best epoch by validation loss: {best['epoch']} (val loss {best['val_loss']}, "
            f"val accuracy {percent(float(best['val_accuracy']))})."
        )
    lines += [
        "",
        "## Per-class test accuracy (ONNX)",
        "",
        "| class | accuracy |",
        "|---|---|",
        *(
            f"| {name} | {percent(acc)} |"
            for name, acc in onnx_results["per_class_accuracy"].items()
        ),
        "",
        "## Confusion matrix (ONNX; rows: true class, columns: predicted)",
        "",
        "| | " + " | ".join(str(i) for i in range(len(labels))) + " |",
        "|---" * (len(labels) + 1) + "|",
        *(
            f"| {i} {labels[i]} | " + " | ".join(str(v) for v in row) + " |"
            for i, row in enumerate(onnx_results["confusion_matrix"])
        ),
        "",
        "## Plots",
        "",
        "![learning curves](card/curves.png)",
        "",
        "![confusion matrix](card/confusion_matrix.png)",
        "",
        "![attention rollout and last-layer heads](card/attention_gallery.png)",
        "",
    ]
    return "\n".join(lines)


def write_model_card(
    run_dir: str | Path, entry: str | Path, version: int | None = None, data_dir: str | None = None
) -> Path:
    run_dir, entry = Path(run_dir), Path(entry)
    version_dir = entry / str(version) if version is not None else newest_version(entry)
    # Always evaluate afresh: a results.json or plots left from an earlier checkpoint would lie.
    results = write_report(run_dir, data_dir)
    onnx_results = evaluate_onnx(version_dir / "model.onnx", data_dir=data_dir)
    checkpoint = resolve_checkpoint(run_dir)
    exported_from = onnx_results["checkpoint_sha256"]
    if exported_from != file_sha256(checkpoint):
        raise ValueError(
            f"{version_dir / 'model.onnx'} was exported from another checkpoint than {checkpoint} "
            f"(sha256 {exported_from}); export that checkpoint first"
        )
    with (run_dir / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    settings = json.loads((run_dir / "settings.json").read_text())
    state_path = run_dir / "last" / "state.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else None
    card_dir = entry / "card"
    card_dir.mkdir(parents=True, exist_ok=True)
    for plot in CARD_PLOTS:
        shutil.copyfile(run_dir / plot, card_dir / plot)
    card = entry / "MODEL_CARD.md"
    model_config = json.loads(read_metadata(checkpoint)["config"])
    card.write_text(
        render(entry, version_dir, onnx_results, results, rows, settings, state, model_config)
    )
    return card


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m export.model_card",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", type=Path, help="the training run directory")
    parser.add_argument("--entry", required=True, type=Path, help="models/NAME")
    parser.add_argument("--version", type=int, default=None, help="default: the newest")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)
    print(write_model_card(args.run_dir, args.entry, args.version, args.data_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
