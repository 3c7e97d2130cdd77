"""Image headers that lie: whether an image is small enough to decode on the event loop is
decided by what decoding really makes, never by what a header claims.

A 4096 x 4095 GIF whose logical screen says 1 x 1 was taken for a thumbnail and decoded on the event
loop (liveness p50 about 400 ms at c=128)."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from service.contract.decoding import PEEK_BYTES, pixels_to_decode
from service.frontend.inputs import RawImage
from service.frontend.serving import INLINE_PIXELS, decode_inline
from tests.support import encode


def gif(width: int, height: int, screen: tuple[int, int] | None = None) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (width, height)).save(buffer, "GIF")
    data = bytearray(buffer.getvalue())
    if screen is not None:
        data[6:10] = screen[0].to_bytes(2, "little") + screen[1].to_bytes(2, "little")
    return bytes(data)


@pytest.fixture(scope="module")
def lying_gif() -> bytes:
    data = gif(4096, 4095, screen=(1, 1))
    assert len(data) <= PEEK_BYTES
    return data


def test_a_gif_whose_screen_claims_1x1_counts_its_real_frame(lying_gif):
    assert pixels_to_decode(lying_gif) == 4096 * 4095


def test_a_lying_gif_is_not_decoded_on_the_event_loop(lying_gif):
    assert not decode_inline([RawImage("images[0]", data=lying_gif)])


def test_honest_thumbnails_still_are(fashion_images):
    thumbnails = [gif(28, 28), encode(fashion_images[0]), encode(fashion_images[1], "BMP")]
    assert [pixels_to_decode(data) for data in thumbnails] == [784, 784, 784]
    assert decode_inline([RawImage(f"images[{i}]", data=d) for i, d in enumerate(thumbnails)])
    assert INLINE_PIXELS >= 3 * 784


def test_unknown_truncated_and_large_files_are_not_guessed(lying_gif):
    assert pixels_to_decode(lying_gif[:12]) is None
    assert pixels_to_decode(b"\xff\xd8\xff" + bytes(100)) is None  # JPEG: not told cheaply
    padded = gif(28, 28) + bytes(PEEK_BYTES)  # a thumbnail's header, but too many bytes
    assert pixels_to_decode(padded) is None
