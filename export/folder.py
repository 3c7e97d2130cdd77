"""Folder datasets in the ImageFolder layout: a user's own images, one folder per class.

    DIR/train/<class>/<image>   and   DIR/test/<class>/<image>
    DIR/<class>/<image>         (no train/: a deterministic split holds TEST_FRACTION of each class out)

Class names are the folder names, sorted. Any file Pillow reads, of any size and mode, becomes the
model's channels and size through the service's own preprocessing (``export.pixels``), so the model
trains on the pixels the service will feed it. Hidden files and folders (a leading dot) are skipped;
every other file should be an image: those that are not are skipped, and one warning names them.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from export.dataset_spec import FOLDER, DatasetError, DatasetSpec, Split
from export.pixels import UnreadableImage, preprocessor_for, read_image

TEST_FRACTION = 0.2
HOW_TO = (
    "give --data-dir a folder holding one sub-folder of images per class (DIR/<class>/*), or "
    "DIR/train/<class>/* and DIR/test/<class>/*"
)
MAX_LISTED = 20


@dataclass(frozen=True)
class FolderLayout:
    root: Path
    classes: tuple[str, ...]
    train: tuple[tuple[Path, int], ...]
    test: tuple[tuple[Path, int], ...]
    held_out: bool  # True: no test/ folder, the test split was held out of the class folders


def _visible(path: Path, root: Path) -> bool:
    return not any(part.startswith(".") for part in path.relative_to(root).parts)


def _class_folders(directory: Path) -> dict[str, Path]:
    return {
        child.name: child
        for child in sorted(directory.iterdir())
        if child.is_dir() and not child.name.startswith(".")
    }


def _files(class_dir: Path) -> list[Path]:
    return sorted(p for p in class_dir.rglob("*") if p.is_file() and _visible(p, class_dir))


def _held_out_order(path: Path, class_dir: Path) -> str:
    """A stable order that does not follow the file names (which often follow the capture order)."""
    return hashlib.sha256(path.relative_to(class_dir).as_posix().encode()).hexdigest()


def scan_folder(root: str | Path) -> FolderLayout:
    """The classes and files of a folder dataset; DatasetError for a layout that cannot train."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"{root}: no such directory; {HOW_TO}")
    has_train = (root / "train").is_dir()
    train_root = root / "train" if has_train else root
    test_root = root / "test" if has_train and (root / "test").is_dir() else None
    folders = _class_folders(train_root)
    if not folders:
        raise DatasetError(f"{train_root}: no class folders found; {HOW_TO}")
    if len(folders) < 2:
        raise DatasetError(
            f"{train_root}: only one class folder ({next(iter(folders))}); a classifier needs two "
            "or more"
        )
    classes = tuple(folders)
    files = {name: _files(folder) for name, folder in folders.items()}
    empty = [str(folders[name]) for name, found in files.items() if not found]
    test_files: dict[str, list[Path]] = {}
    if test_root is not None:
        test_folders = _class_folders(test_root)
        unknown = sorted(set(test_folders) - set(classes))
        if unknown:
            raise DatasetError(
                f"{test_root}: class folders {', '.join(unknown)} are not in {train_root} "
                f"(classes: {', '.join(classes)})"
            )
        test_files = {name: _files(folder) for name, folder in test_folders.items()}
        empty += [str(test_folders[name]) for name, found in test_files.items() if not found]
    if empty:
        raise DatasetError(f"empty class folder(s), holding no image: {', '.join(empty)}")
    train: list[tuple[Path, int]] = []
    test: list[tuple[Path, int]] = []
    for label, name in enumerate(classes):
        if test_root is not None:
            train += [(path, label) for path in files[name]]
            test += [(path, label) for path in test_files.get(name, [])]
            continue
        ordered = sorted(files[name], key=lambda p, d=folders[name]: _held_out_order(p, d))
        count = round(TEST_FRACTION * len(ordered))
        test += [(path, label) for path in sorted(ordered[:count])]
        train += [(path, label) for path in sorted(ordered[count:])]
    if not test:
        raise DatasetError(
            f"{root}: no test images; give a test/ folder beside train/, or put at least 3 images "
            f"in a class folder so that {TEST_FRACTION:.0%} of them can be held out"
        )
    return FolderLayout(root, classes, tuple(train), tuple(test), held_out=test_root is None)


