"""Faults and security: a failing model run, a bad model file at start-up, the API key, and
limits that hold before any work is done.
"""

from __future__ import annotations

import ast
import logging
import select
import shutil
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
import pytest
from fastapi.testclient import TestClient
from PIL import Image, ImageFile

from service.contract.decoding import ACCEPTED_FORMATS
from service.launcher.local_app import local_app
from tests.support import (
    MODEL_NAME,
    NUM_CLASSES,
    RELIABILITY,
    REPO,
    asgi_post,
    assert_error,
    assert_matches,
    b64,
    encode,
    make_settings,
    metric,
    png_claiming,
    recv_until,
    running_server,
    server_env,
    start_process,
    stop_process,
)

# An all-white image is, after normalisation, over 2.0 everywhere: no garment photo is. The patched
# runtime fails any batch that holds one.
POISON = np.full((28, 28), 255, np.uint8)


def poisoned(images: np.ndarray) -> bool:
    return bool((images.reshape(len(images), -1).min(axis=1) > 2.0).any())


class FailingSession:
    """An onnxruntime session whose ``run`` raises for any batch that holds the poison image."""

    def __init__(self, session) -> None:
        self.session = session

    def run(self, output_names, feeds, *args, **kwargs):
        if poisoned(next(iter(feeds.values()))):
            raise RuntimeError("injected fault: onnxruntime failed")
        return self.session.run(output_names, feeds, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.session, name)


@contextmanager
def faulty_client(
    model_repository: Path, monkeypatch: pytest.MonkeyPatch, **settings: object
) -> Iterator[TestClient]:
    """A started app whose two onnxruntime sessions fail on poisoned batches."""
    app = local_app(make_settings(model_repository, RELIABILITY, **settings))
    with TestClient(app, raise_server_exceptions=False) as client:
        runtime = client.app.state.engine.manager.resolve().runtime
        monkeypatch.setattr(
            runtime, "classifiers", [FailingSession(s) for s in runtime.classifiers]
        )
        monkeypatch.setattr(runtime, "attention", FailingSession(runtime.attention))
        yield client


@pytest.fixture
def one_per_batch(model_repository, monkeypatch) -> Iterator[TestClient]:
    with faulty_client(model_repository, monkeypatch, max_batch_size=1) as client:
        yield client


@pytest.fixture
def slow_batches(model_repository, monkeypatch) -> Iterator[TestClient]:
    with faulty_client(
        model_repository, monkeypatch, max_queue_delay_ms=1000.0, idle_dispatch=False
    ) as client:
        yield client


def predict_body(image: np.ndarray) -> dict:
    return {"images": [{"pixels": image.tolist()}], "top_k": NUM_CLASSES, "invert": "never"}


# --- a failing inference --------------------------------------------------------------------------


def test_a_failing_batch_fails_only_its_requests(
    one_per_batch, fashion_images, reference, service_log
):
    client = one_per_batch
    before = client.get("/metrics").text
    bodies = [predict_body(POISON)] + [predict_body(image) for image in fashion_images[:6]]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: client.post("/predict", json=body), bodies))
    failed, *served = answers
    error = assert_error(failed, 500, "the model failed on the batch", "request id")
    assert error["code"] == "inference_failed"
    assert "injected fault" not in failed.text  # the cause goes to the log, not to the client
    for answer, probabilities in zip(
        served, reference.probabilities(fashion_images[:6]), strict=True
    ):
        assert answer.status_code == 200, answer.text
        assert_matches(answer.json()["predictions"][0], probabilities)
    logged = [r for r in service_log.records if r.levelno >= logging.ERROR and r.exc_info]
    assert len(logged) == 1 and error["request_id"] in logged[0].getMessage()
    assert "injected fault" in str(logged[0].exc_info[1])
    after = client.get("/metrics").text
    failures = metric(after, "vitserve_inference_failures_total", graph="classifier")
    assert failures - metric(before, "vitserve_inference_failures_total", graph="classifier") == 1
    assert (
        metric(after, "vitserve_http_requests_total", route="/predict", status="500")
        - metric(before, "vitserve_http_requests_total", route="/predict", status="500")
        == 1
    )
    # and it keeps serving: the same request once more, and the health routes
    again = client.post("/predict", json=bodies[1])
    assert again.status_code == 200
    assert client.get("/health/ready").status_code == 200


