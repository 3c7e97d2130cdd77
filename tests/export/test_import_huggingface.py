"""Hugging Face ViT and DeiT checkpoints, saved by transformers itself with random weights, imported
and exported: the served graphs against transformers' own forward pass and attentions."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from export import onnx as onnx_export
from tests.export.import_support import (
    ATTENTION_PARITY,
    LOGITS_PARITY,
    logits_error,
    randomise,
    served,
    without_prefix,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import transformers
    from transformers import DeiTImageProcessorPil, ViTImageProcessorPil

transformers.logging.set_verbosity_error()

# (architecture, config values, processor, expected preprocessing geometry)
CASES = {
    "vit-tiny-patch16": (
        "ViTForImageClassification",
        {"hidden_size": 64, "num_attention_heads": 4, "image_size": 48, "patch_size": 16},
        ViTImageProcessorPil(size={"height": 48, "width": 48}, resample=2),
        {"resize": "resize", "resample": "bilinear"},
    ),
    "vit-small-patch32-no-qkv-bias": (
        "ViTForImageClassification",
        {
            "hidden_size": 96,
            "num_attention_heads": 6,
            "image_size": 64,
            "patch_size": 32,
            "qkv_bias": False,
        },
        ViTImageProcessorPil(
            size={"shortest_edge": 72}, crop_size={"height": 64, "width": 64}, do_center_crop=True
        ),
        {"resize": "resize-crop", "shorter_side": 72},
    ),
    "deit-distilled-with-teacher": (
        "DeiTForImageClassificationWithTeacher",
        {"hidden_size": 48, "num_attention_heads": 3, "image_size": [32, 48], "patch_size": 16},
        DeiTImageProcessorPil(
            size={"height": 32, "width": 48}, crop_size={"height": 32, "width": 48}
        ),
        {"resize": "resize", "resample": "bicubic"},
    ),
    "deit-distillation-token-without-head": (
        "DeiTForImageClassification",
        {"hidden_size": 48, "num_attention_heads": 3, "image_size": 32, "patch_size": 16},
        DeiTImageProcessorPil(
            size={"height": 36, "width": 36}, crop_size={"height": 32, "width": 32}
        ),
        {"resize": "resize", "resize_to": (36, 36), "crop_offset": "floor"},
    ),
}
LABELS = ["tabby cat", "crane", "crane", "sports car"]  # ImageNet names two classes "crane"


def source_model(architecture: str, values: dict, seed: int = 0):
    family = transformers.DeiTConfig if architecture.startswith("DeiT") else transformers.ViTConfig
    config = family(
        num_hidden_layers=2,
        intermediate_size=2 * values["hidden_size"],
        id2label=dict(enumerate(LABELS)),
        attn_implementation="eager",
        **values,
    )
    model = getattr(transformers, architecture)(config).eval()
    randomise(model, seed)
    return model


def saved(tmp_path: Path, case: str) -> tuple[Path, torch.nn.Module]:
    architecture, values, processor, _ = CASES[case]
    model = source_model(architecture, values)
    directory = tmp_path / case
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory, model


@pytest.mark.parametrize("case", list(CASES))
def test_served_graphs_match_transformers(tmp_path, case):
    directory, source = saved(tmp_path, case)
    result = onnx_export.export_model(directory, "imported", 1, tmp_path / "repo")
    metadata, classifier, attention_graph = served(tmp_path / "repo", "imported")

    height, width = metadata.input.height, metadata.input.width
    images = torch.randn(3, 3, height, width, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = source(pixel_values=images, output_attentions=True)
    (logits,) = classifier.run(["logits"], {"images": images.numpy()})
    attention_logits, maps = attention_graph.run(
        ["logits", "attention"], {"images": images.numpy()}
    )
    assert logits_error(logits, expected.logits) <= LOGITS_PARITY
    assert logits_error(attention_logits, expected.logits) <= LOGITS_PARITY
    # transformers' tokens: [CLS] (DeiT: [DIST]) patches; the maps keep [CLS] and the patches.
    left_out = [1] if CASES[case][0].startswith("DeiT") else []
    reference = without_prefix(torch.stack(expected.attentions, dim=1), left_out)
    assert maps.shape == tuple(reference.shape)
    assert float(abs(maps - reference.numpy()).max()) <= ATTENTION_PARITY

    assert metadata.labels == ["tabby cat", "crane (class 1)", "crane (class 2)", "sports car"]
    pre = metadata.preprocessing
    for key, value in CASES[case][3].items():
        assert getattr(pre, key) == value, key
    assert pre.polarity == "natural" and pre.color == "rgb"
    assert result["source"]["architecture"] == CASES[case][0]
    card = (tmp_path / "repo" / "imported" / "MODEL_CARD.md").read_text()
    assert CASES[case][0] in card and '"hidden_size"' in card
