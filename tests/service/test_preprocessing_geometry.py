"""resize-crop and resize: the served tensor against references built here from Pillow's own resize
of the 8-bit image (what Hugging Face's and timm's processors call), with the resized sizes and crop
offsets worked out by hand in each test, never through the geometry in
``service.contract.preprocessing``."""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from service.contract.model_repository import ModelMetadata
from service.contract.preprocessing import Preprocessor
from tests.model_metadata import classifier_metadata
from tests.support import encode

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
FILTERS = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}


def photo_metadata(size: int = 224, channels: int = 3, **preprocessing: object) -> ModelMetadata:
    """A 16-pixel-patch RGB (or grey) model of ``size`` x ``size`` with ImageNet's mean and std
    unless ``preprocessing`` names its own."""
    return classifier_metadata(
        name="photo",
        channels=channels,
        height=size,
        width=size,
        patch=16,
        **{
            "mean": MEAN[:channels],
            "std": STD[:channels],
            "pooling": "token",
            "class_token": True,
            "polarity": "natural",
            **preprocessing,
        },
    )


def preprocessor(**preprocessing: object) -> Preprocessor:
    return Preprocessor(photo_metadata(**preprocessing), max_pixels=50_000_000)


def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients plus noise: every shift of a crop or change of filter shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (height + width)], -1)
    return np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)


def reference(
    image: np.ndarray, resized_hw: tuple[int, int], top: int, left: int, resample: str
) -> np.ndarray:
    """Pillow's resize of the uint8 image, the crop at (top, left), x / 255, (x - mean) / std."""
    resized = Image.fromarray(image).resize((resized_hw[1], resized_hw[0]), FILTERS[resample])
    crop = np.asarray(resized, dtype=np.float64)[top : top + 224, left : left + 224]
    return ((crop / 255.0 - np.array(MEAN)) / np.array(STD)).transpose(2, 0, 1)


@pytest.mark.parametrize(
    ("shape", "resized", "offset"),
    [
        # 256 * 451 / 300 = 384.85, truncated; margins 32 and 160 split evenly
        ((300, 451), (256, 384), (16, 80)),
        ((451, 300), (384, 256), (80, 16)),
        # 256 * 640 / 427 = 383.7 -> 383; the odd margin 159 leaves its extra pixel after the crop
        ((427, 640), (256, 383), (16, 79)),
    ],
    ids=["landscape", "portrait", "odd-margin"],
)
@pytest.mark.parametrize("resample", ["bicubic", "bilinear"])
def test_resize_crop_resizes_the_shorter_side_and_crops_the_centre(
    shape, resized, offset, resample
):
    image = photo(*shape)
    served = preprocessor(resize="resize-crop", shorter_side=256, resample=resample)
    prepared = served.from_bytes(encode(image), "image")
    expected = reference(image, resized, *offset, resample)
    assert prepared.tensor.shape == (3, 224, 224) and prepared.tensor.dtype == np.float32
    np.testing.assert_allclose(prepared.tensor, expected, atol=1e-5)


@pytest.mark.parametrize("width", [636, 640])
def test_a_round_crop_offset_rounds_half_the_margin_to_even(width):
    """torchvision's CenterCrop (timm) rounds half the margin to even (Python's round). At 636
    pixels the resized width is 381, a margin of 157: 78.5 rounds to 78, where rounding half up gives
    79; at 640 it is 383, a margin of 159: 79.5 rounds to 80, where Hugging Face's floor gives 79.
    The offsets are computed here with decimal's ROUND_HALF_EVEN, not the service's rounding."""
    height, shorter_side, crop = 427, 256, 224
    resized = (shorter_side, int(shorter_side * width / height))
    margins = (resized[0] - crop, resized[1] - crop)

    def half(margin: int, rounding: str) -> int:
        return int((Decimal(margin) / 2).quantize(Decimal(1), rounding=rounding))

    top, left = (half(margin, ROUND_HALF_EVEN) for margin in margins)
    if width == 636:  # the case where half-to-even and half-up differ
        assert (margins[1], left, half(margins[1], ROUND_HALF_UP)) == (157, 78, 79)
    image = photo(height, width, seed=1)
    served = preprocessor(
        resize="resize-crop", shorter_side=shorter_side, resample="bicubic", crop_offset="round"
    )
    prepared = served.from_bytes(encode(image), "image")
    np.testing.assert_allclose(
        prepared.tensor, reference(image, resized, top, left, "bicubic"), atol=1e-5
    )


