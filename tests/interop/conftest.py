"""Fixtures for the interoperability tests: the service tests' fixtures, reused, on this area's ports.

tests/service/conftest.py builds the tiny model with the export stage at session start and runs real
servers; it is loaded here as a private module so that its port range can be set to this area's
(18300-18399, docs/ARCHITECTURE.md) without touching the service tests' own copy.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

_path = Path(__file__).resolve().parents[1] / "service" / "conftest.py"
_spec = importlib.util.spec_from_file_location("_vitserve_service_fixtures", _path)
assert _spec is not None and _spec.loader is not None
service_fixtures = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = service_fixtures  # dataclasses look their module up there
_spec.loader.exec_module(service_fixtures)
service_fixtures.PORTS = range(18300, 18400)  # the interoperability tests' loopback range

# The fixtures this directory uses, registered here by name.
_clean_environment = service_fixtures._clean_environment
model_repository = service_fixtures.model_repository
fashion_images = service_fixtures.fashion_images
reference = service_fixtures.reference

REPO = service_fixtures.REPO
MODEL_NAME = service_fixtures.MODEL_NAME
Reference = service_fixtures.Reference
encode = service_fixtures.encode
running_server = service_fixtures.running_server
Server = service_fixtures.Server


@pytest.fixture(scope="session")
def fashion_test_set() -> tuple[np.ndarray, np.ndarray]:
    """The first 200 Fashion-MNIST test images (uint8 [N, 28, 28]) and their labels (int [N])."""
    from export.data import load_dataset

    _, test = load_dataset("fashion-mnist")
    return test.images[:200, 0].numpy().copy(), test.labels[:200].numpy().copy()


@pytest.fixture(scope="module")
def server(model_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real ``python -m service`` process serving the tiny model, batching over 50 ms."""
    log = tmp_path_factory.mktemp("interop-server") / "service.log"
    with running_server(
        ["-m", "service"], model_repository, log, max_queue_delay_ms=50, max_batch_size=8
    ) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def predict_probabilities(http: httpx.Client, images: np.ndarray) -> np.ndarray:
    """``/predict`` on uint8 [N, H, W] images (as pixels, never inverted): probabilities [N, classes].

    Sent 8 at a time, the servers' max_images_per_request."""
    rows = []
    for start in range(0, len(images), 8):
        body = {
            "images": [{"pixels": image.tolist()} for image in images[start : start + 8]],
            "top_k": 10,
            "invert": "never",
        }
        response = http.post("/predict", json=body)
        assert response.status_code == 200, response.text
        for prediction in response.json()["predictions"]:
            scores = {entry["index"]: entry["score"] for entry in prediction["top_k"]}
            rows.append([scores[i] for i in range(len(scores))])
    return np.asarray(rows)
