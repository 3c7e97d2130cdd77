"""service/frontend/json_guard.py: JSON bodies bounded on their raw bytes, before any parser sees them (issue 17).

The value count is compared with an independent count over the parsed document; the bounds are shown
never to refuse the largest valid request and always to refuse the bombs; over HTTP, a refused body
never reaches pydantic.
"""

from __future__ import annotations

import json
import random
import threading
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from service.errors import InvalidInput, PayloadTooLarge, ServiceError
from service.frontend.error_responses import install_error_handlers
from service.frontend.inputs import INLINE_JSON_BYTES, read_json
from service.frontend.json_guard import (
    ImageJsonLimits,
    check_image_json,
    check_infer_json,
    count_values,
    parse_header_length,
)
from service.frontend.schemas import AttentionRequest, PredictRequest
from tests.support import MAX_BODY_BYTES, assert_error

LIMITS = ImageJsonLimits(max_images=8, max_pixels=10_000, max_values=1_000_000)


def values_in(document: Any) -> int:
    """The reference: every value of a parsed document, containers included, keys not."""
    if isinstance(document, list):
        return 1 + sum(values_in(item) for item in document)
    if isinstance(document, dict):
        return 1 + sum(values_in(item) for item in document.values())
    return 1


def random_document(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice(
        ["list", "dict", "int", "float", "str", "bool", "null"] if depth < 4 else "ifs"
    )
    if kind == "list":
        return [random_document(rng, depth + 1) for _ in range(rng.randint(1, 5))]
    if kind == "dict":
        return {f"k{i}": random_document(rng, depth + 1) for i in range(rng.randint(1, 4))}
    if kind in ("int", "i"):
        return rng.randint(-1000, 1000)
    if kind in ("float", "f"):
        return rng.random() * 255
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return "".join(rng.choice("ab c:/+=") for _ in range(rng.randint(0, 8)))


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "spaced"])
def test_the_value_count_is_exact_for_documents_without_commas_in_strings(compact):
    rng = random.Random(17)
    for _ in range(300):
        document = random_document(rng)
        separators = (",", ":") if compact else (" ,  ", " : ")
        body = json.dumps(document, separators=separators, indent=None if compact else 2).encode()
        assert count_values(body) == values_in(document), body[:200]


def largest_valid_body(limits: ImageJsonLimits, *, single: bool) -> bytes:
    """The valid request with the most values per pixel: C = 3 channels of W = 1 rows, every image at
    the pixel limit, every option given."""
    image = {"pixels": [[[255]] * limits.max_pixels] * 3}
    if single:
        document = {"image": image, "method": "raw", "layer": 0, "head": 0, "format": "json"}
    else:
        document = {"images": [image] * limits.max_images, "top_k": 3, "invert": "never"}
    return json.dumps(document).encode()


@pytest.mark.parametrize("single", [False, True], ids=["predict", "attention"])
def test_the_bounds_never_refuse_the_largest_valid_request(single):
    limits = ImageJsonLimits(max_images=1 if single else 4, max_pixels=500, max_values=10**9)
    body = largest_valid_body(limits, single=single)
    model = AttentionRequest if single else PredictRequest
    model.model_validate_json(body, strict=True)  # the reference: pydantic takes it
    check_image_json(body, limits, field="image" if single else "images")


@pytest.mark.parametrize(
    "inner",
    [b"[]", b"[[]]", b"[0]", b"[[[[[[[[0]]]]]]]]"],
    ids=["empty arrays", "nested empty arrays", "one-pixel rows", "deep chains"],
)
def test_array_bombs_are_refused_by_the_value_limit(inner):
    body = b'{"images": [{"pixels": [' + b",".join([inner] * 600_000) + b"]}]}"
    with pytest.raises(PayloadTooLarge, match=r"max_json_values=1000000") as error:
        check_image_json(body, LIMITS, field="images")
    assert error.value.code == "too_many_json_values" and error.value.field == "body"


def test_bodies_beyond_what_the_pixel_limit_allows_are_refused():
    limits = ImageJsonLimits(max_images=2, max_pixels=100, max_values=10**9)
    allowed = 8 + 2 * (6 * 100 + 5)
    body = b'{"images": [{"pixels": [' + b",".join([b"0"] * allowed) + b"]}]}"
    with pytest.raises(InvalidInput, match=r"max_pixels_per_image=100") as error:
        check_image_json(body, limits, field="images")
    assert error.value.code == "too_many_pixels" and error.value.field == "images"


# --- the Open Inference Protocol ------------------------------------------------------------------

IMAGE = 1 * 28 * 28


def infer_body(data: Any, shape: list[int], **extra: Any) -> bytes:
    tensor = {"name": "images", "shape": shape, "datatype": "UINT8", "data": data}
    return json.dumps({"id": "a", "inputs": [tensor], **extra}).encode()


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_a_valid_inference_request_passes(nested):
    batch = np.zeros((8, 1, 28, 28), np.uint8)
    data = batch.tolist() if nested else batch.reshape(-1).tolist()
    outputs = [{"name": "logits", "parameters": {"binary_data": True, "classification": 3}}]
    body = infer_body(data, [8, 1, 28, 28], outputs=outputs, parameters={"binary_data_output": 1})
    check_infer_json(body, max_images=8, image_elements=IMAGE, max_values=1_000_000)
    squeezed = infer_body(np.zeros((8, 28, 28), np.uint8).tolist(), [8, 28, 28])
    check_infer_json(squeezed, max_images=8, image_elements=IMAGE)


