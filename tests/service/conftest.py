"""Fixtures for the service tests: a tiny model exported by the export stage, the app, real servers.

The model is built once per session with ``export.onnx.export_model`` (the same code that writes the
shipped model), so these tests never depend on the shipped model's file. The tests may import torch;
the service never does (test_startup.py checks it).
"""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from export.checkpoint import save_checkpoint
from export.config import ViTConfig
from export.data import FASHION_MNIST_LABELS, get_dataset_spec, load_dataset
from export.model import VisionTransformer
from export.onnx import export_model
from service.main import create_app
from service.settings import Settings

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-vit"
# Patches of 7 px on 28 x 28: a 4 x 4 grid, so export and inference cost next to nothing. Mean pooling,
# like the shipped model.
TINY = ViTConfig(patch_size=7, dim=32, depth=2, heads=2, mlp_dim=64, pooling="mean")
SPEC = get_dataset_spec("fashion-mnist")
PORTS = range(18000, 18100)  # the service tests' loopback range (docs/ARCHITECTURE.md)

torch.set_num_threads(1)  # a training run may hold the other cores


@pytest.fixture(scope="session", autouse=True)
def _clean_environment() -> Iterator[None]:
    """No VITSERVE_* from the developer's shell leaks into the settings under test."""
    saved = {key: os.environ.pop(key) for key in list(os.environ) if key.startswith("VITSERVE_")}
    saved_port = os.environ.pop("PORT", None)
    yield
    os.environ.update(saved)
    if saved_port is not None:
        os.environ["PORT"] = saved_port


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model repository holding ``tiny-vit`` version 1, written by the export stage."""
    work = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    model = VisionTransformer(TINY).eval()
    with torch.no_grad():  # the head starts at zero: give it weights so that classes differ
        torch.nn.init.normal_(model.head.weight, std=1.0)
        torch.nn.init.normal_(model.position_embedding, std=0.5)
    checkpoint = work / "tiny.safetensors"
    save_checkpoint(model, checkpoint, "fashion-mnist", FASHION_MNIST_LABELS)
    repository = work / "models"
    export_model(checkpoint, MODEL_NAME, 1, repository, measure=False)
    return repository


@pytest.fixture(scope="session")
def fashion_images() -> np.ndarray:
    """24 real Fashion-MNIST test images, uint8 [N, 28, 28]: light objects on a dark background."""
    _, test = load_dataset("fashion-mnist")
    return test.images[:24, 0].numpy().copy()


def make_settings(repository: Path, **overrides) -> Settings:
    values = {
        "model_repository": repository,
        "model_name": MODEL_NAME,
        "max_batch_size": 8,
        "attention_max_batch_size": 2,
        "max_queue_delay_ms": 5.0,
        "max_queue_size": 64,
        "max_images_per_request": 8,
        "max_pixels_per_image": 100_000,
        "max_body_bytes": 256 * 1024,
        "request_timeout_s": 20.0,
        "intra_op_threads": 1,
        "inter_op_threads": 1,
        "provider": "cpu",
        "log_level": "warning",
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(scope="session")
def settings(model_repository: Path) -> Settings:
    return make_settings(model_repository)


@pytest.fixture(scope="session")
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@dataclass(frozen=True)
class Reference:
    """The exported graphs run in-process with onnxruntime: what the service must agree with."""

    classifier: ort.InferenceSession
    attention: ort.InferenceSession

    @staticmethod
    def normalise(images: np.ndarray) -> np.ndarray:
        """uint8 [N, 28, 28] -> the training normalisation, computed here independently."""
        x = images.astype(np.float32)[:, None] / 255.0
        return ((x - SPEC.mean[0]) / SPEC.std[0]).astype(np.float32)

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        (logits,) = self.classifier.run(["logits"], {"images": self.normalise(images)})
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)

    def attention_maps(self, images: np.ndarray) -> np.ndarray:
        _, maps = self.attention.run(["logits", "attention"], {"images": self.normalise(images)})
        return maps


@pytest.fixture(scope="session")
def reference(model_repository: Path) -> Reference:
    version = model_repository / MODEL_NAME / "1"
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    providers = ["CPUExecutionProvider"]
    return Reference(
        ort.InferenceSession(str(version / "model.onnx"), options, providers=providers),
        ort.InferenceSession(str(version / "attention.onnx"), options, providers=providers),
    )


def encode(array: np.ndarray, image_format: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=image_format, **options)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def assert_error(response: httpx.Response, status: int, *fragments: str) -> dict:
    """The response is the service's JSON error with this status, naming every fragment."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"code", "message", "field", "request_id"}
    assert error["request_id"] == response.headers["x-request-id"]
    for fragment in fragments:
        assert fragment in error["message"], (fragment, error["message"])
    assert "Traceback" not in response.text
    return error


# --- real servers -------------------------------------------------------------------------------


def free_port() -> int:
    start = os.getpid() % len(PORTS)
    for offset in range(len(PORTS)):
        port = PORTS[(start + offset) % len(PORTS)]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS.start}-{PORTS.stop - 1}")


def server_env(repository: Path, port: int, **settings: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_") and k != "PORT"}
    env.update(
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        VITSERVE_MODEL_REPOSITORY=str(repository),
        VITSERVE_MODEL_NAME=MODEL_NAME,
        VITSERVE_PROVIDER="cpu",
        VITSERVE_INTRA_OP_THREADS="1",
        VITSERVE_INTER_OP_THREADS="1",
        VITSERVE_MAX_BATCH_SIZE="8",
        VITSERVE_ATTENTION_MAX_BATCH_SIZE="2",
        VITSERVE_MAX_IMAGES_PER_REQUEST="8",
        VITSERVE_MAX_BODY_BYTES=str(256 * 1024),
        VITSERVE_LOG_LEVEL="info",
        PORT=str(port),
    )
    env.update({f"VITSERVE_{key.upper()}": str(value) for key, value in settings.items()})
    return env


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("wb") as handle:
        return subprocess.Popen(
            ["nice", "-n", "10", sys.executable, *command],
            cwd=REPO,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )


@contextmanager
def running_server(
    command: list[str], repository: Path, log: Path, **settings: object
) -> Iterator[Server]:
    """A real service process on a free loopback port ('{port}' in ``command`` is replaced); waits until
    ready; always stopped (SIGTERM) after."""
    port = free_port()
    command = [part.format(port=port) for part in command]
    process = start_server(command, server_env(repository, port, **settings), log)
    server = Server(process, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise AssertionError(f"server exited with {process.returncode}:\n{server.output()}")
            try:
                if httpx.get(f"{server.url}/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server not ready within 60 s:\n{server.output()}")
            time.sleep(0.1)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