def test_every_request_of_the_failing_batch_gets_its_own_500(
    slow_batches, fashion_images, service_log
):
    """Four requests wait together for a batch (1 s queue delay); the batch fails: each of the four
    gets a 500 with its own request id, and the log line names all of them."""
    client = slow_batches
    bodies = [predict_body(POISON)] + [predict_body(image) for image in fashion_images[:3]]
    ids = [f"fault-{i}" for i in range(len(bodies))]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(
            pool.map(
                lambda pair: client.post(
                    "/predict", json=pair[0], headers={"X-Request-ID": pair[1]}
                ),
                zip(bodies, ids, strict=True),
            )
        )
    logged = [r.getMessage() for r in service_log.records if r.levelno >= logging.ERROR]
    batch_line = next(line for line in logged if "batch of" in line)
    in_batch = {i for i in ids if i in batch_line}
    assert ids[0] in in_batch and len(in_batch) >= 2, batch_line  # the delay grouped them
    for answer, request_id in zip(answers, ids, strict=True):
        if request_id in in_batch:
            error = assert_error(answer, 500, "request id")
            assert error["request_id"] == request_id
        else:
            assert answer.status_code == 200
    assert client.post("/predict", json=bodies[1]).status_code == 200


def test_a_failing_attention_run_is_a_500_too(one_per_batch, fashion_images):
    client = one_per_batch
    failed = client.post(
        "/attention", json={"image": {"pixels": POISON.tolist()}, "invert": "never"}
    )
    assert assert_error(failed, 500, "request id")["code"] == "inference_failed"
    served = client.post("/attention", json={"image": {"pixels": fashion_images[0].tolist()}})
    assert served.status_code == 200 and len(served.json()["map"]) == 4
    metrics = client.get("/metrics").text
    assert metric(metrics, "vitserve_inference_failures_total", graph="attention") == 1


# --- start-up with a bad model file ---------------------------------------------------------------


def _without_metadata(path: Path) -> None:
    model = onnx.load(path)
    del model.metadata_props[:]
    onnx.save(model, path)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


BAD_MODELS = {
    # name: (what is done to the copied repository, file named in the message, problem named)
    "missing model.onnx": (lambda v: (v / "model.onnx").unlink(), "1/model.onnx", "is missing"),
    "truncated model.onnx": (lambda v: _truncate(v / "model.onnx"), "1/model.onnx", "cannot load"),
    "empty attention.onnx": (
        lambda v: (v / "attention.onnx").write_bytes(b""),
        "1/attention.onnx",
        "cannot load",
    ),
    "text as model.onnx": (
        lambda v: (v / "model.onnx").write_text("not a model\n"),
        "1/model.onnx",
        "cannot load",
    ),
    "ONNX without metadata": (
        lambda v: _without_metadata(v / "model.onnx"),
        "1/model.onnx",
        "no 'vitserve' entry",
    ),
    "graphs swapped": (
        lambda v: shutil.copy(v / "attention.onnx", v / "model.onnx"),
        "1/model.onnx",
        "expected 'classifier'",
    ),
    "labels.txt disagrees": (
        lambda v: (v / "labels.txt").write_text("cat\ndog\n"),
        "labels.txt",
        "does not match",
    ),
}


