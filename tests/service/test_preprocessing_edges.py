"""service/contract/preprocessing.py at its edges: each refusal's code and wording, limits one value
either side, and the numbers of each conversion against values worked out by hand.

Written against `make mutation`'s survivors in the module (docs/testing.md).
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from service.contract.decoding import PEEK_BYTES, decode_image, pixels_to_decode, sniff_format
from service.contract.preprocessing import (
    Preprocessor,
    _border_mean,
    image_to_array,
    normalise,
    pixels_to_array,
    should_invert,
)
from service.errors import InvalidInput, UnsupportedMediaType
from tests.support import encode


@pytest.mark.parametrize(
    ("pixels", "fragment"),
    [
        ([[0, 10**400]], "found an integer too large to represent"),
        ([[0, 1], [2]], "found rows of different lengths"),
        ([[0, "a"]], "found a value that is not a number"),
        ([[0, None]], "found nan at [0, 1]"),
        ([[[0]], [[0]]], "C x H x W with C = 1 or 3; got shape [2, 1, 1]"),
        ([[[[0]]]], "must be H x W or C x H x W; got 4 dimension(s), shape [1, 1, 1, 1]"),
        (7, "must be H x W or C x H x W; got 0 dimension(s), shape []"),
        ([[0, 256]], "values must be numbers from 0 to 255; found 256.0 at [0, 1]"),
        (
            [[0, -1e-3]],
            "values must be numbers from 0 to 255; found -0.0010000000474974513 at [0, 1]",
        ),
        ([[[0, 1]], [[2, float("nan")]], [[4, 5]]], "found nan at [1, 0, 1]"),
        ([[0, 1e40]], "found inf at [0, 1]"),
    ],
    ids=[
        "huge integer",
        "ragged",
        "string",
        "null",
        "two channels",
        "four dimensions",
        "scalar",
        "over 255",
        "below 0",
        "nan in the second channel",
        "overflow to inf",
    ],
)
def test_a_bad_pixel_list_is_invalid_pixels_with_its_reason(pixels, fragment):
    with pytest.raises(InvalidInput) as error:
        pixels_to_array(pixels, "images[2].pixels", 1000)
    assert fragment in error.value.message, error.value.message
    assert error.value.message.startswith("images[2].pixels: ")
    assert (error.value.field, error.value.code) == ("images[2].pixels", "invalid_pixels")


@pytest.mark.parametrize(("pixels", "shown"), [([[]], "1x0"), ([[], []], "2x0"), ([[[]]], "1x0")])
def test_an_empty_pixel_list_is_an_empty_image(pixels, shown):
    with pytest.raises(InvalidInput) as error:
        pixels_to_array(pixels, "image.pixels", 1000)
    assert error.value.message == f"image.pixels: the image is empty ({shown})"
    assert (error.value.field, error.value.code) == ("image.pixels", "empty_image")


def test_a_pixel_list_of_exactly_max_pixels_passes_and_one_more_row_is_refused():
    array = pixels_to_array([[7] * 6] * 4, "images[0].pixels", 24)
    assert array.shape == (4, 6, 1) and array.dtype == np.float32 and (array == 7).all()
    with pytest.raises(InvalidInput) as error:
        pixels_to_array([[7] * 6] * 5, "images[0].pixels", 24)
    assert error.value.message == (
        "images[0].pixels: 6x5 = 30 pixels is over the limit max_pixels_per_image=24"
    )
    assert (error.value.field, error.value.code) == ("images[0].pixels", "too_many_pixels")


def test_a_channel_first_pixel_list_becomes_height_width_channels():
    red, green, blue = [[1, 2, 3]], [[4, 5, 6]], [[7, 8, 9]]
    array = pixels_to_array([red, green, blue], "f", 100)
    assert array.shape == (1, 3, 3)
    assert array[0].tolist() == [[1, 4, 7], [2, 5, 8], [3, 6, 9]]
    assert pixels_to_array([[[0, 255.0]]], "f", 100).tolist() == [[[0.0], [255.0]]]


# --- pixels_to_decode: the pixel count told from the header, on hand-made bytes ----------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_header(width: int, height: int) -> bytes:
    """The first 24 bytes of a PNG: signature, IHDR's length and type, width and height big-endian."""
    return (
        PNG_SIGNATURE
        + b"\x00\x00\x00\x0dIHDR"
        + width.to_bytes(4, "big")
        + height.to_bytes(4, "big")
    )


def bmp_header(width: int, height: int) -> bytes:
    """The first 26 bytes of a BMP: "BM", sizes and offset, then BITMAPINFOHEADER's size, width and
    height as signed little-endian (a negative height is a top-down image)."""
    return (
        b"BM"
        + bytes(12)
        + (40).to_bytes(4, "little")
        + width.to_bytes(4, "little", signed=True)
        + height.to_bytes(4, "little", signed=True)
    )


