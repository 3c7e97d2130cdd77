"""A folder dataset drawn with PIL.ImageDraw: circles, squares and triangles in RGB images of mixed
sizes, formats and colours, one folder per class (the ImageFolder layout ``--dataset folder`` reads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")
FORMATS = (("png", "PNG"), ("jpg", "JPEG"), ("bmp", "BMP"))


def draw_shape(kind: str, rng: np.random.Generator) -> Image.Image:
    """A light shape on a dark background, 40 to 96 pixels a side (not square), placed at random."""
    width, height = (int(v) for v in rng.integers(40, 97, size=2))
    background = tuple(int(v) for v in rng.integers(0, 70, size=3))
    colour = tuple(int(v) for v in rng.integers(150, 256, size=3))
    image = Image.new("RGB", (width, height), background)
    side = int(rng.integers(int(0.55 * min(width, height)), int(0.9 * min(width, height)) + 1))
    left = int(rng.integers(0, width - side + 1))
    top = int(rng.integers(0, height - side + 1))
    box = (left, top, left + side - 1, top + side - 1)
    draw = ImageDraw.Draw(image)
    if kind == "circle":
        draw.ellipse(box, fill=colour)
    elif kind == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) / 2, box[1])], colour)
    return image


def write_shapes(root: Path, per_class: int, seed: int = 0) -> Path:
    """``root/<shape>/<n>.<png|jpg|bmp>``, ``per_class`` images each; returns ``root``."""
    rng = np.random.default_rng(seed)
    for kind in SHAPES:
        (root / kind).mkdir(parents=True, exist_ok=True)
        for number in range(per_class):
            suffix, pillow_format = FORMATS[number % len(FORMATS)]
            draw_shape(kind, rng).save(root / kind / f"{number:03d}.{suffix}", pillow_format)
    return root
