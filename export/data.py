"""Datasets from their standard files (IDX for MNIST / Fashion-MNIST, python batches for CIFAR-10).

Nothing is downloaded: each loader reads a directory and says where to get the files when they are
missing. Images are kept as uint8 tensors (N, C, H, W); normalisation and augmentation run per batch.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import pickle
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from export.dataset_spec import FOLDER, DatasetError, DatasetSpec, Split
from export.folder import load_folder

FASHION_MNIST_LABELS = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
MNIST_LABELS = tuple(str(digit) for digit in range(10))
CIFAR10_LABELS = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)


DATASETS: dict[str, DatasetSpec] = {
    "fashion-mnist": DatasetSpec(
        name="fashion-mnist",
        labels=FASHION_MNIST_LABELS,
        channels=1,
        height=28,
        width=28,
        mean=(0.2860,),
        std=(0.3530,),
        default_dir="/usr/share/datasets/fashion-mnist",
        how_to_get="install it with `apt-get update && apt-get install dataset-fashion-mnist`, "
        "or pass --data-dir to a directory holding the four IDX files",
        horizontal_flip=True,
    ),
    "mnist": DatasetSpec(
        name="mnist",
        labels=MNIST_LABELS,
        channels=1,
        height=28,
        width=28,
        mean=(0.1307,),
        std=(0.3081,),
        default_dir="data/mnist",
        how_to_get="put train-images-idx3-ubyte(.gz), train-labels-idx1-ubyte(.gz), "
        "t10k-images-idx3-ubyte(.gz) and t10k-labels-idx1-ubyte(.gz) there, or pass --data-dir",
        # A mirrored digit is a different (or no) digit.
        horizontal_flip=False,
    ),
    "cifar10": DatasetSpec(
        name="cifar10",
        labels=CIFAR10_LABELS,
        channels=3,
        height=32,
        width=32,
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
        default_dir="data/cifar-10-batches-py",
        how_to_get="unpack the CIFAR-10 python version (cifar-10-python.tar.gz) there, "
        "or pass --data-dir to the cifar-10-batches-py directory",
        horizontal_flip=True,
        polarity="natural",
    ),
}


DATASET_CHOICES = (*DATASETS, FOLDER)


def get_dataset_spec(name: str) -> DatasetSpec:
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(
            f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}"
        ) from None


def spec_to_json(spec: DatasetSpec) -> str:
    return json.dumps(dataclasses.asdict(spec), sort_keys=True)


def spec_from_json(text: str) -> DatasetSpec:
    return spec_from_dict(json.loads(text))


def spec_from_dict(values: dict) -> DatasetSpec:
    values = dict(values)
    for key in ("labels", "mean", "std"):
        values[key] = tuple(values[key])
    values["files"] = {k: tuple(v) for k, v in values.get("files", {}).items()}
    return DatasetSpec(**values)


def spec_from_metadata(metadata: Mapping[str, str]) -> DatasetSpec:
    """The dataset a checkpoint was trained on. A folder dataset's spec (classes, measured mean and
    std, directory) travels in the checkpoint as ``dataset_spec``; a built-in one is named."""
    if "dataset_spec" in metadata:
        try:
            return spec_from_json(metadata["dataset_spec"])
        except (ValueError, TypeError, KeyError) as error:
            raise DatasetError(f"the checkpoint's dataset_spec is malformed ({error})") from error
    return get_dataset_spec(metadata["dataset"])


def _read_maybe_gzipped(directory: Path, stem: str, spec: DatasetSpec) -> bytes:
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            try:
                if candidate.suffix == ".gz":
                    return gzip.decompress(candidate.read_bytes())
                return candidate.read_bytes()
            except (OSError, EOFError, gzip.BadGzipFile) as error:
                raise DatasetError(
                    f"{candidate}: cannot read ({error}); {spec.how_to_get}"
                ) from error
    raise DatasetError(
        f"{spec.name}: neither {directory / stem}.gz nor {directory / stem} exists; {spec.how_to_get}"
    )


def parse_idx(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """Parse an IDX file (unsigned bytes): magic 0x00 0x00 0x08 ndim, big-endian dims, then data."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DatasetError(f"{source}: not an IDX file (bad magic number)")
    if data[2] != 0x08:
        raise DatasetError(f"{source}: IDX data type 0x{data[2]:02x} is not unsigned byte (0x08)")
    ndim = data[3]
    header = 4 + 4 * ndim
    if ndim < 1 or len(data) < header:
        raise DatasetError(f"{source}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    expected = int(np.prod(shape))
    if len(data) - header != expected:
        raise DatasetError(
            f"{source}: IDX header promises {expected} bytes of data for shape {shape}, "
            f"file holds {len(data) - header}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def load_idx_split(directory: Path, prefix: str, spec: DatasetSpec) -> Split:
    image_stem, label_stem = f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"
    images = parse_idx(
        _read_maybe_gzipped(directory, image_stem, spec), str(directory / image_stem)
    )
    labels = parse_idx(
        _read_maybe_gzipped(directory, label_stem, spec), str(directory / label_stem)
    )
    if images.ndim != 3 or images.shape[1:] != (spec.height, spec.width):
        raise DatasetError(
            f"{directory / image_stem}: expected images of {spec.height}x{spec.width}, "
            f"got shape {images.shape}"
        )
    if labels.ndim != 1 or len(labels) != len(images):
        raise DatasetError(
            f"{directory / label_stem}: {labels.shape} labels for {len(images)} images"
        )
    if labels.max(initial=0) >= len(spec.labels):
        raise DatasetError(f"{directory / label_stem}: label {labels.max()} out of range")
    return Split(
        torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))
    )