def folder_spec(
    root: str | Path,
    classes: tuple[str, ...],
    channels: int,
    height: int,
    width: int,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
) -> DatasetSpec:
    """The DatasetSpec of a folder dataset; mean and std default to 0 and 1 until measured."""
    return DatasetSpec(
        name=FOLDER,
        labels=tuple(classes),
        channels=channels,
        height=height,
        width=width,
        mean=tuple(mean) if mean is not None else (0.0,) * channels,
        std=tuple(std) if std is not None else (1.0,) * channels,
        default_dir=str(Path(root).resolve()),
        how_to_get=HOW_TO,
        horizontal_flip=False,  # unknown: flips only with --hflip
        polarity="natural",
    )


def read_split(files: tuple[tuple[Path, int], ...], spec: DatasetSpec) -> Split:
    """uint8 (N, C, H, W) images, each fit-padded by the service's preprocessing, and labels.

    A file that is not an image Pillow can read is skipped; one warning names and counts them all.
    """
    preprocessor = preprocessor_for(spec)
    images = np.zeros((len(files), spec.channels, spec.height, spec.width), dtype=np.uint8)
    read: list[int] = []
    failures: list[str] = []
    progress = tqdm(
        files, desc="reading images", mininterval=5.0, file=sys.stderr, disable=len(files) < 2000
    )
    for index, (path, _) in enumerate(progress):
        try:
            # Polarity "natural": never inverted, so the display is exactly the model's view.
            prepared = read_image(path, preprocessor, invert="never")
        except UnreadableImage as error:
            failures.append(f"{path} ({error})")
            continue
        images[index] = prepared.display.transpose(2, 0, 1)
        read.append(index)
    if failures:
        listed = "; ".join(failures[:MAX_LISTED])
        more = f"; and {len(failures) - MAX_LISTED} more" if len(failures) > MAX_LISTED else ""
        print(
            f"warning: skipped {len(failures)} of {len(files)} file(s), not images Pillow can "
            f"read: {listed}{more}. Move them out of the dataset folder (files and folders whose "
            "name starts with '.' are skipped quietly)",
            file=sys.stderr,
            flush=True,
        )
    labels = torch.tensor([label for _, label in files], dtype=torch.int64)
    kept = torch.tensor(read, dtype=torch.int64)
    missing = sorted({spec.labels[i] for i in set(labels.tolist()) - set(labels[kept].tolist())})
    if missing:
        raise DatasetError(f"no readable image in the class folder(s) {', '.join(missing)}")
    return Split(torch.from_numpy(images)[kept], labels[kept])


def load_folder(
    root: str | Path, spec: DatasetSpec, splits: tuple[str, ...] = ("train", "test")
) -> tuple[Split, Split]:
    """(train, test) of a folder dataset at ``spec``'s size; a split not asked for is empty."""
    layout = scan_folder(root)
    if layout.classes != spec.labels:
        raise DatasetError(
            f"{layout.root} holds the classes {', '.join(layout.classes)}, the model was trained "
            f"on {', '.join(spec.labels)}"
        )
    empty = Split(
        torch.zeros((0, spec.channels, spec.height, spec.width), dtype=torch.uint8),
        torch.zeros(0, dtype=torch.int64),
    )
    train = read_split(layout.train, spec) if "train" in splits else empty
    test = read_split(layout.test, spec) if "test" in splits else empty
    return train, test


def measure_mean_std(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 (N, C, H, W) images scaled to [0, 1], padding included
    (the model sees it too). Exact integer sums: no float drift over millions of pixels."""
    if len(images) == 0:
        raise DatasetError("no training images to measure the mean and std on")
    pixels = images.transpose(0, 1).reshape(images.shape[1], -1).to(torch.int64)
    count = pixels.shape[1]
    sums = pixels.sum(dim=1).tolist()
    squares = (pixels * pixels).sum(dim=1).tolist()
    mean = tuple(s / count / 255.0 for s in sums)
    variance = [
        max(0, q * count - s * s) / count**2 / 255.0**2 for s, q in zip(sums, squares, strict=True)
    ]
    std = tuple(float(np.sqrt(v)) for v in variance)
    flat = [c for c, s in enumerate(std) if s < 1e-6]
    if flat:
        raise DatasetError(
            f"channel(s) {flat} of the training images are one flat value (std 0): nothing to learn"
        )
    return mean, std
