"""service/frontend/inputs.py: what a request body is read as, and how each refusal names its field.

Written against `make mutation`'s survivors in the module: the Content-Type's parameters, the
multipart limits at their edges (files, fields, a field's size) and the field and code of every
refusal, checked on the served answers; base64 with line breaks decoded to the bytes sent.
"""

from __future__ import annotations

import base64
import json
import threading
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import ValidationError

from service.errors import InvalidInput
from service.frontend.error_responses import install_error_handlers
from service.frontend.inputs import (
    INLINE_JSON_BYTES,
    ImageJsonLimits,
    image_from_json,
    invalid_from,
    parse_json,
    read_json,
)
from service.frontend.schemas import AttentionRequest, ImageInput, PredictRequest
from tests.support import MAX_IMAGES, assert_error, encode

PIXELS = [[0, 255], [255, 0]]


@pytest.fixture(scope="module")
def png() -> bytes:
    return encode(np.full((28, 28), 200, np.uint8))


# --- Content-Type -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json; charset=utf-8; profile=x",
        "Application/JSON ; charset=utf-8",
        "application/vnd.api+json",
        "application/problem+json; charset=utf-8",
    ],
)
def test_a_json_content_type_with_parameters_or_a_json_suffix_is_read_as_json(client, content_type):
    body = json.dumps({"images": [{"pixels": PIXELS}]})
    response = client.post("/predict", content=body, headers={"Content-Type": content_type})
    assert response.status_code == 200, response.text


def test_a_missing_content_type_is_a_415_that_says_none(client):
    response = client.post("/predict", content=b"{}", headers={"Content-Type": ""})
    error = assert_error(response, 415, "got none")
    assert error["field"] == "Content-Type"


# --- JSON ------------------------------------------------------------------------------------------


def test_a_refused_field_is_the_one_pydantic_names_with_every_detail(client):
    body = {"images": [{"pixels": PIXELS}], "top_k": "3", "invert": "sometimes"}
    error = assert_error(client.post("/predict", json=body), 422, "top_k")
    assert error["field"] == "top_k"  # the first of the details
    fields = [detail["field"] for detail in error["details"]]
    assert fields == ["top_k", "invert"], error


def test_json_is_read_strictly():
    """ "top_k": "3" is refused, not coerced (the OpenAPI document's types)."""
    body = json.dumps({"images": [{"pixels": PIXELS}], "top_k": "3"}).encode()
    with pytest.raises(InvalidInput) as error:
        parse_json(body, PredictRequest)
    assert error.value.field == "top_k"
    assert parse_json(body.replace(b'"3"', b"3"), PredictRequest).top_k == 3


def test_a_validation_error_without_details_is_the_body():
    error = invalid_from(ValidationError.from_exception_data("PredictRequest", []))
    assert (error.field, error.details, error.message) == ("body", [], "invalid request")


@pytest.mark.parametrize(
    ("model", "field"), [(PredictRequest, "images"), (AttentionRequest, "image")]
)
def test_the_pixel_bound_names_the_routes_image_field(model, field):
    limits = ImageJsonLimits(max_images=1, max_pixels=4, max_values=10**6)
    image = {"pixels": [0] * 100}
    body = json.dumps({field: [image] if field == "images" else image}).encode()
    with pytest.raises(InvalidInput) as error:
        parse_json(body, model, limits)
    assert (error.value.field, error.value.code) == (field, "too_many_pixels")


def test_a_body_at_the_inline_size_is_parsed_on_the_loop_and_a_larger_one_is_guarded_in_a_worker(
    settings, monkeypatch
):
    """``inputs.read_json``, what the routes call: the app's limits; a small body parsed on the event
    loop (cheaper than a thread hop), a large one in a worker; a bomb of either size refused before
    it is parsed."""
    threads: list[str] = []
    real = PredictRequest.model_validate_json

    def validate(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(PredictRequest, "model_validate_json", validate)
    app = FastAPI()  # a bare app: no middleware sets the current limits, read_json passes its own
    app.state.settings = settings.model_copy(update={"max_json_values": 2048})
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, Any]:
        body = await read_json(request, PredictRequest)
        return {"images": len(body.images), "loop": threading.current_thread().name}

    def sized(size: int) -> bytes:
        empty = len(b'{"images": [{"b64": ""}]}')
        return b'{"images": [{"b64": "' + b"A" * (size - empty) + b'"}]}'

    with TestClient(app) as client:
        headers = {"Content-Type": "application/json"}
        inline = client.post("/echo", content=sized(INLINE_JSON_BYTES), headers=headers)
        assert inline.status_code == 200 and threads[-1] == inline.json()["loop"]
        worker = client.post("/echo", content=sized(INLINE_JSON_BYTES + 1), headers=headers)
        assert worker.status_code == 200 and threads[-1] != worker.json()["loop"]
        # a bomb on the loop, and a large one in the worker: bounded by the app's limits in both
        for count in (3000, 40_000):
            bomb = b'{"images": [{"pixels": [' + b",".join([b"[]"] * count) + b"]}]}"
            assert (len(bomb) > INLINE_JSON_BYTES) == (count > 3000)
            refused = client.post("/echo", content=bomb, headers=headers)
            assert refused.status_code == 413, refused.text
            assert "max_json_values=2048" in refused.json()["error"]["message"]
    assert len(threads) == 2  # the bombs were refused before they were parsed


