"""ViTConfig validation and the named presets."""

from __future__ import annotations

import json

import pytest
import torch

from export.config import PRESETS, ViTConfig, get_preset
from export.model import VisionTransformer


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dim": 30, "heads": 4}, "dim 30 is not divisible by heads 4"),
        ({"heads": 0}, "heads must be at least 1, got 0"),
        ({"depth": 0}, "depth must be at least 1, got 0"),
        ({"mlp_dim": 0}, "mlp_dim must be at least 1, got 0"),
        ({"in_channels": 0}, "in_channels must be at least 1, got 0"),
        ({"image_height": -28}, "image_height must be at least 1, got -28"),
        ({"num_classes": 0}, "num_classes must be at least 1, got 0"),
        ({"representation_size": 0}, "representation_size must be at least 1 or None, got 0"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1.0"),
        ({"attention_dropout": -0.1}, r"attention_dropout must be in \[0, 1\), got -0.1"),
        ({"pooling": "avg"}, "pooling must be 'token' or 'mean', got 'avg'"),
        ({"position_embedding": "rope"}, "position_embedding must be 'learned' or 'sinusoidal'"),
        (
            {"position_embedding": "sinusoidal", "dim": 27, "heads": 3},
            "sinusoidal position embedding needs an even dim, got 27",
        ),
        ({"patch_size": 3}, "patch_size 3 does not divide image_height 28"),
    ],
)
def test_invalid_configs_name_the_field_and_the_limit(changes, message):
    with pytest.raises(ValueError, match=message):
        ViTConfig(**changes)


def test_from_dict_refuses_unknown_fields_and_round_trips():
    config = get_preset("mnist-tiny")
    assert ViTConfig.from_dict(json.loads(config.to_json())) == config
    with pytest.raises(ValueError, match="unknown ViTConfig fields: colour"):
        ViTConfig.from_dict({**config.to_dict(), "colour": "red"})


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown preset 'vit-h14'; choose one of: .*mnist-tiny"):
        get_preset("vit-h14")


@pytest.mark.parametrize(
    ("name", "sizes"),
    [
        # The seed's MNIST notebook.
        (
            "mnist-tiny",
            {"image_height": 28, "in_channels": 1, "patch_size": 2, "dim": 64, "depth": 2}
            | {"heads": 2, "mlp_dim": 256, "representation_size": 32},
        ),
        # The article's CIFAR-10 model.
        (
            "cifar10-small",
            {"image_height": 32, "in_channels": 3, "patch_size": 4, "dim": 48, "depth": 4}
            | {"heads": 4, "mlp_dim": 192},
        ),
        # ViT-Base/16.
        (
            "vit-b16",
            {"image_height": 224, "patch_size": 16, "dim": 768, "depth": 12, "heads": 12}
            | {"mlp_dim": 3072},
        ),
    ],
)
def test_presets_hold_the_seed_sizes(name: str, sizes: dict):
    preset = get_preset(name)
    assert {field: getattr(preset, field) for field in sizes} == sizes


def test_every_named_preset_is_registered():
    assert set(PRESETS) >= {"mnist-tiny", "cifar10-small", "vit-b16", "fashion-small"}


def test_vit_b16_has_the_reference_parameter_count():
    # timm's vit_base_patch16_224 and torchvision's vit_b_16: 86,567,656 parameters.
    with torch.device("meta"):
        model = VisionTransformer(get_preset("vit-b16"))
    assert model.num_parameters() == 86_567_656


def test_the_shipped_preset_stays_under_one_million_parameters():
    with torch.device("meta"):
        model = VisionTransformer(get_preset("fashion-small"))
    assert model.num_parameters() < 1_000_000