def test_startup_with_a_bad_model_exits_non_zero_naming_file_and_problem(
    model_repository, tmp_path
):
    processes = {}
    ports = iter(
        RELIABILITY.ports[len(RELIABILITY.ports) // 2 :]
    )  # the upper half: 50 alone, 25 a worker under -n 2
    try:
        for number, (name, (damage, named, problem)) in enumerate(BAD_MODELS.items()):
            repository = tmp_path / f"repo{number}"
            shutil.copytree(model_repository, repository)
            damage(repository / MODEL_NAME / "1")
            log = tmp_path / f"start{number}.log"
            env = server_env(repository, next(ports), RELIABILITY, log_level="info")
            processes[name] = (start_process(["-m", "service"], env, log), log, named, problem)
        for name, (process, log, named, problem) in processes.items():
            code = process.wait(timeout=120)
            output = log.read_text(errors="replace")
            assert code != 0, (name, output)
            line = next((x for x in output.splitlines() if "cannot start" in x), "")
            assert named in line and problem in line, (name, output)
            assert "Uvicorn running" not in output and "Application startup complete" not in output
    finally:
        for process, *_ in processes.values():
            stop_process(process, timeout=5)


# --- the API key ----------------------------------------------------------------------------------

API_KEY = "s3cret-key-for-tests"
# Liveness, readiness and metrics stay open, in both APIs; "/v2" is the KServe server
# metadata document (name, version, extensions), open as Triton has it.
OPEN = {"/health/live", "/health/ready", "/metrics", "/v2/health/live", "/v2/health/ready", "/v2"}


@pytest.fixture(scope="module")
def keyed(model_repository) -> Iterator[TestClient]:
    settings = make_settings(model_repository, RELIABILITY, api_key=API_KEY)
    with TestClient(local_app(settings), raise_server_exceptions=False) as client:
        yield client


def api_operations(client: TestClient) -> list[tuple[str, str]]:
    paths = client.get("/openapi.json").json()["paths"]
    operations = []
    for template, methods in paths.items():
        path = template.replace("{name}", MODEL_NAME).replace("{version}", "1")
        operations += [(method.upper(), path) for method in methods]
    return operations


def test_with_an_api_key_every_route_but_health_and_metrics_needs_it(keyed):
    operations = api_operations(keyed)
    closed = [(m, p) for m, p in operations if p not in OPEN]
    assert {"/predict", "/attention", "/models"} <= {p for _, p in closed}
    wrong = {
        "none": {},
        "wrong key": {"Authorization": f"Bearer {API_KEY}x"},
        "prefix of the key": {"Authorization": f"Bearer {API_KEY[:-1]}"},
        "empty bearer": {"Authorization": "Bearer "},
        "basic scheme": {"Authorization": f"Basic {API_KEY}"},
        "key without scheme": {"Authorization": API_KEY},
        "non-ASCII": {"Authorization": "Bearer clé".encode()},
    }
    for method, path in closed:
        for label, headers in wrong.items():
            # an empty (invalid) body: the key is checked before anything is read or parsed
            response = keyed.request(method, path, headers=headers, content=b"")
            assert response.status_code == 401, (method, path, label, response.text[:200])
            assert "Traceback" not in response.text
            if path.startswith("/v2/"):
                assert "error" in response.json()
            else:
                assert_error(response, 401, "API key")
                assert response.headers["www-authenticate"] == "Bearer"
        granted = keyed.request(method, path, headers={"Authorization": f"Bearer {API_KEY}"})
        assert granted.status_code != 401, (method, path, granted.text[:200])
    for method, path in operations:
        if path in OPEN:
            assert keyed.request(method, path).status_code == 200, path


def test_the_right_key_serves_and_the_scheme_is_case_insensitive(keyed, fashion_images):
    body = {"images": [{"pixels": fashion_images[0].tolist()}]}
    for scheme in ("Bearer", "bearer", "BEARER"):
        answer = keyed.post("/predict", json=body, headers={"Authorization": f"{scheme} {API_KEY}"})
        assert answer.status_code == 200, answer.text


def test_the_key_is_compared_in_constant_time():
    """Every module that reads the configured key compares it with hmac.compare_digest, and none
    compares it with == or !=."""
    readers = []
    for path in sorted((REPO / "service").rglob("*.py")):
        source = path.read_text()
        if "api_key" not in source:
            continue
        tree = ast.parse(source)
        uses_secret = "get_secret_value" in source
        if not uses_secret:
            continue
        readers.append(path.name)
        calls = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("hmac.compare_digest", "compare_digest")
        ]
        assert calls, f"{path}: reads the API key but never calls hmac.compare_digest"
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(
                isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops
            ):
                text = ast.unparse(node)
                assert not any(w in text for w in ("api_key", "token", "secret", "credentials")), (
                    f"{path}: {text}"
                )
    assert "security.py" in readers


# --- limits before work ---------------------------------------------------------------------------


def test_a_content_length_over_the_limit_is_refused_before_the_body_is_read(client, settings):
    limit = settings.limits.max_body_bytes
    headers = [(b"content-type", b"application/json"), (b"content-length", str(limit + 1).encode())]
    status, body, pulled = asgi_post(client.app, "/predict", headers, [b"x" * 1024] * 10)
    assert status == 413 and f"max_body_bytes={limit}" in body["error"]["message"]
    assert pulled == 0  # not one byte of the body was asked for


