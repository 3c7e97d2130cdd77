"""POST /attention: maps of the grid's shape in [0, 1], equal to an independent reference rollout."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from service.contract.attention_maps import attention_map, colorize, overlay_png
from tests.export.test_rollout import attention_rollout, last_layer_heads, normalise_maps, to_grid
from tests.support import Reference, assert_error, b64, encode

GRID = (4, 4)


def test_rollout_json_matches_the_export_stage(client, fashion_images, reference: Reference):
    image = fashion_images[0]
    response = client.post("/attention", json={"image": {"b64": b64(encode(image))}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["method"] == "rollout" and body["layer"] == 1 and body["head"] is None
    assert body["grid"] == [4, 4] and body["pooling"] == "mean" and body["inverted"] is False
    heatmap = np.array(body["map"])
    assert heatmap.shape == GRID
    assert heatmap.min() == 0.0 and heatmap.max() == 1.0
    maps = reference.attention_maps(image[None])
    expected = normalise_maps(to_grid(attention_rollout(maps, "mean"), GRID))[0]
    np.testing.assert_allclose(heatmap, expected, atol=1e-5)
    predicted = client.post("/predict", json={"images": [{"pixels": image.tolist()}]}).json()
    assert body["prediction"] == predicted["predictions"][0]


def test_raw_maps_per_head_and_head_mean(client, fashion_images, reference: Reference):
    image = fashion_images[1]
    maps = reference.attention_maps(image[None])
    for layer in (0, 1):
        for head in (0, 1):
            body = client.post(
                "/attention",
                json={
                    "image": {"pixels": image.tolist()},
                    "method": "raw",
                    "layer": layer,
                    "head": head,
                },
            ).json()
            expected = normalise_maps(maps[0, layer, head].mean(axis=0).reshape(GRID))
            np.testing.assert_allclose(np.array(body["map"]), expected, atol=1e-5)
            assert body["layer"] == layer and body["head"] == head
    body = client.post(
        "/attention", json={"image": {"pixels": image.tolist()}, "method": "raw"}
    ).json()
    expected = normalise_maps(to_grid(last_layer_heads(maps, "mean").mean(axis=1), GRID))[0]
    np.testing.assert_allclose(np.array(body["map"]), expected, atol=1e-5)


def test_rollout_up_to_a_layer(client, fashion_images, reference: Reference):
    image = fashion_images[2]
    maps = reference.attention_maps(image[None])
    body = client.post("/attention", json={"image": {"pixels": image.tolist()}, "layer": 0}).json()
    expected = normalise_maps(to_grid(attention_rollout(maps[:, :1], "mean"), GRID))[0]
    np.testing.assert_allclose(np.array(body["map"]), expected, atol=1e-5)


def test_multipart_agrees_with_json(client, fashion_images):
    data = encode(fashion_images[3])
    as_json = client.post("/attention", json={"image": {"b64": b64(data)}, "method": "raw"}).json()
    as_form = client.post(
        "/attention", files={"file": ("a.png", data, "image/png")}, data={"method": "raw"}
    ).json()
    assert as_form == as_json


def test_png_overlay_decodes_and_is_large_enough(client, fashion_images):
    image = fashion_images[4]
    response = client.post(
        "/attention", json={"image": {"b64": b64(encode(image))}, "format": "png"}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/png"
    overlay = Image.open(io.BytesIO(response.content))
    overlay.load()
    assert overlay.format == "PNG" and overlay.mode == "RGB" and overlay.size == (224, 224)
    predicted = client.post("/predict", json={"images": [{"pixels": image.tolist()}]}).json()
    assert int(response.headers["x-prediction-index"]) == predicted["predictions"][0]["index"]
    assert response.headers["x-prediction-label"] == predicted["predictions"][0]["label"]
    pixels = np.asarray(overlay)
    assert pixels.std() > 1.0  # not a blank picture


def test_overlay_and_colormap_units():
    assert colorize(np.array([0.0]))[0].tolist() == [0, 0, 4]
    assert colorize(np.array([1.0]))[0].tolist() == [252, 255, 164]
    ramp = colorize(np.linspace(0, 1, 50)).astype(int).sum(axis=1)
    assert (np.diff(ramp) >= 0).all()  # inferno brightens monotonically
    display = np.zeros((20, 30, 1), dtype=np.uint8)
    png = overlay_png(display, np.eye(5, 6))
    assert Image.open(io.BytesIO(png)).size == (30 * 12, 20 * 12)


@pytest.mark.parametrize("pooling", ["token", "mean"])
def test_pooling_readout_matches_the_export_stage(pooling):
    rng = np.random.default_rng(1)
    tokens = 16 + (1 if pooling == "token" else 0)
    logits = rng.standard_normal((1, 3, 2, tokens, tokens))
    maps = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    mine = attention_map(maps[0], method="rollout", layer=2, head=None, pooling=pooling, grid=GRID)
    theirs = normalise_maps(to_grid(attention_rollout(maps, pooling), GRID))[0]
    np.testing.assert_allclose(mine, theirs, atol=1e-12)
    mine = attention_map(maps[0], method="raw", layer=2, head=1, pooling=pooling, grid=GRID)
    theirs = normalise_maps(to_grid(last_layer_heads(maps, pooling)[:, 1], GRID))[0]
    np.testing.assert_allclose(mine, theirs, atol=1e-12)
    constant = attention_map(
        np.full((1, 1, tokens, tokens), 1 / tokens),
        method="raw",
        layer=0,
        head=None,
        pooling=pooling,
        grid=GRID,
    )
    assert (constant == 0).all()


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        ({"layer": 2}, ["layer", "2 layers", "0 to 1"]),
        ({"layer": -1}, ["layer", "greater than or equal to 0"]),
        ({"head": 0}, ["head", "only used with method 'raw'"]),
        ({"method": "raw", "head": 2}, ["head", "2 heads", "0 to 1"]),
        ({"method": "gradcam"}, ["method", "'rollout' or 'raw'"]),
        ({"format": "svg"}, ["format", "'json' or 'png'"]),
        ({"top_k": 11}, ["top_k", "limit is 10"]),
        ({"images": []}, ["images", "Extra inputs"]),
    ],
)
def test_bad_attention_options_are_422(client, options, fragments):
    body = {"image": {"pixels": [[0] * 28] * 28}, **options}
    assert_error(client.post("/attention", json=body), 422, *fragments)


def test_attention_multipart_needs_one_file(client):
    data = encode(np.zeros((28, 28), np.uint8))
    two = [("file", ("a.png", data, "image/png")), ("file", ("b.png", data, "image/png"))]
    assert_error(client.post("/attention", files=two), 422, "file")
    assert_error(
        client.post("/attention", data={"method": "raw"}, files={"x": ("a", b"", "text/plain")}),
        422,
        "x",
    )
    assert_error(client.post("/attention", json={"method": "raw"}), 422, "image", "Field required")
