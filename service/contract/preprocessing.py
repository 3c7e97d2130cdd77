"""Turn any accepted image into exactly what the model was trained on.

Steps, in order: identify the format from its magic bytes (PNG, JPEG, WebP, BMP, GIF only), check the
pixel count from the header before decoding (decompression bombs), decode the first frame (a JPEG at
the smallest DCT scale that still covers the resize), apply the EXIF orientation, reduce a large image
to a few times its size after the resize, bring any mode (palette, alpha, 16-bit, CMYK, ...) to 0-255,
reduce or expand to the model's channels, then the metadata's geometry (``geometry.py``):

- ``fit-pad``: in float32, decide the polarity, fit the image inside the model's H x W keeping its
  aspect ratio, pad it centred;
- ``resize-crop`` and ``resize``: in 8-bit Pillow, as the sources' own processors do (Hugging Face
  resizes uint8 images, then rescales; timm's transforms resize Pillow images), resize with the named
  filter, crop the centre H x W, then decide the polarity on that crop.

Last, scale and normalise with the metadata's mean and std.
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from service.contract.geometry import (
    RESAMPLE,
    draft_side,
    fit_size,
    reducible,
    resize_and_crop,
    shrink,
)
from service.contract.jpeg_data import truncation
from service.contract.model_repository import ModelMetadata, Preprocessing
from service.errors import InvalidInput, UnsupportedMediaType

Invert = Literal["auto", "always", "never"]

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

_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


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


def _composite_on_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    weight = alpha[..., None] / 255.0
    return rgb * weight + 255.0 * (1.0 - weight)


def image_to_array(image: Image.Image) -> np.ndarray:
    """Any Pillow mode -> float32 ``[H, W, 1 or 3]`` in 0-255; transparency is composited on white."""
    mode = image.mode
    if mode.startswith("I;16"):
        return (np.asarray(image, dtype=np.float32) / 257.0)[..., None]
    if mode == "I":
        return np.clip(np.asarray(image, dtype=np.float32) / 257.0, 0, 255)[..., None]
    if mode == "F":
        return np.clip(np.asarray(image, dtype=np.float32), 0, 255)[..., None]
    if mode == "1":
        image, mode = image.convert("L"), "L"
    if mode == "P" or mode == "PA":
        has_alpha = mode == "PA" or "transparency" in image.info
        image = image.convert("RGBA" if has_alpha else "RGB")
        mode = image.mode
    if mode in ("LA", "La"):
        array = np.asarray(image.convert("LA"), dtype=np.float32)
        return _composite_on_white(array[..., :1], array[..., 1])
    if mode in ("RGBA", "RGBa"):
        array = np.asarray(image.convert("RGBA"), dtype=np.float32)
        return _composite_on_white(array[..., :3], array[..., 3])
    if mode == "L":
        return np.asarray(image, dtype=np.float32)[..., None]
    if mode != "RGB":  # CMYK, YCbCr, LAB, HSV, RGBX: Pillow knows the conversion
        image = image.convert("RGB")
    return np.asarray(image, dtype=np.float32)


def pixels_to_array(pixels: Any, field: str, max_pixels: int) -> np.ndarray:
    """A nested list H x W or C x H x W (C = 1 or 3) of 0-255 values -> float32 ``[H, W, C]``."""
    try:
        with np.errstate(over="ignore"):  # 1e40 becomes inf, refused below with its position
            array = np.asarray(pixels, dtype=np.float32)
    except OverflowError as error:  # an integer beyond any float (JSON has no limit on digits)
        raise InvalidInput(
            f"{field}: values must be numbers from 0 to 255; found an integer too large to represent",
            field=field,
            code="invalid_pixels",
        ) from error
    except (ValueError, TypeError) as error:
        reason = (
            "rows of different lengths"
            if "inhomogeneous" in str(error)
            else "a value that is not a number"
        )
        raise InvalidInput(
            f"{field}: must be a rectangular nested list of numbers, H x W or C x H x W; found {reason}",
            field=field,
            code="invalid_pixels",
        ) from error
    if array.ndim == 2:
        array = array[..., None]
    elif array.ndim == 3:
        if array.shape[0] not in (1, 3):
            raise InvalidInput(
                f"{field}: a 3-dimensional pixel array is C x H x W with C = 1 or 3; got shape "
                f"{list(array.shape)}",
                field=field,
                code="invalid_pixels",
            )
        array = np.moveaxis(array, 0, -1)
    else:
        raise InvalidInput(
            f"{field}: must be H x W or C x H x W; got {array.ndim} dimension(s), shape {list(array.shape)}",
            field=field,
            code="invalid_pixels",
        )
    height, width = array.shape[:2]
    if height < 1 or width < 1:
        raise InvalidInput(
            f"{field}: the image is empty ({height}x{width})", field=field, code="empty_image"
        )
    if height * width > max_pixels:
        raise InvalidInput(
            f"{field}: {width}x{height} = {width * height} pixels is over the limit "
            f"max_pixels_per_image={max_pixels}",
            field=field,
            code="too_many_pixels",
        )
    bad = ~np.isfinite(array) | (array < 0) | (array > 255)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        index = index[:2] if array.shape[2] == 1 else (index[2], index[0], index[1])
        raise InvalidInput(
            f"{field}: values must be numbers from 0 to 255; found {array[np.nonzero(bad)][0]} at "
            f"{list(index)}",
            field=field,
            code="invalid_pixels",
        )
    return array


def _border_mean(array: np.ndarray) -> float:
    """The mean of a frame about 5% of the shorter side thick (the whole image when that is all frame):
    the whole sum less the inside's, in float64, without copying the frame out."""
    height, width = array.shape[:2]
    thickness = max(1, round(min(height, width) * 0.05))
    if 2 * thickness >= min(height, width):
        return float(array.mean(dtype=np.float64))
    inside = array[thickness:-thickness, thickness:-thickness]
    frame_sum = array.sum(dtype=np.float64) - inside.sum(dtype=np.float64)
    return float(frame_sum / (array.size - inside.size))


