"""Bounds a whole request is held to, as the README's settings table states them.

- ``VITSERVE_MAX_PIXELS_PER_REQUEST``: the pixels of all the images of one request together, so that
  many images each under ``max_pixels_per_image`` cannot hold a decode slot for long.
- /attention's JSON body is bounded, before it is parsed, by what ONE image can hold
  (``max_pixels_per_image``), not by what ``max_images_per_request`` images can: /attention takes one.

The expected figures are worked out here from the settings, never read from the code under test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.launcher.local_app import local_app
from tests.support import MAX_IMAGES, assert_error, b64, encode, make_settings

BUDGET = 1000  # pixels per request
PER_IMAGE = 100  # pixels per image, for the /attention body bound


def app_with(model_repository: Path, **limits: int) -> Iterator[TestClient]:
    """An in-process app with the tests' settings and ``limits`` over them, for a fixture."""
    with TestClient(local_app(make_settings(model_repository, **limits))) as client:
        yield client


@pytest.fixture(scope="module")
def budgeted(model_repository: Path) -> Iterator[TestClient]:
    yield from app_with(model_repository, max_pixels_per_request=BUDGET)


def png(width: int, height: int) -> bytes:
    return encode(np.full((height, width), 200, dtype=np.uint8))


def files(*images: bytes) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("files", (f"{i}.png", data, "image/png")) for i, data in enumerate(images)]


def test_the_pixel_budget_counts_every_image_of_the_request_together(budgeted):
    """Two 30 x 30 images (900 pixels each, each well under the budget) are 1800 pixels together:
    over a budget of 1000. Counted per image, each would pass."""
    refused = budgeted.post("/predict", files=files(png(30, 30), png(30, 30)))
    error = assert_error(refused, 422, f"max_pixels_per_request={BUDGET}")
    assert error["code"] == "too_many_pixels" and error["field"] == "files[1]"
    # either image alone is within the budget
    assert budgeted.post("/predict", files=files(png(30, 30))).status_code == 200


def test_images_that_fill_the_budget_exactly_are_served(budgeted):
    """25 x 20 + 20 x 25 = 1000 pixels: the budget is a limit, not a bound to stay under."""
    answered = budgeted.post("/predict", files=files(png(25, 20), png(20, 25)))
    assert answered.status_code == 200, answered.text
    assert len(answered.json()["predictions"]) == 2
    over = budgeted.post("/predict", files=files(png(25, 20), png(20, 25), png(1, 1)))
    assert_error(over, 422, f"max_pixels_per_request={BUDGET}")


def test_the_pixel_budget_applies_to_base64_json_and_to_attention(budgeted):
    body = {"images": [{"b64": b64} for b64 in (b64(png(40, 20)), b64(png(20, 40)))]}
    assert_error(budgeted.post("/predict", json=body), 422, f"max_pixels_per_request={BUDGET}")
    big = {"image": {"b64": b64(png(40, 30))}}  # 1200 pixels, one image
    assert_error(budgeted.post("/attention", json=big), 422, f"max_pixels_per_request={BUDGET}")


@pytest.fixture(scope="module")
def small_images(model_repository: Path) -> Iterator[TestClient]:
    yield from app_with(model_repository, max_pixels_per_image=PER_IMAGE)


def body_with_values(key: str, values: int) -> bytes:
    """A JSON body of about ``values`` JSON values: one small valid image and an extra list of
    zeros that no request may hold (a parser would refuse it as an unexpected field)."""
    image = {"pixels": [[0] * 10 for _ in range(10)]}  # 100 pixels: 111 values
    images = image if key == "image" else [image]
    document = {key: images, "padding": [0] * values}
    return json.dumps(document).encode()


def test_an_attention_body_is_bounded_by_what_one_image_can_hold(small_images):
    """One image of at most 100 pixels holds at most about 6 values a pixel (C = 3 numbers and a
    row array each, for a W = 1 image): some 600 values. A body of 2,000 values is more than one
    such image can ever hold, and less than MAX_IMAGES = 8 of them could: refused before parsing,
    as a body that could not be a valid request, not by the parser as an unexpected field."""
    one_image = 6 * PER_IMAGE + 20
    eight_images = MAX_IMAGES * 6 * PER_IMAGE
    values = 2000
    assert one_image < values < eight_images
    response = small_images.post(
        "/attention",
        content=body_with_values("image", values),
        headers={"content-type": "application/json"},
    )
    error = assert_error(response, 422, "1 image(s)", f"max_pixels_per_image={PER_IMAGE}")
    assert error["code"] == "too_many_pixels" and error["field"] == "image"


def test_a_predict_body_is_bounded_by_max_images_per_request_images(small_images):
    """The same 2,000 values fit in what 8 images may hold: /predict leaves the body to the parser,
    which names the unexpected field."""
    response = small_images.post(
        "/predict",
        content=body_with_values("images", 2000),
        headers={"content-type": "application/json"},
    )
    error = assert_error(response, 422)
    assert error["code"] != "too_many_pixels" and "padding" in json.dumps(error)
