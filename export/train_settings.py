"""The settings of a training run and its command line: ``python -m export.train --help``.

The model is the preset, then ``--config FILE.json``, then the architecture flags, each overriding
the one before; the dataset fixes the number of classes (and a built-in dataset the image size and
channels). The resolved config is recorded in the run's settings.json, which ``--resume`` reads back.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from export.cli import command_parser
from export.config import PRESETS, ViTConfig, get_preset
from export.data import DATASET_CHOICES, DATASETS, FOLDER
from export.folder_defaults import TEACHER_BELOW
from export.model_flags import (
    add_architecture_arguments,
    check_folder_fields,
    dataset_fitted,
    given_model_fields,
    resolve_config,
)
from export.teacher import DISTILLATIONS


@dataclass(frozen=True)
class TrainSettings:
    """A run's settings. For a folder dataset, those left None here are chosen from its images when
    the run starts (export/folder_defaults.py) and recorded resolved."""

    preset: str | None = "fashion-small"
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    epochs: int = 50
    # Optimizer steps in all, when the length was given (or chosen) in steps; epochs then follow.
    steps: int | None = None
    batch_size: int = 128
    learning_rate: float = 1e-3
    min_learning_rate: float = 1e-5
    weight_decay: float = 0.05
    warmup_epochs: float = 3.0
    label_smoothing: float = 0.1
    clip_grad_norm: float = 1.0
    patience: int = 12
    # The weights model.safetensors holds: the epoch of lowest validation loss, or the last.
    keep: str = "best"
    # A count of images, or a fraction of the training images when below 1.
    validation_size: int | float = 5000
    train_limit: int | None = None
    seed: int = 0
    threads: int | None = None
    compile: bool = False
    augment: bool = True
    # None: recorded before these were flags, the built-in recipe (export/augment.py).
    hflip: bool | None = None
    erase: bool | None = None
    # "auto" (train a CNN teacher first), a teacher file, or "none" or None: no distillation.
    teacher: str | None = None
    distillation: str = "soft"
    tensorboard: bool = False
    init_from: str | None = None
    # Recorded, not flags: which weights ``init_from`` held when this run started, the model's
    # resolved config, and a folder dataset's spec (classes, measured mean and std, directory).
    init_from_sha256: str | None = None
    model_config: dict | None = None
    dataset_spec: dict | None = None
    # A folder dataset: the model fields the user gave (preset, --config, flags), and every default
    # chosen from the data, as printed at start-up.
    model_flags: dict | None = None
    chosen_from_data: dict | None = None

    def config(self) -> ViTConfig:
        """The run's model; a run recorded before configs were recorded used its preset as is."""
        if self.model_config is not None:
            return ViTConfig.from_dict(self.model_config)
        return dataset_fitted(get_preset(self.preset), self.dataset)


def _count_or_fraction(text: str) -> int | float:
    value = float(text)
    if value.is_integer() and value >= 1:
        return int(value)
    if 0 < value < 1:
        return value
    raise argparse.ArgumentTypeError(
        f"expected a count of 1 or more or a fraction in (0, 1), got {text}"
    )


DESCRIPTION = f"""Train a ViT on a built-in dataset or on a folder of your own images.

    python -m export.train --dataset folder --data-dir photos --out runs/photos
    python -m export.train --preset fashion-small --out runs/fashion-small

--dataset {FOLDER} reads one sub-folder of images per class (photos/<class>/*, a fifth of each class
held out for testing, or photos/train/<class>/* and photos/test/<class>/*). Every setting it is not
given is chosen from the images and printed in one line at start-up: image size and channels, patch
size, model size, batch size, length in optimizer steps, augmentation and, under {TEACHER_BELOW:,} images, a
small CNN trained first on the same split and distilled into the ViT (--teacher auto)
(export/folder_defaults.py). Any flag below overrides its choice.

The model is a preset, then --config FILE.json, then the model flags, each overriding the one
before. The run's settings.json records everything resolved; --resume RUN_DIR continues with it.
--init-from RUN_DIR starts a new run from trained weights with its own schedule: a warm restart of
the same model, or fine-tuning on another dataset (a new head, an adapted patch embedding)."""


