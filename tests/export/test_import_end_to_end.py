"""An imported checkpoint served end to end on real photos, against the source pipeline a user would
otherwise run: transformers' own image processor on the decoded photo, then transformers' own model.

Hugging Face's DeiT (with its distillation token and teacher head) with its processor's squashing
resize to 72 x 72 and the centre 64 x 64 crop, bicubic; and ViT with a shortest-edge resize to 72 and
the centre crop, bilinear. The photos are the ones scikit-learn and scikit-image ship.

Small photos (no reduction before the exact resize) must give the source's probabilities to 1e-4;
the full-size JPEGs, which the service decodes at a reduced DCT scale, must keep every top-1 and stay
within 0.05 of the source's probabilities (tests/service/test_preprocessing_parity.py and
BENCHMARKS.md give the input's own difference).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from export import onnx as onnx_export
from service.launcher.local_app import local_app
from tests.export.import_support import randomise
from tests.support import b64, encode, make_settings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import transformers
    from transformers import DeiTImageProcessorPil, ViTImageProcessorPil

transformers.logging.set_verbosity_error()

LABELS = [f"class {i}" for i in range(8)]
CASES = {
    "deit-distilled-squash-crop": (
        "DeiTForImageClassificationWithTeacher",
        DeiTImageProcessorPil(
            size={"height": 72, "width": 72}, crop_size={"height": 64, "width": 64}, resample=3
        ),
    ),
    "vit-shortest-edge-crop": (
        "ViTForImageClassification",
        ViTImageProcessorPil(
            size={"shortest_edge": 72},
            crop_size={"height": 64, "width": 64},
            do_center_crop=True,
            resample=2,
        ),
    ),
}


def photos() -> dict[str, Image.Image]:
    from skimage import data
    from sklearn.datasets import load_sample_images

    sample = load_sample_images()
    found = {
        Path(name).stem: Image.fromarray(image)
        for name, image in zip(sample.filenames, sample.images, strict=True)
    }
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        found[name] = Image.fromarray(getattr(data, name)())
    return found


@pytest.fixture(scope="module", params=list(CASES))
def served(request, tmp_path_factory) -> Iterator[tuple[TestClient, torch.nn.Module, object]]:
    architecture, processor = CASES[request.param]
    family = transformers.DeiTConfig if architecture.startswith("DeiT") else transformers.ViTConfig
    config = family(
        hidden_size=48,
        num_attention_heads=3,
        num_hidden_layers=2,
        intermediate_size=96,
        image_size=64,
        patch_size=16,
        id2label=dict(enumerate(LABELS)),
        attn_implementation="eager",
    )
    source = getattr(transformers, architecture)(config).eval()
    randomise(source, seed=3)
    directory = tmp_path_factory.mktemp("checkpoint")
    source.save_pretrained(directory)
    processor.save_pretrained(directory)
    repository = tmp_path_factory.mktemp("repo")
    onnx_export.export_model(directory, "imported", 1, repository)
    settings = make_settings(
        repository,
        model_name="imported",
        max_pixels_per_image=4_000_000,
        max_body_bytes=16 * 1024 * 1024,
    )
    with TestClient(local_app(settings)) as client:
        yield client, source, processor


def source_probabilities(source, processor, image: Image.Image) -> np.ndarray:
    inputs = processor(images=image, return_tensors="pt")
    with torch.no_grad():
        logits = source(pixel_values=inputs["pixel_values"]).logits
    return torch.softmax(logits, dim=-1)[0].numpy()


def served_probabilities(client: TestClient, data: bytes) -> np.ndarray:
    body = {"images": [{"b64": b64(data)}], "top_k": len(LABELS)}
    answer = client.post("/predict", json=body)
    assert answer.status_code == 200, answer.text
    probabilities = np.zeros(len(LABELS))
    for entry in answer.json()["predictions"][0]["top_k"]:
        probabilities[entry["index"]] = entry["score"]
    return probabilities


def test_small_photos_get_the_source_pipelines_probabilities(served):
    client, source, processor = served
    for name, photo in photos().items():
        # at most 300 pixels a side: under 8 times the resize, so nothing is reduced before it
        small = photo.copy()
        small.thumbnail((300, 300), Image.Resampling.LANCZOS)
        expected = source_probabilities(source, processor, small)
        answered = served_probabilities(client, encode(small))
        assert int(np.argmax(answered)) == int(np.argmax(expected)), name
        assert float(np.abs(answered - expected).max()) <= 1e-4, name


def test_full_size_jpegs_keep_the_source_pipelines_top_1(served):
    client, source, processor = served
    for name, photo in photos().items():
        data = encode(photo.convert("RGB"), "JPEG", quality=90)
        with Image.open(io.BytesIO(data)) as decoded:
            expected = source_probabilities(source, processor, decoded.convert("RGB"))
        answered = served_probabilities(client, data)
        assert int(np.argmax(answered)) == int(np.argmax(expected)), name
        assert float(np.abs(answered - expected).max()) <= 0.05, name
