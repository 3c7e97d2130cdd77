"""Every bad input is a JSON 4xx naming the field and the limit; the service keeps serving after it."""

from __future__ import annotations

import random
import struct
import zlib

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.frontend.schemas import first_non_number
from service.launcher.local_app import local_app
from tests.support import assert_error, b64, encode, make_settings


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with a token of image data: a decompression bomb."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


def one_pixel_list() -> list[list[int]]:
    return [[0] * 28 for _ in range(28)]


BAD_JSON_BODIES = [
    pytest.param({"images": []}, ["images", "at least 1"], id="no-images"),
    pytest.param({}, ["images", "Field required"], id="missing-images"),
    pytest.param({"images": [{"b64": "@@@"}]}, ["images[0].b64", "base64"], id="bad-base64"),
    pytest.param(
        {"images": [{"b64": b64(b"hello, not an image")}]},
        ["images[0].b64", "PNG, JPEG, WebP, BMP or GIF"],
        id="not-an-image",
    ),
    pytest.param(
        {
            "images": [
                {
                    "b64": b64(
                        encode(np.random.default_rng(0).integers(0, 255, (28, 28), np.uint8))[:400]
                    )
                }
            ]
        },
        ["images[0].b64", "cannot decode the PNG image"],
        id="truncated-png",
    ),
    pytest.param({"images": [{"b64": ""}]}, ["images[0].b64", "empty"], id="empty-image"),
    pytest.param(
        {"images": [{"b64": b64(png_header_only(20_000, 20_000))}]},
        ["images[0].b64", "max_pixels_per_image=100000"],
        id="decompression-bomb",
    ),
    pytest.param(
        {"images": [{"b64": b64(encode(np.zeros((400, 400), np.uint8)))}]},
        ["images[0].b64", "max_pixels_per_image=100000", "400x400"],
        id="too-many-pixels",
    ),
    pytest.param(
        {"images": [{"pixels": [[0] * 350] * 300}]},
        ["images[0].pixels", "max_pixels_per_image=100000"],
        id="too-many-raw-pixels",
    ),
    pytest.param(
        {"images": [{"pixels": [[1, 2], [3]]}]},
        ["images[0].pixels", "different lengths"],
        id="ragged",
    ),
    pytest.param(
        {"images": [{"pixels": [[1, 256]]}]},
        ["images[0].pixels", "0 to 255", "256", "[0, 1]"],
        id="over-255",
    ),
    pytest.param(
        {"images": [{"pixels": [[-1, 0]]}]}, ["images[0].pixels", "0 to 255"], id="negative"
    ),
    pytest.param(
        {"images": [{"pixels": [["a", 0]]}]}, ["images[0].pixels", "not a number"], id="string"
    ),
    pytest.param(
        {"images": [{"pixels": [[[0, 0]]] * 2}]},
        ["images[0].pixels", "C = 1 or 3", "[2, 1, 2]"],
        id="two-channels",
    ),
    pytest.param(
        {"images": [{"pixels": [[[[0]]]]}]}, ["images[0].pixels", "4 dimension"], id="four-dims"
    ),
    pytest.param({"images": [{"pixels": []}]}, ["images[0].pixels"], id="empty-pixels"),
    pytest.param(
        {"images": [{"pixels": [[0]], "b64": "AA=="}]},
        ["images[0]", "exactly one of 'b64' or 'pixels'"],
        id="both-kinds",
    ),
    pytest.param({"images": [{}]}, ["images[0]", "exactly one"], id="neither-kind"),
    pytest.param(
        {"images": [{"pixels": [[0]]}] * 9},
        ["images", "9 images", "max_images_per_request=8"],
        id="too-many-images",
    ),
    pytest.param(
        {"images": [{"pixels": [[0]]}], "top_k": 0},
        ["top_k", "greater than or equal to 1"],
        id="top-k-zero",
    ),
    pytest.param(
        {"images": [{"pixels": [[0]]}], "top_k": 11},
        ["top_k", "10 classes", "limit is 10"],
        id="top-k-too-big",
    ),
    pytest.param(
        {"images": [{"pixels": [[0]]}], "invert": "maybe"}, ["invert", "'auto'"], id="bad-invert"
    ),
    pytest.param(
        {"images": [{"pixels": [[0]]}], "colour": "red"},
        ["colour", "Extra inputs"],
        id="unknown-field",
    ),
]