def should_invert(array: np.ndarray, polarity: str, invert: Invert) -> bool:
    """``auto`` inverts when the image's border says it is the opposite of what training saw."""
    if invert == "always":
        return True
    if invert == "never" or polarity == "natural":
        return False
    border = _border_mean(array)
    return border > 127.5 if polarity == "light-on-dark" else border < 127.5


def _resize(array: np.ndarray, height: int, width: int, resample: str) -> np.ndarray:
    if array.shape[:2] == (height, width):
        return array
    channels = [
        np.asarray(
            Image.fromarray(np.ascontiguousarray(array[..., c])).resize(
                (width, height), RESAMPLE[resample]
            ),
            dtype=np.float32,
        )
        for c in range(array.shape[2])
    ]
    return np.stack(channels, axis=-1)


def normalise(pixels: np.ndarray, preprocessing: Preprocessing) -> np.ndarray:
    """0-255 pixels ``[..., C, H, W]`` -> the model's float32 input, as the metadata says:
    ``x * scale``, then ``(x - mean) / std`` per channel."""
    channels = len(preprocessing.mean)
    pixels = np.asarray(pixels, dtype=np.float32)
    if pixels.ndim < 3 or pixels.shape[-3] != channels:
        raise ValueError(
            f"pixels of shape {list(pixels.shape)} are not [..., C, H, W] with C = {channels}"
        )
    mean = np.asarray(preprocessing.mean, dtype=np.float32).reshape(-1, 1, 1)
    std = np.asarray(preprocessing.std, dtype=np.float32).reshape(-1, 1, 1)
    return (pixels * np.float32(preprocessing.scale) - mean) / std


@dataclass(frozen=True)
class Prepared:
    """One image ready for the model, and how it looks in the model's frame (original polarity)."""

    tensor: np.ndarray  # float32 [C, H, W], normalised
    inverted: bool
    # float32 [h, w, C] in 0-255, original polarity: fit-pad's fitted image before padding, or the
    # centre crop the model sees (then h x w = H x W)
    content: np.ndarray
    offset: tuple[int, int]  # (top, left) of the content in the model's frame
    pad_value: float

    @cached_property
    def display(self) -> np.ndarray:
        """uint8 ``[H, W, C]``, what the model sees but not inverted (the attention overlay's
        background); made only when asked for: /predict never needs it."""
        _, height, width = self.tensor.shape
        pad = 255.0 - self.pad_value if self.inverted else self.pad_value
        return np.rint(_framed(self.content, height, width, self.offset, pad)).astype(np.uint8)


def _framed(
    content: np.ndarray, height: int, width: int, offset: tuple[int, int], value: float
) -> np.ndarray:
    """``content`` [h, w, C] placed at ``offset`` on an H x W canvas of ``value``."""
    if content.shape[:2] == (height, width):
        return content
    canvas = np.full((height, width, content.shape[2]), value, dtype=np.float32)
    top, left = offset
    canvas[top : top + content.shape[0], left : left + content.shape[1]] = content
    return canvas


