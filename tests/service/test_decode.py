"""service/frontend/serving.py's decoding: a request's images become prepared rows, within its pixel budget, under
the decode gate; small requests are decoded on the event loop.

Written against `make mutation`'s survivors in the module (docs/testing.md): the prepared tensors are
checked against normalisation done here by hand, the gate's refusal against its settings, and the
inline bound one pixel either side.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import numpy as np
import pytest

from service.contract.preprocessing import Preprocessor
from service.errors import InvalidInput, ServiceUnavailable
from service.frontend.inputs import RawImage
from service.frontend.serving import (
    INLINE_PIXELS,
    DecodeGate,
    client_gone,
    declared_pixels,
    decode_inline,
    prepare_batch,
)
from service.observability.metrics import Metrics
from service.settings import Settings
from tests.service.test_preprocessing import MEAN, STD, metadata
from tests.support import encode


@pytest.fixture
def preprocessor() -> Preprocessor:
    return Preprocessor(metadata(), max_pixels=1_000_000)


def by_hand(pixels: np.ndarray) -> np.ndarray:
    """A model-sized 28 x 28 image's tensor: x / 255, then (x - mean) / std."""
    return ((pixels.astype(np.float64) / 255.0 - MEAN) / STD)[None]


def test_every_image_is_prepared_in_order_with_the_requests_polarity(preprocessor):
    rng = np.random.default_rng(5)
    first, second, third = (rng.integers(0, 256, (28, 28), dtype=np.uint8) for _ in range(3))
    images = [
        RawImage("images[0].pixels", pixels=first.tolist()),
        RawImage("images[1].pixels", pixels=second.tolist()),
        RawImage("images[2].b64", data=encode(third)),
    ]
    prepared = prepare_batch(preprocessor, images, "always", 10**6)
    assert len(prepared) == 3 and all(p.inverted for p in prepared)
    for image, result in zip((first, second, third), prepared, strict=True):
        np.testing.assert_allclose(result.tensor, by_hand(255 - image.astype(np.int64)), atol=1e-5)
    never = prepare_batch(preprocessor, images[:1], "never", 10**6)
    np.testing.assert_allclose(never[0].tensor, by_hand(first), atol=1e-5)


def test_a_jpeg_is_prepared_at_the_models_size(preprocessor):
    photo = np.full((600, 600), 30, np.uint8)
    (prepared,) = prepare_batch(
        preprocessor, [RawImage("f", data=encode(photo, "JPEG"))], "never", 10**6
    )
    assert prepared.tensor.shape == (1, 28, 28)
    np.testing.assert_allclose(prepared.tensor, by_hand(np.full((28, 28), 30)), atol=0.05)


def test_a_refused_image_is_named_by_its_field(preprocessor):
    images = [
        RawImage("images[0].pixels", pixels=[[0, 1]]),
        RawImage("images[1].pixels", pixels=[[0, 300]]),
    ]
    with pytest.raises(InvalidInput) as error:
        prepare_batch(preprocessor, images, "auto", 10**6)
    assert error.value.field == "images[1].pixels"
    with pytest.raises(InvalidInput) as error:
        prepare_batch(preprocessor, [RawImage("files[2]", data=b"not an image")], "auto", 10**6)
    assert error.value.field == "files[2]" and error.value.message.startswith("files[2]: ")


@pytest.mark.parametrize(
    ("pixels", "declared"),
    [
        ([[0] * 5, [0] * 3], 10),  # rows of different lengths: counted by the first
        ([[0] * 5], 5),
        ([], None),
        ([5, 6], None),
        ([[], []], None),
        (7, None),
        ("pixels", None),
    ],
    ids=["ragged", "one row", "empty", "one dimension", "empty rows", "a number", "a string"],
)
def test_a_pixel_list_declares_rows_times_its_first_row(pixels, declared):
    assert declared_pixels(RawImage("f", pixels=pixels)) == declared


def test_requests_of_up_to_inline_pixels_in_all_are_decoded_on_the_loop():
    tile = RawImage("f", pixels=[[0] * 64] * 64)  # 4096 pixels: INLINE_PIXELS is four of them
    assert INLINE_PIXELS == 4 * 4096
    assert decode_inline([tile] * 4)
    assert not decode_inline([tile] * 4 + [RawImage("f", pixels=[[0]])])
    assert decode_inline([])


def test_a_busy_gate_answers_503_decode_busy_with_its_retry_after():
    async def scenario() -> ServiceUnavailable:
        settings = Settings(max_concurrent_decodes=1, max_decode_waiters=0, retry_after_s=7)
        gate = DecodeGate(settings.limits, Metrics())
        async with gate.slot():
            with pytest.raises(ServiceUnavailable) as error:
                async with gate.slot():
                    pass
        return error.value

    refused = asyncio.run(scenario())
    assert (refused.status_code, refused.code) == (503, "decode_busy")
    assert refused.headers == {"Retry-After": "7"}
    assert refused.message.endswith("retry after 7 s")


def test_client_gone_returns_at_the_disconnect_message():
    messages = [
        {"type": "http.request", "body": b""},
        {"type": "http.request"},
        {"type": "http.disconnect"},
    ]

    class Stub:  # a request from a server that makes no client-gone futures (TestClient's)
        scope: ClassVar[dict] = {}

        async def receive(self) -> dict:
            return messages.pop(0)

    async def signal() -> None:
        await client_gone(Stub())()  # type: ignore[arg-type]

    asyncio.run(signal())
    assert messages == []
