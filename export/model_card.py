"""Write MODEL_CARD.md for a repository entry from its training run and its ONNX evaluation.

``python -m export.model_card runs/fashion-small --entry models/fashion-mnist-vit``

Every figure in the card is read from files the run and the evaluation wrote: metrics.csv (training
time, curves), results.json (the PyTorch checkpoint on the test split) and a fresh evaluation of the
ONNX file (the accuracy the service will deliver).
"""

from __future__ import annotations

import json
import os
import shutil
from itertools import pairwise
from pathlib import Path

from export.checkpoint import file_sha256, read_metadata, resolve_checkpoint
from export.cli import command_parser, exit_status
from export.data import DATASETS, FOLDER, load_test_split
from export.evaluate import (
    dataset_logits,
    evaluate_onnx,
    onnx_dataset_spec,
    onnx_runner,
    onnx_session,
    read_onnx_metadata,
)
from export.hardware import cpu_model
from export.lineage import Stage, training_stages
from export.model_flags import architecture_flags
from export.onnx_graphs import fusions_text
from export.report import plot_curves, read_metrics, write_report
from export.teacher import TEACHER_FILE, teacher_metadata
from export.train_settings import TrainSettings
from service.contract.model_repository import version_numbers
from service.contract.preprocessing import normalise

CARD_PLOTS = ("curves.png", "confusion_matrix.png", "attention_gallery.png")


def train_command(settings: dict, out: str = "runs/NAME", init_from: str | None = None) -> str:
    """The ``python -m export.train`` command that reproduces a run's settings (``init_from``, when
    given, replaces the recorded parent: the reproduction starts from the reproduced parent). What a
    folder run chose from its images is left out: the same images choose it again."""
    defaults = TrainSettings()
    if init_from is not None:
        settings = {**settings, "init_from": init_from}
    chosen = settings.get("chosen_from_data") or {}
    if settings.get("steps"):
        chosen = {**chosen, "epochs": None}  # the steps give the epochs
    if settings.get("dataset") == FOLDER and settings.get("validation_size") == 0.1:
        chosen = {**chosen, "validation_size": None}  # a folder's default
    flags = {
        "preset": "--preset",
        "dataset": "--dataset",
        "data_dir": "--data-dir",
        "epochs": "--epochs",
        "steps": "--steps",
        "batch_size": "--batch-size",
        "learning_rate": "--lr",
        "min_learning_rate": "--min-lr",
        "weight_decay": "--weight-decay",
        "warmup_epochs": "--warmup-epochs",
        "label_smoothing": "--label-smoothing",
        "clip_grad_norm": "--clip-grad-norm",
        "patience": "--patience",
        "keep": "--keep",
        "validation_size": "--validation-size",
        "train_limit": "--train-limit",
        "seed": "--seed",
        "threads": "--threads",
        "teacher": "--teacher",
        "distillation": "--distillation",
        "init_from": "--init-from",
    }
    parts = ["python -m export.train"]
    for key, flag in flags.items():
        value = settings.get(key)
        if key in chosen or value is None:
            continue
        if key == "dataset" or (key == "preset" and value) or value != getattr(defaults, key):
            parts.append(f"{flag} {value}")
    parts += architecture_flags(settings)
    if settings.get("compile"):
        parts.append("--compile")
    if settings.get("augment") is False:
        parts.append("--no-augment")
    recipe = {"hflip": None, "erase": True}
    if settings.get("dataset") in DATASETS:
        recipe["hflip"] = DATASETS[settings["dataset"]].horizontal_flip
    for key, default in recipe.items():
        value = settings.get(key)
        if key not in chosen and value is not None and value != default:
            parts.append(f"--{key}" if value else f"--no-{key}")
    parts.append(f"--out {out}")
    return " ".join(parts)


