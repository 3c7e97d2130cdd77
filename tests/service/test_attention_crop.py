"""A resize-crop model served through the app: /predict answers what onnxruntime gives on the crop
built here with Pillow, and /attention's PNG overlay is drawn on that crop (what the model saw), not
on a fitted and padded frame.

The tiny model's two graphs get resize-crop metadata (shorter side 32, bicubic, the centre 28 x 28);
the weights are the tiny model's, so the answers are checked against it run here."""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from service.contract.attention_maps import overlay_png
from service.launcher.local_app import local_app
from tests.service.test_startup import rewrite_metadata
from tests.support import MODEL_NAME, Reference, assert_matches, b64, encode, make_settings


def cropping(document: dict) -> dict:
    pre = {**document["preprocessing"], "resize": "resize-crop", "shorter_side": 32}
    return {**document, "preprocessing": {**pre, "resample": "bicubic"}}


@pytest.fixture(scope="module")
def crop_client(model_repository, tmp_path_factory) -> Iterator[TestClient]:
    repository = tmp_path_factory.mktemp("crop") / "models"
    shutil.copytree(model_repository, repository)
    for graph in ("model.onnx", "attention.onnx"):
        rewrite_metadata(repository / MODEL_NAME / "1" / graph, cropping)
    with TestClient(local_app(make_settings(repository))) as client:
        yield client


def photo() -> np.ndarray:
    """40 x 60, a light shape on a dark ground with texture: 32 x 48 after the resize, cropped at
    rows 2-30 and columns 10-38."""
    rng = np.random.default_rng(11)
    image = rng.integers(0, 60, (40, 60)).astype(np.uint8)
    image[8:34, 14:50] += 150
    return image


def crop_by_hand(image: np.ndarray) -> np.ndarray:
    resized = Image.fromarray(image).resize((48, 32), Image.Resampling.BICUBIC)
    return np.asarray(resized)[2:30, 10:38]


def test_predict_answers_the_model_on_the_centre_crop(crop_client, reference: Reference):
    image = photo()
    body = {"images": [{"b64": b64(encode(image))}], "invert": "never", "top_k": 10}
    answer = crop_client.post("/predict", json=body)
    assert answer.status_code == 200, answer.text
    expected = reference.probabilities(crop_by_hand(image)[None])[0]
    assert_matches(answer.json()["predictions"][0], expected)


def test_the_overlay_is_drawn_on_the_crop_the_model_saw(crop_client):
    image = {"b64": b64(encode(photo()))}
    as_json = crop_client.post("/attention", json={"image": image, "invert": "never"})
    assert as_json.status_code == 200, as_json.text
    heatmap = np.array(as_json.json()["map"])
    as_png = crop_client.post(
        "/attention", json={"image": image, "invert": "never", "format": "png"}
    )
    assert as_png.status_code == 200 and as_png.headers["content-type"] == "image/png"
    expected = overlay_png(crop_by_hand(photo())[..., None], heatmap)
    np.testing.assert_array_equal(
        np.asarray(Image.open(io.BytesIO(as_png.content))),
        np.asarray(Image.open(io.BytesIO(expected))),
    )
