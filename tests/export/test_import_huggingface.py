"""Hugging Face ViT and DeiT checkpoints, saved by transformers itself with random weights, imported
and exported: the served graphs against transformers' own forward pass and attentions."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from export import onnx as onnx_export
from service.contract.model_repository import check_labels, read_labels, version_files
from service.contract.preprocessing import Preprocessor
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


def source_model(architecture: str, values: dict, seed: int = 0, labels: list[str] = LABELS):
    family = transformers.DeiTConfig if architecture.startswith("DeiT") else transformers.ViTConfig
    config = family(
        num_hidden_layers=2,
        intermediate_size=2 * values["hidden_size"],
        id2label=dict(enumerate(labels)),
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
    assert "4 classes (labels.txt); labels from the checkpoint's id2label." in card
    # the model as vitserve's ViT: a distillation head only where the source has one
    head = {"DeiTForImageClassification": "false", "DeiTForImageClassificationWithTeacher": "true"}
    if CASES[case][0] in head:
        assert f'"distillation_head": {head[CASES[case][0]]}' in card
    else:
        assert '"distillation_head"' not in card and '"distillation_token": false' in card


def test_labels_past_ten_and_a_distinct_mean_and_std_reach_the_served_version(tmp_path):
    """A config.json whose id2label keys are text sorts them as text ("0", "1", "10", "11", "12",
    "2", ...: transformers' own ``to_json_string`` of a config read from JSON, as hub configs are):
    the labels must follow the class numbers, checked against transformers' own ``id2label`` of
    the saved directory class by class, through labels.txt and the service's reader. The
    processor's mean and std differ (every other test has 0.5 for both), checked against the
    processor's own output."""
    labels = [" cat", "a", "a", "a (class 2)", *(f"label {i}" for i in range(4, 13))]
    source = source_model(
        "ViTForImageClassification",
        {"hidden_size": 16, "num_attention_heads": 2, "image_size": 32, "patch_size": 16},
        labels=labels,
    )
    processor = ViTImageProcessorPil(
        size={"height": 32, "width": 32}, image_mean=[0.2, 0.4, 0.6], image_std=[0.1, 0.3, 0.5]
    )
    directory = tmp_path / "checkpoint"
    source.save_pretrained(directory)
    processor.save_pretrained(directory)
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()), indent=2, sort_keys=True))
    assert list(json.loads(path.read_text())["id2label"])[:4] == ["0", "1", "10", "11"]
    id2label = transformers.AutoConfig.from_pretrained(directory).id2label

    onnx_export.export_model(directory, "imported", 1, tmp_path / "repo")
    metadata, classifier, _ = served(tmp_path / "repo", "imported")
    files = version_files(tmp_path / "repo", "imported", 1)
    check_labels(metadata, files)  # the service loads the version
    read = read_labels(files.labels_path.read_text(encoding="utf-8"))
    assert read == metadata.labels
    # transformers' own names, class by class, as the service reads them; the repeated "a" numbered
    # apart from the class already named "a (class 2)"
    assert read[0] == id2label[0].strip() == "cat"
    assert [id2label[i] for i in (1, 2, 3)] == ["a", "a", "a (class 2)"]
    assert read[1:4] == ["a (class 1)", "a (class 2, 2)", "a (class 2)"]
    assert read[4:] == [id2label[i] for i in range(4, len(labels))]

    pre = metadata.preprocessing
    assert (pre.mean, pre.std) == (list(processor.image_mean), list(processor.image_std))
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
    ours = Preprocessor(metadata, 1_000_000).from_image(photo).tensor
    theirs = processor(images=photo, return_tensors="np")["pixel_values"][0]
    assert float(np.abs(ours - theirs).max()) <= 1e-5
    (logits,) = classifier.run(["logits"], {"images": ours[None]})
    with torch.no_grad():
        expected = source(pixel_values=torch.from_numpy(theirs[None])).logits
    assert logits_error(logits, expected) <= LOGITS_PARITY
