"""Where an image of h x w pixels lands in the model's H x W, for each ``preprocessing.resize``, and
the Pillow steps that put it there.

The preprocessing resizes to :func:`resized_size`, then places the result (fit-pad) or crops it
(:func:`crop_box`); the decoder asks JPEG for :func:`draft_side`, and a large image is reduced first
(:func:`shrink` for fit-pad, within :func:`resize_and_crop` for the others). The rounding is the
sources' own, since a one-pixel shift of a crop changes every input value of a photo: fit-pad rounds
the fitted size to the nearest pixel; a shorter-side resize truncates the longer side, as Hugging
Face's ``get_resize_output_image_size`` and torchvision's ``Resize`` do.
"""

from __future__ import annotations

from PIL import Image

from service.contract.model_repository import Preprocessing

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


def resized_size(pre: Preprocessing, h: int, w: int, height: int, width: int) -> tuple[int, int]:
    """The size ``h x w`` is resized to before it is padded (fit-pad) or cropped (the others)."""
    if pre.resize == "fit-pad":
        return fit_size(h, w, height, width)
    if pre.resize == "resize-crop":
        assert pre.shorter_side is not None  # ModelMetadata checks it
        return shorter_side_size(h, w, pre.shorter_side)
    return pre.resize_to or (height, width)


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


def draft_side(pre: Preprocessing, height: int, width: int) -> int:
    """The side that both of a JPEG's decoded sides must keep at least (``Image.draft``): enough for
    the resize whatever the image's aspect ratio and EXIF orientation."""
    if pre.resize == "resize-crop":
        assert pre.shorter_side is not None
        return pre.shorter_side
    if pre.resize == "resize" and pre.resize_to is not None:
        return max(pre.resize_to)
    return max(height, width)


def shrink(image: Image.Image, height: int, width: int) -> Image.Image:
    """A large image, box-filtered in Pillow (C, 8/32-bit) to ``SHRINK_MARGIN`` times the size it
    takes in the model's H x W, so that no full-size float copy is ever made: a 65 kB PNG of
    4096 x 4096 RGBA pixels would otherwise cost about 0.8 GB and seconds of CPU. Modes are first
    brought where ``preprocessing.image_to_array`` brings them; the fit-pad geometry that follows is
    unchanged."""
    w, h = image.size
    if min(height / h, width / w) * SHRINK_MARGIN >= 1:
        return image
    fit_h, fit_w = fit_size(h, w, height, width)
    image = reducible(image)
    size = (min(w, SHRINK_MARGIN * fit_w), min(h, SHRINK_MARGIN * fit_h))
    return image.resize(size, Image.Resampling.BOX)


def reducible(image: Image.Image) -> Image.Image:
    """``image`` in a mode Pillow can reduce and ``preprocessing.image_to_array`` reads as it would
    the original (palette, 1-bit and 16-bit modes converted; alpha kept)."""
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
