"""POST /predict through the real app: agreement with onnxruntime, encodings, polarity, metrics."""

from __future__ import annotations

import numpy as np
import pytest

from export.data import FASHION_MNIST_LABELS
from tests.support import FASHION_INPUT, MODEL_NAME, Reference, b64, encode

LABELS = list(FASHION_MNIST_LABELS)


def check_against_reference(predictions: list[dict], expected: np.ndarray, top_k: int) -> None:
    assert len(predictions) == len(expected)
    for prediction, probabilities in zip(predictions, expected, strict=True):
        best = int(np.argmax(probabilities))
        assert prediction["index"] == best
        assert prediction["label"] == LABELS[best]
        assert prediction["score"] == pytest.approx(float(probabilities[best]), rel=1e-4, abs=1e-6)
        order = np.argsort(-probabilities, kind="stable")[:top_k]
        assert [entry["index"] for entry in prediction["top_k"]] == order.tolist()
        assert [entry["label"] for entry in prediction["top_k"]] == [LABELS[i] for i in order]
        scores = [entry["score"] for entry in prediction["top_k"]]
        assert scores == pytest.approx(probabilities[order].tolist(), rel=1e-4, abs=1e-6)


def test_json_predictions_match_onnxruntime(client, fashion_images, reference: Reference):
    images = fashion_images[:8]
    response = client.post(
        "/predict", json={"images": [{"b64": b64(encode(image))} for image in images], "top_k": 3}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == {"name": MODEL_NAME, "version": 1}
    expected = reference.probabilities(images)
    assert len(set(np.argmax(expected, axis=1).tolist())) > 1, (
        "the test model should not be constant"
    )
    check_against_reference(body["predictions"], expected, top_k=3)


def test_every_encoding_agrees(client, fashion_images, reference: Reference):
    images = fashion_images[8:12]
    expected = reference.probabilities(images)
    as_png = [{"b64": b64(encode(image))} for image in images]
    as_pixels = [{"pixels": image.tolist()} for image in images]
    as_chw = [{"pixels": image[None].tolist()} for image in images]
    as_bmp = [{"b64": "data:image/bmp;base64," + b64(encode(image, "BMP"))} for image in images]
    as_webp = [{"b64": b64(encode(image, "WEBP", lossless=True))} for image in images]
    as_gif = [{"b64": b64(encode(image, "GIF"))} for image in images]
    for images_json in (as_png, as_pixels, as_chw, as_bmp, as_webp, as_gif):
        response = client.post("/predict", json={"images": images_json, "top_k": 10})
        assert response.status_code == 200, response.text
        check_against_reference(response.json()["predictions"], expected, top_k=10)
    files = [("files", (f"{i}.png", encode(image), "image/png")) for i, image in enumerate(images)]
    multipart = client.post("/predict", files=files, data={"top_k": "10"})
    assert multipart.status_code == 200, multipart.text
    json_answer = client.post("/predict", json={"images": as_png, "top_k": 10})
    assert multipart.json() == json_answer.json()


def test_default_top_k_is_five(client, fashion_images):
    response = client.post("/predict", json={"images": [{"pixels": fashion_images[0].tolist()}]})
    assert response.status_code == 200
    prediction = response.json()["predictions"][0]
    assert len(prediction["top_k"]) == 5
    assert prediction["top_k"][0]["index"] == prediction["index"]


def test_dark_on_light_image_is_inverted_by_auto(client, fashion_images, reference: Reference):
    images = fashion_images[12:16]
    expected = reference.probabilities(images)
    photos = [{"b64": b64(encode(255 - image))} for image in images]  # dark garment on white
    auto = client.post("/predict", json={"images": photos, "top_k": 10})
    check_against_reference(auto.json()["predictions"], expected, top_k=10)
    always = client.post(
        "/predict",
        json={
            "images": [{"pixels": image.tolist()} for image in 255 - images],
            "invert": "always",
            "top_k": 10,
        },
    )
    check_against_reference(always.json()["predictions"], expected, top_k=10)
    never = client.post("/predict", json={"images": photos, "invert": "never", "top_k": 10})
    scores = [p["score"] for p in never.json()["predictions"]]
    assert scores != pytest.approx([p["score"] for p in auto.json()["predictions"]])


def test_rgb_rgba_and_larger_images_are_brought_to_the_model(client, fashion_images, reference):
    image = fashion_images[16]
    expected = reference.probabilities(image[None])
    rgb = np.repeat(image[..., None], 3, axis=2)
    rgba = np.dstack([rgb, np.full_like(image, 255)])
    doubled = np.kron(image, np.ones((2, 2), dtype=np.uint8))  # 56 x 56, scaled back to 28 x 28
    for array in (rgb, rgba):
        response = client.post(
            "/predict", json={"images": [{"b64": b64(encode(array))}], "top_k": 10}
        )
        check_against_reference(response.json()["predictions"], expected, top_k=10)
    response = client.post("/predict", json={"images": [{"b64": b64(encode(doubled))}]})
    assert response.status_code == 200
    assert response.json()["predictions"][0]["index"] == int(np.argmax(expected))


def test_request_id_is_echoed_or_generated(client, fashion_images):
    body = {"images": [{"pixels": fashion_images[0].tolist()}]}
    mine = client.post("/predict", json=body, headers={"X-Request-ID": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42"
    generated = client.post("/predict", json=body)
    assert len(generated.headers["x-request-id"]) == 32
    unsafe = client.post("/predict", json=body, headers={"X-Request-ID": "bad id\twith spaces"})
    assert unsafe.headers["x-request-id"] != "bad id\twith spaces"


def test_metrics_count_requests_batches_and_queue_time(client, fashion_images):
    client.post("/predict", json={"images": [{"pixels": fashion_images[0].tolist()}]})
    text = client.get("/metrics").text
    for line in (
        'vitserve_http_requests_total{method="POST",route="/predict",status="200"}',
        'vitserve_http_request_duration_seconds_count{method="POST",route="/predict"}',
        'vitserve_queue_wait_seconds_count{graph="classifier",model="tiny-vit"}',
        'vitserve_compute_seconds_count{graph="classifier",model="tiny-vit"}',
        'vitserve_batch_size_count{graph="classifier",model="tiny-vit"}',
        'vitserve_queue_depth{graph="classifier",model="tiny-vit"} 0.0',
        "vitserve_ready 1.0",
        f'vitserve_model_info{{model="{MODEL_NAME}",precision="fp32",provider="CPUExecutionProvider",version="1"}} 1.0',
    ):
        assert line in text, line


def test_models_health_and_openapi(client, settings):
    info = client.get("/models").json()["models"][0]
    assert info["name"] == MODEL_NAME and info["version"] == 1
    assert info["labels"] == LABELS
    assert info["input"] == FASHION_INPUT
    assert info["provider"] == "CPUExecutionProvider"
    assert info["grid"] == [4, 4] and info["pooling"] == "mean"
    assert info["batching"]["max_batch_size"] == settings.batching.max_batch_size
    assert info["limits"]["max_images_per_request"] == settings.limits.max_images_per_request
    assert client.get(f"/models/{MODEL_NAME}").json() == info
    assert client.get("/health/live").json() == {"status": "live", "ready": True}
    assert client.get("/health/ready").json() == {"status": "ready", "ready": True}
    document = client.get("/openapi.json").json()
    body = document["paths"]["/predict"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "multipart/form-data"}
    assert body["application/json"]["examples"]
    assert "PredictRequest" in document["components"]["schemas"]
    assert "ImageInput" in document["components"]["schemas"]
    assert "422" in document["paths"]["/predict"]["post"]["responses"]


def test_the_default_top_k_fits_a_model_with_fewer_classes():
    """A three-class model answers the default request (top_k 5 unless asked) with its three
    classes; asking for more classes than it has is still a 422."""
    from service.errors import InvalidInput
    from service.frontend.routers.predict import check_top_k

    labels = ["circle", "square", "triangle"]
    assert check_top_k(5, labels, given=False) == 3
    assert check_top_k(2, labels, given=True) == 2
    with pytest.raises(InvalidInput, match="top_k: 5 is more than the model's 3 classes"):
        check_top_k(5, labels, given=True)
