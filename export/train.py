"""Train a ViT: ``python -m export.train --preset fashion-small --out runs/NAME``.

    python -m export.train --dataset folder --data-dir photos/ --image-size 64 --channels 3 \
        --patch-size 8 --dim 128 --depth 6 --heads 4 --mlp-dim 256 --epochs 30 --out runs/photos

Datasets: the built-in ones (their files, never downloaded), or ``--dataset folder`` for a folder of
one sub-folder of images per class (export/folder.py). The model is a preset, then ``--config
FILE.json``, then the architecture flags (export/train_settings.py); the run's settings.json records
the resolved model, and ``--resume RUN_DIR`` continues with it. The loop is export/trainer.py.

``--init-from CHECKPOINT`` starts a new run (its own schedule, a fresh optimizer) from trained weights:
a warm restart of the learning rate, the way to train a finished run for longer.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from export.checkpoint import CheckpointError, file_sha256, resolve_checkpoint
from export.data import (
    FOLDER,
    DatasetError,
    DatasetSpec,
    Split,
    get_dataset_spec,
    load_dataset,
    spec_from_dict,
    train_validation_split,
)
from export.folder import folder_spec, load_folder, measure_mean_std, scan_folder
from export.train_settings import TrainSettings, parse_args, settings_json
from export.trainer import (
    METRIC_FIELDS,
    Trainer,
    configure_optimizer,
    evaluate_split,
    learning_rate_at,
    pick_device,
)

__all__ = [
    "METRIC_FIELDS",
    "TrainSettings",
    "Trainer",
    "configure_optimizer",
    "evaluate_split",
    "learning_rate_at",
    "main",
    "parse_args",
    "pick_device",
    "prepare",
]


def check_same_validation_split(settings: TrainSettings, checkpoint: Path) -> None:
    """Refuse a parent run whose training images include this run's validation images."""
    parent_settings = checkpoint.parent / "settings.json"
    if not parent_settings.is_file():
        raise ValueError(
            f"{checkpoint}: no settings.json beside it, so its validation split is unknown and "
            "this run's validation images may have been trained on; start from a run directory"
        )
    parent = json.loads(parent_settings.read_text())
    keys = ("dataset", "validation_size", "seed", "data_dir")
    for key in keys if settings.dataset == FOLDER else keys[:-1]:
        if parent.get(key) != getattr(settings, key):
            raise ValueError(
                f"{checkpoint} was trained with {key}={parent.get(key)!r}, this run has "
                f"{key}={getattr(settings, key)!r}: the validation split would differ and include "
                "images the checkpoint was trained on"
            )


def refuse_existing_run(out_dir: Path) -> None:
    """A new run never writes into the directory of a run that has weights. One that has none (it
    stopped before its first epoch was saved) holds nothing to lose, and is started over."""
    taken = [name for name in ("model.safetensors", "last") if (out_dir / name).exists()]
    if taken:
        raise ValueError(
            f"{out_dir} already holds a run ({', '.join(taken)}); continue it with "
            f"--resume {out_dir}, or give a new --out"
        )


