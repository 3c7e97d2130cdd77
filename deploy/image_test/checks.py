"""The checks on a running service container, each against a reference of its own.

/predict is judged by Fashion-MNIST's own test labels (Debian's dataset-fashion-mnist, which
`make test` installs): the shipped model classifies about 93% of the test set right, so at least
28 of the first 32 images must come back with their true class. The attention map must be a PNG
the size the service promises; gRPC readiness is asked with tritonclient, as a Triton client would.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import urllib.error
import urllib.request
from pathlib import Path

from .steps import Failure, wait_for

DATASET = Path("/usr/share/datasets/fashion-mnist")
MODEL = "fashion-mnist-vit"
IMAGES = 32
AT_LEAST_RIGHT = 28


def http(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url)
    if body is not None:
        request.data = json.dumps(body).encode()
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def fashion_mnist_test_set(count: int = IMAGES) -> tuple[list[list[list[int]]], list[int]]:
    """The first ``count`` Fashion-MNIST test images (28x28, 0-255) and their labels."""

    def read(name: str) -> bytes:
        plain, packed = DATASET / name, DATASET / f"{name}.gz"
        if plain.exists():
            return plain.read_bytes()
        if packed.exists():
            return gzip.decompress(packed.read_bytes())
        raise Failure(f"{plain} is missing (`make dataset` installs dataset-fashion-mnist)")

    pixels = read("t10k-images-idx3-ubyte")[16 : 16 + count * 784]
    labels = list(read("t10k-labels-idx1-ubyte")[8 : 8 + count])
    images = [
        [list(pixels[i * 784 + r * 28 : i * 784 + r * 28 + 28]) for r in range(28)]
        for i in range(count)
    ]
    return images, labels


def wait_ready(base: str, timeout: float = 180) -> None:
    wait_for(
        f"{base}/health/ready answering 200",
        lambda: http(f"{base}/health/ready", timeout=5)[0] == 200,
        timeout=timeout,
    )


def predict_right(base: str) -> str:
    images, labels = fashion_mnist_test_set()
    status, _, body = http(
        f"{base}/predict", {"images": [{"pixels": image} for image in images], "top_k": 1}
    )
    if status != 200:
        raise Failure(f"/predict answered {status}: {body[:300]!r}")
    answer = json.loads(body)
    got = [prediction["index"] for prediction in answer["predictions"]]
    if len(got) != len(labels):
        raise Failure(f"/predict answered {len(got)} predictions for {len(labels)} images")
    right = sum(g == want for g, want in zip(got, labels, strict=True))
    if right < AT_LEAST_RIGHT:
        raise Failure(f"/predict: {right} of {len(labels)} right, fewer than {AT_LEAST_RIGHT}")
    return f"{right} of {len(labels)} test images right (model {answer['model']})"


def attention_png(base: str) -> str:
    from PIL import Image

    images, _ = fashion_mnist_test_set(1)
    picture = io.BytesIO()
    Image.frombytes("L", (28, 28), bytes(v for row in images[0] for v in row)).save(picture, "PNG")
    image = {"b64": base64.b64encode(picture.getvalue()).decode()}
    status, headers, body = http(f"{base}/attention", {"image": image, "format": "png"})
    if status != 200 or not body.startswith(b"\x89PNG\r\n\x1a\n"):
        raise Failure(
            f"/attention answered {status}, {headers.get('content-type')}: {body[:120]!r}"
        )
    width, height = Image.open(io.BytesIO(body)).size
    prediction = {k: v for k, v in headers.items() if k.lower().startswith("x-prediction")}
    if not prediction:
        raise Failure("/attention's PNG came without its X-Prediction-* headers")
    return f"a {width}x{height} PNG, {prediction}"


def grpc_ready(port: int) -> str:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")
    try:
        wait_for("gRPC ServerReady", client.is_server_ready, timeout=60)
        if not client.is_model_ready(MODEL):
            raise Failure(f"gRPC: ModelReady({MODEL}) is false")
    finally:
        client.close()
    return f"ServerReady and ModelReady({MODEL}) on 127.0.0.1:{port}"


def serves_version(base: str, version: int, timeout: float = 120) -> str:
    """Wait until ``version`` of the model is ready and answers /predict as that version."""
    url = f"{base}/v2/models/{MODEL}/versions/{version}/ready"
    wait_for(
        f"version {version} ready ({url})", lambda: http(url, timeout=5)[0] == 200, timeout=timeout
    )
    images, _ = fashion_mnist_test_set(1)
    status, _, body = http(f"{base}/predict", {"images": [{"pixels": images[0]}]})
    served = json.loads(body).get("model", {}) if status == 200 else {}
    if served.get("version") != version:
        raise Failure(
            f"/predict answered {status} from {served or body[:200]!r}, not version {version}"
        )
    return f"version {version} ready and answering /predict"
