"""The training defaults of a folder dataset, chosen from its images when the user gives none.

Read from the image headers of the training files (no decoding): the usual size and whether every
image is grey. From them and the number of training images:

- image size: the median width and height, scaled down so that neither passes ``MAX_SIDE``, each a
  multiple of the patch size; channels: 1 when every file is stored grey, else 3;
- patch size 4 up to 32-pixel images, 8 above (a grid of at most 8 x 8 patches);
- the model: small (dim 64, depth 4) under ``SMALL_DATASET`` images, the shipped model's size (dim
  96, depth 6) under ``LARGE_DATASET``, dim 128 above;
- batch size: about a thirtieth of the images, a power of two from 16 to 128, so that a small
  dataset still takes tens of optimizer steps an epoch;
- length in optimizer steps: ``EPOCHS_WORTH`` epochs, at least ``MIN_STEPS`` and at most
  ``MAX_STEPS`` (a small dataset trains long enough, a large one is not over-trained), with a
  warm-up of 5% of them, no early stopping, and the last epoch's weights kept (on 2,000
  Fashion-MNIST images the epoch of lowest validation loss came mid-schedule, 2.4 points of test
  accuracy below the last: docs/training.md);
- augmentation: scale changes and translations, no flips and no erasing (``export/augment.py``);
- a CNN teacher (``--teacher auto``, export/teacher.py) under ``TEACHER_BELOW`` images, the range of
  the small model: on 2,000 Fashion-MNIST images, soft distillation from it gave 82.88% of the test
  images over three seeds against 82.27% without it (each distilled seed above each plain one), for
  about a third more CPU time (docs/training.md). The threshold is recorded with the choice.

``choose`` returns only what the user left unset; ``describe`` is the line printed at start-up.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

MAX_SIDE = 64
SMALL_DATASET = 10_000
LARGE_DATASET = 50_000
EPOCHS_WORTH = 300
MIN_STEPS = 3_000
MAX_STEPS = 20_000
WARMUP_FRACTION = 0.05
# A CNN teacher (--teacher auto) is trained and distilled into the ViT under this many images.
TEACHER_BELOW = SMALL_DATASET
GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "F"})


@dataclass(frozen=True)
class FolderSurvey:
    """What the headers of a folder's training files say."""

    files: int
    width: int  # the median width of the images that could be opened
    height: int
    grey: bool  # every image that could be opened is stored grey


def survey(paths: list[Path] | tuple[Path, ...]) -> FolderSurvey:
    """Opens each file's header only; a file Pillow cannot open is left for the reader to report."""
    widths, heights, grey = [], [], True
    for path in paths:
        try:
            with Image.open(path) as image:
                widths.append(image.width)
                heights.append(image.height)
                grey = grey and image.mode in GREY_MODES
        except Exception:  # Pillow raises many exception types for files it cannot read
            continue
    if not widths:
        return FolderSurvey(len(paths), MAX_SIDE, MAX_SIDE, False)
    width, height = round(statistics.median(widths)), round(statistics.median(heights))
    return FolderSurvey(len(paths), width, height, grey)


def image_size(found: FolderSurvey, patch: int | None = None) -> tuple[int, int]:
    """(height, width) for images usually ``found.height`` x ``found.width``: the same aspect ratio,
    neither side above ``MAX_SIDE``, each a multiple of ``patch`` (by default the patch size they
    get)."""
    shrink = min(1.0, MAX_SIDE / max(found.width, found.height))
    patch = patch or (4 if max(found.width, found.height) * shrink <= 32 else 8)
    sides = (found.height, found.width)
    height, width = (max(patch, patch * round(side * shrink / patch)) for side in sides)
    return height, width


def patch_size_for(height: int, width: int) -> int:
    """4 up to 32-pixel images, 8 above; if that does not divide both sides, the largest that does."""
    wanted = 4 if max(height, width) <= 32 else 8
    return max(p for p in range(1, wanted + 1) if height % p == 0 and width % p == 0)


def batch_size_for(images: int) -> int:
    return int(min(128, max(16, 2 ** round(math.log2(max(1, images / 30))))))


def steps_for(images: int, batch_size: int) -> int:
    per_epoch = max(1, images // batch_size)
    return int(min(MAX_STEPS, max(MIN_STEPS, EPOCHS_WORTH * per_epoch)))


def model_for(images: int) -> dict:
    if images < SMALL_DATASET:
        dim, depth = 64, 4
    elif images < LARGE_DATASET:
        dim, depth = 96, 6
    else:
        dim, depth = 128, 6
    return {"dim": dim, "depth": depth, "heads": 4, "mlp_dim": 2 * dim, "pooling": "mean"}


def choose(found: FolderSurvey, train_images: int, given: dict) -> dict:
    """Every default chosen from the data that ``given`` (the user's settings and model fields, by
    ViTConfig or TrainSettings name) does not already fix."""
    height, width = image_size(found, given.get("patch_size"))
    height = given.get("image_height") or height
    width = given.get("image_width") or width
    chosen: dict = {
        "image_height": height,
        "image_width": width,
        "in_channels": 1 if found.grey else 3,
        "patch_size": patch_size_for(height, width),
        **model_for(train_images),
    }
    batch_size = given.get("batch_size") or batch_size_for(train_images)
    chosen["batch_size"] = batch_size
    if given.get("epochs") is None:
        steps = given.get("steps") or steps_for(train_images, batch_size)
        per_epoch = max(1, train_images // batch_size)
        chosen.update(steps=steps, epochs=-(-steps // per_epoch))
    epochs = given.get("epochs") or chosen["epochs"]
    chosen["warmup_epochs"] = round(WARMUP_FRACTION * epochs, 2)
    chosen["patience"] = epochs
    chosen["keep"] = "last"
    chosen["hflip"] = False
    chosen["erase"] = False
    chosen["teacher"] = "auto" if train_images < TEACHER_BELOW else "none"
    chosen["teacher_below"] = TEACHER_BELOW
    return {key: value for key, value in chosen.items() if given.get(key) is None}


def describe(chosen: dict) -> str:
    """One line: ``key value`` pairs in the order they were chosen; the teacher's with the number
    of images it is chosen below."""
    parts = []
    for key, value in chosen.items():
        if key == "teacher" and "teacher_below" in chosen:
            value = f"{value} (auto under {chosen['teacher_below']:,} training images)"
        if key != "teacher_below":
            parts.append(f"{key} {value}")
    return ", ".join(parts)