def gif(version: bytes, width: int, height: int, size: int | None = None) -> bytes:
    """A GIF whose logical screen claims 1 x 1 and whose first image is width x height; padded with
    zero bytes after its trailer to ``size`` bytes."""
    data = (
        version
        + (1).to_bytes(2, "little") * 2
        + b"\x00\x00\x00"  # screen 1 x 1, no palette
        + b"\x2c"
        + bytes(4)
        + width.to_bytes(2, "little")
        + height.to_bytes(2, "little")
        + b"\x00"
        + b"\x02\x02\x44\x01\x00"
        + b"\x3b"  # a token of LZW data, then the trailer
    )
    return data if size is None else data + bytes(size - len(data))


def test_a_png_headers_pixels_are_its_big_endian_width_times_height():
    assert pixels_to_decode(png_header(257, 3)) == 771
    wide = png_header(2**24 + 1, 2**24 + 3)  # every byte of both fields counts
    assert pixels_to_decode(wide) == (2**24 + 1) * (2**24 + 3)
    assert pixels_to_decode(png_header(5, 7) + b"rest of the file") == 35
    assert pixels_to_decode(png_header(5, 7)[:23]) is None  # a truncated header tells nothing
    not_png = b"\xff\xd8\xff\xe0" + bytes(8) + b"IHDR" + bytes(8)  # IHDR at 12, but a JPEG
    assert pixels_to_decode(not_png) is None


def test_a_bmp_headers_pixels_are_its_signed_width_times_height():
    assert pixels_to_decode(bmp_header(300, 200)) == 60_000
    assert pixels_to_decode(bmp_header(300, -200)) == 60_000  # top-down
    assert pixels_to_decode(bmp_header(-300, 200)) == 60_000  # malformed: still its magnitude
    assert pixels_to_decode(bmp_header(300, 200)[:25]) is None


def test_a_gifs_pixels_are_its_first_frame_not_its_screen():
    for version in (b"GIF87a", b"GIF89a"):
        assert pixels_to_decode(gif(version, 40, 30)) == 1200, version
    assert pixels_to_decode(gif(b"GIF89a", 40, 30, size=PEEK_BYTES)) == 1200
    assert pixels_to_decode(gif(b"GIF89a", 40, 30, size=PEEK_BYTES + 1)) is None


def test_transparency_is_composited_on_white():
    la = Image.fromarray(np.array([[[0, 0], [0, 255], [0, 51], [200, 0]]], np.uint8), mode="LA")
    # alpha 0: white; 255: the pixel; 51 (0.2): 0.2 x 0 + 0.8 x 255; 0 over anything: white
    assert image_to_array(la)[..., 0].tolist() == [[255.0, 0.0, 204.0, 255.0]]
    rgba = Image.fromarray(np.array([[[10, 20, 30, 0], [10, 20, 30, 255]]], np.uint8), mode="RGBA")
    assert image_to_array(rgba).tolist() == [[[255.0] * 3, [10.0, 20.0, 30.0]]]


# --- sniff_format and decode_image ---------------------------------------------------------------


def test_the_format_is_the_pillow_name_of_the_magic_bytes():
    assert sniff_format(b"RIFF\x00\x00\x00\x00WEBPVP8 ", "f") == "WEBP"
    with pytest.raises(InvalidInput, match=r"^f: not a recognisable image") as error:
        sniff_format(b"RIFF\x00\x00\x00\x00WAVEfmt ", "f")  # RIFF, but a sound
    assert error.value.code == "undecodable_image"
    with pytest.raises(InvalidInput, match=r"not a recognisable image"):
        sniff_format(b"JUNK\x00\x00\x00\x00WEBPVP8 ", "f")  # WEBP, but not in RIFF
    with pytest.raises(UnsupportedMediaType) as error:
        sniff_format(b"\x00\x00\x00\x18ftypavif", "f")
    assert error.value.message.startswith("f: HEIF/AVIF images are not supported; send a PNG")


def test_an_image_that_decodes_to_no_pixels_is_an_empty_image(monkeypatch):
    """Pillow refuses a zero-sized PNG, GIF or BMP before this check; a decoder that does not is
    caught here (Image.open stubbed to answer such an image)."""
    for size in ((0, 5), (5, 0)):
        monkeypatch.setattr(Image, "open", lambda *_, size=size, **__: Image.new("L", size))
        with pytest.raises(InvalidInput) as error:
            decode_image(b"\x89PNG\r\n\x1a\n", "images[1]", 1000, 28)
        shown = f"{size[0]}x{size[1]}"
        assert error.value.message == f"images[1]: the image is {shown} pixels"
        assert (error.value.field, error.value.code) == ("images[1]", "empty_image")


def test_a_large_jpeg_is_decoded_at_a_reduced_scale():
    photo = np.tile(np.arange(0, 256, 16, dtype=np.uint8), (640, 40))  # 640 x 640
    data = encode(photo, "JPEG", quality=90)
    image = decode_image(data, "f", 10**6, 28)
    # JPEG draft mode decodes at 1/8 scale at most: 80 x 80, still at least the draft size
    assert image.size == (80, 80)


