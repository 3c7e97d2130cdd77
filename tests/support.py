"""What the service-level suites (tests/service, tests/reliability, tests/interop) share, fixtures aside.

Test modules import from here (``from tests.support import ...``), never from ``conftest``: with several
test directories in one run, ``conftest`` may name another directory's. The shared fixtures (the tiny
model, exported once per session, the apps, the reference) live in tests/conftest.py.

What differs between the suites is a ``Suite``: its loopback ports (docs/ARCHITECTURE.md), the limits its
apps and servers run with, and how long a server may take to become ready.
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import io
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from bench import server_process
from bench.machine import tree_memory_kib
from export.config import ViTConfig
from export.data import FASHION_MNIST_LABELS, get_dataset_spec
from service.engine.batcher import DynamicBatcher
from service.engine.pipeline import ModelPipeline
from service.engine.request import awaited
from service.settings import Settings

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "tiny-vit"
# Patches of 7 px on 28 x 28: a 4 x 4 grid, so export and inference cost next to nothing. Mean pooling,
# like the shipped model.
TINY = ViTConfig(patch_size=7, dim=32, depth=2, heads=2, mlp_dim=64, pooling="mean")
SPEC = get_dataset_spec("fashion-mnist")
NUM_CLASSES = len(FASHION_MNIST_LABELS)
MAX_IMAGES = 8
# The input a Fashion-MNIST model's metadata declares (and /models shows).
FASHION_INPUT = {
    "name": "images",
    "layout": "NCHW",
    "dtype": "float32",
    "channels": 1,
    "height": 28,
    "width": 28,
}
# The reliability suite's limits: big enough for its oversized and many-image corpus.
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_PIXELS = 4096 * 4096


def worker_share(ports: range) -> range:
    """This pytest-xdist worker's share of ``ports`` (all of them outside xdist): two workers that
    look for a free port at once never pick the same one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return ports
    size = len(ports) // count
    index = int(worker[2:])
    return ports[index * size : (index + 1) * size]


def made_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]
) -> Path:
    """The directory ``name``, filled by ``make(directory)`` once per pytest run and shared by its
    xdist workers: the first to ask makes it under a lock, the others wait and read it.

    A module- or session-scoped fixture is otherwise made on every worker that runs a test using it,
    and ``--dist worksteal`` splits modules between workers: an export or a training run made twice.
    What ``make`` writes must only be read afterwards. Per run, never across runs (nor across
    ``make mutation``'s mutants): each run has its own base directory."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's, above each worker's own
    directory = base / "made-once" / name
    directory.parent.mkdir(parents=True, exist_ok=True)
    with directory.with_name(f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
        done = directory.with_name(f"{name}.done")
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)  # a make that failed part way
            directory.mkdir()
            make(directory)
            done.touch()
    return directory


@dataclass(frozen=True)
class Suite:
    """What differs between the suites that build apps and run real servers."""

    ports: range  # its loopback range (docs/ARCHITECTURE.md), this xdist worker's share of it
    limits: Mapping[str, object] = field(default_factory=dict)  # over BASE_SETTINGS
    ready_within_s: float = 60.0  # how long a real server may take to become ready

    def __post_init__(self) -> None:
        object.__setattr__(self, "ports", worker_share(self.ports))


SERVICE = Suite(range(18000, 18100))
RELIABILITY = Suite(
    range(18200, 18300),
    {
        "max_queue_delay_ms": 2.0,
        "max_pixels_per_image": MAX_PIXELS,
        "max_body_bytes": MAX_BODY_BYTES,
    },
    ready_within_s=90.0,
)
INTEROP = Suite(range(18300, 18400))

BASE_SETTINGS: Mapping[str, object] = {
    "model_name": MODEL_NAME,
    "max_batch_size": 8,
    "attention_max_batch_size": 2,
    "max_queue_delay_ms": 5.0,
    "max_queue_size": 64,
    "max_images_per_request": MAX_IMAGES,
    "max_pixels_per_image": 100_000,
    "max_body_bytes": 256 * 1024,
    "request_timeout_s": 20.0,
    "intra_op_threads": 1,
    "inter_op_threads": 1,
    "provider": "cpu",
    "log_level": "warning",
    "grpc_port": 0,  # no gRPC listener unless a test asks for one on its own ports
}


def make_settings(repository: Path, suite: Suite = SERVICE, **overrides: object) -> Settings:
    """Settings for an in-process app: BASE_SETTINGS, then the suite's limits, then ``overrides``."""
    values = {**BASE_SETTINGS, **suite.limits, "model_repository": repository, **overrides}
    return Settings(**values)


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