def plot_all_stages(stages: list[Stage], path: Path) -> None:
    """One set of learning curves over every run, epochs counted from the first run's start."""
    rows, restarts, offset = [], [], 0
    for stage in stages:
        stage_rows = read_metrics(stage.run_dir / "metrics.csv")
        rows += [{**row, "epoch": row["epoch"] + offset} for row in stage_rows]
        offset += len(stage_rows)
        restarts.append(offset)
    # The marked epoch must be the shipped checkpoint's, which is the last run's best.
    last_run = rows[restarts[-2] :]
    best = min(last_run, key=lambda row: row["val_loss"])
    label = (
        f"epoch {int(best['epoch']) - restarts[-2]} of run {len(stages)} "
        f"(epoch {int(best['epoch'])} counting every run)"
    )
    plot_curves(
        rows,
        path,
        stages[-1].settings,
        restarts=tuple(restarts[:-1]),
        best=best,
        best_label=label,
    )


def newest_version(entry: Path) -> Path:
    versions = version_numbers(entry)
    if not versions:
        raise FileNotFoundError(f"{entry}: no version directories")
    return entry / str(versions[-1])


def batch_dependence(path: Path, data_dir: str | Path | None = None) -> tuple[int, int]:
    """(test images classified differently at batch 1 and at batch 32, test images): a graph that
    quantizes activations with one scale per batch lets an image's neighbours change its class."""
    session = onnx_session(path, threads=None)
    metadata = read_onnx_metadata(session, path)
    test = load_test_split(onnx_dataset_spec(session, path, data_dir=data_dir), data_dir)
    run = onnx_runner(session, metadata.input.name, metadata.outputs.logits)
    images = normalise(test.images.numpy(), metadata.preprocessing)
    alone, batched = (dataset_logits(run, images, lambda x: x, size).argmax(1) for size in (1, 32))
    return int((alone != batched).sum()), len(images)


def quantization_lines(
    run_dir: Path, entry: Path, version_dir: Path, onnx_results: dict
) -> list[str]:
    """What an int8 or fp16 graph is, how it was made, and what it costs."""
    precision, method = onnx_results["precision"], onnx_results["quantization"]
    options = f"--quantize {precision}"
    if precision == "fp16":
        how = (
            "every float32 weight and activation in float16 by onnxruntime's float16 converter, "
            "its input and output float32; made for CUDA, measured here with onnxruntime's CPU "
            "provider, which runs in float32 the float16 nodes it has no kernel for"
        )
    else:
        how = f"`{method}` quantization by onnxruntime"
        options += f" --quantization {method}"
    if onnx_results.get("calibration_images"):
        how += f", calibrated on {onnx_results['calibration_images']} training images"
    if onnx_results.get("weight_range"):
        low, high = onnx_results["weight_range"]
        how += (
            f", weights in 7 bits ({low} to {high}) so that int8 kernels without VNNI do not "
            "saturate"
        )
    lines = [
        f"- Precision: {precision} ({how}), made from the float32 graph of the same "
        f"checkpoint, which measured {percent(onnx_results['float_test_accuracy'])} on the same "
        "split in the same export.",
        f"- Made by: `python -m export.onnx {run_dir} --name {entry.name} --version "
        f"{version_dir.name} {options}`",
    ]
    offline = onnx_results.get("float_agreement")
    if offline:
        lines.append(
            f"- Against the float32 graph on the same test images: top-1 agreement "
            f"{percent(offline['top1_agreement'])}; per image, the largest |p_{precision} - "
            f"p_float| over its classes: p99 {offline['probability_difference_p99']:.4f}, max "
            f"{offline['probability_difference_max']:.4f}. Tried as a candidate (`--candidate`), the "
            "shadow measures the same on live requests before it answers any."
        )
    changed, images = batch_dependence(version_dir / "model.onnx")
    if method == "dynamic":
        lines.append(
            "- Its activations are quantized with one scale per batch, so a prediction can depend on "
            f"the images batched with it: {changed} of {images} test images are classified "
            "differently at batch 1 and at batch 32."
        )
    elif method == "static-qdq":
        lines.append(
            "- Its activation scales are fixed at calibration, so a prediction does not depend on the "
            f"images batched with it: {changed} of {images} test images are classified differently "
            "at batch 1 and at batch 32."
        )
    else:
        lines.append(
            f"- {changed} of {images} test images are classified differently at batch 1 and at "
            "batch 32."
        )
    return lines