def add_training_arguments(parser: argparse.ArgumentParser, defaults: TrainSettings) -> None:
    chosen = f"default: chosen from the data for {FOLDER}, else"
    group = parser.add_argument_group("schedule")
    group.add_argument(
        "--epochs", type=int, default=None, help=f"length in epochs ({chosen} {defaults.epochs})"
    )
    group.add_argument(
        "--steps",
        type=int,
        default=None,
        help="length in optimizer steps instead of epochs (default: chosen from the data for "
        f"{FOLDER}, else --epochs)",
    )
    group.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"images a step ({chosen} {defaults.batch_size})",
    )
    group.add_argument(
        "--lr", type=float, default=defaults.learning_rate, dest="learning_rate", help="peak"
    )
    group.add_argument(
        "--min-lr",
        type=float,
        default=defaults.min_learning_rate,
        dest="min_learning_rate",
        help="end of the cosine decay",
    )
    group.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="AdamW's")
    group.add_argument(
        "--warmup-epochs",
        type=float,
        default=None,
        help=f"epochs of linear warm-up ({chosen} {defaults.warmup_epochs:g})",
    )
    group.add_argument(
        "--label-smoothing", type=float, default=defaults.label_smoothing, help="of the labels"
    )
    group.add_argument(
        "--clip-grad-norm", type=float, default=defaults.clip_grad_norm, help="0: no clipping"
    )
    group.add_argument(
        "--patience",
        type=int,
        default=None,
        help="stop after this many epochs without a lower validation loss (default: never for "
        f"{FOLDER}, else {defaults.patience})",
    )
    group.add_argument(
        "--keep",
        choices=("best", "last"),
        default=None,
        help="the weights the run keeps: the epoch of lowest validation loss, or the last "
        f"(default: last for {FOLDER}, else best)",
    )
    group = parser.add_argument_group("augmentation")
    group.add_argument(
        "--no-augment",
        action="store_false",
        dest="augment",
        help="no augmentation at all (by default: translations, and scale changes for a folder)",
    )
    group.add_argument(
        "--hflip",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="mirror half the images left-right; only for classes a mirror image keeps (not digits "
        "or letters). Default: off for a folder, the dataset's recipe for a built-in one",
    )
    group.add_argument(
        "--erase",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="blank a random rectangle in a quarter of the images; it can hide what tells two "
        "classes apart. Default: off for a folder, on for a built-in dataset",
    )
    group = parser.add_argument_group("distillation (export/teacher.py)")
    group.add_argument(
        "--teacher",
        default=None,
        help="'auto': train a small CNN on the same split first (for half the ViT's steps), then "
        "distil it into the ViT; a teacher file (RUN_DIR/teacher.safetensors of an earlier run) "
        f"reuses one; 'none'. Default: auto for a folder of under {TEACHER_BELOW:,} training images "
        "(on 2,000 Fashion-MNIST images it gained 0.6 points, 82.88%% against 82.27%% over three "
        "seeds, for about a third more CPU time: docs/training.md), else none",
    )
    group.add_argument(
        "--distillation",
        choices=DISTILLATIONS,
        default=defaults.distillation,
        help="soft: the teacher's distribution at temperature 3 (Kullback-Leibler divergence); "
        "hard: its class as a second label; with --distillation-token, the token's head learns it "
        "(default: soft; hard lost to it, with or without a token: docs/training.md)",
    )


def parse_args(argv: list[str] | None = None) -> tuple[TrainSettings, Path, Path | None, bool]:
    defaults = TrainSettings()
    parser = command_parser("export.train", DESCRIPTION)
    parser.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help=f"the model to start from (default: chosen from the data for {FOLDER}, else "
        f"{defaults.preset})",
    )
    parser.add_argument(
        "--dataset",
        default=defaults.dataset,
        choices=sorted(DATASET_CHOICES),
        help="what to train on",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help=f"directory of the dataset's files (required for {FOLDER}; else the dataset's own)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="run directory to write (a new run needs one)"
    )
    add_training_arguments(parser, defaults)
    parser.add_argument(
        "--validation-size",
        type=_count_or_fraction,
        default=None,
        help=f"images held out for validation, or a fraction (default {defaults.validation_size}, "
        f"0.1 for {FOLDER})",
    )
    parser.add_argument(
        "--train-limit", type=int, default=None, help="use only the first N training images"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="of everything random")
    parser.add_argument(
        "--threads", type=int, default=None, help="PyTorch CPU threads (default: all cores)"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the training step")
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="log losses, accuracy, learning rate and attention images to RUN_DIR/tensorboard",
    )
    parser.add_argument("--resume", type=Path, default=None, help="run directory to continue")
    parser.add_argument(
        "--init-from",
        default=None,
        help="start from the weights of this checkpoint (or run directory) with a new schedule",
    )
    parser.add_argument(
        "--no-report", action="store_true", help="skip the plots and test evaluation"
    )
    add_architecture_arguments(parser)
    args = vars(parser.parse_args(argv))
    if args["resume"] is not None and args["init_from"] is not None:
        parser.error(
            "--resume continues a run with the weights it has; --init-from starts a new one"
        )
    if args["resume"] is None and args["out"] is None:
        parser.error("--out RUN_DIR is required for a new run (--resume RUN_DIR continues one)")
    folder = args["dataset"] == FOLDER
    if folder and args["data_dir"] is None and args["resume"] is None:
        parser.error(
            f"--dataset {FOLDER} needs --data-dir DIR (one sub-folder of images per class)"
        )
    if args["epochs"] is not None and args["steps"] is not None:
        parser.error("give the length in --epochs or in --steps, not both")
    if args["validation_size"] is None:
        args["validation_size"] = 0.1 if folder else defaults.validation_size
    model_config, model_flags = None, None
    try:
        if folder:
            model_flags = given_model_fields(args)
            check_folder_fields(model_flags)
        else:
            args["preset"] = args["preset"] or defaults.preset
            model_config = resolve_config(args).to_dict()
    except ValueError as error:
        parser.error(str(error))
    if not folder:
        spec = DATASETS[args["dataset"]]
        for name, value in {
            "epochs": None if args["steps"] else defaults.epochs,
            "batch_size": defaults.batch_size,
            "warmup_epochs": defaults.warmup_epochs,
            "patience": defaults.patience,
            "keep": defaults.keep,
            "hflip": spec.horizontal_flip,
            "erase": True,
        }.items():
            if args[name] is None:
                args[name] = value
    out, resume, no_report = args.pop("out"), args.pop("resume"), args.pop("no_report")
    settings = TrainSettings(**args, model_config=model_config, model_flags=model_flags)
    return settings, out, resume, no_report


def settings_json(settings: TrainSettings) -> str:
    return json.dumps(asdict(settings), indent=2)
