"""The settings of a training run and its command line: ``python -m export.train --help``.

The model is the preset, then ``--config FILE.json``, then the architecture flags, each overriding
the one before; the dataset fixes the number of classes (and a built-in dataset the image size and
channels). The resolved config is recorded in the run's settings.json, which ``--resume`` reads back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from export.cli import command_parser
from export.config import PRESETS, ViTConfig, get_preset
from export.data import DATASET_CHOICES, DATASETS, FOLDER


@dataclass(frozen=True)
class TrainSettings:
    preset: str = "fashion-small"
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    epochs: int = 50
    batch_size: int = 128
    learning_rate: float = 1e-3
    min_learning_rate: float = 1e-5
    weight_decay: float = 0.05
    warmup_epochs: float = 3.0
    label_smoothing: float = 0.1
    clip_grad_norm: float = 1.0
    patience: int = 12
    # A count of images, or a fraction of the training images when below 1.
    validation_size: int | float = 5000
    train_limit: int | None = None
    seed: int = 0
    threads: int | None = None
    compile: bool = False
    augment: bool = True
    tensorboard: bool = False
    init_from: str | None = None
    # Recorded, not flags: which weights ``init_from`` held when this run started, the model's
    # resolved config, and a folder dataset's spec (classes, measured mean and std, directory).
    init_from_sha256: str | None = None
    model_config: dict | None = None
    dataset_spec: dict | None = None

    def config(self) -> ViTConfig:
        """The run's model; a run recorded before configs were recorded used its preset as is."""
        if self.model_config is not None:
            return ViTConfig.from_dict(self.model_config)
        return dataset_fitted(get_preset(self.preset), self.dataset)


# ViTConfig field -> flag. in_channels, image size and num_classes come from the dataset (or the
# image flags for a folder dataset), so they are listed apart.
ARCHITECTURE_FLAGS = {
    "patch_size": "--patch-size",
    "dim": "--dim",
    "depth": "--depth",
    "heads": "--heads",
    "mlp_dim": "--mlp-dim",
    "pooling": "--pooling",
    "position_embedding": "--position-embedding",
    "patch_embedding": "--patch-embedding",
    "representation_size": "--representation-size",
    "dropout": "--dropout",
    "attention_dropout": "--attention-dropout",
    "qkv_bias": "--qkv-bias",
    "layer_norm_eps": "--layer-norm-eps",
}
IMAGE_FLAGS = {
    "in_channels": "--channels",
    "image_height": "--image-height",
    "image_width": "--image-width",
}


def dataset_fitted(config: ViTConfig, dataset: str) -> ViTConfig:
    """A built-in dataset's image size, channels and classes replace the config's."""
    if dataset not in DATASETS:
        return config
    spec = DATASETS[dataset]
    return config.replace(
        in_channels=spec.channels,
        image_height=spec.height,
        image_width=spec.width,
        num_classes=len(spec.labels),
    )


def _optional_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _count_or_fraction(text: str) -> int | float:
    value = float(text)
    if value.is_integer() and value >= 1:
        return int(value)
    if 0 < value < 1:
        return value
    raise argparse.ArgumentTypeError(
        f"expected a count of 1 or more or a fraction in (0, 1), got {text}"
    )


