"""Turn any accepted image into exactly what the model was trained on.

Steps, in order: decode the file (``decoding.py``: its format from its magic bytes, the pixel count
from the header before decoding, the first frame, a JPEG at the smallest DCT scale that still covers
the resize, the EXIF orientation), reduce a large image
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

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import numpy as np
from PIL import Image

from service.contract.decoding import decode_image
from service.contract.geometry import (
    RESAMPLE,
    draft_side,
    fit_size,
    reducible,
    resize_and_crop,
    shrink,
)
from service.contract.model_repository import ModelMetadata, Preprocessing
from service.errors import InvalidInput

Invert = Literal["auto", "always", "never"]

_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


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
