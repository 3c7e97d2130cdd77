"""Checkpoints made by other libraries, mapped onto ``export/model.py``'s ViT.

``load_imported(directory)`` reads a Hugging Face model directory (export/importers/huggingface.py)
or a timm checkpoint in timm's hub layout (export/importers/timm.py): the config checked before
anything is allocated, the weights loaded strictly by the source's own names, the labels and the
preprocessing taken from the checkpoint. A directory with a ``config.json`` is such a checkpoint; a
vitserve run has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import ValidationError

from export.checkpoint import CheckpointError, file_sha256
from export.importers import huggingface, timm
from export.importers.weights import Weights, map_weights, read_json, weight_file
from export.model import VisionTransformer
from service.contract.model_repository import Preprocessing

SUPPORTED = (
    "a vitserve run; a Hugging Face directory of "
    + ", ".join(huggingface.ARCHITECTURES)
    + f"; a timm checkpoint in timm's hub layout of {timm.SUPPORTED}"
)


@dataclass
class Imported:
    """A checkpoint of another library, as vitserve's ViT and what serving it needs."""

    model: VisionTransformer
    labels: list[str]
    labels_source: str  # where the labels came from, in words
    preprocessing: dict
    library: str  # "transformers" or "timm"
    architecture: str
    config: dict  # the source's config.json, as read
    weights: Path
    weights_sha256: str
    notes: list[str] = field(default_factory=list)

    @property
    def source(self) -> dict:
        """What the metadata and the model card say of where the weights came from."""
        return {
            "library": self.library,
            "architecture": self.architecture,
            "weights": self.weights.name,
            "weights_sha256": self.weights_sha256,
            "labels": self.labels_source,
            "preprocessing_notes": self.notes,
        }


def is_imported(path: str | Path) -> bool:
    """Whether ``path`` is a directory of another library's checkpoint (it holds a config.json)."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def load_imported(directory: str | Path) -> Imported:
    """The checkpoint in ``directory``, or CheckpointError naming what is wrong or unsupported."""
    directory = Path(directory)
    config_path = directory / "config.json"
    config = read_json(config_path)
    where = str(config_path)
    if "architectures" in config:
        library = "transformers"
        architecture = huggingface.architecture(config, where)
        vit, labels = huggingface.vit_config(config, where)
        document, notes = huggingface.preprocessing(
            huggingface.read_processor(directory), vit, str(directory / "preprocessor_config.json")
        )
        layout = huggingface.weight_layout(vit, architecture)
    elif "architecture" in config:
        library, architecture = "timm", str(config["architecture"])
        vit, labels = timm.vit_config(config, where)
        document, notes = timm.preprocessing(config, vit, where)
        layout = timm.weight_layout(vit)
    else:
        raise CheckpointError(
            f"{where}: not a checkpoint this importer knows; supported: {SUPPORTED}"
        )
    preprocessing = checked_preprocessing(document, vit.in_channels, where)
    path = weight_file(directory)
    # Built on the meta device, the model has shapes and no storage: nothing is allocated until the
    # file's own header has shown that it holds every weight of the config, at its shape.
    with torch.device("meta"):
        model = VisionTransformer(vit)
    expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
    state = map_weights(str(path), Weights(path), layout, expected)
    model.load_state_dict(state, strict=True, assign=True)
    return Imported(
        model.eval(),
        labels.names,
        labels.source,
        preprocessing,
        library,
        architecture,
        config,
        path,
        file_sha256(path),
        notes,
    )


def checked_preprocessing(document: dict, channels: int, where: str) -> dict:
    """The document as the service's contract reads it, refused when it would not load there."""
    try:
        checked = Preprocessing(**document)
    except (ValidationError, TypeError) as error:
        raise CheckpointError(
            f"{where}: preprocessing the service cannot serve: {error}"
        ) from error
    for name in ("mean", "std"):
        if len(getattr(checked, name)) != channels:
            raise CheckpointError(
                f"{where}: {name} has {len(getattr(checked, name))} values for {channels} channel(s)"
            )
    if any(s <= 0 for s in checked.std):
        raise CheckpointError(f"{where}: std values must be positive")
    return checked.model_dump(exclude_none=True)


def probe_images(model: VisionTransformer, preprocessing: dict, count: int) -> torch.Tensor:
    """``count`` seeded images for checking the graphs against PyTorch: smooth random shapes with
    fine noise, 0-255 in every channel, normalised as the service will (scale, mean, std). Made in
    place, so that they take twice their own size at most (the images and their noise)."""
    c = model.config
    generator = torch.Generator().manual_seed(0)
    coarse = torch.rand(count, c.in_channels, 4, 4, generator=generator)
    pixels = torch.nn.functional.interpolate(
        coarse, size=(c.image_height, c.image_width), mode="bicubic", align_corners=False
    )
    noise = torch.rand(count, c.in_channels, c.image_height, c.image_width, generator=generator)
    pixels.mul_(0.8).add_(noise.mul_(0.2)).mul_(255).clamp_(0, 255).round_()
    del noise
    mean = torch.tensor(preprocessing["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(preprocessing["std"]).view(1, -1, 1, 1)
    return pixels.mul_(preprocessing["scale"]).sub_(mean).div_(std)