def test_resize_scales_straight_to_the_input():
    image = photo(300, 451, seed=2)
    prepared = preprocessor(resize="resize").from_bytes(encode(image), "image")
    np.testing.assert_allclose(
        prepared.tensor, reference(image, (224, 224), 0, 0, "bilinear"), atol=1e-5
    )


def test_resize_to_a_larger_square_then_crops_its_centre():
    """Hugging Face's DeiT: 256 x 256 whatever the aspect ratio, then the centre 224 x 224."""
    image = photo(300, 451, seed=3)
    served = preprocessor(resize="resize", resize_to=[256, 256], resample="bicubic")
    prepared = served.from_bytes(encode(image), "image")
    np.testing.assert_allclose(
        prepared.tensor, reference(image, (256, 256), 16, 16, "bicubic"), atol=1e-5
    )


def test_the_display_is_the_crop_the_model_saw():
    image = photo(300, 451, seed=4)
    served = preprocessor(resize="resize-crop", shorter_side=256, resample="bicubic")
    prepared = served.from_bytes(encode(image), "image")
    resized = Image.fromarray(image).resize((384, 256), Image.Resampling.BICUBIC)
    expected = np.asarray(resized)[16:240, 80:304]
    assert prepared.display.dtype == np.uint8
    np.testing.assert_array_equal(prepared.display, expected)


def test_a_pixel_list_is_rounded_to_8_bits_as_the_same_image_sent_as_a_file():
    """Values 0.4 below whole levels round up to them, then resize as the file's pixels do."""
    image = np.maximum(photo(120, 90, seed=5), 1)
    served = preprocessor(resize="resize-crop", shorter_side=224, resample="bicubic")
    from_file = served.from_bytes(encode(image), "image").tensor
    pixels = (image.astype(np.float64) - 0.4).transpose(2, 0, 1).tolist()
    np.testing.assert_array_equal(served.from_pixels(pixels, "pixels").tensor, from_file)


def test_a_grey_model_takes_the_luma_of_a_colour_photo():
    image = photo(300, 451, seed=6)
    metadata = photo_metadata(channels=1, resize="resize-crop", shorter_side=256)
    prepared = Preprocessor(metadata, 10**7).from_bytes(encode(image), "image")
    luma = np.rint(image @ np.array([0.299, 0.587, 0.114])).astype(np.uint8)
    grey = Image.fromarray(luma).resize((384, 256), Image.Resampling.BILINEAR)
    crop = np.asarray(grey, dtype=np.float64)[16:240, 80:304]
    expected = (crop / 255.0 - MEAN[0]) / STD[0]
    # ITU-R 601-2 luma, as Pillow rounds it (integer weights): at most a level from the float one
    np.testing.assert_allclose(prepared.tensor[0], expected, atol=1.01 / 255 / STD[0])


def test_transparency_is_composited_on_white_before_the_resize():
    rgba = np.zeros((240, 320, 4), np.uint8)
    rgba[..., 0], rgba[..., 3] = 255, 0  # fully transparent red
    served = preprocessor(resize="resize-crop", shorter_side=224)
    prepared = served.from_bytes(encode(rgba), "image")
    np.testing.assert_array_equal(prepared.display, np.full((224, 224, 3), 255, np.uint8))


def modes_of(rgb: Image.Image) -> dict[str, tuple[Image.Image, Image.Image]]:
    """Each mode a decoder can give, with the 8-bit RGB or grey image it stands for."""
    grey = rgb.convert("L")
    sixteen = Image.fromarray(np.asarray(grey).astype(np.uint16) * 257)  # I;16: 0-65535
    palette = rgb.quantize(64)
    opaque = rgb.copy()
    opaque.putalpha(255)
    return {
        "1": (rgb.convert("1"), rgb.convert("1").convert("L")),
        "P": (palette, palette.convert("RGB")),
        "LA": (grey.convert("LA"), grey),
        "RGBA": (opaque, rgb),
        "CMYK": (rgb.convert("CMYK"), rgb.convert("CMYK").convert("RGB")),
        "I;16": (sixteen, grey),
        "F": (grey.convert("F"), grey),
    }