def add_architecture_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag defaults to absent, so that what the user gave is told from what the preset says."""
    group = parser.add_argument_group(
        "model", "override the preset (and --config) field by field; see export/config.py"
    )
    unset = {"default": argparse.SUPPRESS}
    group.add_argument("--config", type=Path, default=None, help="JSON object of ViTConfig fields")
    group.add_argument("--image-size", type=int, help="square images of this side", **unset)
    group.add_argument("--image-height", type=int, **unset)
    group.add_argument("--image-width", type=int, **unset)
    group.add_argument("--channels", type=int, choices=(1, 3), dest="in_channels", **unset)
    for name in ("patch_size", "dim", "depth", "heads", "mlp_dim"):
        group.add_argument(ARCHITECTURE_FLAGS[name], type=int, **unset)
    group.add_argument("--pooling", choices=("token", "mean"), **unset)
    group.add_argument("--position-embedding", choices=("learned", "sinusoidal"), **unset)
    group.add_argument("--patch-embedding", choices=("conv", "linear"), **unset)
    group.add_argument(
        "--representation-size",
        type=_optional_int,
        help="pre-logits Linear + Tanh of this size, or 'none'",
        **unset,
    )
    group.add_argument("--dropout", type=float, **unset)
    group.add_argument("--attention-dropout", type=float, **unset)
    group.add_argument("--qkv-bias", action=argparse.BooleanOptionalAction, **unset)
    group.add_argument("--layer-norm-eps", type=float, **unset)


def read_config_file(path: Path) -> dict:
    try:
        values = json.loads(path.read_text())
    except OSError as error:
        raise ValueError(f"--config {path}: cannot read it ({error.strerror or error})") from error
    except json.JSONDecodeError as error:
        raise ValueError(f"--config {path}: not valid JSON ({error})") from error
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a JSON object of ViTConfig fields")
    known = {f.name for f in dataclasses.fields(ViTConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--config {path}: unknown ViTConfig fields: {', '.join(unknown)}")
    return values


def resolve_config(args: dict) -> ViTConfig:
    """Preset, then --config, then flags; pops the architecture arguments out of ``args``.
    Raises ValueError with one line naming what is wrong."""
    values = get_preset(args["preset"]).to_dict()
    explicit: dict = {}
    path = args.pop("config")
    if path is not None:
        explicit.update(read_config_file(path))
        explicit.pop("num_classes", None)  # always the dataset's
    if "image_size" in args:
        if "image_height" in args or "image_width" in args:
            raise ValueError(
                "--image-size sets both sides; give it or --image-height/--image-width"
            )
        args["image_height"] = args["image_width"] = args.pop("image_size")
    explicit.update(
        {name: args.pop(name) for name in (*IMAGE_FLAGS, *ARCHITECTURE_FLAGS) if name in args}
    )
    values.update(explicit)
    dataset = args["dataset"]
    if dataset in DATASETS:
        spec = DATASETS[dataset]
        wanted = {
            "in_channels": spec.channels,
            "image_height": spec.height,
            "image_width": spec.width,
        }
        for name, flag in IMAGE_FLAGS.items():
            if name in explicit and explicit[name] != wanted[name]:
                raise ValueError(
                    f"{flag} {explicit[name]}: {dataset} images are {spec.height}x{spec.width} with "
                    f"{spec.channels} channel(s); image size and channels are chosen for "
                    f"--dataset {FOLDER}"
                )
    config = ViTConfig.from_dict(values)
    return dataset_fitted(config, dataset)


def architecture_flags(settings: dict) -> list[str]:
    """The flags that turn the recorded preset into the recorded model (for reproducing a run)."""
    if settings.get("model_config") is None:
        return []
    recorded = ViTConfig.from_dict(settings["model_config"])
    preset = dataset_fitted(get_preset(settings["preset"]), settings["dataset"])
    flags = []
    for name, flag in {**IMAGE_FLAGS, **ARCHITECTURE_FLAGS}.items():
        value = getattr(recorded, name)
        if value == getattr(preset, name):
            continue
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags.append(f"{flag} {'none' if value is None else value}")
    return flags


def parse_args(argv: list[str] | None = None) -> tuple[TrainSettings, Path, Path | None, bool]:
    from export import train

    defaults = TrainSettings()
    parser = command_parser("export.train", train.__doc__)
    parser.add_argument("--preset", default=defaults.preset, choices=sorted(PRESETS))
    parser.add_argument("--dataset", default=defaults.dataset, choices=sorted(DATASET_CHOICES))
    parser.add_argument(
        "--data-dir", default=None, help=f"directory of the dataset's files (required for {FOLDER})"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="run directory to write (a new run needs one)"
    )
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.learning_rate, dest="learning_rate")
    parser.add_argument(
        "--min-lr", type=float, default=defaults.min_learning_rate, dest="min_learning_rate"
    )
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    parser.add_argument("--warmup-epochs", type=float, default=defaults.warmup_epochs)
    parser.add_argument("--label-smoothing", type=float, default=defaults.label_smoothing)
    parser.add_argument("--clip-grad-norm", type=float, default=defaults.clip_grad_norm)
    parser.add_argument("--patience", type=int, default=defaults.patience)
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
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="torch.compile the training step")
    parser.add_argument("--no-augment", action="store_false", dest="augment")
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
    if args["dataset"] == FOLDER and args["data_dir"] is None and args["resume"] is None:
        parser.error(
            f"--dataset {FOLDER} needs --data-dir DIR (one sub-folder of images per class)"
        )
    if args["validation_size"] is None:
        args["validation_size"] = 0.1 if args["dataset"] == FOLDER else defaults.validation_size
    try:
        config = resolve_config(args)
    except ValueError as error:
        parser.error(str(error))
    out, resume, no_report = args.pop("out"), args.pop("resume"), args.pop("no_report")
    return TrainSettings(**args, model_config=config.to_dict()), out, resume, no_report


def settings_json(settings: TrainSettings) -> str:
    return json.dumps(asdict(settings), indent=2)
