"""The served input tensor against the sources' own processors, on the real photos that scikit-learn
and scikit-image ship: Hugging Face's ``ViTImageProcessorPil`` and ``DeiTImageProcessorPil`` (the PIL
backend: the default one needs torchvision), and timm's evaluation transform written down from its
source (``timm.data.transforms_factory.transforms_imagenet_eval``: ``Resize(floor(224 / crop_pct))``
of the shorter side, bicubic, ``CenterCrop(224)``, ``ToTensor``, ``Normalize``), since timm's
transforms import torchvision.

Decoded in full, every photo's input matches to float rounding; decoded at a reduced JPEG scale (the
photos over twice the resize), it stays within the bound stated below.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import skimage.data
import sklearn.datasets
from PIL import Image, ImageOps
from transformers import DeiTImageProcessorPil, ViTImageProcessorPil

from service.contract.preprocessing import Preprocessor
from tests.service.test_preprocessing_geometry import photo_metadata

SKLEARN = Path(sklearn.datasets.__file__).parent / "images"
SKIMAGE = Path(skimage.data.__file__).parent
# (file, decoded at a reduced JPEG scale for a 256-pixel resize)
PHOTOS = [
    (SKLEARN / "china.jpg", False),
    (SKLEARN / "flower.jpg", False),
    (SKIMAGE / "astronaut.png", False),
    (SKIMAGE / "chelsea.png", False),
    (SKIMAGE / "coffee.png", False),
    (SKIMAGE / "camera.png", False),  # grey: every processor repeats it into RGB
    (SKIMAGE / "rocket.jpg", False),
    (SKIMAGE / "motorcycle_left.png", False),
    (SKIMAGE / "retina.jpg", True),  # 1411 x 1411: 1/4 scale
    (SKIMAGE / "hubble_deep_field.jpg", True),  # 1000 x 872: 1/2 scale
]
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def timm_eval(image: Image.Image, crop_pct: float = 0.875, size: int = 224) -> np.ndarray:
    """timm's eval transform at crop_pct 0.875, bicubic, ImageNet mean and std, as its source
    (and torchvision's ``Resize`` and ``CenterCrop``) computes it."""
    image = image.convert("RGB")
    side = math.floor(size / crop_pct)
    w, h = image.size
    new_w, new_h = (side, int(side * h / w)) if w <= h else (int(side * w / h), side)
    image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    top, left = round((new_h - size) / 2.0), round((new_w - size) / 2.0)  # half to even
    crop = np.asarray(image, dtype=np.float32)[top : top + size, left : left + size] / 255.0
    mean, std = np.array(IMAGENET_MEAN, np.float32), np.array(IMAGENET_STD, np.float32)
    return ((crop - mean) / std).transpose(2, 0, 1)


def hugging_face(processor) -> Callable[[Image.Image], np.ndarray]:
    def run(image: Image.Image) -> np.ndarray:
        return processor(image, do_convert_rgb=True, return_tensors="np")["pixel_values"][0]

    return run


# name: (the source's pipeline, the metadata the importer writes for it)
SOURCES = {
    "hf-vit": (
        hugging_face(ViTImageProcessorPil()),  # 224 x 224, bilinear, mean and std 0.5
        {"resize": "resize", "resample": "bilinear", "mean": [0.5] * 3, "std": [0.5] * 3},
    ),
    "hf-deit": (  # 256 x 256 whatever the aspect ratio, bicubic, the centre 224
        hugging_face(DeiTImageProcessorPil(image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)),
        {"resize": "resize", "resize_to": [256, 256], "resample": "bicubic"},
    ),
    "hf-deit-shortest-edge": (
        hugging_face(
            DeiTImageProcessorPil(
                size={"shortest_edge": 256}, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD
            )
        ),
        {"resize": "resize-crop", "shorter_side": 256, "resample": "bicubic"},
    ),
    "timm-crop-pct": (
        timm_eval,
        {
            "resize": "resize-crop",
            "shorter_side": 256,
            "resample": "bicubic",
            "crop_offset": "round",
        },
    ),
}


def served(source: str, draft: bool = True) -> Preprocessor:
    preprocessing = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, **SOURCES[source][1]}
    return Preprocessor(photo_metadata(**preprocessing), max_pixels=10**8, draft=draft)


def decoded_in_full(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return ImageOps.exif_transpose(image)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("path", [path for path, _ in PHOTOS], ids=lambda path: path.name)
def test_the_input_of_a_fully_decoded_photo_is_the_sources(source, path):
    data = path.read_bytes()
    expected = SOURCES[source][0](decoded_in_full(data))
    tensor = served(source).from_image(decoded_in_full(data)).tensor
    assert tensor.shape == expected.shape == (3, 224, 224)
    np.testing.assert_allclose(tensor, expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize(("path", "drafted"), PHOTOS, ids=[path.name for path, _ in PHOTOS])
def test_a_photo_sent_as_a_file_is_within_a_level_on_average_of_the_sources(source, path, drafted):
    """From the file's bytes: exact where the JPEG is decoded in full; where it is decoded at a
    reduced scale, retina.jpg (1/4) and hubble_deep_field.jpg (1/2) measured a mean of 0.011 and a
    maximum of 0.67 (normalised units; 0.6 and 39 levels of 255)."""
    data = path.read_bytes()
    expected = SOURCES[source][0](decoded_in_full(data))
    difference = np.abs(served(source).from_bytes(data, "image").tensor - expected)
    if not drafted:
        assert difference.max() <= 2e-6
        return
    assert difference.mean() < 0.02 and difference.max() < 1.0


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize(
    "path", [path for path, drafted in PHOTOS if drafted], ids=lambda path: path.name
)
def test_with_the_jpeg_draft_off_a_large_photo_file_is_the_sources_exactly(source, path):
    """``VITSERVE_JPEG_DRAFT=false``: the JPEGs that the draft would decode at 1/4 and 1/2 scale
    are decoded in full, so the served input is the source's to float rounding."""
    data = path.read_bytes()
    expected = SOURCES[source][0](decoded_in_full(data))
    tensor = served(source, draft=False).from_bytes(data, "image").tensor
    np.testing.assert_allclose(tensor, expected, rtol=0, atol=2e-6)
    assert np.abs(served(source).from_bytes(data, "image").tensor - expected).max() > 1e-3
