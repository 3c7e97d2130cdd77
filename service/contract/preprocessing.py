"""Turn any accepted image into exactly what the model was trained on, top to bottom in this file.

1. Decode (``decoding.py``, the file formats: its format from its magic bytes, the pixel count from
   the header before decoding, the first frame, the EXIF orientation), a JPEG at the smallest DCT
   scale that still covers the resize (the draft: :func:`draft_side`).
2. Geometry: where an image of h x w pixels lands in the model's H x W, one :class:`Geometry` per
   ``preprocessing.resize`` (:data:`GEOMETRIES`), and the Pillow steps that put it there. A large
   image is first reduced to a few times its size after the resize (:func:`shrink`, or within
   :func:`resize_and_crop`).

   - ``fit-pad``: in float32, decide the polarity, fit the image inside the model's H x W keeping
     its aspect ratio (rounded to the nearest pixel), pad it centred;
   - ``resize-crop`` and ``resize``: in 8-bit Pillow, as the sources' own processors do (Hugging Face
     resizes uint8 images, then rescales; timm's transforms resize Pillow images), resize with the
     named filter (a shorter-side resize truncates the longer side, as Hugging Face's
     ``get_resize_output_image_size`` and torchvision's ``Resize`` do), crop the centre H x W, then
     decide the polarity on that crop. The rounding is the sources' own: a one-pixel shift of a
     crop changes every input value of a photo.
3. Colour: any mode (palette, alpha, 16-bit, CMYK, ...) to 0-255 (:func:`image_to_array`),
   reduced or expanded to the model's channels; the polarity (:func:`should_invert`).
4. Normalise: scale, then the metadata's mean and std (:func:`normalise`).

:class:`Preprocessor` runs the steps for one version's metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import numpy as np
from PIL import Image

from service.contract.decoding import decode_image
from service.contract.model_repository import ModelMetadata, Preprocessing
from service.errors import InvalidInput

Invert = Literal["auto", "always", "never"]

_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


# --- the geometry: where the image lands in the model's H x W, and the JPEG draft -----------------


RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
}

# How much larger than its resized size an image stays after the reduction before the exact resize.
SHRINK_MARGIN = 4
# A resize that would make more than this many times the crop's pixels computes only the crop
# (Pillow resizes the source box that maps onto it, with the same filter): a 1 x 4000 strip would
# otherwise become a 256 x 1024000 image. Below it the whole image is resized, then cropped, as the
# sources do, pixel for pixel: the box's own arithmetic moves about one value in 10^4 by a level.
CROP_ONLY_BEYOND = 16


def fit_size(h: int, w: int, height: int, width: int) -> tuple[int, int]:
    """The largest size of ``h x w``'s aspect ratio inside ``height x width``, rounded to the nearest
    pixel, at least one pixel across."""
    scale = min(height / h, width / w)
    return min(height, max(1, round(h * scale))), min(width, max(1, round(w * scale)))


def shorter_side_size(h: int, w: int, side: int) -> tuple[int, int]:
    """The shorter side becomes ``side``, the longer ``int(side * long / short)`` (truncated)."""
    if w <= h:
        return int(side * h / w), side
    return side, int(side * w / h)


@dataclass(frozen=True)
class Geometry:
    """One ``preprocessing.resize`` mode: the size an h x w image is resized to in the model's
    H x W, the side a JPEG's draft must keep, and whether it crops (resized in 8-bit Pillow, then
    the centre H x W) or pads (fitted in float32, then padded)."""

    resized_size: Callable[[Preprocessing, int, int, int, int], tuple[int, int]]  # h, w, H, W
    draft_side: Callable[[Preprocessing, int, int], int]  # H, W
    crops: bool


GEOMETRIES: dict[str, Geometry] = {
    "fit-pad": Geometry(
        lambda pre, h, w, height, width: fit_size(h, w, height, width),
        lambda pre, height, width: max(height, width),
        crops=False,
    ),
    "resize-crop": Geometry(  # ModelMetadata checks that shorter_side is set
        lambda pre, h, w, height, width: shorter_side_size(h, w, pre.shorter_side),  # type: ignore[arg-type]
        lambda pre, height, width: pre.shorter_side,  # type: ignore[return-value,arg-type]
        crops=True,
    ),
    "resize": Geometry(
        lambda pre, h, w, height, width: pre.resize_to or (height, width),
        lambda pre, height, width: max(pre.resize_to or (height, width)),
        crops=True,
    ),
}


def resized_size(pre: Preprocessing, h: int, w: int, height: int, width: int) -> tuple[int, int]:
    """The size ``h x w`` is resized to before it is padded (fit-pad) or cropped (the others)."""
    return GEOMETRIES[pre.resize].resized_size(pre, h, w, height, width)


def draft_side(pre: Preprocessing, height: int, width: int) -> int:
    """The side that both of a JPEG's decoded sides must keep at least (``Image.draft``): enough for
    the resize whatever the image's aspect ratio and EXIF orientation."""
    return GEOMETRIES[pre.resize].draft_side(pre, height, width)


def centre_offset(size: int, crop: int, rounding: str) -> int:
    """Where a centre crop of ``crop`` starts in ``size``: ``floor`` puts an odd margin's extra pixel
    after the crop, ``round`` rounds half a margin to even (Python's and torchvision's ``round``)."""
    margin = size - crop
    return margin // 2 if rounding == "floor" else round(margin / 2.0)


def crop_box(
    pre: Preprocessing, resized: tuple[int, int], height: int, width: int
) -> tuple[int, int, int, int]:
    """The centre ``height x width`` of a resized image as Pillow's (left, top, right, bottom)."""
    top = centre_offset(resized[0], height, pre.crop_offset)
    left = centre_offset(resized[1], width, pre.crop_offset)
    return left, top, left + width, top + height


