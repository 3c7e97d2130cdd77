"""Preprocessing: formats, modes, orientation, fit-pad geometry, polarity and normalisation."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from service.contract.model_repository import ModelMetadata
from service.contract.preprocessing import Preprocessor, should_invert
from service.errors import InvalidInput, UnsupportedMediaType
from tests.model_metadata import classifier_metadata
from tests.support import encode

MEAN, STD = 0.286, 0.353


def metadata(
    channels: int = 1, height: int = 28, width: int = 28, polarity: str = "light-on-dark"
) -> ModelMetadata:
    return classifier_metadata(
        name="m",
        channels=channels,
        height=height,
        width=width,
        patch=4,
        mean=[MEAN] * channels,
        std=[STD] * channels,
        resize="fit-pad",
        pad_value=0,
        polarity=polarity,
    )


def pixels_of(tensor: np.ndarray) -> np.ndarray:
    """Undo the normalisation: back to 0-255 model pixels."""
    return (tensor * STD + MEAN) * 255.0


@pytest.fixture
def gray() -> Preprocessor:
    return Preprocessor(metadata(), max_pixels=1_000_000)


def test_model_sized_image_is_only_normalised(gray):
    image = np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8)
    image[:2], image[-2:], image[:, :2], image[:, -2:] = 0, 0, 0, 0  # dark border: no inversion
    prepared = gray.from_bytes(encode(image), "f")
    expected = ((image.astype(np.float32) / 255 - MEAN) / STD)[None]
    assert prepared.tensor.dtype == np.float32 and prepared.tensor.shape == (1, 28, 28)
    np.testing.assert_allclose(prepared.tensor, expected, rtol=1e-6, atol=1e-6)
    assert not prepared.inverted


def test_fit_pad_keeps_aspect_ratio_and_centres(gray):
    wide = np.zeros((20, 40), dtype=np.uint8)  # h=20, w=40 -> 14 x 28, centred with 7 rows above
    wide[:, :] = 200
    prepared = gray.from_pixels(wide.tolist(), "f", invert="never")
    model = pixels_of(prepared.tensor[0])
    np.testing.assert_allclose(model[7:21], 200, atol=1e-3)
    np.testing.assert_allclose(model[:7], 0, atol=1e-3)
    np.testing.assert_allclose(model[21:], 0, atol=1e-3)
    tall = gray.from_pixels(np.full((56, 14), 90).tolist(), "f", invert="never")
    model = pixels_of(tall.tensor[0])  # 56 x 14 -> 28 x 7, columns 10..16
    np.testing.assert_allclose(model[:, 10:17], 90, atol=1e-3)
    np.testing.assert_allclose(model[:, :10], 0, atol=1e-3)
    np.testing.assert_allclose(model[:, 17:], 0, atol=1e-3)
    small = gray.from_pixels(np.full((7, 7), 255).tolist(), "f", invert="never")
    np.testing.assert_allclose(pixels_of(small.tensor[0]), 255, atol=1e-3)  # upscaled to fill


def test_polarity_auto_always_never(gray):
    photo = np.full((28, 28), 250, dtype=np.uint8)
    photo[8:20, 8:20] = 10  # dark object on a light background
    auto = gray.from_pixels(photo.tolist(), "f")
    assert auto.inverted
    np.testing.assert_allclose(pixels_of(auto.tensor[0]), 255.0 - photo, atol=1e-3)
    assert auto.display[14, 14, 0] == 10  # the display keeps the photo's own polarity
    assert not gray.from_pixels(photo.tolist(), "f", invert="never").inverted
    assert gray.from_pixels((255 - photo).tolist(), "f", invert="always").inverted
    assert not gray.from_pixels((255 - photo).tolist(), "f").inverted
    assert not should_invert(photo[..., None].astype(np.float32), "natural", "auto")
    assert should_invert((255 - photo)[..., None].astype(np.float32), "dark-on-light", "auto")


def test_padding_of_an_inverted_photo_is_the_training_background(gray):
    photo = np.full((28, 56), 255, dtype=np.uint8)  # white, wide: padded above and below
    photo[10:18, 20:36] = 0
    prepared = gray.from_bytes(encode(photo), "f")
    model = pixels_of(prepared.tensor[0])
    assert prepared.inverted
    np.testing.assert_allclose(model[:7], 0, atol=1e-3)  # pad_value 0 after polarity
    assert prepared.display[0, 0, 0] == 255  # and white in the photo's own polarity


def test_modes_and_formats(gray):
    rgb = np.zeros((28, 28, 3), dtype=np.uint8)
    rgb[..., 0] = 255  # pure red: luma 0.299 * 255
    red = pixels_of(gray.from_bytes(encode(rgb), "f", "never").tensor[0])
    np.testing.assert_allclose(red, 0.299 * 255, atol=0.6)
    rgba = np.zeros((28, 28, 4), dtype=np.uint8)  # fully transparent: white after compositing
    composited = gray.from_bytes(encode(rgba), "f", "never")
    np.testing.assert_allclose(pixels_of(composited.tensor[0]), 255, atol=1e-3)
    wide = (np.arange(28 * 28).reshape(28, 28) * 80).astype(np.uint16)  # 16-bit grayscale PNG
    sixteen = pixels_of(gray.from_bytes(encode(wide), "f", "never").tensor[0])
    np.testing.assert_allclose(sixteen, wide / 257.0, atol=1e-2)
    palette = Image.fromarray(np.full((28, 28), 77, np.uint8)).convert("P")
    buffer = io.BytesIO()
    palette.save(buffer, "GIF")
    np.testing.assert_allclose(
        pixels_of(gray.from_bytes(buffer.getvalue(), "f", "never").tensor), 77, atol=1e-3
    )
    cmyk = Image.new("CMYK", (28, 28), (0, 0, 0, 0))  # no ink: white
    buffer = io.BytesIO()
    cmyk.save(buffer, "JPEG", quality=95)
    np.testing.assert_allclose(
        pixels_of(gray.from_bytes(buffer.getvalue(), "f", "never").tensor), 255, atol=2
    )
    bilevel = Image.new("1", (28, 28), 1)
    buffer = io.BytesIO()
    bilevel.save(buffer, "BMP")
    np.testing.assert_allclose(
        pixels_of(gray.from_bytes(buffer.getvalue(), "f", "never").tensor), 255, atol=1e-3
    )


def test_exif_orientation_is_applied(gray):
    image = np.zeros((10, 28), dtype=np.uint8)  # landscape on disk
    image[:, :14] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display: portrait, 28 x 10
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, "JPEG", quality=100, exif=exif)
    prepared = gray.from_bytes(buffer.getvalue(), "f", "never")
    model = pixels_of(prepared.tensor[0])
    assert model[:, :9].max() < 5 and model[:, 19:].max() < 5  # padded left and right: upright
    assert model[:12, 9:19].mean() > 200  # the white half is on top after rotation


def test_rgb_model_gets_three_channels():
    rgb_model = Preprocessor(metadata(channels=3, height=32, width=32, polarity="natural"), 10**6)
    gray_image = np.full((32, 32), 100, dtype=np.uint8)
    prepared = rgb_model.from_bytes(encode(gray_image), "f")
    assert prepared.tensor.shape == (3, 32, 32)
    np.testing.assert_allclose(pixels_of(prepared.tensor), 100, atol=1e-3)
    assert not prepared.inverted


def test_rejections_name_the_field(gray):
    with pytest.raises(UnsupportedMediaType, match=r"photo: TIFF"):
        gray.from_bytes(b"MM\x00*" + b"\x00" * 10, "photo")
    with pytest.raises(InvalidInput, match=r"photo: not a recognisable image"):
        gray.from_bytes(b"\x00\x01\x02", "photo")
    small = Preprocessor(metadata(), max_pixels=100)
    with pytest.raises(
        InvalidInput, match=r"photo: .*max_pixels_per_image=100 \(11x10 = 110 pixels\)"
    ):
        small.from_bytes(encode(np.zeros((10, 11), np.uint8)), "photo")
    with pytest.raises(
        InvalidInput, match=r"photo: values must be numbers from 0 to 255; found nan at \[0, 1\]"
    ):
        gray.from_pixels([[0, float("nan")]], "photo")
    channels_first = np.zeros((3, 2, 2))
    channels_first[2, 0, 1] = 300  # reported as [channel, row, column]
    with pytest.raises(InvalidInput, match=r"found 300.0 at \[2, 0, 1\]"):
        gray.from_pixels(channels_first.tolist(), "photo")
