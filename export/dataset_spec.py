"""What every dataset is described by, with no loader attached: the spec a checkpoint records, a
split of uint8 images, and the error a loader raises. ``export.data`` (the built-in datasets),
``export.folder`` (a folder of images) and ``export.pixels`` build on it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A user's folder of images (export/folder.py): its spec is made from the folder and the model.
FOLDER = "folder"


class DatasetError(RuntimeError):
    """A dataset file is missing or malformed; the message names the path and the remedy."""


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    labels: tuple[str, ...]
    channels: int
    height: int
    width: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    default_dir: str
    how_to_get: str
    horizontal_flip: bool
    # Light objects on a dark background: what a photo must be turned into before inference.
    polarity: str = "light-on-dark"
    files: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Split:
    images: torch.Tensor  # uint8 (N, C, H, W)
    labels: torch.Tensor  # int64 (N,)

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: torch.Tensor) -> Split:
        return Split(self.images[indices], self.labels[indices])