@pytest.mark.parametrize(("body", "fragments"), BAD_JSON_BODIES)
def test_bad_json_predict_is_422(client, body, fragments):
    assert_error(client.post("/predict", json=body), 422, *fragments)


def test_invalid_json_is_422(client):
    response = client.post(
        "/predict", content=b'{"images": [', headers={"Content-Type": "application/json"}
    )
    assert_error(response, 422, "body", "Invalid JSON")


@pytest.mark.parametrize(
    ("content_type", "shown"),
    [("text/plain", "text/plain"), (None, "none"), ("application/xml", "application/xml")],
)
def test_unsupported_content_type_is_415(client, content_type, shown):
    headers = {"Content-Type": content_type} if content_type else {}
    response = client.post("/predict", content=b"images", headers=headers)
    error = assert_error(response, 415, "application/json or multipart/form-data", shown)
    assert error["field"] == "Content-Type"


@pytest.mark.parametrize(
    ("data", "name"),
    [
        (b"II*\x00" + b"\x00" * 64, "TIFF"),
        (b"%PDF-1.7\n" + b"\x00" * 64, "PDF"),
        (b"\x00\x00\x00\x1cftypavif" + b"\x00" * 64, "HEIF/AVIF"),
    ],
)
def test_unsupported_image_format_is_415(client, data, name):
    error = assert_error(
        client.post("/predict", json={"images": [{"b64": b64(data)}]}), 415, name, "PNG, JPEG"
    )
    assert error["field"] == "images[0].b64"
    files = {"files": ("x.bin", data, "application/octet-stream")}
    error = assert_error(client.post("/predict", files=files), 415, name)
    assert error["field"] == "files[0]"


def test_multipart_errors_are_422(client):
    image = encode(np.zeros((28, 28), np.uint8))
    assert_error(
        client.post("/predict", data={"top_k": "3"}, files={"other": ("a", b"", "text/plain")}),
        422,
        "other",
    )
    response = client.post("/predict", files={"file": ("a.png", image, "image/png")})
    assert_error(response, 422, "file", "'files'")
    response = client.post(
        "/predict", files=[("files", ("a.png", image, "image/png"))], data={"top_k": "many"}
    )
    assert_error(response, 422, "top_k", "integer")
    response = client.post("/predict", files=[("files", ("a.png", b"", "image/png"))])
    assert_error(response, 422, "files[0]", "empty")
    too_many = [("files", (f"{i}.png", image, "image/png")) for i in range(9)]
    assert_error(client.post("/predict", files=too_many), 422, "files", "max_images_per_request=8")
    broken = b'--xyz\r\nContent-Disposition: form-data; name="files"\r\n\r\nabc'
    response = client.post(
        "/predict", content=broken, headers={"Content-Type": "multipart/form-data"}
    )
    assert_error(response, 422, "multipart/form-data")


