"""An image file's bytes to a decoded, upright Pillow image, refused with a 4xx that says why.

The format from its magic bytes (PNG, JPEG, WebP, BMP, GIF only), the pixel count from the header
before decoding (decompression bombs), a JPEG whose data cannot hold its header's image refused as
truncated, the first frame decoded (a JPEG at the smallest DCT scale that still covers the resize, when
asked) and the EXIF orientation applied. ``preprocessing.py`` takes the image from there.

Whether a JPEG's compressed data can hold the image its header declares (:func:`truncation`): libjpeg
decodes a JPEG whose data ends early (a file cut and ended with an EOI marker, or a header patched to
claim 4000 x 4000 over a 28 x 28 image's data) without an error: it warns, fills the missing blocks
with grey, and Pillow ignores the warning (``LOAD_TRUNCATED_IMAGES`` or not). So the file itself is
checked, before decoding: every 8 x 8 block of every component has a DC coefficient, coded with a
Huffman code of at least one bit in each Huffman-coded DCT JPEG (baseline, extended or progressive),
so data of fewer bits than the image has blocks cannot be the whole image. A cut that leaves at least
a bit a block is not caught here; it decodes with grey blocks, as in any viewer.
"""

from __future__ import annotations

import io
import math
import re
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

from service.errors import InvalidInput, UnsupportedMediaType

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF")
ACCEPTED_TEXT = "PNG, JPEG, WebP, BMP or GIF"

# Magic bytes of the accepted formats, and of common others so that they get a 415 that names them.
_ACCEPTED_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
)
_OTHER_MAGIC = (
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"%PDF", "PDF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"qoif", "QOI"),
    (b"\x76\x2f\x31\x01", "OpenEXR"),
    (b"<svg", "SVG"),
    (b"<?xml", "SVG/XML"),
    (b"P1", "PBM"),
    (b"P4", "PBM"),
    (b"P2", "PGM"),
    (b"P5", "PGM"),
    (b"P3", "PPM"),
    (b"P6", "PPM"),
)

# ITU-R 601-2 luma, as Pillow's convert("L") uses.
# The pixel limit is checked on the header in decode_image (a 4xx naming the setting); Pillow's own
# warning below its hard limit would only repeat it, once per image, and catch_warnings per image
# costs as much as decoding a thumbnail.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def sniff_format(data: bytes, field: str) -> str:
    """The Pillow format name of ``data``; 415 for a known other format, 422 for unknown bytes."""
    if not data:
        raise InvalidInput(
            f"{field}: the image is empty (0 bytes)", field=field, code="empty_image"
        )
    for magic, name in _ACCEPTED_MAGIC:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    other = None
    for magic, name in _OTHER_MAGIC:
        if data.startswith(magic):
            other = name
    if other is None and data[4:8] == b"ftyp":
        other = "HEIF/AVIF"
    if other is not None:
        raise UnsupportedMediaType(
            f"{field}: {other} images are not supported; send a {ACCEPTED_TEXT} file",
            field=field,
            code="unsupported_image_format",
        )
    raise InvalidInput(
        f"{field}: not a recognisable image (expected a {ACCEPTED_TEXT} file)",
        field=field,
        code="undecodable_image",
    )


# Files larger than this are never taken for thumbnails: pixels_to_decode does not parse them.
PEEK_BYTES = 256 * 1024


def pixels_to_decode(data: bytes) -> int | None:
    """The pixels decoding ``data``'s first frame really makes, told without decoding: a PNG's or
    BMP's header (what its decoder allocates), a GIF's canvas as Pillow sizes it from the first
    image descriptor (the logical screen may claim 1x1 for a 4096x4095 frame). None when it
    cannot be told cheaply: JPEG, WebP, malformed, or more than PEEK_BYTES."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        return int.from_bytes(data[16:20], "big") * int.from_bytes(data[20:24], "big")
    if data[:2] == b"BM" and len(data) >= 26:
        width = int.from_bytes(data[18:22], "little", signed=True)
        height = int.from_bytes(data[22:26], "little", signed=True)
        return abs(width * height)
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) <= PEEK_BYTES:
        try:
            with Image.open(io.BytesIO(data), formats=["GIF"]) as image:  # header and descriptor
                width, height = image.size
        except Exception:  # Pillow raises many exception types for malformed headers
            return None
        return width * height
    return None


# an object's default repr, as Pillow puts the file it was given in its messages
_OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")


def pillow_problem(error: Exception, image_format: str) -> str:
    """What Pillow found wrong, for the client: never an object's repr (its memory address)."""
    if isinstance(error, UnidentifiedImageError):
        return f"not a valid {image_format} file"
    return _OBJECT_REPR.sub("the image", str(error)) or type(error).__name__