def load_training_data(settings: TrainSettings) -> tuple[TrainSettings, DatasetSpec, Split, Split]:
    """(settings, spec, train, validation). A new folder run measures the mean and std of its
    training images and records them, with the classes, in the settings' ``dataset_spec``."""
    if settings.dataset != FOLDER:
        spec = get_dataset_spec(settings.dataset)
        train_full, _ = load_dataset(spec, settings.data_dir)
    elif settings.dataset_spec is not None:  # resumed: the classes and statistics it began with
        spec = spec_from_dict(settings.dataset_spec)
        train_full, _ = load_dataset(spec, settings.data_dir)
    else:
        layout = scan_folder(settings.data_dir)
        config = settings.config().replace(num_classes=len(layout.classes))
        spec = folder_spec(
            layout.root, layout.classes, config.in_channels, config.image_height, config.image_width
        )
        train_full, _ = load_folder(layout.root, spec, splits=("train",))
        settings = replace(settings, model_config=config.to_dict())
    train, validation = train_validation_split(train_full, settings.validation_size, settings.seed)
    if settings.train_limit:
        train = train.subset(torch.arange(min(settings.train_limit, len(train))))
    if settings.dataset == FOLDER and settings.dataset_spec is None:
        mean, std = measure_mean_std(train.images)
        spec = replace(spec, mean=mean, std=std)
        settings = replace(settings, dataset_spec=dataclasses.asdict(spec))
        print(
            f"{spec.default_dir}: {len(spec.labels)} classes ({', '.join(spec.labels)}), "
            f"{len(train_full)} training images; mean {[round(m, 4) for m in mean]}, "
            f"std {[round(s, 4) for s in std]}",
            flush=True,
        )
    return settings, spec, train, validation


def main(argv: list[str] | None = None) -> int:
    settings, out_dir, resume, no_report = parse_args(argv)
    try:
        trainer, train, validation = prepare(settings, out_dir, resume)
    except (CheckpointError, DatasetError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    trainer.fit(train, validation)
    if not no_report:
        from export.report import write_report

        write_report(trainer.out_dir, data_dir=trainer.settings.data_dir)
    return 0


def prepare(
    settings: TrainSettings, out_dir: Path | None, resume: Path | None
) -> tuple[Trainer, Split, Split]:
    """The trainer (fresh, resumed, or started from other weights) and its data splits."""
    if resume is not None:
        state_path = resume / "last" / "state.json"
        if not state_path.is_file():
            raise ValueError(f"{resume}: not a run to resume ({state_path} does not exist)")
        saved = json.loads(state_path.read_text())["settings"]
        # The model, schedule and data are the saved ones; only threads/compile may change.
        settings = TrainSettings(
            **{**saved, "threads": settings.threads, "compile": settings.compile}
        )
        out_dir = resume
    else:
        refuse_existing_run(out_dir)
    if settings.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            "--tensorboard needs the tensorboard package: pip install -r requirements/export.txt"
        )
    initial_weights = None
    if resume is None and settings.init_from is not None:
        initial_weights = resolve_checkpoint(settings.init_from)
        check_same_validation_split(settings, initial_weights)
        settings = replace(settings, init_from_sha256=file_sha256(initial_weights))
    if settings.threads:
        torch.set_num_threads(settings.threads)
    settings, spec, train, validation = load_training_data(settings)
    if len(train) < settings.batch_size:
        raise ValueError(
            f"batch size {settings.batch_size} exceeds the {len(train)} training images"
        )
    trainer = Trainer(settings, out_dir, spec)
    if resume is not None:
        trainer.load_state(resume / "last")
        print(f"resumed {resume} at epoch {trainer.epoch}", flush=True)
    elif initial_weights is not None:
        trainer.load_initial_weights(initial_weights)
        if file_sha256(initial_weights) != settings.init_from_sha256:
            raise ValueError(f"{initial_weights} changed while it was read; is it still training?")
        print(f"starting from the weights of {initial_weights}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume is None:  # a row left by a first epoch that stopped before saving its weights
        (out_dir / "metrics.csv").unlink(missing_ok=True)
    (out_dir / "settings.json").write_text(settings_json(settings))
    c = trainer.model.config
    print(
        f"{settings.preset}: {trainer.model.num_parameters():,} parameters (dim {c.dim}, depth "
        f"{c.depth}, heads {c.heads}, patch {c.patch_size} {c.patch_embedding}, "
        f"{c.in_channels}x{c.image_height}x{c.image_width} -> {c.num_classes} classes), "
        f"{len(train)} train / {len(validation)} validation images, device {trainer.device}",
        flush=True,
    )
    return trainer, train, validation


if __name__ == "__main__":
    raise SystemExit(main())