def wait_until(
    condition: Callable[[], object], what: str, timeout_s: float = 30.0, poll_s: float = 0.02
) -> object:
    """Poll ``condition`` until it returns something truthy, and return that; fail naming ``what``
    after ``timeout_s``. A test waits on an event with this, never on a fixed sleep: a passing run
    waits only as long as the event takes, and ``timeout_s`` is only the bound of a failing one."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


# --- what the service must agree with -------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """The exported graphs run in-process with onnxruntime: what the service must agree with."""

    classifier: ort.InferenceSession
    attention: ort.InferenceSession

    @classmethod
    def load(cls, repository: Path) -> Reference:
        version = repository / MODEL_NAME / "1"
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        return cls(
            ort.InferenceSession(str(version / "model.onnx"), options, providers=providers),
            ort.InferenceSession(str(version / "attention.onnx"), options, providers=providers),
        )

    @staticmethod
    def normalise(images: np.ndarray) -> np.ndarray:
        """uint8 [N, 28, 28] -> the training normalisation, computed here independently."""
        x = images.astype(np.float32)[:, None] / 255.0
        return ((x - SPEC.mean[0]) / SPEC.std[0]).astype(np.float32)

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        """uint8 [N, 28, 28] light-on-dark images -> softmax probabilities [N, classes]."""
        (logits,) = self.classifier.run(["logits"], {"images": self.normalise(images)})
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)

    def attention_maps(self, images: np.ndarray) -> np.ndarray:
        _, maps = self.attention.run(["logits", "attention"], {"images": self.normalise(images)})
        return maps


def assert_matches(prediction: dict, probabilities: np.ndarray, atol: float = 1e-4) -> None:
    """One served prediction agrees with the reference probabilities of its image."""
    assert prediction["index"] == int(np.argmax(probabilities)), (prediction, probabilities)
    for entry in prediction["top_k"]:
        assert entry["score"] == pytest.approx(float(probabilities[entry["index"]]), abs=atol)


def asgi_post(
    app, path: str, headers: list[tuple[bytes, bytes]], chunks: Iterable[bytes]
) -> tuple[int, dict, int]:
    """POST to the ASGI app directly, with header bytes no HTTP client would send and the body in
    ``chunks`` (then an empty last message): (status, JSON answer, how many chunks the app read)."""
    pending = iter(chunks)
    pulled = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal pulled
        chunk = next(pending, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        pulled += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"testserver"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body), pulled


def recv_until(sock: socket.socket, done: Callable[[bytes], bool], data: bytes = b"") -> bytes:
    """``data`` and what ``sock`` sends after it, read until ``done(data)`` or the peer closes."""
    while not done(data):
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
    return data


# --- real servers ---------------------------------------------------------------------------------


def free_port(ports: range) -> int:
    """A free port of ``ports``, looking from a point that differs between runs and processes."""
    return server_process.free_port(ports, start=os.getpid() * 7 + int(time.monotonic() * 1000))


def run_python(script: str, env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -c script args`` from the repository root with ``env``; its output as text."""
    return run_in_repo(["-c", script, *args], env)