@pytest.mark.parametrize(
    "body",
    [
        infer_body([[]] * 100_000, [1, 1, 28, 28]),
        infer_body([0] * (5 * IMAGE), [1, 1, 28, 28]),
        infer_body([0], [1, 1, 28, 28], parameters={"x": [[]] * 50_000}),
        infer_body([[]] * 500_000, [10**9, 1, 28, 28]),
        infer_body([[]] * 100_000, [-1, 1, 28, 28]),
    ],
    ids=[
        "empty arrays",
        "five times the declared data",
        "a bomb in the parameters",
        "a huge declared shape",
        "an invalid shape",
    ],
)
def test_inference_requests_beyond_their_declared_shapes_are_refused(body):
    with pytest.raises(ServiceError, match=r"more than its declared tensor shapes") as error:
        check_infer_json(body, max_images=8, image_elements=IMAGE)
    assert error.value.status_code == 400


def test_inference_requests_over_the_value_limit_are_413():
    body = infer_body([0] * (8 * IMAGE), [8, 1, 28, 28])
    with pytest.raises(ServiceError, match=r"max_json_values=1024") as error:
        check_infer_json(body, max_images=8, image_elements=IMAGE, max_values=1024)
    assert error.value.status_code == 413


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0", 0), ("17", 17), (" 100\t", 100), ("1000", 1000)],
)
def test_a_header_length_of_ascii_digits_is_read(value, expected):
    assert parse_header_length(value, 1000) == expected


@pytest.mark.parametrize(
    "value",
    [
        "",
        " ",
        "-1",
        "+5",
        "0x10",
        "1e3",
        "1001",
        "\uff11\uff12",
        "\u00b2",
        "\u0663",
        "1" * 5000,
        "9" * 20,
        "1_0",
    ],
    ids=[
        "empty",
        "space",
        "negative",
        "plus",
        "hex",
        "exponent",
        "beyond the body",
        "fullwidth digits",
        "superscript",
        "arabic-indic",
        "5000 digits",
        "20 digits",
        "underscore",
    ],
)
def test_a_header_length_of_anything_else_is_a_400(value):
    with pytest.raises(ServiceError) as error:
        parse_header_length(value, 1000)
    assert error.value.status_code == 400
    message = error.value.message
    assert "Inference-Header-Content-Length" in message and len(message) < 200
    message.encode("utf-8")  # encodable, whatever came in


# --- over HTTP: refused before pydantic sees the body ---------------------------------------------


@pytest.fixture
def no_parsing(monkeypatch):
    """Fails the test if a JSON request model parses anything."""
    calls: list[str] = []

    def spy(model):
        real = model.model_validate_json

        def validate(*args: Any, **kwargs: Any) -> Any:
            calls.append(model.__name__)
            return real(*args, **kwargs)

        monkeypatch.setattr(model, "model_validate_json", validate)

    spy(PredictRequest)
    spy(AttentionRequest)
    return calls


@pytest.mark.parametrize("route", ["/predict", "/attention"])
def test_a_bomb_under_the_body_limit_is_refused_unparsed(client, route, no_parsing):
    key = "images" if route == "/predict" else "image"
    bomb = b"[" + b",".join([b"[]"] * (MAX_BODY_BYTES // 4)) + b"]"
    image = b'{"pixels": ' + bomb + b"}"
    body = b'{"%s": %s}' % (key.encode(), b"[" + image + b"]" if key == "images" else image)
    assert len(body) < MAX_BODY_BYTES
    response = client.post(route, content=body, headers={"Content-Type": "application/json"})
    error = assert_error(response, 413, "max_json_values=1048576")
    assert error["code"] == "too_many_json_values"
    assert no_parsing == []
    small = {"images": [{"pixels": [[0, 1], [2, 3]]}]}
    assert client.post("/predict", json=small).status_code == 200
    assert no_parsing == ["PredictRequest"]


def test_read_json_guards_and_parses_off_the_event_loop(settings, monkeypatch):
    """``inputs.read_json``, what the routes call: the app's limits; a small body parsed on the event
    loop (cheaper than a thread hop), a large one in a worker."""
    threads: list[str] = []
    real = PredictRequest.model_validate_json

    def validate(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(PredictRequest, "model_validate_json", validate)
    app = FastAPI()
    app.state.settings = settings.model_copy(update={"max_json_values": 2048})
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, Any]:
        body = await read_json(request, PredictRequest)
        return {"images": len(body.images), "loop": threading.current_thread().name}

    with TestClient(app) as client:
        good = client.post("/echo", json={"images": [{"pixels": [[0, 1]]}] * 2})
        assert good.status_code == 200 and good.json()["images"] == 2
        assert threads == [good.json()["loop"]]
        large = {"images": [{"b64": "A" * (INLINE_JSON_BYTES + 4)}]}
        big = client.post("/echo", json=large)
        assert big.status_code == 200 and threads[-1] != big.json()["loop"]
        bomb = client.post("/echo", json={"images": [{"pixels": [[]] * 3000}]})
        assert bomb.status_code == 413, bomb.text  # a bare app: no request ids
        assert "max_json_values=2048" in bomb.json()["error"]["message"]
    assert len(threads) == 2  # the bomb was refused before it was parsed
