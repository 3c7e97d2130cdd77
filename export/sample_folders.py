"""Folder datasets to try ``--dataset folder`` on, written out as image files.

    python -m export.sample_folders fashion-mnist data/fashion-2000   # 200 a class + the 10,000 test
    python -m export.sample_folders shapes data/shapes-600            # 600 drawn shapes + 300 held out

``fashion-mnist``: the first ``--per-class`` images of each class of the Fashion-MNIST training set as
PNG files in ``DIR/train/<class>/``, and the whole test set in ``DIR/test/<class>/``.
``shapes``: circles, squares and triangles drawn with PIL.ImageDraw in RGB images of mixed sizes
(40 to 96 pixels a side), formats (PNG, JPEG, BMP) and colours, ``--per-class`` of each in
``DIR/train/<shape>/`` (seed 0) and a third as many, drawn with another seed, in ``DIR/test/<shape>/``.
The figures in BENCHMARKS.md were measured on these folders.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from export.cli import command_parser, exit_status
from export.data import Split, get_dataset_spec, load_dataset

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


def write_split(root: Path, split: Split, labels: tuple[str, ...]) -> None:
    """``root/<label>/<n>.png``, grey PNGs (label names made safe for a file system)."""
    for index, (image, label) in enumerate(zip(split.images, split.labels.tolist(), strict=True)):
        folder = root / labels[label].replace("/", "-")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[0].numpy(), mode="L").save(folder / f"{index:05d}.png")


def first_per_class(split: Split, classes: int, count: int | None) -> Split:
    """The first ``count`` images of each class, in their order in the split (all when None)."""
    if count is None:
        return split
    chosen = [
        int(i) for c in range(classes) for i in (split.labels == c).nonzero().flatten()[:count]
    ]
    return split.subset(torch.tensor(sorted(chosen)))


def write_fashion_mnist(
    root: Path, per_class: int, data_dir: str | None = None, test_per_class: int | None = None
) -> Path:
    """``root/train/<class>/`` with the first ``per_class`` training images of each class, and
    ``root/test/<class>/`` with the test set (its first ``test_per_class`` a class when given)."""
    spec = get_dataset_spec("fashion-mnist")
    train, test = load_dataset(spec, data_dir)
    classes = len(spec.labels)
    write_split(root / "train", first_per_class(train, classes, per_class), spec.labels)
    write_split(root / "test", first_per_class(test, classes, test_per_class), spec.labels)
    return root


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("export.sample_folders", __doc__)
    parser.add_argument("kind", choices=("fashion-mnist", "shapes"))
    parser.add_argument("out", type=Path, help="directory to write (must not exist)")
    parser.add_argument("--per-class", type=int, default=200, help="training images per class")
    parser.add_argument("--data-dir", default=None, help="Fashion-MNIST's IDX files")
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"{args.out} already exists")

    def write() -> None:
        if args.kind == "fashion-mnist":
            write_fashion_mnist(args.out, args.per_class, args.data_dir)
        else:
            write_shapes(args.out / "train", args.per_class, seed=0)
            write_shapes(args.out / "test", max(1, args.per_class // 3), seed=1)
        print(args.out)

    return exit_status(write)


if __name__ == "__main__":
    raise SystemExit(main())