def run_in_repo(
    argv: Sequence[str], env: Mapping[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python argv`` from the repository root with ``env`` and no other variable; its output as
    text."""
    return subprocess.run(
        [sys.executable, *argv],
        cwd=REPO,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def server_env(
    repository: Path, port: int, suite: Suite = SERVICE, **settings: object
) -> dict[str, str]:
    """The environment of a ``python -m service`` (or uvicorn) process: the suite's body limit, then
    ``settings`` as VITSERVE_* variables; nothing from the caller's VITSERVE_* or PORT."""
    max_body_bytes = suite.limits.get("max_body_bytes", BASE_SETTINGS["max_body_bytes"])
    return server_process.clean_env(
        {
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "VITSERVE_MODEL_REPOSITORY": str(repository),
            "VITSERVE_MODEL_NAME": MODEL_NAME,
            "VITSERVE_PROVIDER": "cpu",
            "VITSERVE_INTRA_OP_THREADS": "1",
            "VITSERVE_INTER_OP_THREADS": "1",
            "VITSERVE_MAX_BATCH_SIZE": "8",
            "VITSERVE_ATTENTION_MAX_BATCH_SIZE": "2",
            "VITSERVE_MAX_IMAGES_PER_REQUEST": str(MAX_IMAGES),
            "VITSERVE_MAX_BODY_BYTES": str(max_body_bytes),
            "VITSERVE_LOG_LEVEL": "info",
            "VITSERVE_HOST": "127.0.0.1",
            "VITSERVE_GRPC_PORT": "0",  # not 8001: tests pass a port of their range to have gRPC
            "PORT": str(port),
            **{f"VITSERVE_{key.upper()}": str(value) for key, value in settings.items()},
        }
    )


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    port: int
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def rss_bytes(self, field: str = "VmRSS") -> int:
        """Resident memory of the server's processes together from /proc (VmHWM: the sum of their
        peaks): the supervisor, the engine and every front end."""
        kib = tree_memory_kib(self.process.pid)[field]
        assert kib is not None, f"no {field} for process {self.process.pid}"
        return kib * 1024


def start_process(command: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``python COMMAND`` from the repository root under ``nice -n 10``, output to ``log``."""
    return server_process.spawn(["nice", "-n", "10", sys.executable, *command], env, log)


def stop_process(process: subprocess.Popen, timeout: float = 30) -> None:
    server_process.stop_process(process, timeout_s=timeout)


@contextmanager
def running_server(
    repository: Path,
    log: Path,
    *,
    suite: Suite,
    command: Sequence[str] = ("-m", "service"),
    **settings: object,
) -> Iterator[Server]:
    """A real service process on a free port of the suite's range ('{port}' in ``command`` is
    replaced); waits until ready; always stopped (SIGTERM) after."""

    def environment(port: int) -> dict[str, str]:
        return server_env(repository, port, suite, **settings)

    with service_process(environment, log, suite, command) as live:
        yield Server(live.process, live.url, live.port, log)


@contextmanager
def service_process(
    env: Callable[[int], dict[str, str]],
    log: Path,
    suite: Suite,
    command: Sequence[str] = ("-m", "service"),
) -> Iterator[server_process.RunningServer]:
    """``running_server`` with the environment ``env(port)`` makes for the port it is given."""
    with server_process.running(
        ["nice", "-n", "10", sys.executable, *command],
        env,
        log,
        ports=suite.ports,
        start=os.getpid() * 7 + int(time.monotonic() * 1000),
        ready_timeout_s=suite.ready_within_s,
        poll_s=0.1,
        name="server",
    ) as live:
        yield live


class HoldFirstCall:
    """A model run (shared by several batcher instances) whose first call waits for ``release``:
    that call's instance stays busy while the others are free, whichever instance took it."""

    def __init__(self, run) -> None:
        self.run = run
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._calls = 0

    def __call__(self, images):
        with self._lock:
            first = self._calls == 0
            self._calls += 1
        if first:
            self.release.wait(30)
        return self.run(images)


@contextmanager
def held(pipeline: ModelPipeline) -> Iterator[ModelPipeline]:
    """A version held for the length of a block, as a call holds it from its arrival to its answer."""
    pipeline.hold()
    try:
        yield pipeline
    finally:
        pipeline.release()


async def submit(
    batcher: DynamicBatcher,
    rows: np.ndarray,
    request_id: str | None = None,
    disconnected: object | None = None,
    alone: bool = False,
) -> list[np.ndarray]:
    """A request of ``rows`` queued on ``batcher`` as the engine queues one, and awaited as a front
    end's own engine awaits it: every output, stacked over the rows in order, or its error."""
    return await awaited(lambda r: batcher.enqueue([r], alone), rows, request_id, disconnected)  # type: ignore[arg-type]


async def run_on(
    pipeline: ModelPipeline,
    graph: str,
    rows: np.ndarray,
    request_id: str | None = None,
    disconnected: object | None = None,
    alone: bool = False,
) -> list[np.ndarray]:
    """:func:`submit` on one graph of a model version (its batcher, as ``Engine.submit`` queues)."""
    return await awaited(
        lambda r: pipeline.batcher(graph).enqueue([r], alone),  # type: ignore[arg-type]
        rows,
        request_id,
        disconnected,  # type: ignore[arg-type]
    )