class _CifarUnpickler(pickle.Unpickler):
    """CIFAR-10 batches are pickles of plain dicts; refuse anything that would run code."""

    ALLOWED = frozenset(
        {
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
        }
    )

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR-10 batch")


def _cifar_array(value: object, key: str, path: Path, spec: DatasetSpec) -> np.ndarray:
    """An array of integers from a batch entry; never lets numpy's OverflowError escape."""
    try:
        array = np.asarray(value)
    except (OverflowError, ValueError, TypeError) as error:
        raise DatasetError(f"{path}: {key} is not a rectangular array ({error})") from error
    if array.dtype.kind not in "iu":
        raise DatasetError(
            f"{path}: {key} must hold integers, got {array.dtype} values; {spec.how_to_get}"
        )
    return array


def load_cifar_batch(path: Path, spec: DatasetSpec) -> Split:
    if not path.is_file():
        raise DatasetError(f"{spec.name}: {path} does not exist; {spec.how_to_get}")
    try:
        batch = _CifarUnpickler(io.BytesIO(path.read_bytes()), encoding="bytes").load()
        raw_data, raw_labels = batch[b"data"], batch[b"labels"]
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as error:
        raise DatasetError(
            f"{path}: not a CIFAR-10 python batch ({error}); {spec.how_to_get}"
        ) from error
    data = _cifar_array(raw_data, "data", path, spec)
    labels = _cifar_array(raw_labels, "labels", path, spec)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.ndim != 1:
        raise DatasetError(
            f"{path}: expected (N, 3072) data and N labels, got data {data.shape} and labels "
            f"{labels.shape}"
        )
    if len(labels) != len(data):
        raise DatasetError(f"{path}: {len(labels)} labels for {len(data)} images")
    if data.size and (data.min() < 0 or data.max() > 255):
        raise DatasetError(
            f"{path}: pixel values must be 0 to 255, found {data.min()} to {data.max()}"
        )
    bad = np.flatnonzero((labels < 0) | (labels >= len(spec.labels)))
    if len(bad):
        raise DatasetError(
            f"{path}: label {labels[bad[0]]} of image {bad[0]} is out of range: "
            f"{spec.name} has labels 0 to {len(spec.labels) - 1}"
        )
    images = data.astype(np.uint8).reshape(-1, 3, 32, 32)
    return Split(torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64)))


def load_dataset(
    dataset: str | DatasetSpec, data_dir: str | Path | None = None
) -> tuple[Split, Split]:
    """(train, test) for a dataset, read from ``data_dir`` or the dataset's default directory."""
    spec = dataset if isinstance(dataset, DatasetSpec) else get_dataset_spec(dataset)
    directory = Path(data_dir or spec.default_dir)
    if spec.name == FOLDER:
        return load_folder(directory, spec)
    if not directory.is_dir():
        raise DatasetError(f"{spec.name}: directory {directory} does not exist; {spec.how_to_get}")
    if spec.name == "cifar10":
        parts = [load_cifar_batch(directory / f"data_batch_{i}", spec) for i in range(1, 6)]
        train = Split(torch.cat([p.images for p in parts]), torch.cat([p.labels for p in parts]))
        return train, load_cifar_batch(directory / "test_batch", spec)
    return load_idx_split(directory, "train", spec), load_idx_split(directory, "t10k", spec)


def load_test_split(spec: DatasetSpec, data_dir: str | Path | None = None) -> Split:
    """The test split alone (a folder dataset then decodes only its test images)."""
    if spec.name == FOLDER:
        return load_folder(Path(data_dir or spec.default_dir), spec, splits=("test",))[1]
    return load_dataset(spec, data_dir)[1]


def train_validation_split(
    train: Split, validation_size: int | float, seed: int
) -> tuple[Split, Split]:
    """A seeded random split; ``validation_size`` is a count, or a fraction when below 1."""
    if isinstance(validation_size, float) and 0 < validation_size < 1:
        validation_size = max(1, round(validation_size * len(train)))
    if not 0 < validation_size < len(train):
        raise ValueError(f"validation_size must be in (0, {len(train)}), got {validation_size}")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    return train.subset(order[validation_size:]), train.subset(order[:validation_size])


def normalize(images: torch.Tensor, spec: DatasetSpec) -> torch.Tensor:
    """uint8 (N, C, H, W) -> float32, scaled to [0, 1] then standardised per channel."""
    mean = torch.tensor(spec.mean).view(1, -1, 1, 1)
    std = torch.tensor(spec.std).view(1, -1, 1, 1)
    return (images.float() / 255.0 - mean) / std
