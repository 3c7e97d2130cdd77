"""Folder datasets: layouts, clear errors, every image mode, and the service's pixels."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from export.config import ViTConfig
from export.data import DatasetError, normalize, spec_from_json, spec_to_json
from export.folder import (
    TEST_FRACTION,
    folder_spec,
    load_folder,
    measure_mean_std,
    read_split,
    scan_folder,
)
from export.model import VisionTransformer
from export.onnx import describe
from service.contract.model_repository import ModelMetadata
from service.contract.preprocessing import Preprocessor


def save(path: Path, image: Image.Image, image_format: str = "PNG", **options) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, image_format, **options)
    return path


def solid(width: int, height: int, colour=(200, 30, 60)) -> Image.Image:
    return Image.new("RGB", (width, height), colour)


def class_folders(root: Path, counts: dict[str, int]) -> Path:
    for name, count in counts.items():
        for number in range(count):
            save(root / name / f"{number}.png", solid(10 + number, 12, (number * 9 % 256, 0, 0)))
    return root


def spec_for(root: Path, classes, channels: int = 3, size: int = 32):
    return folder_spec(root, tuple(classes), channels, size, size)


# -- layouts -------------------------------------------------------------------------------------
def test_train_and_test_folders_give_sorted_classes_and_both_splits(tmp_path):
    class_folders(tmp_path / "train", {"dog": 3, "cat": 2})
    class_folders(tmp_path / "test", {"cat": 1, "dog": 2})
    layout = scan_folder(tmp_path)
    assert layout.classes == ("cat", "dog") and not layout.held_out
    assert [(p.relative_to(tmp_path).as_posix(), label) for p, label in layout.train] == [
        ("train/cat/0.png", 0),
        ("train/cat/1.png", 0),
        ("train/dog/0.png", 1),
        ("train/dog/1.png", 1),
        ("train/dog/2.png", 1),
    ]
    assert [(p.relative_to(tmp_path).as_posix(), label) for p, label in layout.test] == [
        ("test/cat/0.png", 0),
        ("test/dog/0.png", 1),
        ("test/dog/1.png", 1),
    ]


def test_class_folders_alone_are_split_the_same_way_every_time(tmp_path):
    class_folders(tmp_path, {"a": 10, "b": 15, "c": 3})
    first, second = scan_folder(tmp_path), scan_folder(tmp_path)
    assert first == second and first.held_out
    for label, count in enumerate((10, 15, 3)):
        test = {p for p, lab in first.test if lab == label}
        train = {p for p, lab in first.train if lab == label}
        assert not test & train and len(test | train) == count
        assert len(test) == round(TEST_FRACTION * count)
    # Held out by a hash of the name, not by the name's order: not simply the first or last files.
    held = sorted(p for p, lab in first.test if lab == 1)
    by_name = sorted((tmp_path / "b").iterdir())
    assert held not in (by_name[:3], by_name[-3:]), held


def test_hidden_files_and_folders_are_skipped(tmp_path):
    class_folders(tmp_path, {"a": 5, "b": 5})
    (tmp_path / "a" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    save(tmp_path / ".thumbnails" / "x.png", solid(4, 4))
    save(tmp_path / "b" / ".cache" / "y.png", solid(4, 4))
    layout = scan_folder(tmp_path)
    assert layout.classes == ("a", "b")
    assert len(layout.train) + len(layout.test) == 10


# -- clear errors --------------------------------------------------------------------------------
def test_a_folder_without_class_folders_is_refused(tmp_path):
    save(tmp_path / "loose.png", solid(5, 5))
    with pytest.raises(DatasetError, match=rf"{tmp_path}: no class folders found; give --data-dir"):
        scan_folder(tmp_path)
    with pytest.raises(DatasetError, match="no such directory"):
        scan_folder(tmp_path / "missing")


def test_one_class_is_refused(tmp_path):
    class_folders(tmp_path, {"only": 4})
    with pytest.raises(DatasetError, match=r"only one class folder \(only\)"):
        scan_folder(tmp_path)


def test_an_empty_class_is_named(tmp_path):
    class_folders(tmp_path / "train", {"a": 3, "b": 3})
    (tmp_path / "train" / "empty").mkdir()
    class_folders(tmp_path / "test", {"a": 1})
    (tmp_path / "test" / "b").mkdir()
    with pytest.raises(DatasetError, match="empty class folder") as error:
        scan_folder(tmp_path)
    assert str(tmp_path / "train" / "empty") in str(error.value)
    assert str(tmp_path / "test" / "b") in str(error.value)


def test_a_test_class_the_training_set_lacks_is_refused(tmp_path):
    class_folders(tmp_path / "train", {"a": 3, "b": 3})
    class_folders(tmp_path / "test", {"a": 1, "zebra": 1})
    with pytest.raises(DatasetError, match="class folders zebra are not in"):
        scan_folder(tmp_path)


def test_classes_too_small_to_hold_images_out_are_refused(tmp_path):
    class_folders(tmp_path, {"a": 2, "b": 2})
    with pytest.raises(DatasetError, match="no test images; give a test/ folder"):
        scan_folder(tmp_path)


def test_files_that_are_not_images_are_skipped_with_one_warning_naming_them(tmp_path, capsys):
    class_folders(tmp_path, {"a": 5, "b": 5})
    notes = tmp_path / "a" / "notes.txt"
    notes.write_text("not an image")
    truncated = tmp_path / "b" / "broken.png"
    buffer = io.BytesIO()
    solid(30, 30).save(buffer, "PNG")
    truncated.write_bytes(buffer.getvalue()[:60])
    layout = scan_folder(tmp_path)
    files = layout.train + layout.test
    split = read_split(files, spec_for(tmp_path, layout.classes))
    assert sorted(split.labels.tolist()) == [0] * 5 + [1] * 5
    warning = capsys.readouterr().err.strip()
    assert warning.count("\n") == 0 and warning.startswith("warning: skipped 2 of 12 file(s)")
    assert f"{notes} (" in warning and f"{truncated} (" in warning
    assert "BytesIO" not in warning and " at 0x" not in warning
    # A class left with no image cannot train.
    for path in (tmp_path / "b").glob("*.png"):
        if path != truncated:
            path.unlink()
    layout = scan_folder(tmp_path)
    with pytest.raises(DatasetError, match="no readable image in the class folder"):
        read_split(layout.train + layout.test, spec_for(tmp_path, layout.classes))


# -- pixels --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("width", "height"), [(40, 20), (20, 40)])
def test_fit_and_pad_keeps_the_aspect_ratio_and_centres_on_black(tmp_path, width, height):
    """Independent reference: a 2:1 red block fills 32 x 16 of a 32 x 32 canvas, rows (or
    columns) 8 to 23, and the rest is the pad value 0."""
    path = save(tmp_path / "x" / "wide.png", solid(width, height, (255, 0, 0)))
    split = read_split(((path, 0),), spec_for(tmp_path, ("x", "y")))
    image = split.images[0]
    expected = torch.zeros(3, 32, 32, dtype=torch.uint8)
    if width > height:
        expected[0, 8:24, :] = 255
    else:
        expected[0, :, 8:24] = 255
    assert torch.equal(image, expected)


def test_any_mode_and_format_becomes_the_models_channels(tmp_path):
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (23, 37, 3), dtype=np.uint8))
    files = [
        save(tmp_path / "rgba.png", Image.new("RGBA", (30, 50), (0, 255, 0, 128))),
        save(tmp_path / "palette.gif", rgb.convert("P"), "GIF"),
        save(tmp_path / "gray.jpg", rgb.convert("L"), "JPEG"),
        save(tmp_path / "deep.png", Image.fromarray(np.full((9, 13), 40000, np.uint16))),
        save(tmp_path / "cmyk.jpg", rgb.convert("CMYK"), "JPEG"),
        # TIFF: refused by the service's upload check, so Pillow reads it, then the same steps.
        save(tmp_path / "scan.tiff", rgb, "TIFF"),
        save(tmp_path / "same.png", rgb),
        save(tmp_path / "big.webp", rgb.resize((900, 500)), "WEBP"),
    ]
    split = read_split(tuple((path, 0) for path in files), spec_for(tmp_path, ("a", "b")))
    assert split.images.shape == (len(files), 3, 32, 32) and split.images.dtype == torch.uint8
    # Half-transparent green is composited on white, as the service does.
    assert split.images[0, :, 16, 16].tolist() == [127, 255, 127]
    gray = split.images[2]
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])
    assert split.images[3, 0, 16, 16] == round(40000 / 257)  # 16-bit scaled to 8
    # The same pixels as TIFF (Pillow's path) and PNG (the service's path) give the same view.
    assert torch.equal(split.images[5], split.images[6])
    one_channel = read_split(((files[0], 0),), spec_for(tmp_path, ("a", "b"), channels=1))
    assert one_channel.images.shape == (1, 1, 32, 32)
    luma = 0.299 * 127.5 + 0.587 * 255 + 0.114 * 127.5
    assert abs(int(one_channel.images[0, 0, 16, 16]) - luma) <= 1


def test_exif_orientation_is_applied(tmp_path):
    image = Image.new("RGB", (40, 20), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 20, 20))  # left half red
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view upright
    path = save(tmp_path / "a" / "photo.jpg", image, "JPEG", exif=exif, quality=95)
    view = read_split(((path, 0),), spec_for(tmp_path, ("a", "b"))).images[0]
    # Upright it is 20 wide, 40 tall, red on top: columns 8-23 hold it, the top half red.
    assert view[0, 4, 16] > 200 and view[2, 4, 16] < 60
    assert view[2, 28, 16] > 200 and view[0, 28, 16] < 60
    assert view[:, :, :6].max() == 0  # padded left and right


def test_the_training_tensor_is_what_the_service_makes_of_the_same_file(tmp_path):
    """The exported metadata's Preprocessor, as the service builds it, on the file's bytes."""
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (45, 71, 3), dtype=np.uint8)
    files = [
        save(tmp_path / "a" / "noise.jpg", Image.fromarray(pixels), "JPEG", quality=90),
        save(tmp_path / "a" / "wide.png", Image.fromarray(pixels).resize((301, 97))),
        save(tmp_path / "b" / "alpha.png", Image.fromarray(pixels).convert("RGBA").rotate(30)),
    ]
    files += [save(tmp_path / "b" / f"{n}.png", solid(9 + n, 30)) for n in range(4)]
    spec = spec_for(tmp_path, ("a", "b"))
    images = read_split(tuple((p, 0) for p in files), spec).images
    mean, std = measure_mean_std(images)
    spec = folder_spec(tmp_path, ("a", "b"), 3, 32, 32, mean, std)
    config = ViTConfig(image_height=32, image_width=32, in_channels=3, patch_size=8, num_classes=2)
    document = describe(
        VisionTransformer(config), spec, ["a", "b"], "m", 1, "classifier", None, None, ""
    )
    service = Preprocessor(ModelMetadata.model_validate(document), max_pixels=10_000_000)
    training = normalize(images, spec)
    for index, path in enumerate(files):
        prepared = service.from_bytes(path.read_bytes(), "file")
        # The same pixels: the training image is the service's model view, stored as uint8.
        assert np.array_equal(prepared.display.transpose(2, 0, 1), images[index].numpy())
        # The float tensor differs only by that rounding: at most half a level, over std.
        bound = 0.5 / 255 / min(std) + 1e-6
        difference = np.abs(prepared.tensor - training[index].numpy()).max()
        assert difference <= bound, (path.name, difference, bound)


def test_mean_and_std_match_numpy_in_float64():
    rng = np.random.default_rng(2)
    images = torch.from_numpy(rng.integers(0, 256, (7, 3, 11, 13), dtype=np.uint8))
    mean, std = measure_mean_std(images)
    scaled = images.numpy().astype(np.float64) / 255.0
    np.testing.assert_allclose(mean, scaled.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(std, scaled.std(axis=(0, 2, 3)), rtol=1e-9)
    flat = torch.full((2, 1, 4, 4), 9, dtype=torch.uint8)
    with pytest.raises(DatasetError, match=r"channel\(s\) \[0\] .* one flat value"):
        measure_mean_std(flat)


def test_load_folder_refuses_other_classes_than_the_models(tmp_path):
    class_folders(tmp_path, {"a": 5, "b": 5})
    with pytest.raises(DatasetError, match=re.escape("holds the classes a, b, the model was")):
        load_folder(tmp_path, spec_for(tmp_path, ("a", "c")))


def test_a_folder_spec_round_trips_through_json(tmp_path):
    spec = folder_spec(tmp_path, ("x", "y"), 3, 24, 40, (0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    assert spec_from_json(spec_to_json(spec)) == spec
    assert spec.default_dir == str(tmp_path.resolve()) and spec.polarity == "natural"
