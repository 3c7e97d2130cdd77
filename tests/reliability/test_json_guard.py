"""service/frontend/inputs.py's JSON bounds: JSON bodies bounded on their raw bytes, before any parser
sees them.

The value count is compared with an independent count over the parsed document; the bounds are shown
never to refuse the largest valid request and always to refuse the bombs; over HTTP, a refused body
never reaches pydantic.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest

from service.errors import InvalidInput, PayloadTooLarge, ServiceError
from service.frontend.inputs import (
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


# --- the bounds at their edges (written against `make mutation`'s survivors) ----------------------
# Each bound is checked one value either side of where the module's docstring puts it, with the
# body's values counted by `values_in` over the parsed document, not by `count_values`.


def pixels_body(key: str, count: int) -> bytes:
    """A /predict (``key="images"``) body of one image of ``count`` pixel values."""
    image = {"pixels": [0] * count}
    return json.dumps({key: [image]} if key == "images" else {key: image}).encode()


def test_a_body_of_exactly_max_json_values_passes_and_one_more_is_413():
    body = pixels_body("images", 96)
    values = values_in(json.loads(body))
    assert values == 100
    check_image_json(
        body, ImageJsonLimits(max_images=8, max_pixels=10_000, max_values=100), field="images"
    )
    with pytest.raises(PayloadTooLarge) as error:
        check_image_json(body, ImageJsonLimits(8, 10_000, max_values=99), field="images")
    # the refusal says what to do instead
    assert "send large images as files (base64 or multipart) rather than pixel lists" in (
        error.value.message
    )
    assert "the JSON holds 100 values" in error.value.message


@pytest.mark.parametrize(("images", "pixels"), [(1, 10), (2, 10), (3, 7)])
def test_a_body_of_exactly_what_the_images_can_hold_passes_and_one_more_is_refused(images, pixels):
    # the docstring's bound: 8 option values, and per image 6 values per pixel plus 5
    allowed = 8 + images * (6 * pixels + 5)
    limits = ImageJsonLimits(max_images=images, max_pixels=pixels, max_values=10**9)
    body = pixels_body("images", allowed - 4)  # root, list, image object, pixel list
    assert values_in(json.loads(body)) == allowed
    check_image_json(body, limits, field="images")
    over = pixels_body("images", allowed - 3)
    with pytest.raises(InvalidInput, match=rf"\({allowed}\)$"):
        check_image_json(over, limits, field="images")


def overhead_body(shape: list[Any], filler: int, data: Any = None) -> bytes:
    """An inference request whose parameters hold ``filler`` more numbers, to reach a bound."""
    tensor = {"name": "images", "shape": shape, "datatype": "UINT8", "data": data or [0]}
    return json.dumps({"inputs": [tensor], "parameters": {"x": [0] * filler}}).encode()


def fill_to(values: int, shape: list[Any], data: Any = None) -> bytes:
    """An inference request holding exactly ``values`` JSON values (counted on the parsed document)."""
    base = values_in(json.loads(overhead_body(shape, 0, data)))
    body = overhead_body(shape, values - base, data)
    assert values_in(json.loads(body)) == values
    return body


@pytest.mark.parametrize(
    ("shape", "max_images", "image_elements", "allowed"),
    [
        # 256 + (len * prod + 1) + (len + 1): 256 + 17 + 5
        ([1, 1, 2, 2], 8, 784, 278),
        # two shapes: 256 + (2 * 6 + 1) + (2 + 1) + (1 * 3 + 1) + (1 + 1)
        (None, 8, 784, 256 + 13 + 3 + 4 + 2),
        # a declared shape beyond max_images: the data term capped at 4 x 1 x 4 + 1
        ([10**6, 1, 2, 2], 1, 4, 256 + 17 + 5),
    ],
    ids=["one shape", "two shapes", "capped by max_images"],
)
def test_an_inference_request_of_exactly_its_allowance_passes_and_one_more_is_refused(
    shape, max_images, image_elements, allowed
):
    if shape is None:  # two tensors: shapes [2, 3] and [3]

        def two(filler: int) -> bytes:
            tensors = [
                {"name": "a", "shape": [2, 3], "datatype": "UINT8", "data": [0]},
                {"name": "b", "shape": [3], "datatype": "UINT8", "data": [0]},
            ]
            return json.dumps({"inputs": tensors, "parameters": {"x": [0] * filler}}).encode()

        base = values_in(json.loads(two(0)))
        body, over = two(allowed - base), two(allowed - base + 1)
    else:
        body, over = fill_to(allowed, shape), fill_to(allowed + 1, shape)
    assert values_in(json.loads(body)) == allowed
    check_infer_json(body, max_images=max_images, image_elements=image_elements)
    with pytest.raises(ServiceError) as error:
        check_infer_json(over, max_images=max_images, image_elements=image_elements)
    assert error.value.status_code == 400 and error.value.code == "bad_request"
    assert f"allow ({allowed})" in error.value.message


def test_the_refusal_names_at_most_four_declared_shapes_or_none():
    tensors = [
        {"name": f"t{i}", "shape": [i + 1, 7], "datatype": "UINT8", "data": [0]} for i in range(5)
    ]
    body = json.dumps({"inputs": tensors, "parameters": {"x": [0] * 1000}}).encode()
    with pytest.raises(ServiceError) as error:
        check_infer_json(body, max_images=8, image_elements=IMAGE)
    message = error.value.message
    assert "shapes ([1, 7], [2, 7], [3, 7], [4, 7]) and" in message and "[5, 7]" not in message
    shapeless = json.dumps({"inputs": [{"name": "a", "data": [0] * 1000}]}).encode()
    with pytest.raises(ServiceError, match=r"declared tensor shapes \(none\) and"):
        check_infer_json(shapeless, max_images=8, image_elements=IMAGE)


def test_an_inference_request_of_exactly_max_json_values_passes_and_one_more_is_413():
    body = fill_to(300, [1, 1, 28, 28])
    check_infer_json(body, max_images=8, image_elements=IMAGE, max_values=300)
    with pytest.raises(ServiceError) as error:
        check_infer_json(body, max_images=8, image_elements=IMAGE, max_values=299)
    assert error.value.status_code == 413 and error.value.code == "too_many_json_values"
    assert "holds 300 JSON values" in error.value.message


@pytest.mark.parametrize(
    "shape",
    [[], ["1"], [1.5, 28], ["a", 1], [None], [True, 1]],
    ids=["empty", "string", "float", "letter", "null", "bool"],
)
def test_a_shape_that_is_not_a_list_of_integers_declares_nothing(shape):
    """The guard leaves such a shape to the decoder (a 400 there): here it bounds the request by the
    fixed allowance alone, and never fails on it."""
    fixed = 256 - (shape == [])  # the count takes an empty array for one value more (the docstring)
    check_infer_json(fill_to(fixed, shape), max_images=8, image_elements=IMAGE)
    with pytest.raises(ServiceError, match=r"allow \(256\)"):
        check_infer_json(fill_to(fixed + 1, shape), max_images=8, image_elements=IMAGE)


def test_a_dimension_of_at_most_12_digits_is_read_and_a_longer_one_ignored():
    data = [0] * 2000  # more than the fixed allowance, fewer than 8 images of 784 values
    twelve = fill_to(2100, [10**11, 1, 28, 28], data)
    check_infer_json(twelve, max_images=8, image_elements=IMAGE)
    thirteen = fill_to(2100, [10**12, 1, 28, 28], data)
    with pytest.raises(ServiceError, match=r"shapes \(none\)"):
        check_infer_json(thirteen, max_images=8, image_elements=IMAGE)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0" * 18 + "7", 7), (" \t 12 \t", 12)],
    ids=["19 digits", "spaces and tabs around"],
)
def test_a_header_length_at_the_edges_is_read(value, expected):
    assert parse_header_length(value, 1000) == expected


@pytest.mark.parametrize(
    "value",
    ["0" * 19 + "7", "12\n", "\r12", "\x0b12", "12\x0c", "12X", "X12", "\u00a012"],
    ids=[
        "20 digits",
        "newline",
        "carriage return",
        "vertical tab",
        "form feed",
        "X after",
        "X before",
        "no-break space",
    ],
)
def test_a_header_length_with_other_characters_or_20_digits_is_a_400(value):
    with pytest.raises(ServiceError) as error:
        parse_header_length(value, 1000)
    assert error.value.status_code == 400 and error.value.code == "bad_request"


def test_a_refused_header_length_is_quoted_whole_up_to_40_characters_then_cut():
    forty = "x" * 40
    with pytest.raises(ServiceError) as error:
        parse_header_length(forty, 1000)
    assert error.value.message == (
        f"Inference-Header-Content-Length: {forty!r} is not a byte count within the 1000-byte body"
    )
    with pytest.raises(ServiceError) as error:
        parse_header_length("y" * 39 + "zw", 1000)
    shown = repr("y" * 39 + "z... (41 characters)")
    assert error.value.message == (
        f"Inference-Header-Content-Length: {shown} is not a byte count within the 1000-byte body"
    )
