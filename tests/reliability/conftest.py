"""Fixtures for the reliability tests: a tiny model written by the export stage, apps, real servers.

The model is exported once per session with ``export.onnx.export_model`` (as tests/service does), so
nothing here depends on the shipped model's file. Real servers listen on loopback ports 18200-18299
(docs/ARCHITECTURE.md), run under ``nice -n 10`` with one thread, and are always stopped.
"""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from export.checkpoint import save_checkpoint
from export.config import ViTConfig
from export.data import FASHION_MNIST_LABELS, load_dataset
from export.model import VisionTransformer
from export.onnx import export_model
from service.main import create_app
from service.settings import Settings

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-vit"
TINY = ViTConfig(patch_size=7, dim=32, depth=2, heads=2, mlp_dim=64, pooling="mean")
PORTS = range(18200, 18300)  # the reliability tests' loopback range (docs/ARCHITECTURE.md)
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_IMAGES = 8
MAX_PIXELS = 4096 * 4096
NUM_CLASSES = len(FASHION_MNIST_LABELS)

torch.set_num_threads(1)  # a training run may hold the other core


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
    work = tmp_path_factory.mktemp("reliability-export")
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
    """16 real Fashion-MNIST test images, uint8 [N, 28, 28]: light objects on a dark background."""
    _, test = load_dataset("fashion-mnist")
    return test.images[:16, 0].numpy().copy()


def make_settings(repository: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "model_repository": repository,
        "model_name": MODEL_NAME,
        "max_batch_size": 8,
        "attention_max_batch_size": 2,
        "max_queue_delay_ms": 2.0,
        "max_queue_size": 64,
        "max_images_per_request": MAX_IMAGES,
        "max_pixels_per_image": MAX_PIXELS,
        "max_body_bytes": MAX_BODY_BYTES,
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
    with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:
        yield test_client


# --- images and answers ---------------------------------------------------------------------------


def encode(image: Image.Image | np.ndarray, image_format: str = "PNG", **options: object) -> bytes:
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming(width: int, height: int) -> bytes:
    """A valid PNG header (right CRCs) that claims ``width x height`` grey pixels, with one tiny IDAT:
    what a decompression bomb looks like before anything is inflated."""
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", idat)
        + _chunk(b"IEND", b"")
    )


# What a stack trace or an internal path looks like in a response body.
_LEAKS = re.compile(r"Traceback|File \"|/site-packages/|/work/|\.py\b|line \d+, in ")


def assert_no_leak(response: httpx.Response) -> None:
    text = (
        response.text if not response.headers.get("content-type", "").startswith("image/") else ""
    )
    assert not _LEAKS.search(text), f"the response leaks internals: {text[:500]}"


def assert_error(response: httpx.Response, status: int, *fragments: str) -> dict:
    """The response is the service's JSON error with this status, naming every fragment."""
    assert response.status_code == status, (status, response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) >= {"code", "message", "field", "request_id"}, error
    assert error["request_id"] and error["request_id"] == response.headers["x-request-id"]
    for fragment in fragments:
        assert fragment in error["message"], (fragment, error["message"])
    assert_no_leak(response)
    return error


def metric(metrics_text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


# --- real servers ---------------------------------------------------------------------------------


def free_port() -> int:
    start = (os.getpid() * 7 + int(time.monotonic() * 1000)) % len(PORTS)
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
        VITSERVE_MAX_IMAGES_PER_REQUEST=str(MAX_IMAGES),
        VITSERVE_MAX_BODY_BYTES=str(MAX_BODY_BYTES),
        VITSERVE_LOG_LEVEL="info",
        VITSERVE_HOST="127.0.0.1",
        VITSERVE_PORT=str(port),
    )
    env.update({f"VITSERVE_{key.upper()}": str(value) for key, value in settings.items()})
    return env


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    port: int
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def rss_bytes(self, field: str = "VmRSS") -> int:
        """Resident memory of the server process from /proc (VmHWM is the peak)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field} for process {self.process.pid}")


def start_process(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("wb") as handle:
        return subprocess.Popen(
            ["nice", "-n", "10", sys.executable, *command],
            cwd=REPO,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )


def stop_process(process: subprocess.Popen, timeout: float = 30) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def running_server(repository: Path, log: Path, **settings: object) -> Iterator[Server]:
    """``python -m service`` on a free loopback port; waits until ready; always stopped after."""
    port = free_port()
    process = start_process(["-m", "service"], server_env(repository, port, **settings), log)
    server = Server(process, f"http://127.0.0.1:{port}", port, log)
    try:
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                raise AssertionError(f"server exited with {process.returncode}:\n{server.output()}")
            try:
                if httpx.get(f"{server.url}/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server not ready within 90 s:\n{server.output()}")
            time.sleep(0.1)
        yield server
    finally:
        stop_process(process)


# --- what the service must agree with -------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """The exported classifier run in-process with onnxruntime on independently normalised images."""

    session: object
    mean: float
    std: float

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        """uint8 [N, 28, 28] light-on-dark images -> softmax probabilities [N, classes]."""
        x = ((images.astype(np.float32)[:, None] / 255.0 - self.mean) / self.std).astype(np.float32)
        (logits,) = self.session.run(["logits"], {"images": x})
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)


@pytest.fixture(scope="session")
def reference(model_repository: Path) -> Reference:
    import onnxruntime as ort

    from export.data import get_dataset_spec

    spec = get_dataset_spec("fashion-mnist")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        str(model_repository / MODEL_NAME / "1" / "model.onnx"),
        options,
        providers=["CPUExecutionProvider"],
    )
    return Reference(session, float(spec.mean[0]), float(spec.std[0]))


def assert_matches(prediction: dict, probabilities: np.ndarray, atol: float = 1e-4) -> None:
    """One served prediction agrees with the reference probabilities of its image."""
    assert prediction["index"] == int(np.argmax(probabilities)), (prediction, probabilities)
    for entry in prediction["top_k"]:
        assert entry["score"] == pytest.approx(float(probabilities[entry["index"]]), abs=atol)
