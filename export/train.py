"""Train a ViT: ``python -m export.train --help`` (its text is export/train_settings.py's).

    python -m export.train --dataset folder --data-dir photos --out runs/photos
    python -m export.train --preset fashion-small --out runs/fashion-small

This module prepares a run: a new one (a folder dataset's defaults chosen from its images,
export/folder_defaults.py), a resumed one, or one started from other weights (``--init-from``), and
its CNN teacher when it has one (export/teacher.py). The loop is export/trainer.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from export.augment import augmentation_for
from export.checkpoint import (
    CheckpointError,
    file_sha256,
)
from export.config import ViTConfig
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
from export.finetune import architecture, conflicting_fields, load_parent, parent_weights
from export.folder import FolderLayout, folder_spec, load_folder, measure_mean_std, scan_folder
from export.folder_defaults import choose, describe, survey
from export.model_flags import dataset_fitted
from export.teacher import TEACHER_FILE, load_teacher, train_teacher
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


def fine_tuning(settings: TrainSettings, checkpoint: Path) -> tuple[TrainSettings, bool]:
    """(settings, True) when the parent was trained on other data: the run keeps the parent's
    architecture at this dataset's size, channels and classes (export/finetune.py)."""
    parent_model, metadata = load_parent(checkpoint)
    parent = parent_model.config
    same = metadata["dataset"] == settings.dataset
    if same and settings.dataset == FOLDER:
        recorded = json.loads(metadata.get("dataset_spec", "{}")).get("default_dir")
        same = recorded == str(Path(settings.data_dir).resolve())
    if same:
        return settings, False
    if settings.dataset != FOLDER:
        config = dataset_fitted(parent, settings.dataset)
        return replace(settings, model_config=config.to_dict()), True
    conflicts = conflicting_fields(parent, settings.model_flags)
    if conflicts:
        raise ValueError(
            f"--init-from {checkpoint} keeps the parent's model; these differ from it: "
            + ", ".join(conflicts)
        )
    return replace(settings, model_flags={**settings.model_flags, **architecture(parent)}), True


def refuse_existing_run(out_dir: Path) -> None:
    """A new run never writes into the directory of a run that has weights. One that has none (it
    stopped before its first epoch was saved) holds nothing to lose, and is started over."""
    taken = [name for name in ("model.safetensors", "last") if (out_dir / name).exists()]
    if taken:
        raise ValueError(
            f"{out_dir} already holds a run ({', '.join(taken)}); continue it with "
            f"--resume {out_dir}, or give a new --out"
        )


def validation_count(settings: TrainSettings, images: int) -> int:
    size = settings.validation_size
    return max(1, round(size * images)) if isinstance(size, float) and size < 1 else int(size)


def choose_from_data(settings: TrainSettings, layout: FolderLayout) -> TrainSettings:
    """A new folder run's settings with every one left unset chosen from its images, and its model."""
    images = len(layout.train) - validation_count(settings, len(layout.train))
    if settings.train_limit:
        images = min(images, settings.train_limit)
    found = survey([path for path, _ in layout.train])
    given = {**asdict(settings), **settings.model_flags}
    chosen = choose(found, images, given)
    print(f"{layout.root}: defaults chosen from the data: {describe(chosen)}", flush=True)
    fields = {f.name for f in dataclasses.fields(ViTConfig)}
    model = {k: v for k, v in {**chosen, **settings.model_flags}.items() if k in fields}
    config = ViTConfig.from_dict({**model, "num_classes": len(layout.classes)})
    # The rest are settings, but for what only explains a choice (the teacher's threshold).
    names = {f.name for f in dataclasses.fields(TrainSettings)}
    settings = replace(settings, **{k: v for k, v in chosen.items() if k in names})
    return replace(settings, model_config=config.to_dict(), chosen_from_data=chosen)