def lineage_lines(stages: list[Stage]) -> list[str]:
    """Where the weights came from besides the data: a parent trained on other data, a teacher."""
    lines = []
    imported_from = stages[0].settings.get("init_from")
    if imported_from is not None:  # a lineage starts from a parent of ours only at an import
        lines.append(
            f"- Fine-tuned: `{stages[0].run_dir}` started from `{imported_from}`, a checkpoint "
            "of another library imported by export/importers/; its head was initialised afresh "
            "where the classes differ."
        )
    for earlier, stage in pairwise(stages):
        before, after = earlier.settings, stage.settings
        if (before.get("dataset"), before.get("data_dir")) != (after["dataset"], after["data_dir"]):
            source = before.get("data_dir") or before.get("dataset")
            lines.append(
                f"- Fine-tuned: `{stage.run_dir}` started from `{stage.settings['init_from']}`, "
                f"trained on {source} ({before.get('dataset')}); its head was initialised afresh "
                "where the classes differ and its patch embedding adapted to the channels."
            )
    final = stages[-1]
    teacher = final.settings.get("teacher")
    if teacher not in (None, "none"):
        path = final.run_dir / TEACHER_FILE if teacher == "auto" else Path(teacher)
        metadata = teacher_metadata(path) if path.is_file() else {}
        figures, hyper = metadata.get("figures", {}), metadata.get("hyper", {})
        made = "trained first on the same split" if teacher == "auto" else "given"
        cnn = f"width {hyper['width']}, " if "width" in hyper else ""
        steps = figures.get("steps")
        cnn += f"{steps:,} steps" if isinstance(steps, int) else "? steps"
        if "seconds" in figures:  # not in the training time below, which is the ViT's
            cnn += f" in {figures['seconds'] / 60:.1f} minutes"
        token = (final.settings.get("model_config") or {}).get("distillation_token")
        through = (
            " through a distillation token (the served logits are the mean of the class head's and "
            "the distillation head's)"
            if token
            else ""
        )
        lines.append(
            f"- Distilled ({final.settings.get('distillation')} distillation, DeiT-style{through}) "
            f"from a small CNN teacher ({cnn}), {made}: `{path}` "
            f"(validation accuracy {percent(figures.get('val_accuracy', float('nan')))}). Only "
            "the ViT is exported."
        )
    return lines


def fusion_lines(version_dir: Path, onnx_results: dict) -> list[str]:
    """What onnxruntime's CPU optimizer fuses in the graph, as counted when it was exported (none
    for a graph exported before the count was recorded)."""
    fusions = onnx_results.get("onnxruntime_fusions")
    if fusions is None:
        return []
    return [
        f"- onnxruntime's fusions in `{version_dir.name}/model.onnx` (CPU, ORT_ENABLE_ALL, "
        f"onnxruntime {onnx_results.get('exported_with_onnxruntime')} at export): "
        f"{fusions_text(fusions)}."
    ]


def percent(value: float) -> str:
    return f"{100 * value:.2f}%"


def stage_line(stage: Stage, last: bool) -> str:
    """One run of the chain: epochs, time, its best epoch; how to continue it if it is the last."""
    line = f"- `{stage.run_dir}`: {len(stage.rows)} of {stage.settings.get('epochs')} epochs run"
    # Resuming an earlier run would rewrite the weights that a later run recorded starting from.
    if last and not stage.finished:
        line += (
            f" (not finished: it resumes with `python -m export.train --resume {stage.run_dir}`)"
        )
    line += f", {stage.seconds / 60:.1f} minutes"
    if (best := stage.best) is not None:
        line += (
            f"; lowest validation loss {float(best['val_loss']):.4f} at epoch {best['epoch']} "
            f"(validation accuracy {percent(float(best['val_accuracy']))})"
        )
    return line + "."