@pytest.mark.parametrize("mode", ["1", "P", "LA", "RGBA", "CMYK", "I;16", "F"])
def test_every_decoded_mode_is_resized_as_the_image_it_stands_for(mode):
    """A palette image keeps its filter (Pillow resizes "P" with nearest unless converted first);
    16-bit and float images are resized at their depth, then rounded: within a level."""
    image, meaning = modes_of(Image.fromarray(photo(300, 451, seed=10)))[mode]
    served = preprocessor(resize="resize-crop", shorter_side=256, resample="bicubic")
    levels = (served.from_image(image).tensor - served.from_image(meaning).tensor) * 255
    assert np.abs(levels * np.array(STD)[:, None, None]).max() <= 1.01


def test_a_jpeg_is_decoded_at_the_smallest_scale_that_keeps_the_shorter_side():
    """2048 x 1536 for a shorter side of 400: 1/2 scale (768 >= 400), not 1/4 (384 < 400), which
    is what the crop's 224 alone would allow; the same for a resize to 400 x 300."""
    data = encode(photo(1536, 2048, seed=7), "JPEG", quality=90)
    cropping = preprocessor(resize="resize-crop", shorter_side=400)
    assert cropping.decode(data, "image").size == (1024, 768)
    assert preprocessor(resize="resize").decode(data, "image").size == (512, 384)
    squashing = preprocessor(resize="resize", resize_to=[400, 300])  # its larger side counts
    assert squashing.decode(data, "image").size == (1024, 768)


def test_a_large_image_is_reduced_before_the_exact_resize_with_little_change():
    """6000 x 4000 to 384 x 256: 3 x 3 block averages over the exact source box first (Pillow's
    reducing_gap), then the bicubic resize; the input stays within a few levels of the single
    full-size resize, and the geometry is the full image's (256 * 6000 / 4000 = 384 wide)."""
    image = photo(4000, 6000, seed=8)
    served = preprocessor(resize="resize-crop", shorter_side=256, resample="bicubic")
    prepared = served.from_image(Image.fromarray(image))
    expected = reference(image, (256, 384), 16, 80, "bicubic")
    levels = np.abs(prepared.tensor - expected) * np.array(STD)[:, None, None] * 255
    assert levels.mean() < 0.5 and levels.max() <= 3.01


def test_a_thin_strip_resizes_only_its_crop(monkeypatch):
    """3 x 300 to a shorter side of 256 would be 256 x 25600 pixels: only the 224 x 224 crop is
    made, and it is the full resize's crop to within a level (rows 16-240, columns 12688-12912)."""
    strip = photo(3, 300, seed=9)
    made = []
    resize = Image.Image.resize

    def recorded(self, size, *args, **kwargs):
        made.append(size)
        return resize(self, size, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "resize", recorded)
    served = preprocessor(resize="resize-crop", shorter_side=256, resample="bicubic")
    prepared = served.from_bytes(encode(strip), "image")
    assert made == [(224, 224)]
    monkeypatch.undo()
    expected = reference(strip, (256, 25600), 16, 12688, "bicubic")
    levels = np.abs(prepared.tensor - expected) * np.array(STD)[:, None, None] * 255
    assert levels.max() <= 1.01


@pytest.mark.parametrize(
    ("preprocessing", "fragment"),
    [
        ({"resize": "resize-crop"}, "shorter_side is given with resize-crop"),
        ({"resize": "resize", "shorter_side": 256}, "shorter_side is given with resize-crop"),
        ({"resize": "resize-crop", "shorter_side": 200}, "smaller than the centre crop"),
        ({"resize": "resize", "resize_to": [256, 200]}, "resize_to [256, 200] is smaller"),
        (
            {"resize": "resize-crop", "shorter_side": 256, "resize_to": [256, 256]},
            "resize_to is given with resize",
        ),
        ({"resize": "fit-pad", "crop_offset": "round"}, "crop_offset is for the centre crop"),
        ({"resize": "resize", "resample": "hamming"}, "resample"),
    ],
)
def test_inconsistent_geometries_are_refused_with_the_field(preprocessing, fragment):
    with pytest.raises(ValidationError, match=re.escape(fragment)):
        photo_metadata(**preprocessing)