def test_an_overflow_to_infinity_is_refused_with_warnings_as_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InvalidInput, match=r"found inf at \[0, 1\]"):
            pixels_to_array([[0, 1e40]], "f", 100)


# --- polarity, normalisation, fit ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("polarity", "border", "inverted"),
    [
        ("light-on-dark", 127.5, False),
        ("light-on-dark", 128.0, True),
        ("light-on-dark", 128.75, True),
        ("dark-on-light", 127.5, False),
        ("dark-on-light", 127.0, True),
        ("dark-on-light", 128.0, False),
        ("natural", 255.0, False),
    ],
)
def test_auto_inverts_only_past_the_middle_grey(polarity, border, inverted):
    array = np.full((10, 10, 1), border, np.float32)
    assert should_invert(array, polarity, "auto") is inverted
    assert should_invert(array, polarity, "always") is True
    assert should_invert(array, polarity, "never") is False


def frame_reference(array: np.ndarray, thickness: int) -> float:
    """The mean of the frame, from a mask, in float64."""
    mask = np.ones(array.shape[:2], bool)
    mask[thickness:-thickness, thickness:-thickness] = False
    return float(array[mask].astype(np.float64).mean())


def test_the_border_is_a_frame_of_5_percent_of_the_shorter_side():
    ring = np.zeros((20, 30, 1), np.float32)
    ring[0, :] = ring[-1, :] = ring[:, 0] = ring[:, -1] = 255.0  # 1 pixel: 5% of 20
    assert _border_mean(ring) == 255.0
    three = np.zeros((3, 3, 1), np.float32)
    three[1, 1] = 255.0  # a frame of 8 pixels around the middle one
    assert _border_mean(three) == 0.0
    two = np.array([[[10.0], [20.0]], [[30.0], [41.0]]], np.float32)  # all frame
    assert _border_mean(two) == pytest.approx(25.25, rel=1e-15)
    rng = np.random.default_rng(3)
    large = rng.uniform(0, 255, (112, 90, 1)).astype(np.float32)
    assert _border_mean(large) == pytest.approx(frame_reference(large, 4), rel=1e-12)
    tiny = rng.uniform(0, 255, (2, 7, 1)).astype(np.float32)
    assert _border_mean(tiny) == pytest.approx(float(tiny.astype(np.float64).mean()), rel=1e-12)


@pytest.mark.parametrize("channels", [1, 3])
def test_normalise_leaves_its_input_alone_and_is_contiguous(channels):
    """It works in place on its own copy: a one-channel image's transposed view is contiguous, and
    must not be overwritten (Prepared.content is that image)."""
    pre = SimpleNamespace(
        mean=[0.485, 0.456, 0.406][:channels], std=[0.229] * channels, scale=1 / 255
    )
    image = np.random.default_rng(0).uniform(0, 255, (5, 7, channels)).astype(np.float32)
    kept = image.copy()
    out = normalise(image.transpose(2, 0, 1), pre)  # type: ignore[arg-type]
    assert np.array_equal(image, kept)
    assert out.flags.c_contiguous and out.shape == (channels, 5, 7)
    mean = np.float32(pre.mean).reshape(-1, 1, 1)
    std = np.float32(pre.std).reshape(-1, 1, 1)
    written_out = (kept.transpose(2, 0, 1) * np.float32(pre.scale) - mean) / std
    assert np.array_equal(out, written_out)  # the same float32 steps: the same bits


def test_normalise_is_scale_then_mean_and_std_per_channel_in_float32():
    pre = SimpleNamespace(mean=[0.5, 0.25, 0.0], std=[0.5, 0.25, 2.0], scale=1 / 255)
    pixels = np.zeros((3, 1, 2), np.float64)
    pixels[:, 0, 1] = 255.0
    out = normalise(pixels, pre)  # type: ignore[arg-type]
    assert out.dtype == np.float32
    np.testing.assert_allclose(out[:, 0, 0], [-1.0, -1.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(out[:, 0, 1], [1.0, 3.0, 0.5], rtol=1e-6)
    assert normalise(np.zeros((2, 3, 1, 2), np.uint8), pre).dtype == np.float32  # type: ignore[arg-type]
    for shape in ((1, 2), (2, 4, 4), (1, 1, 4, 4)):
        with pytest.raises(ValueError, match=r"are not \[\.\.\., C, H, W\]") as error:
            normalise(np.zeros(shape), pre)  # type: ignore[arg-type]
        assert str(error.value) == (
            f"pixels of shape {list(shape)} are not [..., C, H, W] with C = 3"
        )


def test_a_thin_image_keeps_at_least_one_pixel_across():
    from tests.service.test_preprocessing import metadata

    prepared = Preprocessor(metadata(), 10_000).from_pixels([[200]] * 56, "f", "never")
    assert prepared.content.shape == (28, 1, 1) and prepared.offset == (0, 13)
    assert np.allclose(prepared.content, 200.0)
