"""Batched training augmentation on normalised images, and which of it a dataset gets.

Three kinds that keep the class of any image: a small scale change (zoom in or out about the centre),
a translation (pad and crop), and nothing else by default. Two that do not keep every class, each its
own flag: a horizontal flip (``--hflip``: a mirrored digit or letter is another, or no, symbol) and
random erasing (``--erase``: it can hide the one stroke that tells two classes apart). The built-in
datasets keep the recipe their models were trained with: translation, flips where the dataset allows
them, and erasing; a folder dataset gets scale changes and translations unless asked for more.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from export.dataset_spec import FOLDER, DatasetSpec

# Random erasing: the chance that an image gets a rectangle, as in the shipped model's recipe.
ERASING_PROBABILITY = 0.25
# A folder's default scale change: zoom by a factor in [1 - s, 1 + s].
FOLDER_MAX_SCALE = 0.1
# A folder's default translation, as a fraction of the image side.
FOLDER_SHIFT_FRACTION = 0.1


@dataclass(frozen=True)
class Augmentation:
    """Random zoom, translation (pad and crop), horizontal flip, random erasing."""

    max_shift: int = 2
    horizontal_flip: bool = True
    erasing_probability: float = ERASING_PROBABILITY
    max_scale: float = 0.0
    # The normalised value that padding and erasing write, per channel: 0 (the mean) for the
    # built-in recipes, the normalised black of the service's fit-and-pad for a folder dataset.
    fill: tuple[float, ...] = (0.0,)

    def __call__(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Works on normalised float images (N, C, H, W)."""
        n, _, h, w = images.shape
        fill = torch.tensor(self.fill, dtype=images.dtype).view(1, -1, 1, 1)
        if self.max_scale:
            zoom = 1 + (2 * torch.rand(n, generator=generator) - 1) * self.max_scale
            theta = torch.zeros(n, 2, 3)
            theta[:, 0, 0] = theta[:, 1, 1] = 1 / zoom
            grid = F.affine_grid(theta, list(images.shape), align_corners=False)
            images = F.grid_sample(images - fill, grid, align_corners=False) + fill
        if self.max_shift:
            s = self.max_shift
            padded = F.pad(images - fill, (s, s, s, s)) + fill
            dy = torch.randint(0, 2 * s + 1, (n,), generator=generator)
            dx = torch.randint(0, 2 * s + 1, (n,), generator=generator)
            rows = (dy.view(n, 1) + torch.arange(h).view(1, h)).view(n, 1, h, 1)
            cols = (dx.view(n, 1) + torch.arange(w).view(1, w)).view(n, 1, 1, w)
            batch = torch.arange(n).view(n, 1, 1, 1)
            channel = torch.arange(images.shape[1]).view(1, -1, 1, 1)
            images = padded[batch, channel, rows, cols]
        if self.horizontal_flip:
            flip = torch.rand(n, generator=generator) < 0.5
            images = torch.where(flip.view(n, 1, 1, 1), images.flip(-1), images)
        if self.erasing_probability:
            images = torch.where(self.erased(images, generator), fill, images)
        return images

    def erased(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A (N, 1, H, W) mask: rectangles covering 2% to 20% of an image, aspect ratio 0.3 to 3.3."""
        n, _, h, w = images.shape
        erase = torch.rand(n, generator=generator) < self.erasing_probability
        area = (0.02 + 0.18 * torch.rand(n, generator=generator)) * h * w
        aspect = torch.exp(
            torch.empty(n).uniform_(np.log(0.3), np.log(1 / 0.3), generator=generator)
        )
        eh = (area * aspect).sqrt().round().clamp(1, h).long()
        ew = (area / aspect).sqrt().round().clamp(1, w).long()
        top = (torch.rand(n, generator=generator) * (h - eh + 1)).long()
        left = (torch.rand(n, generator=generator) * (w - ew + 1)).long()
        ys = torch.arange(h).view(1, h, 1)
        xs = torch.arange(w).view(1, 1, w)
        inside = (
            (ys >= top.view(n, 1, 1))
            & (ys < (top + eh).view(n, 1, 1))
            & (xs >= left.view(n, 1, 1))
            & (xs < (left + ew).view(n, 1, 1))
            & erase.view(n, 1, 1)
        )
        return inside.unsqueeze(1)


def augmentation_for(
    spec: DatasetSpec, hflip: bool | None = None, erase: bool | None = None
) -> Augmentation:
    """A dataset's augmentation. ``hflip`` and ``erase`` are the run's flags; None (a run recorded
    before they were flags) is the recipe the built-in models were trained with: flips where the
    dataset allows them (``spec.horizontal_flip``), and erasing."""
    hflip = spec.horizontal_flip if hflip is None else hflip
    erase = True if erase is None else erase
    probability = ERASING_PROBABILITY if erase else 0.0
    if spec.name != FOLDER:
        shift = 4 if spec.height >= 32 else 2
        return Augmentation(max_shift=shift, horizontal_flip=hflip, erasing_probability=probability)
    black = tuple(-m / s for m, s in zip(spec.mean, spec.std, strict=True))
    return Augmentation(
        max_shift=max(1, round(FOLDER_SHIFT_FRACTION * min(spec.height, spec.width))),
        horizontal_flip=hflip,
        erasing_probability=probability,
        max_scale=FOLDER_MAX_SCALE,
        fill=black,
    )
