"""The servers vitserve is measured against answer correctly: the same JSON as the service, and the
probabilities of an independent reference (the model file run here on images normalised here)."""

from __future__ import annotations

import base64

import numpy as np
import onnxruntime as ort
import pytest
from fastapi.testclient import TestClient

from bench.baselines.plain_onnx_server import create_app
from bench.payloads import load_images, png_bytes
from bench.server_process import REPO
from export.data import get_dataset_spec

MODEL_DIR = REPO / "models" / "fashion-mnist-vit" / "1"
LABELS = (MODEL_DIR / "labels.txt").read_text().split("\n")


def reference_logits(images: np.ndarray) -> np.ndarray:
    """uint8 [N, 28, 28] light-on-dark garments -> logits of the shipped model, computed here."""
    spec = get_dataset_spec("fashion-mnist")
    x = ((images.astype(np.float32)[:, None] / 255.0 - spec.mean[0]) / spec.std[0]).astype(
        np.float32
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        MODEL_DIR / "model.onnx", options, providers=["CPUExecutionProvider"]
    )
    return session.run(["logits"], {"images": x})[0]


def probabilities(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def test_the_plain_server_answers_what_the_model_says():
    images, _ = load_images(3)
    expected = probabilities(reference_logits(images))
    body = {
        "images": [{"b64": base64.b64encode(png_bytes(i)).decode()} for i in images],
        "top_k": 3,
    }
    with TestClient(create_app(MODEL_DIR)) as client:
        assert client.get("/health/ready").status_code == 200
        answer = client.post("/predict", json=body).json()
    assert answer["model"] == {"name": "fashion-mnist-vit", "version": 1}
    for prediction, p in zip(answer["predictions"], expected, strict=True):
        order = np.argsort(-p)[:3]
        assert [e["index"] for e in prediction["top_k"]] == order.tolist()
        assert [e["label"] for e in prediction["top_k"]] == [LABELS[i] for i in order]
        assert [e["score"] for e in prediction["top_k"]] == pytest.approx(p[order], abs=1e-5)
        assert (
            prediction["index"] == order[0]
            and prediction["score"] == prediction["top_k"][0]["score"]
        )


def test_the_torch_server_runs_the_weights_the_model_file_was_exported_from():
    from bench.baselines.torch_eager_server import checkpoint_of, torch_model

    assert checkpoint_of(MODEL_DIR) == REPO / "checkpoints/fashion-small-stage3/model.safetensors"
    images, _ = load_images(4)
    spec = get_dataset_spec("fashion-mnist")
    x = ((images.astype(np.float32)[:, None] / 255.0 - spec.mean[0]) / spec.std[0]).astype(
        np.float32
    )
    assert torch_model(MODEL_DIR)(x) == pytest.approx(reference_logits(images), abs=1e-4)


def test_the_no_model_server_answers_the_same_json_without_a_model():
    from bench.baselines.no_model_server import no_model

    images, _ = load_images(2)
    body = {"images": [{"b64": base64.b64encode(png_bytes(i)).decode()} for i in images]}
    with TestClient(create_app(MODEL_DIR, no_model(MODEL_DIR))) as client:
        answer = client.post("/predict", json=body).json()
    assert len(answer["predictions"]) == 2
    for prediction in answer["predictions"]:  # every logit 0: every class equally likely
        assert [e["index"] for e in prediction["top_k"]] == [0, 1, 2, 3, 4]
        assert [e["score"] for e in prediction["top_k"]] == pytest.approx([0.1] * 5)


def test_a_dynamic_batch_answers_each_request_as_alone():
    """The anchors' batched stage: one model run over every request's images, split back."""
    from bench.baselines.classifier import Classifier

    classifier = Classifier(MODEL_DIR)
    encoded = [base64.b64encode(png_bytes(i)).decode() for i in load_images(3)[0]]
    tensors = [classifier.tensor(e) for e in encoded]
    requests = [(np.stack(tensors[:2]), 3), (tensors[2][None], 1)]
    batched = classifier.answer_each(requests)
    alone = [classifier.answer(classifier.logits(x), k) for x, k in requests]
    assert [len(a["predictions"]) for a in batched] == [2, 1]
    assert [len(a["predictions"][0]["top_k"]) for a in batched] == [3, 1]
    for got, want in zip(batched, alone, strict=True):
        for g, w in zip(got["predictions"], want["predictions"], strict=True):
            assert g["index"] == w["index"] and g["score"] == pytest.approx(w["score"], abs=1e-5)


def test_the_triton_png_model_answers_triton_classification_strings():
    from bench.baselines.classifier import Classifier
    from bench.baselines.triton_server import TOP_K, classify_pngs

    images, _ = load_images(2)
    rows = np.array([[base64.b64encode(png_bytes(i))] for i in images], dtype=np.object_)
    answered = classify_pngs(Classifier(MODEL_DIR), rows)
    expected = probabilities(reference_logits(images))
    assert answered.shape == (2, TOP_K)
    for row, p in zip(answered, expected, strict=True):
        score, index, label = row[0].decode().split(":", 2)
        assert (int(index), label) == (int(np.argmax(p)), LABELS[int(np.argmax(p))])
        assert float(score) == pytest.approx(p.max(), abs=1e-5)
