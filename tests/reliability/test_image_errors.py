"""What a client hears about an image the service cannot use ("Reliability round five"): never a memory
address (Pillow named the file it was given, ``<_io.BytesIO object at 0x7f95...>``)."""

from __future__ import annotations

import re

import pytest

from service.errors import InvalidInput, ServiceError
from tests.support import assert_error, b64

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