class Preprocessor:
    """The metadata's preprocessing, as one callable per input kind."""

    def __init__(self, metadata: ModelMetadata, max_pixels: int, draft: bool = True) -> None:
        self.metadata = metadata
        self.max_pixels = max_pixels
        spec = metadata.input
        self.channels, self.height, self.width = spec.channels, spec.height, spec.width
        # draft: a JPEG decoded at a reduced scale that still covers the resize (jpeg_draft)
        self.draft_side = (
            draft_side(metadata.preprocessing, self.height, self.width) if draft else 0
        )
        self._mode = "L" if self.channels == 1 else "RGB"
        self._size = (self.height, self.width)

    def decode(self, data: bytes, field: str) -> Image.Image:
        """The image ``data`` holds, upright, decoded no larger than the geometry needs."""
        return decode_image(data, field, self.max_pixels, self.draft_side)

    def from_bytes(self, data: bytes, field: str, invert: Invert = "auto") -> Prepared:
        return self.from_image(self.decode(data, field), invert)

    def from_image(self, image: Image.Image, invert: Invert = "auto") -> Prepared:
        """A decoded image of any size and mode -> the model's input."""
        if self.metadata.preprocessing.resize == "fit-pad":
            return self.from_array(image_to_array(shrink(image, self.height, self.width)), invert)
        image = reducible(image)
        if image.mode in ("L", "RGB") and image.mode != self._mode:
            image = image.convert(self._mode)  # Pillow's luma, or the grey repeated
        # Any other mode is resized and cropped as it is (alpha premultiplied, 16-bit as 32-bit),
        # then brought to the model's 8-bit mode: compositing on white commutes with the resize.
        image = resize_and_crop(image, self.metadata.preprocessing, *self._size)
        if image.mode != self._mode:
            image = self._eight_bit(image_to_array(image))
        return self._cropped(image, invert)

    def from_pixels(self, pixels: Any, field: str, invert: Invert = "auto") -> Prepared:
        return self.from_array(pixels_to_array(pixels, field, self.max_pixels), invert)

    def from_array(self, array: np.ndarray, invert: Invert = "auto") -> Prepared:
        """float32 ``[h, w, 1 or 3]`` in 0-255 -> the model's input (rounded to 8 bits first for the
        geometries that resize in 8 bits)."""
        pre = self.metadata.preprocessing
        if pre.resize != "fit-pad":
            image = resize_and_crop(self._eight_bit(array), pre, *self._size)
            return self._cropped(image, invert)
        array = self._channels(array)
        inverted = should_invert(array, pre.polarity, invert)
        h, w = array.shape[:2]
        new_h, new_w = fit_size(h, w, self.height, self.width)
        array = np.clip(_resize(array, new_h, new_w, pre.resample), 0.0, 255.0)
        offset = ((self.height - new_h) // 2, (self.width - new_w) // 2)
        return self._prepared(array, inverted, offset)

    def _channels(self, array: np.ndarray) -> np.ndarray:
        if array.shape[2] == self.channels:
            return array
        return array @ _LUMA[:, None] if self.channels == 1 else np.repeat(array, 3, axis=2)

    def _eight_bit(self, array: np.ndarray) -> Image.Image:
        """float32 ``[h, w, 1 or 3]`` in 0-255 -> an 8-bit image in the model's mode."""
        pixels = np.rint(np.clip(self._channels(array), 0.0, 255.0)).astype(np.uint8)
        return Image.fromarray(pixels[..., 0] if self.channels == 1 else pixels)

    def _cropped(self, image: Image.Image, invert: Invert) -> Prepared:
        """The H x W crop, 8-bit in the model's mode -> the model's input."""
        array = np.asarray(image, dtype=np.float32).reshape(self.height, self.width, self.channels)
        inverted = should_invert(array, self.metadata.preprocessing.polarity, invert)
        return self._prepared(array, inverted, (0, 0))

    def _prepared(self, content: np.ndarray, inverted: bool, offset: tuple[int, int]) -> Prepared:
        pre = self.metadata.preprocessing
        pad_value = float(pre.pad_value)
        model_view = _framed(
            255.0 - content if inverted else content, self.height, self.width, offset, pad_value
        )
        tensor = normalise(model_view.transpose(2, 0, 1), pre)
        return Prepared(
            tensor=np.ascontiguousarray(tensor, dtype=np.float32),
            inverted=inverted,
            content=content,
            offset=offset,
            pad_value=pad_value,
        )
