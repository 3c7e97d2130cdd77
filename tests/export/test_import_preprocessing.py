"""The preprocessing written for an imported checkpoint, from its processor's or timm's config, for
the forms those configs take on the hub (numbers worked out by hand from the sources' transforms)."""

from __future__ import annotations

from typing import Any

import pytest

from export.checkpoint import CheckpointError
from export.config import ViTConfig
from export.importers import huggingface, timm

VIT_224 = ViTConfig(
    image_height=224, image_width=224, in_channels=3, patch_size=16, dim=8, depth=1, heads=1
)
IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def assert_preprocessing(
    made: tuple[dict[str, Any], list[str]], geometry: dict[str, Any], noted: bool
) -> None:
    """The preprocessing document holds ``geometry``, with notes exactly when ``noted``."""
    document, notes = made
    for key, value in geometry.items():
        assert document[key] == value, key
    assert bool(notes) == noted


@pytest.mark.parametrize(
    ("processor", "geometry", "noted"),
    [
        # google/vit-base-patch16-224's: a plain resize to the input
        ({"size": {"height": 224, "width": 224}, "resample": 2}, {"resize": "resize"}, False),
        # facebook/deit-*-224's legacy form: a bare 256 (a square), then the centre 224
        (
            {"size": 256, "crop_size": 224, "do_center_crop": True, "resample": 3},
            {
                "resize": "resize",
                "resize_to": [256, 256],
                "resample": "bicubic",
                "crop_offset": "floor",
            },
            False,
        ),
        (
            {
                "size": {"shortest_edge": 256},
                "crop_size": {"height": 224, "width": 224},
                "do_center_crop": True,
            },
            {"resize": "resize-crop", "shorter_side": 256},
            False,
        ),
        ({"do_rescale": False, "do_normalize": False}, {"scale": 1.0, "mean": [0.0] * 3}, False),
    ],
)
def test_hugging_face_processors(processor, geometry, noted):
    assert_preprocessing(huggingface.preprocessing(processor, VIT_224, "p"), geometry, noted)


@pytest.mark.parametrize(
    "processor",
    [
        {"size": {"shortest_edge": 256, "longest_edge": 1333}},
        {"resample": 5},  # PIL's HAMMING: no filter of the service
        {"size": {"shortest_edge": 200}, "crop_size": 224, "do_center_crop": True},
        {"size": 256, "crop_size": 192, "do_center_crop": True},
        {"size": {"height": 200, "width": 256}, "crop_size": 224, "do_center_crop": True},
    ],
)
def test_hugging_face_processors_the_service_cannot_follow_are_refused(processor):
    with pytest.raises(CheckpointError):
        huggingface.preprocessing(processor, VIT_224, "p")


@pytest.mark.parametrize(
    ("pretrained", "geometry", "noted"),
    [
        # timm's defaults: crop_pct 0.875, centre, bilinear: floor(224 / 0.875) = 256
        (
            {},
            {
                "resize": "resize-crop",
                "shorter_side": 256,
                "resample": "bilinear",
                "crop_offset": "round",
            },
            False,
        ),
        # vit_*.augreg: crop_pct 0.9, bicubic: floor(224 / 0.9) = floor(248.9) = 248
        ({"crop_pct": 0.9, "interpolation": "bicubic"}, {"shorter_side": 248}, False),
        ({"crop_pct": 1.0, "crop_mode": "squash"}, {"resize": "resize"}, False),
        # squash: each side to floor(224 / 0.95) = 235, then the centre 224
        (
            {"crop_pct": 0.95, "crop_mode": "squash"},
            {"resize": "resize", "resize_to": [235, 235]},
            False,
        ),
        ({"crop_pct": 1.0, "crop_mode": "border"}, {"shorter_side": 224}, True),
        ({"mean": [0.5] * 3, "std": [0.5] * 3}, {"mean": [0.5] * 3, "scale": 1 / 255}, False),
    ],
)
def test_timm_pretrained_configs(pretrained, geometry, noted):
    config = {"pretrained_cfg": {"input_size": [3, 224, 224], **IMAGENET, **pretrained}}
    assert_preprocessing(timm.preprocessing(config, VIT_224, "c"), geometry, noted)


@pytest.mark.parametrize(
    "pretrained",
    [{"input_size": [3, 384, 384]}, {"interpolation": "hamming"}, {"crop_pct": 1.2}],
)
def test_timm_configs_the_service_cannot_follow_are_refused(pretrained):
    with pytest.raises(CheckpointError):
        timm.preprocessing({"pretrained_cfg": pretrained}, VIT_224, "c")