def render(
    entry: Path,
    version_dir: Path,
    onnx_results: dict,
    results: dict,
    stages: list[Stage],
    model_config: dict,
) -> str:
    labels = onnx_results["labels"]
    final = stages[-1]
    seconds = sum(stage.seconds for stage in stages)
    earlier_epochs = sum(len(stage.rows) for stage in stages[:-1])
    kept = f"epoch {results.get('epoch')}"
    if len(stages) > 1:
        kept += (
            f" of the last run (epoch {int(results.get('epoch') or 0) + earlier_epochs} "
            "counting every run)"
        )
    # Reproductions go to new directories under runs/, each starting from the one before, so that
    # pasting them never touches the runs this card was made from.
    outs = [f"runs/{stage.run_dir.name}" for stage in stages]
    commands = [
        train_command(stage.settings, out=out, init_from=outs[i - 1] if i else None)
        for i, (stage, out) in enumerate(zip(stages, outs, strict=True))
    ]
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
        *(
            quantization_lines(stages[-1].run_dir, entry, version_dir, onnx_results)
            if onnx_results.get("precision", "float32") != "float32"
            else []
        ),
        f"- PyTorch checkpoint on the same split: {percent(results['accuracy'])} "
        f"(cross-entropy {results['loss']:.4f}).",
        f"- Reproduce: `python -m export.evaluate {entry}/{version_dir.name}/model.onnx`",
        f"- ONNX file sha256: `{onnx_results['sha256']}`",
        *fusion_lines(version_dir, onnx_results),
        "",
        "## Model",
        "",
        (
            f"- Preset `{final.settings['preset']}`"
            if final.settings.get("preset")
            else "- Chosen from the data by `export.train` (`chosen_from_data` in its settings.json)"
        )
        + f", {results['parameters']:,} parameters: "
        f"`{json.dumps(model_config, sort_keys=True)}`.",
        f"- Checkpoint from {kept}, "
        + ("the last" if final.settings.get("keep") == "last" else "the lowest validation loss")
        + f" of that run ({results.get('val_loss')}; validation accuracy "
        f"{results.get('val_accuracy')}).",
        "",
        "## Training",
        "",
        *lineage_lines(stages),
        *([""] if lineage_lines(stages) else []),
        (
            "To train it again, run from the repository root, in this order (each later run starts "
            "from the best weights of the one before, with a new learning-rate schedule):"
            if len(stages) > 1
            else "To train it again, run from the repository root:"
        ),
        "",
        "```",
        *commands,
        "```",
        "",
        "The runs this model came from:",
        "",
        *(stage_line(stage, last=stage is final) for stage in stages),
        f"- Training time on this machine: {seconds / 60:.1f} minutes of wall-clock time in all "
        f"({cpu_model()}, {os.cpu_count()} cores, PyTorch threads "
        f"{final.settings.get('threads')}), shared with other work, so it is an upper bound.",
    ]
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
    stages = training_stages(run_dir)
    card_dir = entry / "card"
    card_dir.mkdir(parents=True, exist_ok=True)
    for plot in CARD_PLOTS:
        shutil.copyfile(run_dir / plot, card_dir / plot)
    if len(stages) > 1:
        plot_all_stages(stages, card_dir / "curves.png")
    card = entry / "MODEL_CARD.md"
    model_config = json.loads(read_metadata(checkpoint)["config"])
    card.write_text(render(entry, version_dir, onnx_results, results, stages, model_config))
    return card


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("export.model_card", __doc__)
    parser.add_argument("run_dir", type=Path, help="the training run directory")
    parser.add_argument("--entry", required=True, type=Path, help="models/NAME")
    parser.add_argument("--version", type=int, default=None, help="default: the newest")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)
    return exit_status(
        lambda: print(write_model_card(args.run_dir, args.entry, args.version, args.data_dir)),
        FileNotFoundError,
    )


if __name__ == "__main__":
    raise SystemExit(main())