def test_body_over_the_limit_is_413_before_it_is_read(client, settings):
    limit = settings.limits.max_body_bytes
    response = client.post(
        "/predict", content=b"x" * (limit + 1), headers={"Content-Type": "application/json"}
    )
    error = assert_error(response, 413, f"max_body_bytes={limit}", "Content-Length")
    assert error["field"] == "body"

    def chunks():  # no Content-Length: counted as it streams in
        for _ in range(limit // 1024 + 2):
            yield b" " * 1024

    response = client.post(
        "/predict", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert_error(response, 413, f"max_body_bytes={limit}")
    image = {"b64": b64(np.random.default_rng(0).bytes(limit))}
    assert_error(client.post("/predict", json={"images": [image]}), 413, "max_body_bytes")


def test_unknown_route_and_method(client):
    assert_error(client.get("/nowhere"), 404, "/nowhere")
    assert_error(client.get("/predict"), 405, "GET")
    assert_error(client.get("/models/another"), 404, "another")


def test_service_keeps_serving_after_bad_input(client, fashion_images):
    good = {"images": [{"pixels": fashion_images[0].tolist()}]}
    first = client.post("/predict", json=good).json()
    for body, _ in [p.values for p in BAD_JSON_BODIES]:
        assert 400 <= client.post("/predict", json=body).status_code < 500
    assert client.post("/predict", json=good).json() == first
    assert client.get("/health/ready").status_code == 200


def test_api_key(model_repository, fashion_images):
    app = local_app(make_settings(model_repository, api_key="s3cret-key"))
    body = {"images": [{"pixels": fashion_images[0].tolist()}]}
    with TestClient(app) as client:
        error = assert_error(client.post("/predict", json=body), 401, "Authorization: Bearer")
        assert error["field"] == "Authorization"
        assert client.post("/predict", json=body).headers["www-authenticate"] == "Bearer"
        wrong = {"Authorization": "Bearer s3cret-kez"}
        assert_error(client.post("/predict", json=body, headers=wrong), 401, "not valid")
        basic = {"Authorization": "Basic czNjcmV0LWtleQ=="}
        assert_error(client.post("/predict", json=body, headers=basic), 401, "Bearer <API key>")
        assert_error(client.post("/attention", json={"image": body["images"][0]}), 401)
        assert_error(client.get("/models"), 401)
        right = {"Authorization": "Bearer s3cret-key"}
        assert client.post("/predict", json=body, headers=right).status_code == 200
        assert client.get("/models", headers=right).status_code == 200
        for open_route in ("/health/live", "/health/ready", "/metrics"):
            assert client.get(open_route).status_code == 200


def test_a_failing_model_run_is_500_with_the_request_id(client, monkeypatch, fashion_images):
    runtime = client.app.state.engine.manager.resolve().runtime

    def broken(images, instance=0):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(runtime, "classify", broken)
    body = {"images": [{"pixels": fashion_images[0].tolist()}]}
    response = client.post("/predict", json=body, headers={"X-Request-ID": "req-500"})
    error = assert_error(response, 500, "the model failed", "request id")
    assert error["code"] == "inference_failed" and error["request_id"] == "req-500"
    assert "illegal memory" not in response.text  # internals stay in the log
    monkeypatch.undo()
    assert client.post("/predict", json=body).status_code == 200
    failures = client.app.state.metrics.registry.get_sample_value(
        "vitserve_inference_failures_total", {"model": "tiny-vit", "graph": "classifier"}
    )
    assert failures >= 1


def _first_non_number_reference(value, path=()):
    """Brute force, element by element: the reference for schemas.first_non_number (pixels are
    JSON integers; a fraction is refused like a string)."""
    if type(value) is list:
        for index, item in enumerate(value):
            found = _first_non_number_reference(item, (*path, index))
            if found is not None:
                return found
        return None
    return None if type(value) is int else (list(path), value)


def test_the_first_non_number_of_a_pixel_list_is_found_where_it_is():
    rng = random.Random(17)

    def nested(depth: int = 0):
        if depth < 3 and rng.random() < 0.5:
            return [nested(depth + 1) for _ in range(rng.randint(0, 4))]
        return rng.choice([0, 1.5, 255, 7, 3.0, 0, 0, 0, "a", "12", True, False, None, {"r": 1}])

    for _ in range(5000):
        document = [nested() for _ in range(rng.randint(0, 4))]
        assert first_non_number(document) == _first_non_number_reference(document), document
    rows = [[0] * 100 for _ in range(100)]
    assert first_non_number(rows) is None
    rows[99][99] = True
    assert first_non_number(rows) == ([99, 99], True)