@pytest.mark.parametrize("declared", [None, b"100"], ids=["chunked", "lying Content-Length"])
def test_a_body_without_an_honest_length_is_stopped_at_the_limit(client, settings, declared):
    limit = settings.limits.max_body_bytes
    chunk = b" " * 65536
    headers = [(b"content-type", b"application/json")]
    if declared is not None:
        headers.append((b"content-length", declared))
    status, body, pulled = asgi_post(
        client.app, "/predict", headers, [chunk] * (4 * limit // len(chunk))
    )
    assert status == 413 and f"max_body_bytes={limit}" in body["error"]["message"]
    assert pulled <= limit // len(chunk) + 1  # reading stopped at the limit, not at the end


def test_decoders_are_restricted_to_the_allow_list(client, fashion_images, monkeypatch):
    """Pillow is only ever asked to open an allowed format, named explicitly, and a refused
    format or a bomb header never reaches a decoder."""
    opened: list[tuple[str, ...]] = []
    loaded: list[tuple[int, int]] = []
    real_open, real_load = Image.open, ImageFile.ImageFile.load

    def spy_open(fp, mode="r", formats=None):
        opened.append(tuple(formats or ()))
        return real_open(fp, mode, formats)

    def spy_load(self):
        loaded.append(self.size)
        return real_load(self)

    monkeypatch.setattr(Image, "open", spy_open)
    monkeypatch.setattr(ImageFile.ImageFile, "load", spy_load)
    image = fashion_images[0]
    allowed = {
        "PNG": encode(image),
        "JPEG": encode(image, "JPEG"),
        "WEBP": encode(image, "WEBP"),
        "BMP": encode(image, "BMP"),
        "GIF": encode(image, "GIF"),
    }
    for name, data in allowed.items():
        answer = client.post("/predict", json={"images": [{"b64": b64(data)}]})
        assert answer.status_code == 200, answer.text
        assert opened[-1] == (name,)
    assert set(allowed) == set(ACCEPTED_FORMATS)
    opened.clear()
    loaded.clear()
    refused = [encode(image, fmt) for fmt in ("TIFF", "ICO", "PDF", "PPM", "TGA", "PCX")]
    for data in refused:
        answer = client.post("/predict", json={"images": [{"b64": b64(data)}]})
        assert answer.status_code in (415, 422), answer.text
    # a header claiming 50000 x 50000 may be opened (to read the size) but is never loaded
    for width in (50_000, 5_000):
        bomb = png_claiming(width, width)
        assert client.post("/predict", json={"images": [{"b64": b64(bomb)}]}).status_code == 422
    assert all(formats and set(formats) <= set(ACCEPTED_FORMATS) for formats in opened), opened
    assert not any(w * h > 10_000 for w, h in loaded), loaded


def test_nothing_from_a_request_becomes_a_path(client, fashion_images, tmp_path):
    target = tmp_path / "pwned.png"
    name = "../" * 12 + str(target).lstrip("/")
    answer = client.post(
        "/predict", files=[("files", (name, encode(fashion_images[0]), "image/png"))]
    )
    assert answer.status_code == 200
    assert not target.exists()
    for path in ("/models/..%2F..%2Fetc%2Fpasswd", "/models/%2Fetc%2Fpasswd", "/models/%2E%2E"):
        answer = client.get(path)
        assert answer.status_code == 404 and "root:" not in answer.text


# --- limits over the wire -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_body_server(model_repository, tmp_path_factory):
    log = tmp_path_factory.mktemp("limits") / "service.log"
    with running_server(model_repository, log, suite=RELIABILITY, max_body_bytes=65536) as server:
        yield server


def _read_response(sock: socket.socket, timeout: float) -> tuple[int, bytes]:
    sock.settimeout(timeout)
    data = recv_until(sock, lambda data: b"\r\n\r\n" in data)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    body = recv_until(sock, lambda body: len(body) >= length, body)
    return int(head.split(b" ")[1]), body


def test_over_the_wire_a_huge_content_length_is_answered_without_the_body(small_body_server):
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", small_body_server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        status, body = _read_response(sock, timeout=10)  # no byte of the body was ever sent
    assert status == 413 and b"max_body_bytes=65536" in body
    assert time.monotonic() - started < 5


def test_over_the_wire_a_chunked_body_is_cut_off_at_the_limit(small_body_server):
    chunk = b" " * 16384
    total = 64 * 1024 * 1024  # far more than the kernel's socket buffers can swallow
    sent = 0
    with socket.create_connection(("127.0.0.1", small_body_server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        deadline = time.monotonic() + 20
        try:
            while sent < total and time.monotonic() < deadline:
                if select.select([sock], [], [], 0)[0]:
                    break  # the server has answered (or closed)
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, body = _read_response(sock, timeout=10)
    assert status == 413 and b"max_body_bytes=65536" in body
    assert sent < total, "the server read the whole 64 MB body"
    # still serving afterwards
    import httpx

    assert httpx.get(f"{small_body_server.url}/health/ready", timeout=5).status_code == 200


def test_the_openapi_document_declares_the_bearer_scheme_on_exactly_the_closed_routes(keyed):
    document = keyed.get("/openapi.json").json()
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for template, methods in document["paths"].items():
        path = template.replace("{name}", MODEL_NAME).replace("{version}", "1")
        for method, operation in methods.items():
            declared = operation.get("security") == [{"HTTPBearer": []}]
            assert declared == (path not in OPEN), (method, template)