def load_training_data(settings: TrainSettings) -> tuple[TrainSettings, DatasetSpec, Split, Split]:
    """(settings, spec, train, validation). A new folder run chooses its defaults from the images,
    then measures the mean and std of its training images and records them, with the classes, in
    the settings' ``dataset_spec``."""
    if settings.dataset != FOLDER:
        spec = get_dataset_spec(settings.dataset)
        train_full, _ = load_dataset(spec, settings.data_dir)
    elif settings.dataset_spec is not None:  # resumed: the classes and statistics it began with
        spec = spec_from_dict(settings.dataset_spec)
        train_full, _ = load_dataset(spec, settings.data_dir)
    else:
        layout = scan_folder(settings.data_dir)
        settings = choose_from_data(settings, layout)
        config = settings.config()
        spec = folder_spec(
            layout.root, layout.classes, config.in_channels, config.image_height, config.image_width
        )
        train_full, _ = load_folder(layout.root, spec, splits=("train",))
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
    if settings.steps and len(train) >= settings.batch_size:
        per_epoch = len(train) // settings.batch_size
        settings = replace(settings, epochs=-(-settings.steps // per_epoch))
    return settings, spec, train, validation


def auto_teacher(
    settings: TrainSettings, out_dir: Path, spec: DatasetSpec, train: Split, validation: Split
) -> torch.nn.Module:
    """``--teacher auto``: the teacher this run trained, training it first if it has not yet: for
    half as many steps as the ViT, on the same split and augmentation."""
    path = out_dir / TEACHER_FILE
    if path.is_file():
        return load_teacher(path, spec)
    per_epoch = len(train) // settings.batch_size
    steps = (settings.steps or settings.epochs * per_epoch) // 2
    augment = augmentation_for(spec, settings.hflip, settings.erase) if settings.augment else None
    print(f"training a CNN teacher for {steps} steps: {path}", flush=True)
    return train_teacher(
        train, validation, spec, augment, steps, settings.batch_size, settings.seed, path
    )


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
    initial_weights, fine_tune = None, False
    if resume is None and settings.init_from is not None:
        initial_weights = parent_weights(settings.init_from)
        settings, fine_tune = fine_tuning(settings, initial_weights)
        if not fine_tune:
            check_same_validation_split(settings, initial_weights)
        settings = replace(settings, init_from_sha256=file_sha256(initial_weights))
    if settings.threads:
        torch.set_num_threads(settings.threads)
    settings, spec, train, validation = load_training_data(settings)
    if len(train) < settings.batch_size:
        raise ValueError(
            f"batch size {settings.batch_size} exceeds the {len(train)} training images"
        )
    given_teacher = settings.teacher not in (None, "none", "auto")
    teacher = load_teacher(Path(settings.teacher), spec) if given_teacher else None
    trainer = Trainer(settings, out_dir, spec)
    if resume is not None:
        trainer.load_state(resume / "last")
        print(f"resumed {resume} at epoch {trainer.epoch}", flush=True)
    elif initial_weights is not None:
        trainer.load_initial_weights(initial_weights, fine_tune)
        if file_sha256(initial_weights) != settings.init_from_sha256:
            raise ValueError(f"{initial_weights} changed while it was read; is it still training?")
        print(f"starting from the weights of {initial_weights}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume is None:  # a row left by a first epoch that stopped before saving its weights
        (out_dir / "metrics.csv").unlink(missing_ok=True)
    (out_dir / "settings.json").write_text(settings_json(settings))
    c = trainer.model.config
    print(
        f"{settings.preset or 'model chosen from the data'}: "
        f"{trainer.model.num_parameters():,} parameters (dim {c.dim}, depth "
        f"{c.depth}, heads {c.heads}, patch {c.patch_size} {c.patch_embedding}, "
        f"{c.in_channels}x{c.image_height}x{c.image_width} -> {c.num_classes} classes), "
        f"{len(train)} train / {len(validation)} validation images, device {trainer.device}",
        flush=True,
    )
    if settings.teacher == "auto":
        teacher = auto_teacher(settings, out_dir, spec, train, validation)
    trainer.use_teacher(teacher)
    return trainer, train, validation


if __name__ == "__main__":
    raise SystemExit(main())