def shrink(image: Image.Image, height: int, width: int) -> Image.Image:
    """A large image, box-filtered in Pillow (C, 8/32-bit) to ``SHRINK_MARGIN`` times the size it
    takes in the model's H x W, so that no full-size float copy is ever made: a 65 kB PNG of
    4096 x 4096 RGBA pixels would otherwise cost about 0.8 GB and seconds of CPU. Modes are first
    brought where :func:`image_to_array` brings them; the fit-pad geometry that follows is
    unchanged."""
    w, h = image.size
    if min(height / h, width / w) * SHRINK_MARGIN >= 1:
        return image
    fit_h, fit_w = fit_size(h, w, height, width)
    image = reducible(image)
    size = (min(w, SHRINK_MARGIN * fit_w), min(h, SHRINK_MARGIN * fit_h))
    return image.resize(size, Image.Resampling.BOX)


def resize_and_crop(image: Image.Image, pre: Preprocessing, height: int, width: int) -> Image.Image:
    """``resize-crop`` and ``resize``: the centre ``height x width`` of the image resized with the
    named filter. A large image is first averaged over whole blocks of pixels (Pillow's
    ``reducing_gap``: ``Image.reduce``) while each side stays at least ``SHRINK_MARGIN`` times its
    resized length."""
    w, h = image.size
    resized = resized_size(pre, h, w, height, width)
    crop = crop_box(pre, resized, height, width)
    if resized == (h, w):
        return image if resized == (height, width) else image.crop(crop)
    filter_ = RESAMPLE[pre.resample]
    gap = None if filter_ == Image.Resampling.NEAREST else SHRINK_MARGIN
    if resized[0] * resized[1] <= CROP_ONLY_BEYOND * height * width:
        image = image.resize((resized[1], resized[0]), filter_, reducing_gap=gap)
        return image if resized == (height, width) else image.crop(crop)
    x, y = w / resized[1], h / resized[0]
    box = (crop[0] * x, crop[1] * y, crop[2] * x, crop[3] * y)
    return image.resize((width, height), filter_, box=box, reducing_gap=gap)


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


# --- colour: modes to 0-255, the model's channels, the polarity -----------------------------------


def reducible(image: Image.Image) -> Image.Image:
    """``image`` in one of the modes Pillow can reduce and :func:`image_to_array` reads (palette,
    1-bit and 16-bit modes converted; alpha kept): the one place a mode is brought there."""
    mode = image.mode
    if mode == "1":
        image = image.convert("L")
    elif mode in ("P", "PA"):
        has_alpha = mode == "PA" or "transparency" in image.info
        image = image.convert("RGBA" if has_alpha else "RGB")
    elif mode.startswith("I;16"):
        image = image.convert("I")
    elif mode not in ("L", "LA", "La", "RGB", "RGBA", "RGBa", "I", "F"):
        image = image.convert("RGB")
    return image


def _composite_on_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    weight = alpha[..., None] / 255.0
    return rgb * weight + 255.0 * (1.0 - weight)


def image_to_array(image: Image.Image) -> np.ndarray:
    """Any Pillow mode -> float32 ``[H, W, 1 or 3]`` in 0-255; transparency is composited on white."""
    image = reducible(image)  # 1-bit, palette and 16-bit modes brought to L, RGB(A) and I
    mode = image.mode
    if mode == "I":
        return np.clip(np.asarray(image, dtype=np.float32) / 257.0, 0, 255)[..., None]
    if mode == "F":
        return np.clip(np.asarray(image, dtype=np.float32), 0, 255)[..., None]
    if mode in ("LA", "La"):
        array = np.asarray(image.convert("LA"), dtype=np.float32)
        return _composite_on_white(array[..., :1], array[..., 1])
    if mode in ("RGBA", "RGBa"):
        array = np.asarray(image.convert("RGBA"), dtype=np.float32)
        return _composite_on_white(array[..., :3], array[..., 3])
    if mode == "L":
        return np.asarray(image, dtype=np.float32)[..., None]
    return np.asarray(image, dtype=np.float32)  # RGB: reducible converted every other mode


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


# --- normalise; the steps in order: Preprocessor --------------------------------------------------


def normalise(pixels: np.ndarray, preprocessing: Preprocessing) -> np.ndarray:
    """0-255 pixels ``[..., C, H, W]`` -> the model's float32 input, as the metadata says:
    ``x * scale``, then ``(x - mean) / std`` per channel."""
    channels = len(preprocessing.mean)
    # A C-ordered copy, then every step in place: the same float32 operations in the same order,
    # so the same bits, about 8x faster on a transposed [H, W, C] image (BENCHMARKS.md).
    tensor = np.array(pixels, dtype=np.float32, order="C")
    if tensor.ndim < 3 or tensor.shape[-3] != channels:
        raise ValueError(
            f"pixels of shape {list(tensor.shape)} are not [..., C, H, W] with C = {channels}"
        )
    tensor *= np.float32(preprocessing.scale)
    tensor -= np.asarray(preprocessing.mean, dtype=np.float32).reshape(-1, 1, 1)
    tensor /= np.asarray(preprocessing.std, dtype=np.float32).reshape(-1, 1, 1)
    return tensor


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
        self.geometry = GEOMETRIES[metadata.preprocessing.resize]
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
        if not self.geometry.crops:
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
        if self.geometry.crops:
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
        return Prepared(
            tensor=normalise(model_view.transpose(2, 0, 1), pre),
            inverted=inverted,
            content=content,
            offset=offset,
            pad_value=pad_value,
        )
