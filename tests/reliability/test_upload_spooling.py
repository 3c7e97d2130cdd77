"""A multipart upload over 1 MiB is spooled to TMPDIR (Starlette's SpooledTemporaryFile): when TMPDIR is
full, the request is a 503 with Retry-After that says why, not a 500 with a traceback, and the next
request is served."""

from __future__ import annotations

import tempfile

import pytest

from tests.reliability.full_disk import full_tmpfs
from tests.support import assert_error, encode


@pytest.mark.parametrize("room_kib", [0, 1024], ids=["no room", "room for a third of it"])
def test_an_upload_that_cannot_be_spooled_is_a_503_and_the_next_is_served(
    client, fashion_images, monkeypatch, room_kib
):
    upload = encode(fashion_images[0]) + b"\0" * (3 * 1024 * 1024)  # spooled past its first MiB
    with full_tmpfs(2048, room_kib * 1024) as full:
        monkeypatch.setattr(tempfile, "tempdir", str(full))
        refused = client.post("/predict", files={"files": ("big.png", upload)})
        error = assert_error(refused, 503, "temporary directory", "No space left on device")
        assert error["code"] == "no_temporary_space"
        assert int(refused.headers["Retry-After"]) >= 1
        served = client.post("/predict", files={"files": ("small.png", encode(fashion_images[1]))})
        assert served.status_code == 200, served.text
