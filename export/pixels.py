"""Image files to model pixels through the service's own preprocessing, so that training and serving
see the same pixels.

The ``preprocessing`` document written into every exported model is built here, once; the service
reads it back (``service.contract.model_repository.Preprocessing``), and training reads its image files with
``service.contract.preprocessing.Preprocessor`` built from the same document: decode, EXIF orientation, shrink,
any mode to 0-255, to the model's channels, fit inside H x W keeping the aspect ratio, pad centred.
The service is imported only where a file is read, so exporting a built-in dataset needs no service
package.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

from export.dataset_spec import DatasetSpec

if TYPE_CHECKING:
    from service.contract.preprocessing import Invert, Prepared, Preprocessor

# Pillow's own decompression-bomb limit (twice MAX_IMAGE_PIXELS): a training set may hold photos far
# larger than the service accepts in one request.
MAX_PIXELS = 2 * 89_478_485


class UnreadableImage(ValueError):
    """Neither the service's decoder nor Pillow could read a file; the message says why."""


def preprocessing_document(spec: DatasetSpec) -> dict:
    """The ``preprocessing`` entry of a model's metadata (docs/model-repository.md)."""
    return {
        "color": "grayscale" if spec.channels == 1 else "rgb",
        "resize": "fit-pad",
        "pad_value": 0,
        "polarity": spec.polarity,
        "scale": 1.0 / 255.0,
        "mean": list(spec.mean),
        "std": list(spec.std),
    }


def preprocessor_for(spec: DatasetSpec) -> Preprocessor:
    """The service's Preprocessor for images of ``spec``'s channels and size.

    Only the input and preprocessing entries steer it; the model entries it does not read describe
    a 1-pixel-patch model so that the metadata validates for any image size.
    """
    from service.contract.model_repository import ModelMetadata
    from service.contract.preprocessing import Preprocessor

    document = {
        "format": 1,
        "graph": "classifier",
        "name": spec.name,
        "version": 1,
        "labels": list(spec.labels),
        "input": {
            "name": "images",
            "layout": "NCHW",
            "dtype": "float32",
            "channels": spec.channels,
            "height": spec.height,
            "width": spec.width,
        },
        "preprocessing": preprocessing_document(spec),
        "patch": {"size": 1, "grid": [spec.height, spec.width]},
        "pooling": "mean",
        "class_token": False,
        "tokens": spec.height * spec.width,
        "depth": 1,
        "heads": 1,
    }
    return Preprocessor(ModelMetadata.model_validate(document), MAX_PIXELS)


def read_image(path: Path, preprocessor: Preprocessor, invert: Invert = "auto") -> Prepared:
    """One file, prepared exactly as the service prepares an upload of its bytes.

    A format the service refuses (TIFF, PPM, ...) is opened by Pillow, then goes through the same
    steps after decoding. Raises :class:`UnreadableImage` naming the reason.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    from service.contract.preprocessing import image_to_array, shrink
    from service.errors import ServiceError

    try:
        data = path.read_bytes()
    except OSError as error:
        raise UnreadableImage(f"cannot read the file ({error.strerror or error})") from error
    try:
        return preprocessor.from_bytes(data, str(path), invert)
    except ServiceError as error:
        service_reason = error.message.removeprefix(f"{path}: ")
    try:
        with Image.open(io.BytesIO(data)) as opened:
            side = max(preprocessor.height, preprocessor.width)
            opened.draft(None, (side, side))
            opened.load()
            image = ImageOps.exif_transpose(opened)
    except UnidentifiedImageError:
        raise UnreadableImage(f"{service_reason}; Pillow knows no image format it is in") from None
    except Exception as error:  # Pillow raises many exception types for files it cannot read
        raise UnreadableImage(f"{service_reason}; Pillow: {error}") from error
    image = shrink(image, preprocessor.height, preprocessor.width)
    return preprocessor.from_array(image_to_array(image), invert)
