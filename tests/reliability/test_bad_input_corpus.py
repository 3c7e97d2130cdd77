"""A corpus of bad and awkward input, generated here with Pillow and raw bytes.

Every bad request gets its documented 4xx as JSON naming the field and, where there is one, the limit;
every awkward but valid image (alpha, palette, 16-bit, CMYK, animated, rotated, tiny, large) is served.
No answer carries a stack trace or a path, nothing is a 5xx, and the service is still ready and right
afterwards.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from service.launcher.local_app import local_app
from tests.support import (
    MAX_BODY_BYTES,
    MAX_IMAGES,
    MAX_PIXELS,
    NUM_CLASSES,
    RELIABILITY,
    asgi_post,
    assert_error,
    assert_matches,
    assert_no_leak,
    b64,
    encode,
    make_settings,
    metric,
    png_claiming,
)

STRICT_PIXELS = 10_000  # a second app with a small pixel limit, to reach it under the body limit


# --- generated files ------------------------------------------------------------------------------


def gif_claiming(width: int, height: int) -> bytes:
    """A one-pixel GIF whose logical screen claims ``width x height``."""
    data = bytearray(encode(Image.new("L", (1, 1)), "GIF"))
    data[6:10] = struct.pack("<HH", width, height)
    return bytes(data)


def multipart_body(parts: Iterator[bytes], boundary: str) -> bytes:
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


def many_fields_form(count: int, boundary: str = "vitserve-corpus") -> tuple[bytes, str]:
    """A multipart form with ``count`` tiny text fields and one file part."""

    def parts() -> Iterator[bytes]:
        for i in range(count):
            yield (
                f'--{boundary}\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\nx\r\n'
            ).encode()
        yield (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="a.png"\r\n'
                "Content-Type: image/png\r\n\r\n"
            ).encode()
            + encode(np.zeros((4, 4), np.uint8))
            + b"\r\n"
        )

    return multipart_body(parts(), boundary), f"multipart/form-data; boundary={boundary}"


SURROGATE_FORM = "multipart/form-data; boundary=b; charset=unicode_escape"


def surrogate_form(images: np.ndarray, *, text_name: bool) -> bytes:
    """A form with one good file part and a part named ``\\ud800``, which the charset
    ``unicode_escape`` (the client's choice) decodes to a lone surrogate."""
    odd = (
        b'--b\r\nContent-Disposition: form-data; name="\\ud800"\r\n\r\n3\r\n'
        if text_name
        else b'--b\r\nContent-Disposition: form-data; name="\\ud800"; filename="x.png"\r\n'
        b"Content-Type: image/png\r\n\r\nx\r\n"
    )
    good = (
        b'--b\r\nContent-Disposition: form-data; name="files"; filename="a.png"\r\n'
        b"Content-Type: image/png\r\n\r\n" + encode(images[0]) + b"\r\n"
    )
    return good + odd + b"--b--\r\n"


# --- the corpus -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bad:
    """One bad request: how to send it, and the status, field and message fragments it must get."""

    name: str
    request: Callable[[np.ndarray], dict[str, Any]]
    status: int
    fragments: tuple[str, ...] = ()
    field: str | None = None
    route: str = "/predict"
    strict: bool = False  # sent to the app with max_pixels_per_image=STRICT_PIXELS
    codes: tuple[str, ...] = ()


def as_json(body: Any) -> Callable[[np.ndarray], dict[str, Any]]:
    return lambda _: {"json": body}


def raw(content: bytes, content_type: str | None = "application/json") -> Callable:
    headers = {"Content-Type": content_type} if content_type else {}
    return lambda _: {"content": content, "headers": headers}


def one_b64(data: bytes | Callable[[np.ndarray], bytes]) -> Callable:
    def build(images: np.ndarray) -> dict[str, Any]:
        payload = data(images) if callable(data) else data
        return {"json": {"images": [{"b64": b64(payload)}]}}

    return build


def one_file(data: bytes, name: str = "files") -> Callable:
    return lambda _: {"files": [(name, ("upload.bin", data, "application/octet-stream"))]}


def pixels(value: Any) -> Callable:
    return lambda _: {"json": {"images": [{"pixels": value}]}}


def good_pixels(images: np.ndarray) -> list:
    return images[0].tolist()


def _png(images: np.ndarray) -> bytes:
    return encode(images[0])


def _jpeg(images: np.ndarray) -> bytes:
    return encode(images[0], "JPEG", quality=90)


def _other_format(image_format: str) -> bytes:
    return encode(Image.new("RGB", (16, 16), (200, 10, 10)), image_format)


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'
LIMIT = f"max_body_bytes={MAX_BODY_BYTES}"
TOO_MANY = f"max_images_per_request={MAX_IMAGES}"
PIXEL_LIMIT = f"max_pixels_per_image={MAX_PIXELS}"
STRICT_LIMIT = f"max_pixels_per_image={STRICT_PIXELS}"

CORPUS: list[Bad] = [
    # The body: empty, not JSON, not the right JSON.
    Bad("empty body", raw(b""), 422, ("body", "Invalid JSON"), "body"),
    Bad("not JSON", raw(b"images=1&top_k=2"), 422, ("Invalid JSON",), "body"),
    Bad("not UTF-8", raw(b'\xff\xfe{"images": []}'), 422, ("Invalid JSON",), "body"),
    Bad("JSON null", raw(b"null"), 422, ("body",), "body"),
    Bad("JSON array", as_json([{"b64": "AAAA"}]), 422, ("body",), "body"),
    Bad("JSON nested 5000 deep", raw(b"[" * 5000 + b"]" * 5000), 422, ("recursion",), "body"),
    Bad("images is a string", as_json({"images": "cat.png"}), 422, ("images", "array"), "images"),
    Bad("images missing", as_json({"top_k": 3}), 422, ("images", "required"), "images"),
    Bad("images empty", as_json({"images": []}), 422, ("images", "at least 1"), "images"),
    Bad("image is a number", as_json({"images": [7]}), 422, ("images[0]",), "images[0]"),
    Bad(
        "unknown top-level field",
        as_json({"images": [{"pixels": [[0]]}], "colour": "red"}),
        422,
        ("colour", "Extra inputs"),
        "colour",
    ),
    Bad(
        "unknown image field",
        as_json({"images": [{"pixels": [[0]], "url": "http://x/y.png"}]}),
        422,
        ("images[0].url", "Extra inputs"),
        "images[0].url",
    ),
    Bad(
        "both b64 and pixels",
        as_json({"images": [{"pixels": [[0]], "b64": "AAAA"}]}),
        422,
        ("images[0]", "exactly one"),
        "images[0]",
    ),
    Bad("neither b64 nor pixels", as_json({"images": [{}]}), 422, ("exactly one",), "images[0]"),
    Bad(
        "top_k a word",
        as_json({"images": [{"pixels": [[0]]}], "top_k": "three"}),
        422,
        ("top_k", "integer"),
        "top_k",
    ),
    Bad(
        "top_k a number in a string",
        as_json({"images": [{"pixels": [[0]]}], "top_k": "3"}),
        422,
        ("top_k", "integer"),
        "top_k",
    ),
    Bad(
        "top_k a fraction",
        as_json({"images": [{"pixels": [[0]]}], "top_k": 2.5}),
        422,
        ("top_k", "integer"),
        "top_k",
    ),
    Bad(
        "top_k 0",
        as_json({"images": [{"pixels": [[0]]}], "top_k": 0}),
        422,
        ("top_k", "greater than or equal to 1"),
        "top_k",
    ),
    Bad(
        "top_k over the class count",
        as_json({"images": [{"pixels": [[0]]}], "top_k": NUM_CLASSES + 1}),
        422,
        ("top_k", f"the limit is {NUM_CLASSES}"),
        "top_k",
    ),
    Bad(
        "invert unknown",
        as_json({"images": [{"pixels": [[0]]}], "invert": "sometimes"}),
        422,
        ("invert",),
        "invert",
    ),
    # base64 and the bytes inside it.
    Bad(
        "base64 invalid characters",
        as_json({"images": [{"b64": "iVBO*&^%$#@!"}]}),
        422,
        ("images[0].b64", "not valid base64"),
        "images[0].b64",
        codes=("invalid_base64",),
    ),
    Bad(
        "base64 bad padding",
        as_json({"images": [{"b64": "iVBORw0KGgo"}]}),
        422,
        ("images[0].b64", "not valid base64"),
        "images[0].b64",
        codes=("invalid_base64",),
    ),
    Bad(
        "zero-byte image",
        as_json({"images": [{"b64": ""}]}),
        422,
        ("images[0].b64", "empty (0 bytes)"),
        "images[0].b64",
        codes=("empty_image",),
    ),
    Bad(
        "random bytes",
        one_b64(np.random.default_rng(6).bytes(2048)),
        422,
        ("images[0].b64", "not a recognisable image"),
        "images[0].b64",
        codes=("undecodable_image",),
    ),
    Bad(
        "truncated PNG",
        one_b64(lambda images: _png(images)[: len(_png(images)) // 2]),
        422,
        ("images[0].b64", "cannot decode the PNG"),
        "images[0].b64",
        codes=("undecodable_image",),
    ),
    Bad(
        "PNG cut inside its header",
        one_b64(lambda images: _png(images)[:20]),
        422,
        ("images[0].b64", "PNG"),
        "images[0].b64",
        codes=("undecodable_image",),
    ),
    Bad(
        "truncated JPEG",
        one_b64(lambda images: _jpeg(images)[: len(_jpeg(images)) // 2]),
        422,
        ("images[0].b64", "cannot decode the JPEG"),
        "images[0].b64",
        codes=("undecodable_image",),
    ),
    Bad(
        "PNG with a corrupted IDAT",
        one_b64(lambda images: _png(images)[:60] + b"\x00" * 40 + _png(images)[100:]),
        422,
        ("images[0].b64", "cannot decode the PNG"),
        "images[0].b64",
    ),
    Bad(
        "bytes posing as BMP",
        one_b64(b"BM" + b"\x00" * 64),
        422,
        ("images[0].b64", "cannot decode the BMP"),
        "images[0].b64",
    ),
    Bad(
        "PNG claiming 50000 x 50000 (decompression bomb)",
        one_b64(png_claiming(50_000, 50_000)),
        422,
        ("images[0].b64", PIXEL_LIMIT),
        "images[0].b64",
        codes=("too_many_pixels",),
    ),
    Bad(
        "PNG claiming 5000 x 5000 (over the pixel limit)",
        one_b64(png_claiming(5_000, 5_000)),
        422,
        ("images[0].b64", PIXEL_LIMIT, "5000x5000 = 25000000 pixels"),
        "images[0].b64",
        codes=("too_many_pixels",),
    ),
    Bad(
        "GIF claiming 65535 x 65535",
        one_b64(gif_claiming(65_535, 65_535)),
        422,
        ("images[0].b64", PIXEL_LIMIT),
        "images[0].b64",
        codes=("too_many_pixels",),
    ),
    Bad(
        "PNG of 101 x 100 over a 10000-pixel limit",
        one_b64(encode(np.zeros((100, 101), np.uint8))),
        422,
        ("images[0].b64", STRICT_LIMIT, "101x100 = 10100 pixels"),
        "images[0].b64",
        strict=True,
        codes=("too_many_pixels",),
    ),
    Bad(
        "pixels 101 x 100 over a 10000-pixel limit",
        pixels(np.zeros((100, 101), np.uint8).tolist()),
        422,
        ("images[0].pixels", STRICT_LIMIT),
        "images[0].pixels",
        strict=True,
        codes=("too_many_pixels",),
    ),
    # Formats not on the allow-list: 415 naming the format.
    *[
        Bad(
            f"{name} image",
            one_b64(data),
            415,
            ("images[0].b64", name, "PNG, JPEG, WebP, BMP or GIF"),
            "images[0].b64",
            codes=("unsupported_image_format",),
        )
        for name, data in (
            ("TIFF", _other_format("TIFF")),
            ("ICO", _other_format("ICO")),
            ("PDF", _other_format("PDF")),
            ("SVG", SVG),
            ("SVG/XML", b'<?xml version="1.0"?>' + SVG),
        )
    ],
    Bad(
        "TIFF as a multipart file",
        one_file(_other_format("TIFF")),
        415,
        ("files[0]", "TIFF"),
        "files[0]",
    ),
    # Pixels.
    Bad(
        "pixels with ragged rows",
        pixels([[0, 1, 2], [3, 4]]),
        422,
        ("images[0].pixels", "rows of different lengths"),
        "images[0].pixels",
    ),
    Bad(
        "pixels one-dimensional",
        pixels([0, 1, 2, 3]),
        422,
        ("images[0].pixels", "1 dimension"),
        "images[0].pixels",
    ),
    Bad(
        "pixels four-dimensional",
        pixels([[[[0]]]]),
        422,
        ("images[0].pixels", "4 dimension"),
        "images[0].pixels",
    ),
    Bad(
        "pixels with 2 channels",
        pixels([[[0, 1], [2, 3]], [[4, 5], [6, 7]]]),
        422,
        ("images[0].pixels", "C = 1 or 3"),
        "images[0].pixels",
    ),
    Bad("pixels empty rows", pixels([[]]), 422, ("images[0].pixels", "empty"), "images[0].pixels"),
    Bad(
        "pixels NaN",
        raw(b'{"images": [{"pixels": [[0, NaN], [1, 2]]}]}'),
        422,
        ("images[0].pixels", "0 to 255", "NaN at [0, 1]", "not an integer"),
        "images[0].pixels",
    ),
    Bad(
        "pixels Infinity",
        raw(b'{"images": [{"pixels": [[0, 1], [Infinity, 2]]}]}'),
        422,
        ("images[0].pixels", "0 to 255", "Infinity at [1, 0]", "not an integer"),
        "images[0].pixels",
    ),
    Bad(
        "pixels negative",
        pixels([[0, -1], [1, 2]]),
        422,
        ("images[0].pixels", "0 to 255", "-1.0 at [0, 1]"),
        "images[0].pixels",
    ),
    Bad(
        "pixels too large",
        pixels([[0, 1], [256, 2]]),
        422,
        ("images[0].pixels", "0 to 255", "256.0 at [1, 0]"),
        "images[0].pixels",
    ),
    Bad(
        "pixels 1e40",
        raw(b'{"images": [{"pixels": [[1e40]]}]}'),
        422,
        ("images[0].pixels", "0 to 255"),
        "images[0].pixels",
    ),
    Bad(
        "pixels an integer of 400 digits",
        raw(b'{"images": [{"pixels": [[1' + b"0" * 400 + b"]]}]}"),
        422,
        ("images[0].pixels", "0 to 255", "too large"),
        "images[0].pixels",
    ),
    Bad(
        "pixels a word",
        pixels([["black", 0]]),
        422,
        ("images[0].pixels", "not a number"),
        "images[0].pixels",
    ),
    Bad(
        "pixels an object",
        pixels([[{"r": 1}]]),
        422,
        ("images[0].pixels", "not a number"),
        "images[0].pixels",
    ),
    # Strict pixels: JSON numbers only; numeric strings and booleans are not numbers.
    Bad(
        "pixels numeric strings",
        pixels([["12", 0], [0, 0]]),
        422,
        ("images[0].pixels", '"12" at [0, 0]', "not a number"),
        "images[0].pixels",
    ),
    Bad(
        "pixels booleans",
        pixels([[0, True], [0, 0]]),
        422,
        ("images[0].pixels", "true at [0, 1]", "not a number"),
        "images[0].pixels",
    ),
    Bad(
        "pixels fractions",
        pixels([[0, 0], [12.5, 0]]),
        422,
        ("images[0].pixels", "12.5 at [1, 0]", "not an integer"),
        "images[0].pixels",
    ),
    Bad(
        "pixels null",
        pixels([[0, 1], [None, 2]]),
        422,
        ("images[0].pixels", "null at [1, 0]"),
        "images[0].pixels",
    ),
    Bad(
        "pixels a numeric string in the last channel",
        lambda _: {"json": {"image": {"pixels": [[[0]], [[0]], [["7"]]]}}},
        422,
        ("image.pixels", '"7" at [2, 0, 0]'),
        "image.pixels",
        route="/attention",
    ),
    # JSON bombs under the byte limit: refused on the raw bytes, before parsing.
    Bad(
        "nested empty arrays under the byte limit",
        raw(b'{"images": [{"pixels": [' + b",".join([b"[[]]"] * 600_000) + b"]}]}"),
        413,
        ("max_json_values=1048576",),
        "body",
        codes=("too_many_json_values",),
    ),
    Bad(
        "one-pixel rows over max_json_values",
        raw(b'{"images": [{"pixels": [' + b",".join([b"[0]"] * 600_000) + b"]}]}"),
        413,
        ("max_json_values=1048576", "send large images as files"),
        "body",
        codes=("too_many_json_values",),
    ),
    Bad(
        "empty arrays in /attention",
        raw(b'{"image": {"pixels": [' + b",".join([b"[]"] * 1_100_000) + b"]}}"),
        413,
        ("max_json_values=1048576",),
        "body",
        route="/attention",
        codes=("too_many_json_values",),
    ),
    Bad(
        "a pixel list beyond what the pixel limit allows",
        raw(b'{"images": [{"pixels": [' + b",".join([b"0"] * 500_000) + b"]}]}"),
        422,
        ("images", STRICT_LIMIT, f"{MAX_IMAGES} image(s)"),
        "images",
        strict=True,
        codes=("too_many_pixels",),
    ),
    # Size and count limits.
    Bad(
        "JSON body over the byte limit",
        lambda images: {"json": {"images": [{"b64": "A" * MAX_BODY_BYTES}]}},
        413,
        (LIMIT,),
        "body",
    ),
    Bad(
        "file over the byte limit",
        one_file(b"\x89PNG\r\n\x1a\n" + b"\x00" * MAX_BODY_BYTES),
        413,
        (LIMIT,),
        "body",
    ),
    Bad(
        "too many images (JSON)",
        lambda images: {"json": {"images": [{"pixels": [[0]]}] * (MAX_IMAGES + 1)}},
        422,
        ("images", TOO_MANY),
        "images",
        codes=("too_many_images",),
    ),
    Bad(
        "too many images, each undecodable: counted before decoding",
        lambda images: {"json": {"images": [{"b64": "AAAA"}] * (MAX_IMAGES + 1)}},
        422,
        ("images", TOO_MANY),
        "images",
        codes=("too_many_images",),
    ),
    Bad(
        "too many files (multipart)",
        lambda images: {
            "files": [("files", (f"{i}.png", encode(images[0]), "image/png")) for i in range(9)]
        },
        422,
        ("files", TOO_MANY),
        "files",
        codes=("too_many_images",),
    ),
    Bad(
        "far too many files (multipart)",
        lambda images: {
            "files": [("files", (f"{i}.png", b"x", "image/png")) for i in range(3 * MAX_IMAGES)]
        },
        422,
        ("files", TOO_MANY),
        "files",
        codes=("too_many_images",),
    ),
    # Content types and multipart forms.
    Bad(
        "unsupported content type",
        raw(b"<images/>", "application/xml"),
        415,
        ("Content-Type", "application/xml"),
        "Content-Type",
    ),
    Bad("no content type", raw(b"{}", None), 415, ("Content-Type", "none"), "Content-Type"),
    Bad(
        "image bytes sent as the body",
        lambda images: {"content": encode(images[0]), "headers": {"Content-Type": "image/png"}},
        415,
        ("image/png",),
        "Content-Type",
    ),
    Bad(
        "multipart without a boundary",
        raw(b"--x\r\n", "multipart/form-data"),
        422,
        ("malformed multipart",),
        "body",
    ),
    Bad(
        "huge multipart form: 5000 fields",
        lambda images: dict(zip(("content", "headers"), _form_request(5000), strict=True)),
        422,
        ("multipart", "Maximum number of fields is 32"),
        "body",
    ),
    Bad(
        "multipart text field of 100 kB",
        lambda images: {
            "data": {"top_k": "1" * 100_000},
            "files": [("files", ("a.png", encode(images[0]), "image/png"))],
        },
        422,
        ("multipart", "Part exceeded maximum size"),
        "body",
    ),
    Bad(
        "multipart file part with another name",
        lambda images: {"data": {"top_k": "3"}, "files": {"image": ("a.png", b"x", "image/png")}},
        422,
        ("image", "files"),
        "image",
    ),
    Bad(
        "multipart without a file part",
        raw(
            b'--b\r\nContent-Disposition: form-data; name="top_k"\r\n\r\n3\r\n--b--\r\n',
            "multipart/form-data; boundary=b",
        ),
        422,
        ("files", "no file part"),
        "files",
    ),
    # A field name the client's own charset decodes to a lone surrogate: the message naming it must
    # still encode (a 4xx, not a 500).
    Bad(
        "multipart text field named a lone surrogate",
        lambda images: {
            "content": surrogate_form(images, text_name=True),
            "headers": {"Content-Type": SURROGATE_FORM},
        },
        422,
        ("\\ud800",),
        "\\ud800",
    ),
    Bad(
        "multipart file part named a lone surrogate",
        lambda images: {
            "content": surrogate_form(images, text_name=False),
            "headers": {"Content-Type": SURROGATE_FORM},
        },
        422,
        ("\\ud800", "unexpected file part"),
        "\\ud800",
    ),
    Bad(
        "URL-encoded form",
        lambda images: {"data": {"top_k": "3"}},
        415,
        ("application/x-www-form-urlencoded",),
        "Content-Type",
    ),
    Bad(
        "multipart 'files' sent as a text field",
        lambda images: {"data": {"files": "cat.png"}, "files": {"x": ("", b"", "text/plain")}},
        422,
        ("files",),
    ),
    Bad(
        "multipart top_k not a number",
        lambda images: {
            "data": {"top_k": "many"},
            "files": [("files", ("a.png", encode(images[0]), "image/png"))],
        },
        422,
        ("top_k", "integer"),
        "top_k",
    ),
    Bad(
        "multipart zero-byte file",
        one_file(b""),
        422,
        ("files[0]", "empty (0 bytes)"),
        "files[0]",
    ),
    # /attention options.
    Bad(
        "attention layer out of range",
        lambda images: {"json": {"image": {"pixels": good_pixels(images)}, "layer": 99}},
        422,
        ("layer", "2 layers"),
        "layer",
        route="/attention",
    ),
    Bad(
        "attention head with rollout",
        lambda images: {"json": {"image": {"pixels": good_pixels(images)}, "head": 0}},
        422,
        ("head", "raw"),
        "head",
        route="/attention",
    ),
    Bad(
        "attention head out of range",
        lambda images: {
            "json": {"image": {"pixels": good_pixels(images)}, "method": "raw", "head": 9}
        },
        422,
        ("head", "2 heads"),
        "head",
        route="/attention",
    ),
    Bad(
        "attention layer false",
        lambda images: {"json": {"image": {"pixels": good_pixels(images)}, "layer": False}},
        422,
        ("layer", "integer"),
        "layer",
        route="/attention",
    ),
    Bad(
        "attention unknown method",
        lambda images: {"json": {"image": {"pixels": good_pixels(images)}, "method": "gradcam"}},
        422,
        ("method",),
        "method",
        route="/attention",
    ),
    Bad(
        "attention two files",
        lambda images: {
            "files": [("file", (f"{i}.png", encode(images[0]), "image/png")) for i in range(2)]
        },
        422,
        ("file",),
        "file",
        route="/attention",
    ),
    Bad(
        "attention images instead of image",
        lambda images: {"json": {"images": [{"pixels": good_pixels(images)}]}},
        422,
        ("image",),
        route="/attention",
    ),
]


def _form_request(fields: int) -> tuple[bytes, dict[str, str]]:
    body, content_type = many_fields_form(fields)
    return body, {"Content-Type": content_type}


@pytest.fixture(scope="module")
def strict_client(model_repository) -> Iterator[TestClient]:
    settings = make_settings(model_repository, RELIABILITY, max_pixels_per_image=STRICT_PIXELS)
    with TestClient(local_app(settings), raise_server_exceptions=False) as client:
        yield client


def test_the_corpus_is_large_enough():
    names = [case.name for case in CORPUS]
    assert len(set(names)) == len(names)
    assert len(CORPUS) >= 25


@pytest.mark.parametrize("case", CORPUS, ids=[case.name for case in CORPUS])
def test_bad_input_gets_its_status_and_message(
    case: Bad, client, strict_client, fashion_images
) -> None:
    target = strict_client if case.strict else client
    response = target.post(case.route, **case.request(fashion_images))
    error = assert_error(response, case.status, *case.fragments)
    if case.field is not None:
        assert error["field"] == case.field, error
    if case.codes:
        assert error["code"] in case.codes, error


@pytest.mark.parametrize(
    ("length", "status"),
    [
        ("\u00b2".encode("latin-1"), 400),  # a superscript two: str.isdigit() says yes, int() no
        (b"\xbd", 400),  # one half
        (b"1" * 5000, 413),  # beyond int()'s 4300 digits, and beyond any limit
        (b"12a", 400),
        (b"-5", 400),
    ],
    ids=["superscript digit", "vulgar fraction", "5000 digits", "trailing letter", "negative"],
)
@pytest.mark.parametrize("path", ["/predict", "/v2/models/tiny-vit/infer"])
def test_an_odd_content_length_is_a_4xx(client, path, length, status):
    headers = [(b"content-type", b"application/json"), (b"content-length", length)]
    answer_status, answer, _ = asgi_post(client.app, path, headers, [b"{}"])
    assert answer_status == status, answer
    message = answer["error"] if path.startswith("/v2") else answer["error"]["message"]
    assert "Content-Length" in message and len(message) < 200, message


# --- awkward but valid: served, not refused -------------------------------------------------------


def _palette(image: np.ndarray) -> Image.Image:
    paletted = Image.fromarray(image, mode="L").convert("P")  # grey palette: lossless
    paletted.putpalette([v for i in range(256) for v in (i, i, i)])
    paletted.frombytes(image.tobytes())
    return paletted


def _sixteen_bit(image: np.ndarray) -> Image.Image:
    return Image.fromarray(image.astype(np.uint16) * 257)  # mode I;16, same picture


def _rgba(image: np.ndarray) -> Image.Image:
    return Image.fromarray(np.dstack([image, image, image, np.full_like(image, 255)]))


def _grey_alpha(image: np.ndarray) -> Image.Image:
    return Image.fromarray(np.dstack([image, np.full_like(image, 255)]), mode="LA")


def _upscaled(image: np.ndarray, factor: int) -> Image.Image:
    return Image.fromarray(np.kron(image, np.ones((factor, factor), np.uint8)))


def _animated_gif(image: np.ndarray) -> bytes:
    first = Image.fromarray(image)
    others = [Image.fromarray(255 - image), Image.new("L", (28, 28), 128)]
    return encode(first, "GIF", save_all=True, append_images=others, duration=50, loop=0)


def _exif_rotated_jpeg(image: np.ndarray) -> bytes:
    rotated = Image.fromarray(np.rot90(image, 1))  # stored rotated; EXIF says rotate it back
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(rotated.convert("RGB"), "JPEG", quality=95, exif=exif)


# (name, file bytes, whether the picture is exactly the garment so that the reference must agree)
def awkward_images(images: np.ndarray) -> list[tuple[str, bytes, bool]]:
    image = images[3]
    rgb = np.dstack([image] * 3)
    photo = Image.fromarray(rgb).resize((2000, 1500), Image.Resampling.BICUBIC)
    return [
        ("RGBA PNG", encode(_rgba(image)), True),
        ("grey + alpha PNG", encode(_grey_alpha(image)), True),
        ("half-transparent RGBA PNG", encode(Image.fromarray(np.dstack([rgb, image]))), False),
        ("palette PNG", encode(_palette(image)), True),
        ("palette PNG with transparency", encode(_palette(image), transparency=0), False),
        ("16-bit PNG", encode(_sixteen_bit(image)), True),
        ("1-bit PNG", encode(Image.fromarray(image).convert("1")), False),
        ("RGB PNG", encode(rgb), True),
        ("BMP", encode(image, "BMP"), True),
        ("lossless WebP", encode(rgb, "WEBP", lossless=True), True),
        ("GIF", encode(image, "GIF"), False),
        ("animated GIF (first frame served)", _animated_gif(image), False),
        ("greyscale JPEG", encode(image, "JPEG", quality=95), False),
        ("CMYK JPEG", encode(Image.fromarray(rgb).convert("CMYK"), "JPEG"), False),
        ("EXIF-rotated JPEG", _exif_rotated_jpeg(image), False),
        ("1 x 1 PNG", encode(np.zeros((1, 1), np.uint8)), False),
        ("3 x 500 PNG", encode(np.full((500, 3), 200, np.uint8)), False),
        ("2000 x 1500 JPEG photo", encode(photo, "JPEG", quality=85), False),
        ("4096 x 4096 RGBA PNG", encode(Image.new("RGBA", (4096, 4096), (9, 9, 9, 255))), False),
    ]


def test_awkward_but_valid_images_are_served(client, fashion_images, reference):
    cases = awkward_images(fashion_images)
    expected = reference.probabilities(fashion_images[3:4])[0]
    assert len(cases) >= 15
    for name, data, exact in cases:
        response = client.post(
            "/predict",
            json={"images": [{"b64": b64(data)}], "top_k": NUM_CLASSES, "invert": "never"},
        )
        assert response.status_code == 200, (name, response.text[:300])
        prediction = response.json()["predictions"][0]
        assert 0 <= prediction["index"] < NUM_CLASSES, name
        assert sum(entry["score"] for entry in prediction["top_k"]) == pytest.approx(1, abs=1e-4)
        if exact:
            assert_matches(prediction, expected)
    data_url = "data:image/png;base64," + b64(encode(fashion_images[3]))
    response = client.post("/predict", json={"images": [{"b64": data_url}], "top_k": NUM_CLASSES})
    assert response.status_code == 200
    assert_matches(response.json()["predictions"][0], expected)


def test_a_large_image_is_served_as_its_small_self(client, fashion_images):
    """A garment blown up 64 times (1792 x 1792) gets the scores of the same garment blown up twice:
    the large image is brought down without changing what the model sees."""
    image = fashion_images[5]
    answers = []
    for factor in (2, 64):
        body = {"images": [{"b64": b64(encode(_upscaled(image, factor)))}], "top_k": NUM_CLASSES}
        response = client.post("/predict", json=body)
        assert response.status_code == 200, response.text
        answers.append({e["index"]: e["score"] for e in response.json()["predictions"][0]["top_k"]})
    small, large = answers
    assert [large[i] for i in range(NUM_CLASSES)] == pytest.approx(
        [small[i] for i in range(NUM_CLASSES)], abs=2e-3
    )


def test_multipart_with_mixed_awkward_files(client, fashion_images):
    cases = awkward_images(fashion_images)[:MAX_IMAGES]
    files = [("files", (f"{n}.bin", data, "application/octet-stream")) for n, data, _ in cases]
    response = client.post("/predict", files=files, data={"top_k": "2"})
    assert response.status_code == 200, response.text
    assert len(response.json()["predictions"]) == len(cases)


# --- afterwards -----------------------------------------------------------------------------------


def test_after_the_corpus_the_service_is_ready_and_right(client, fashion_images, reference):
    """Runs after the corpus (file order): no 5xx was ever answered, and serving goes on, correct."""
    for case in CORPUS:  # once more, interleaved with good requests, on one app
        if case.strict:
            continue
        bad = client.post(case.route, **case.request(fashion_images))
        assert bad.status_code == case.status, (case.name, bad.text[:300])
        assert_no_leak(bad)
        good = client.post("/predict", json={"images": [{"pixels": fashion_images[1].tolist()}]})
        assert good.status_code == 200, (case.name, good.text[:300])
    assert client.get("/health/ready").status_code == 200
    images = fashion_images[:MAX_IMAGES]
    response = client.post(
        "/predict",
        json={"images": [{"b64": b64(encode(i))} for i in images], "top_k": NUM_CLASSES},
    )
    assert response.status_code == 200
    for prediction, probabilities in zip(
        response.json()["predictions"], reference.probabilities(images), strict=True
    ):
        assert_matches(prediction, probabilities)
    metrics = client.get("/metrics").text
    served = metric(metrics, "vitserve_http_requests_total")
    assert served > 2 * len(CORPUS)
    for status in ("500", "501", "502", "503", "504"):
        assert metric(metrics, "vitserve_http_requests_total", status=status) == 0, status


def test_error_answers_carry_no_internals_even_for_odd_requests(client):
    """Odd methods, paths and headers still get the JSON error shape."""
    odd: list[httpx.Response] = [
        client.get("/predict"),
        client.delete("/models"),
        client.get("/no/such/route"),
        client.get("/models/..%2F..%2Fetc%2Fpasswd"),
        client.post(
            "/predict", json={"images": [{"pixels": [[0]]}]}, headers={"X-Request-ID": "x\ty"}
        ),
    ]
    for response in odd[:4]:
        assert response.status_code in (404, 405), response.text
        assert_error(response, response.status_code)
    assert odd[4].status_code == 200 and odd[4].headers["x-request-id"] != "x\ty"
