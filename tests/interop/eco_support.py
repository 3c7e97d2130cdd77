"""What the ecosystem tests (gRPC, Triton's config and statistics, tracing, logs, CORS, KServe's client)
share: their own ports of the interop range, servers with gRPC on, and an independent reference.

HTTP servers take ports 18350-18359, gRPC listeners 18360-18399 (docs/ARCHITECTURE.md gives the interop
tests 18300-18399).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
from fastapi.testclient import TestClient

from bench import server_process
from service.launcher.local_app import local_app
from tests.support import (
    INTEROP,
    Reference,
    Server,
    Suite,
    free_port,
    make_settings,
    server_env,
    start_process,
    stop_process,
    worker_share,
)

ECO = Suite(range(18350, 18360), ready_within_s=INTEROP.ready_within_s)
GRPC_PORTS = worker_share(range(18360, 18400))


def grpc_port() -> int:
    return free_port(GRPC_PORTS)


@contextmanager
def eco_server(
    repository: Path, log: Path, env: Mapping[str, str] | None = None, **settings: object
) -> Iterator[tuple[Server, int]]:
    """A real ``python -m service`` with gRPC on: (the server, its gRPC port). ``env`` adds variables
    that are not settings (OTEL_*); ``settings`` become VITSERVE_* variables."""
    port, grpc = free_port(ECO.ports), grpc_port()
    environment = {**server_env(repository, port, ECO, grpc_port=grpc, **settings), **(env or {})}
    process = start_process(["-m", "service"], environment, log)
    server = Server(process, f"http://127.0.0.1:{port}", port, log)
    try:
        server_process.wait_ready(
            process, server.url, log, timeout_s=ECO.ready_within_s, poll_s=0.1, name="server"
        )
        yield server, grpc
    finally:
        stop_process(process)


@contextmanager
def eco_app(repository: Path, grpc: bool = True, **settings: object) -> Iterator[TestClient]:
    """An in-process app (its lifespan run), with a gRPC listener on a port of ours when ``grpc``;
    the port is ``client.app.state.settings.server.grpc_port``."""
    values = {"grpc_port": grpc_port() if grpc else 0, **settings}
    with TestClient(local_app(make_settings(repository, ECO, **values))) as client:
        yield client


def reference_logits(reference: Reference, tensor: np.ndarray) -> np.ndarray:
    """The classifier graph on a float32 [N, 1, 28, 28] tensor, run by the test's own session."""
    (logits,) = reference.classifier.run(["logits"], {"images": tensor})
    return logits


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def predict_probabilities(http: httpx.Client, images: np.ndarray) -> np.ndarray:
    """``/predict`` on uint8 [N, H, W] images (as pixels, never inverted): probabilities [N, classes],
    sent 8 at a time (the test servers' max_images_per_request)."""
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