def test_base64_with_line_breaks_and_a_data_url_decodes_to_the_bytes_sent(png):
    text = base64.b64encode(png).decode()
    wrapped = "\r\n".join(text[i : i + 76] for i in range(0, len(text), 76))
    for b64 in (wrapped, f"data:image/png;base64,{wrapped}\n", f"  {text} \t"):
        raw = image_from_json(ImageInput(b64=b64), "images[3]")
        assert raw.data == png and raw.field == "images[3].b64"


def test_a_data_url_prefix_is_taken_off_once(png):
    prefix = "data:image/png;base64,"
    text = base64.b64encode(png).decode()
    with pytest.raises(InvalidInput) as error:
        image_from_json(ImageInput(b64=prefix + prefix + text), "images[0]")
    assert (error.value.field, error.value.code) == ("images[0].b64", "invalid_base64")


def test_invalid_base64_names_its_image(client):
    body = {"images": [{"pixels": PIXELS}, {"b64": "not base64!"}]}
    error = assert_error(client.post("/predict", json=body), 422, "images[1].b64")
    assert (error["field"], error["code"]) == ("images[1].b64", "invalid_base64")


# --- multipart/form-data -----------------------------------------------------------------------------


def test_one_file_more_than_the_limit_is_counted_and_two_more_stop_the_parser(client, png):
    one_more = client.post(
        "/predict", files=[("files", ("a.png", png, "image/png"))] * (MAX_IMAGES + 1)
    )
    error = assert_error(one_more, 422, f"files: {MAX_IMAGES + 1} files; the limit")
    assert (error["field"], error["code"]) == ("files", "too_many_images")
    two_more = client.post(
        "/predict", files=[("files", ("a.png", png, "image/png"))] * (MAX_IMAGES + 2)
    )
    error = assert_error(
        two_more, 422, f"files: too many files; the limit is max_images_per_request={MAX_IMAGES}"
    )
    assert (error["field"], error["code"]) == ("files", "too_many_images")


def multipart(fields: list[tuple[str, str]], png: bytes) -> dict[str, Any]:
    data: dict[str, list[str]] = {}
    for name, value in fields:
        data.setdefault(name, []).append(value)
    return {"data": data, "files": [("files", ("a.png", png, "image/png"))]}


def test_32_fields_are_read_and_the_33rd_stops_the_parser(client, png):
    # the file parts are not counted: the 33rd text field is refused before options are validated
    thirty_two = client.post("/predict", **multipart([("top_k", "1")] * 32, png))
    assert_error(thirty_two, 422, "top_k: given more than once")
    thirty_three = client.post("/predict", **multipart([("top_k", "1")] * 33, png))
    error = assert_error(
        thirty_three,
        422,
        "body: malformed multipart/form-data (Too many fields. Maximum number of fields is 32.)",
    )
    assert error["field"] == "body"


def test_a_text_field_of_64_kib_is_read_and_one_byte_more_is_refused(client, png):
    at_limit = client.post("/predict", **multipart([("invert", "x" * 64 * 1024)], png))
    error = assert_error(at_limit, 422, "invert")
    assert error["field"] == "invert"
    over = client.post("/predict", **multipart([("invert", "x" * (64 * 1024 + 1))], png))
    error = assert_error(
        over, 422, "body: malformed multipart/form-data (", "exceeded maximum size of 64KB."
    )
    assert error["field"] == "body"


def test_multipart_refusals_name_their_field(client, png):
    stray = client.post("/predict", files=[("files", ("a.png", png)), ("other", ("b.png", png))])
    error = assert_error(
        stray, 422, "other: unexpected file part; send the image(s) in part(s) named 'files'"
    )
    assert error["field"] == "other"
    text = client.post("/predict", data={"files": "x"}, files=[("files", ("a.png", png))])
    error = assert_error(
        text, 422, "files: must be a file part (with a filename), not a text field"
    )
    assert error["field"] == "files"
    twice = client.post("/predict", **multipart([("top_k", "1"), ("top_k", "2")], png))
    error = assert_error(twice, 422, "top_k: given more than once")
    assert error["field"] == "top_k"
    options = client.post("/predict", **multipart([("top_k", "zero")], png))
    error = assert_error(options, 422, "top_k")
    assert error["field"] == "top_k"


def test_a_malformed_multipart_body_is_the_bodys_fault(client):
    response = client.post(
        "/predict",
        content=b"--xyz\r\nContent-Disposition: form-data\r\n\r\nno name\r\n--xyz--\r\n",
        headers={"Content-Type": "multipart/form-data; boundary=xyz"},
    )
    error = assert_error(response, 422, "body: malformed multipart/form-data")
    assert error["field"] == "body"