def decode_image(data: bytes, field: str, max_pixels: int, draft_size: int) -> Image.Image:
    """Decode the first frame, upright, after checking the header's pixel count against the limit."""
    image_format = sniff_format(data, field)
    too_many = (
        f"{field}: the image has too many pixels; the limit is max_pixels_per_image={max_pixels}"
    )
    try:
        image = Image.open(io.BytesIO(data), formats=[image_format])
    except Image.DecompressionBombError as error:
        raise InvalidInput(too_many, field=field, code="too_many_pixels") from error
    except Exception as error:  # Pillow raises many exception types for malformed headers
        raise undecodable(field, image_format, error) from error
    width, height = image.size
    if width < 1 or height < 1:
        raise InvalidInput(
            f"{field}: the image is {width}x{height} pixels", field=field, code="empty_image"
        )
    if width * height > max_pixels:
        raise InvalidInput(
            f"{too_many} ({width}x{height} = {width * height} pixels)",
            field=field,
            code="too_many_pixels",
        )
    truncated = truncation(data) if image_format == "JPEG" else None
    if truncated is not None:  # libjpeg would fill the missing blocks with grey, and say nothing
        raise InvalidInput(f"{field}: {truncated}", field=field, code="truncated_image")
    try:
        if draft_size:  # JPEG only: decode at a reduced scale when it can (0: never)
            image.draft(None, (draft_size, draft_size))
        image.load()
        ImageOps.exif_transpose(image, in_place=True)  # a copy per image otherwise
    except Exception as error:
        raise undecodable(field, image_format, error) from error
    return image


def undecodable(field: str, image_format: str, error: Exception) -> InvalidInput:
    """The 422 for an image Pillow could not open or decode, in Pillow's words (no object's repr)."""
    return InvalidInput(
        f"{field}: cannot decode the {image_format} image ({pillow_problem(error, image_format)})",
        field=field,
        code="undecodable_image",
    )


# --- a JPEG's data against its header -------------------------------------------------------------

# SOF markers of Huffman-coded DCT frames (baseline, extended, progressive): the ones checked
_HUFFMAN_DCT_FRAMES = {0xC0, 0xC1, 0xC2}
# every other start of frame (lossless, hierarchical, arithmetic-coded): not checked
_OTHER_FRAMES = {0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_SOS, _EOI = 0xDA, 0xD9
# where a scan's entropy-coded data ends: a marker that is neither a stuffed 0x00 nor a restart
_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


def blocks_and_data(data: bytes) -> tuple[int, int, int, int] | None:
    """``(width, height, blocks, data_bits)`` of a Huffman-coded DCT JPEG: its header's size, the
    8 x 8 blocks of all its components, and the bits of its scans' entropy-coded data. None when it
    is not such a JPEG or its markers cannot be followed (its decoder then judges it)."""
    frame: tuple[int, int, int] | None = None
    bits = 0
    at, size = 2, len(data)  # past SOI
    while at + 4 <= size:
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # a fill byte before a marker
            at += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            at += 2
            continue
        if marker == _EOI:
            break
        length = int.from_bytes(data[at + 2 : at + 4], "big")
        if length < 2:
            return None
        segment = data[at + 4 : at + 2 + length]
        if marker in _OTHER_FRAMES:
            return None
        if marker in _HUFFMAN_DCT_FRAMES:
            frame = _frame_blocks(segment)
            if frame is None:
                return None
        at += 2 + length
        if marker == _SOS:
            end = _SCAN_END.search(data, at)
            stop = size if end is None else end.start()
            bits += 8 * (stop - at)
            at = stop
    if frame is None:
        return None
    return (*frame, bits)


def _frame_blocks(segment: bytes) -> tuple[int, int, int] | None:
    """A frame header's width, height and 8 x 8 blocks over its components."""
    if len(segment) < 6:
        return None
    height = int.from_bytes(segment[1:3], "big")
    width = int.from_bytes(segment[3:5], "big")
    count = segment[5]
    if len(segment) < 6 + 3 * count or not count or not height:  # height 0: set by a DNL marker
        return None
    sampling = [(segment[7 + 3 * i] >> 4, segment[7 + 3 * i] & 15) for i in range(count)]
    if any(h == 0 or v == 0 for h, v in sampling):
        return None
    h_max = max(h for h, _ in sampling)
    v_max = max(v for _, v in sampling)
    blocks = sum(
        math.ceil(math.ceil(width * h / h_max) / 8) * math.ceil(math.ceil(height * v / v_max) / 8)
        for h, v in sampling
    )
    return width, height, blocks


def truncation(data: bytes) -> str | None:
    """Why a JPEG's data cannot hold its image (it is truncated), or None."""
    found = blocks_and_data(data)
    if found is None:
        return None
    width, height, blocks, bits = found
    if bits >= blocks:
        return None
    return (
        f"the JPEG image is truncated: its header says {width}x{height} pixels ({blocks} blocks "
        f"of 8x8), and its data of {bits // 8} bytes cannot hold more than {bits} of them"
    )
