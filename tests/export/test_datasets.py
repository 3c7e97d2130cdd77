"""Dataset files (IDX, CIFAR-10 batches), augmentation and the validation split."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from export.augment import Augmentation, augmentation_for
from export.data import (
    DatasetError,
    Split,
    get_dataset_spec,
    load_cifar_batch,
    load_dataset,
    parse_idx,
    train_validation_split,
)
from export.folder import folder_spec


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist_dir(directory: Path, train: int = 6, test: int = 4, gz: bool = True) -> Path:
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", train), ("t10k", test)):
        for kind, array in (
            ("images-idx3-ubyte", rng.integers(0, 256, (count, 28, 28))),
            ("labels-idx1-ubyte", np.arange(count) % 10),
        ):
            data = idx_bytes(np.asarray(array))
            if gz:
                (directory / f"{prefix}-{kind}.gz").write_bytes(gzip.compress(data))
            else:
                (directory / f"{prefix}-{kind}").write_bytes(data)
    return directory


# -- IDX -----------------------------------------------------------------------------------------
def test_parse_idx_reads_shape_and_values():
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    parsed = parse_idx(idx_bytes(array), "x")
    assert parsed.shape == (2, 3, 4) and parsed.dtype == np.uint8
    np.testing.assert_array_equal(parsed, array)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01\x02\x08\x01" + struct.pack(">I", 1) + b"\x00", "bad magic number"),
        (b"PK\x03\x04garbage", "bad magic number"),
        (b"\x00\x00", "bad magic number"),
        (
            b"\x00\x00\x0d\x01" + struct.pack(">I", 1) + b"\x00\x00\x00\x00",
            "0x0d is not unsigned byte",
        ),
        (b"\x00\x00\x08\x03" + struct.pack(">I", 2), "truncated IDX header"),
        (
            idx_bytes(np.zeros((2, 3), np.uint8))[:-1],
            r"promises 6 bytes of data for shape \(2, 3\), file holds 5",
        ),
        (idx_bytes(np.zeros((2, 3), np.uint8)) + b"\x00", "file holds 7"),
    ],
)
def test_parse_idx_refuses_malformed_bytes_naming_the_source(data, message):
    with pytest.raises(DatasetError, match=message) as error:
        parse_idx(data, "/data/some-file-idx3-ubyte")
    assert str(error.value).startswith("/data/some-file-idx3-ubyte: ")


@pytest.mark.parametrize("gz", [True, False])
def test_load_dataset_from_idx_files(tmp_path, gz):
    train, test = load_dataset("mnist", write_mnist_dir(tmp_path / "mnist", gz=gz))
    assert train.images.shape == (6, 1, 28, 28) and test.images.shape == (4, 1, 28, 28)
    assert train.images.dtype == torch.uint8 and train.labels.dtype == torch.int64
    assert train.labels.tolist() == [0, 1, 2, 3, 4, 5]


def test_malformed_file_in_a_directory_is_named(tmp_path):
    directory = write_mnist_dir(tmp_path / "mnist")
    (directory / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"\x07\x07\x08\x03"))
    with pytest.raises(DatasetError, match=rf"{directory}/t10k-images-idx3-ubyte: not an IDX file"):
        load_dataset("mnist", directory)


def test_broken_gzip_is_named(tmp_path):
    directory = write_mnist_dir(tmp_path / "mnist")
    (directory / "train-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b\x08garbage")
    with pytest.raises(DatasetError, match=rf"{directory}/train-labels-idx1-ubyte.gz: cannot read"):
        load_dataset("mnist", directory)


def test_label_count_must_match_image_count(tmp_path):
    directory = write_mnist_dir(tmp_path / "mnist")
    (directory / "train-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(idx_bytes(np.zeros(5, np.uint8)))
    )
    with pytest.raises(DatasetError, match=r"train-labels-idx1-ubyte: \(5,\) labels for 6 images"):
        load_dataset("mnist", directory)


def test_missing_directory_says_how_to_get_the_data(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetError) as error:
        load_dataset("fashion-mnist", missing)
    message = str(error.value)
    assert str(missing) in message
    assert "apt-get install dataset-fashion-mnist" in message and "--data-dir" in message


def test_missing_file_says_how_to_get_the_data(tmp_path):
    directory = write_mnist_dir(tmp_path / "mnist")
    (directory / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(
        DatasetError, match=rf"{directory}/t10k-labels-idx1-ubyte.gz nor .* --data-dir"
    ):
        load_dataset("mnist", directory)


def test_fashion_mnist_defaults_to_the_debian_package_directory():
    assert get_dataset_spec("fashion-mnist").default_dir == "/usr/share/datasets/fashion-mnist"
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'"):
        get_dataset_spec("imagenet")


# -- CIFAR-10 ------------------------------------------------------------------------------------
def cifar_batch(count: int, offset: int) -> dict:
    data = np.zeros((count, 3072), dtype=np.uint8)
    data[:, :1024] = 10 + offset  # red plane
    data[:, 1024:2048] = 20 + offset  # green plane
    data[:, 2048:] = 30 + offset  # blue plane
    data[:, 2048 + 5 * 32 + 7] = 255  # blue, row 5, column 7
    return {
        b"batch_label": f"batch {offset}".encode(),
        b"labels": [(offset + i) % 10 for i in range(count)],
        b"data": data,
        b"filenames": [f"image_{offset}_{i}.png".encode() for i in range(count)],
    }


def write_cifar_dir(directory: Path, count: int = 3) -> Path:
    directory.mkdir(parents=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for offset, name in enumerate(names):
        # Protocol 4: numpy arrays pickle through _reconstruct, like the published batches.
        (directory / name).write_bytes(pickle.dumps(cifar_batch(count, offset), protocol=4))
    return directory


def test_cifar10_batches_load_channel_planes_in_order(tmp_path):
    train, test = load_dataset("cifar10", write_cifar_dir(tmp_path / "cifar-10-batches-py"))
    assert train.images.shape == (15, 3, 32, 32) and test.images.shape == (3, 3, 32, 32)
    assert train.images.dtype == torch.uint8
    assert train.labels.tolist() == [0, 1, 2, 1, 2, 3, 2, 3, 4, 3, 4, 5, 4, 5, 6]
    first = train.images[0]
    assert first[0, 0, 0] == 10 and first[1, 0, 0] == 20 and first[2, 0, 0] == 30
    assert first[2, 5, 7] == 255 and first[2, 7, 5] == 30
    assert test.images[0, 0, 0, 0] == 15  # test_batch is the sixth file written


def test_cifar10_refuses_a_pickle_that_would_run_code(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": Exploit(), b"labels": [0]}))
    with pytest.raises(
        DatasetError, match=rf"{path}: not a CIFAR-10 python batch .*refusing to load"
    ):
        load_cifar_batch(path, get_dataset_spec("cifar10"))
    assert not marker.exists()


def test_cifar10_refuses_a_batch_of_the_wrong_shape(tmp_path):
    path = tmp_path / "test_batch"
    path.write_bytes(
        pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, protocol=4)
    )
    with pytest.raises(DatasetError, match=r"expected \(N, 3072\) data"):
        load_cifar_batch(path, get_dataset_spec("cifar10"))


def write_batch(path: Path, data, labels) -> Path:
    path.write_bytes(pickle.dumps({b"data": data, b"labels": labels}, protocol=4))
    return path


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        ([0, 10], "label 10 of image 1 is out of range: cifar10 has labels 0 to 9"),
        ([-1, 0], "label -1 of image 0 is out of range"),
        ([0, 2**70], "labels must hold integers, got object values"),
        ([0, 1.5], "labels must hold integers, got float64 values"),
        ([0], r"1 labels for 2 images"),
        (
            [[0, 1]],
            r"expected \(N, 3072\) data and N labels, got data \(2, 3072\) and labels \(1, 2\)",
        ),
    ],
)
def test_cifar10_refuses_bad_labels(tmp_path, labels, message):
    path = write_batch(tmp_path / "data_batch_1", np.zeros((2, 3072), np.uint8), labels)
    with pytest.raises(DatasetError, match=rf"{path}: {message}"):
        load_cifar_batch(path, get_dataset_spec("cifar10"))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([[300] * 3072], "pixel values must be 0 to 255, found 300 to 300"),
        (np.full((1, 3072), -5, np.int64), "pixel values must be 0 to 255, found -5 to -5"),
        ([[2**80] * 3072], "data must hold integers, got object values"),
        ([[0] * 3072, [0] * 10], "data is not a rectangular array"),
        (np.zeros((1, 3072), np.float32), "data must hold integers, got float32 values"),
        (b"raw bytes", "data must hold integers"),
    ],
)
def test_cifar10_refuses_malformed_data_without_an_overflow_error(tmp_path, data, message):
    path = write_batch(tmp_path / "data_batch_1", data, [0])
    with pytest.raises(DatasetError, match=rf"{path}: {message}"):
        load_cifar_batch(path, get_dataset_spec("cifar10"))


# -- augmentation --------------------------------------------------------------------------------
def batch_of_images(n: int = 16, channels: int = 1, size: int = 28) -> torch.Tensor:
    return torch.randn(n, channels, size, size, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("channels", [1, 3])
def test_augmentation_keeps_shape_and_dtype_and_is_deterministic_per_seed(channels):
    images = batch_of_images(channels=channels)
    augment = Augmentation()
    first = augment(images, torch.Generator().manual_seed(7))
    again = augment(images, torch.Generator().manual_seed(7))
    other = augment(images, torch.Generator().manual_seed(8))
    assert first.shape == images.shape and first.dtype == images.dtype
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert not torch.equal(first, images)


def test_augmentation_shift_is_a_crop_of_the_zero_padded_image():
    images = batch_of_images()
    shifted = Augmentation(max_shift=2, horizontal_flip=False, erasing_probability=0.0)(
        images, torch.Generator().manual_seed(0)
    )
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    offsets = set()
    for i in range(len(images)):
        matches = [
            (dy, dx)
            for dy in range(5)
            for dx in range(5)
            if torch.equal(shifted[i], padded[i, :, dy : dy + 28, dx : dx + 28])
        ]
        assert matches, f"image {i} is not a shifted crop"
        offsets.add(matches[0])
    assert len(offsets) > 1


def test_augmentation_flip_and_erasing():
    images = batch_of_images(n=64)
    flipped = Augmentation(max_shift=0, horizontal_flip=True, erasing_probability=0.0)(
        images, torch.Generator().manual_seed(0)
    )
    is_flipped = [torch.equal(f, i.flip(-1)) for f, i in zip(flipped, images, strict=True)]
    is_same = [torch.equal(f, i) for f, i in zip(flipped, images, strict=True)]
    assert all(a or b for a, b in zip(is_flipped, is_same, strict=True))
    assert 10 < sum(is_flipped) < 54

    erased = Augmentation(max_shift=0, horizontal_flip=False, erasing_probability=1.0)(
        images, torch.Generator().manual_seed(0)
    )
    changed = erased != images
    assert (erased[changed] == 0).all()
    fraction = changed.float().mean(dim=(1, 2, 3))
    assert (fraction > 0).all() and (fraction <= 0.25).all()


def test_no_augmentation_is_the_identity():
    images = batch_of_images()
    none = Augmentation(max_shift=0, horizontal_flip=False, erasing_probability=0.0)
    assert torch.equal(none(images, torch.Generator().manual_seed(0)), images)


def test_augmentation_fits_each_dataset():
    assert augmentation_for(get_dataset_spec("fashion-mnist")).horizontal_flip
    assert not augmentation_for(get_dataset_spec("mnist")).horizontal_flip  # a mirrored 2 is no 2
    assert augmentation_for(get_dataset_spec("cifar10")).max_shift == 4
    # A run's flags override the recipe, each on its own.
    mnist = augmentation_for(get_dataset_spec("mnist"), hflip=True, erase=False)
    assert mnist.horizontal_flip and mnist.erasing_probability == 0


def test_a_folder_gets_scale_changes_and_translations_only_unless_asked():
    spec = folder_spec("d", ("a", "b"), 3, 64, 64, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.5))
    augment = augmentation_for(spec, hflip=False, erase=False)
    assert (augment.horizontal_flip, augment.erasing_probability) == (False, 0.0)
    assert augment.max_scale > 0 and augment.max_shift == 6
    asked = augmentation_for(spec, hflip=True, erase=True)
    assert asked.horizontal_flip and asked.erasing_probability > 0


def test_zooming_out_and_shifting_pad_with_the_services_black():
    """The border a zoom or a shift opens is the normalised black the service pads with, not the
    mean: the model never sees a grey frame at training that it would not see when served."""
    black = (-2.0, -1.6, -0.6)
    images = torch.zeros(64, 3, 32, 32)  # the mean everywhere
    augment = Augmentation(
        max_shift=3, horizontal_flip=False, erasing_probability=0.0, max_scale=0.2, fill=black
    )
    out = augment(images, torch.Generator().manual_seed(0))
    corner, black = out[:, :, 0, 0], torch.tensor(black)
    assert torch.isclose(corner, black).all(dim=1).sum() > 16  # shifted or zoomed out
    # Elsewhere the mean, or a blend of the two at the edge of a zoomed-out image: never grey.
    assert ((corner >= black - 1e-5) & (corner <= 1e-5)).all()
    # A zoom alone keeps the image's centre where it was.
    zoom = Augmentation(max_shift=0, horizontal_flip=False, erasing_probability=0.0, max_scale=0.2)
    dot = torch.zeros(8, 1, 33, 33)
    dot[:, :, 16, 16] = 1.0
    assert (
        zoom(dot, torch.Generator().manual_seed(1))[:, 0].flatten(1).argmax(1) == 16 * 33 + 16
    ).all()


# -- validation split ----------------------------------------------------------------------------
def numbered_split(n: int = 100) -> Split:
    return Split(torch.zeros(n, 1, 2, 2, dtype=torch.uint8), torch.arange(n))


def test_validation_split_is_deterministic_and_disjoint():
    full = numbered_split()
    train, validation = train_validation_split(full, 20, seed=3)
    train2, validation2 = train_validation_split(full, 20, seed=3)
    assert len(train) == 80 and len(validation) == 20
    assert torch.equal(validation.labels, validation2.labels) and torch.equal(
        train.labels, train2.labels
    )
    assert not set(train.labels.tolist()) & set(validation.labels.tolist())
    assert sorted(train.labels.tolist() + validation.labels.tolist()) == list(range(100))
    _, other = train_validation_split(full, 20, seed=4)
    assert set(other.labels.tolist()) != set(validation.labels.tolist())


@pytest.mark.parametrize("size", [0, 100, -1])
def test_validation_split_size_must_leave_both_sides(size):
    with pytest.raises(ValueError, match=r"validation_size must be in \(0, 100\)"):
        train_validation_split(numbered_split(), size, seed=0)
