"""What a client hears about an image the service cannot use ("Reliability round five"): never a memory
address (Pillow named the file it was given, ``<_io.BytesIO object at 0x7f95...>``), and a JPEG whose data
cannot hold the image its header declares is refused as truncated, where libjpeg decoded it with grey
blocks and the service answered 200, at full size and through the JPEG draft (reduced-scale) path alike.
"""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from PIL import Image

from service.contract.decoding import decode_image
from service.errors import InvalidInput, ServiceError
from tests.support import assert_error, b64, encode

ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}|object at")

# a recognised format's magic bytes over bytes no decoder takes
CORRUPT = {
    "PNG": b"\x89PNG\r\n\x1a\n" + b"\x00" * 30,
    "JPEG": b"\xff\xd8\xff" + b"junk" * 10,
    "GIF": b"GIF89a" + b"\x00" * 3,
    "WEBP": b"RIFF\x00\x00\x00\x00WEBP" + b"x" * 20,
}


@pytest.mark.parametrize("image_format", list(CORRUPT))
def test_a_corrupt_image_s_error_carries_no_memory_address(client, image_format):
    response = client.post("/predict", json={"images": [{"b64": b64(CORRUPT[image_format])}]})
    error = assert_error(response, 422, "images[0]", f"cannot decode the {image_format} image")
    assert not ADDRESS.search(response.text), error["message"]
    assert f"not a valid {image_format} file" in error["message"]


def test_no_service_error_carries_an_object_s_repr():
    """Whatever library message a ServiceError quotes, it reaches the client without an address."""
    error = InvalidInput("cannot identify image file <_io.BytesIO object at 0x7f95d4a0b2c0>")
    assert error.message == "cannot identify image file <object>" == str(error)
    assert ServiceError("kept: 0x10 and <tag>").message == "kept: 0x10 and <tag>"


def jpeg(size: int, **options: object) -> bytes:
    pixels = np.random.default_rng(size).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return encode(pixels, "JPEG", **options)


def claiming(data: bytes, width: int, height: int) -> bytes:
    """``data`` (a JPEG) with its frame header patched to claim ``width`` x ``height``."""
    patched = bytearray(data)
    for marker in (b"\xff\xc0", b"\xff\xc2"):
        at = patched.find(marker)
        if at >= 0:
            patched[at + 5 : at + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
            return bytes(patched)
    raise AssertionError("no frame header")


def cut(data: bytes, keep: int) -> bytes:
    """The first ``keep`` bytes of ``data``, ended with an EOI marker as if whole."""
    return data[:keep] + b"\xff\xd9"


TRUNCATED = {
    # the report: a 28 x 28 image's data under a header claiming 4000 x 4000
    "4000x4000 over 28x28": claiming(jpeg(28), 4000, 4000),
    "progressive 4000x4000 over 28x28": claiming(jpeg(28, progressive=True), 4000, 4000),
    # a 1000 x 1000 photo cut to its first 2 KB (31,250 blocks need 3.9 KB at one bit each)
    "1000x1000 cut to 2 KB": cut(encode(np.full((1000, 1000, 3), 90, np.uint8), "JPEG"), 2048),
}


@pytest.mark.parametrize("kind", list(TRUNCATED))
def test_a_truncated_jpeg_is_refused_as_truncated(client, kind):
    data = TRUNCATED[kind]
    for draft_side in (28, 4000):  # through the draft (1/8 scale) and at full size
        with pytest.raises(InvalidInput) as refused:
            decode_image(data, "images[0]", 20_000_000, draft_side)
        assert refused.value.code == "truncated_image"
        assert "truncated" in refused.value.message
    response = client.post("/predict", json={"images": [{"b64": b64(data)}]})
    assert_error(response, 422, "images[0]", "truncated")


WHOLE = {
    # the most compressible JPEGs there are: one colour, optimised Huffman tables (2 bits a block)
    "white 2000x2000 optimised": encode(
        np.full((2000, 2000), 255, np.uint8), "JPEG", optimize=True
    ),
    "black 1500x1500 4:4:4 quality 1": encode(
        np.zeros((1500, 1500, 3), np.uint8), "JPEG", subsampling=0, quality=1, optimize=True
    ),
    "grey 1200x800 progressive": encode(
        np.full((800, 1200, 3), 128, np.uint8), "JPEG", progressive=True, optimize=True
    ),
    "28x28 photo": jpeg(28),
    "1x1": encode(np.zeros((1, 1), np.uint8), "JPEG"),
}


@pytest.mark.parametrize("kind", list(WHOLE))
def test_a_whole_jpeg_decodes_to_what_pillow_decodes(kind):
    """The check refuses no whole file: each decodes, at full size, to Pillow's own pixels."""
    data = WHOLE[kind]
    decoded = decode_image(data, "images[0]", 20_000_000, 4000)
    with Image.open(io.BytesIO(data)) as reference:
        assert np.array_equal(np.asarray(decoded), np.asarray(reference.convert(decoded.mode)))
