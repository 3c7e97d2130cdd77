"""The model from the command line: a preset, then ``--config FILE.json``, then the architecture
flags, each overriding the one before; a built-in dataset fixes the image size, channels and classes.
A folder dataset records the fields its user gave (``model_flags``) and chooses the rest from its
images (export/folder_defaults.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from export.config import ViTConfig, get_preset
from export.data import DATASETS, FOLDER

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
    "distillation_token": "--distillation-token",
    "dropout": "--dropout",
    "attention_dropout": "--attention-dropout",
    "qkv_bias": "--qkv-bias",
    "layer_norm_eps": "--layer-norm-eps",
    "class_token": "--class-token",
    "pooled_norm": "--pooled-norm",
    "distillation_head": "--distillation-head",
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


def add_architecture_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag defaults to absent, so that what the user gave is told from what the preset says."""
    group = parser.add_argument_group(
        "model",
        "override the preset (and --config) field by field; see export/config.py. Default: the "
        f"preset's, and for a {FOLDER} without --preset, chosen from its images",
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
    group.add_argument(
        "--distillation-token",
        action=argparse.BooleanOptionalAction,
        help="DeiT's distillation token: a second token with a head of its own that learns the "
        "teacher's predictions (--teacher); the logits are the mean of both heads'. Default: off "
        "(on 2,000 Fashion-MNIST images it lost to distillation without it, hard and soft: "
        "docs/training.md)",
        **unset,
    )
    group.add_argument("--dropout", type=float, **unset)
    group.add_argument("--attention-dropout", type=float, **unset)
    group.add_argument("--qkv-bias", action=argparse.BooleanOptionalAction, **unset)
    group.add_argument("--layer-norm-eps", type=float, **unset)
    group.add_argument(
        "--class-token",
        action=argparse.BooleanOptionalAction,
        help="a class token beside mean pooling (token pooling always has one)",
        **unset,
    )
    group.add_argument(
        "--pooled-norm",
        action=argparse.BooleanOptionalAction,
        help="the final layer norm on what a head reads, after pooling (timm's fc_norm)",
        **unset,
    )
    group.add_argument(
        "--distillation-head",
        action=argparse.BooleanOptionalAction,
        help="whether the distillation token has a head of its own (default: yes)",
        **unset,
    )


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


def given_model_fields(args: dict) -> dict:
    """The model fields the user gave: the preset's (when named), then --config, then the flags,
    each overriding the one before; pops the architecture arguments out of ``args``."""
    values = get_preset(args["preset"]).to_dict() if args["preset"] is not None else {}
    path = args.pop("config")
    if path is not None:
        values.update(read_config_file(path))
    values.pop("num_classes", None)  # always the dataset's
    if "image_size" in args:
        if "image_height" in args or "image_width" in args:
            raise ValueError(
                "--image-size sets both sides; give it or --image-height/--image-width"
            )
        args["image_height"] = args["image_width"] = args.pop("image_size")
    explicit = {
        name: args.pop(name) for name in (*IMAGE_FLAGS, *ARCHITECTURE_FLAGS) if name in args
    }
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
    elif args["preset"] is not None:
        # A preset names a model, not an image size: a folder's images still choose theirs.
        for name in IMAGE_FLAGS:
            values.pop(name, None)
    return {**values, **explicit}


def resolve_config(args: dict) -> ViTConfig:
    """A built-in dataset's model: its preset with the fields given, fitted to the dataset.
    Raises ValueError with one line naming what is wrong."""
    values = {**get_preset(args["preset"]).to_dict(), **given_model_fields(args)}
    return dataset_fitted(ViTConfig.from_dict(values), args["dataset"])


def check_folder_fields(fields: dict) -> None:
    """What can be checked of a folder's model before its images are read: the fields given, with
    fitting stand-ins for the ones chosen from the data later. Raises ValueError."""
    patch = fields.get("patch_size", 1)
    ViTConfig.from_dict({"image_height": 8 * patch, "image_width": 8 * patch, **fields})


def architecture_flags(settings: dict) -> list[str]:
    """The flags that turn the recorded preset into the recorded model (for reproducing a run). A
    folder run whose model was chosen from its images gets only the fields its user gave: the same
    images choose the rest again."""
    if settings.get("model_config") is None:
        return []
    recorded = ViTConfig.from_dict(settings["model_config"])
    given = settings.get("model_flags")
    if given is not None:
        preset = get_preset(settings["preset"]).to_dict() if settings.get("preset") else {}
        names = [name for name in given if given[name] != preset.get(name, object())]
    else:
        preset_config = dataset_fitted(get_preset(settings["preset"]), settings["dataset"])
        names = [
            name
            for name in {**IMAGE_FLAGS, **ARCHITECTURE_FLAGS}
            if getattr(recorded, name) != getattr(preset_config, name)
        ]
    flags = []
    for name, flag in {**IMAGE_FLAGS, **ARCHITECTURE_FLAGS}.items():
        if name not in names:
            continue
        value = getattr(recorded, name)
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags.append(f"{flag} {'none' if value is None else value}")
    return flags
