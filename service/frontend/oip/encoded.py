"""Encoded images over the Open Inference Protocol: the ``BYTES`` input ``image``.

Each element is one image file (PNG, JPEG, WebP, BMP or GIF); the shape is ``[N]`` (as KServe and
OpenVINO clients send it) or ``[N, 1]`` (as Triton declares a string input under batching: the model
metadata's ``[-1, 1]``). The files travel as:

- HTTP JSON: ``data`` holds one string per image, the file in base64 (standard alphabet; a ``data:`` URL
  prefix is accepted), the only way a binary file fits in a JSON string: what ``tritonclient``'s
  ``binary_data=False`` sends for a base64-encoded element, KServe's custom-model examples send, and
  MLServer names ``parameters.content_type: "base64"`` (accepted, and the only value accepted).
- HTTP binary data extension and gRPC ``raw_input_contents``: Triton's serialized BYTES tensor, each
  element a 4-byte little-endian length then its bytes (``tritonclient``'s ``serialize_byte_tensor``).
- gRPC ``contents.bytes_contents``: one bytes value per image.

Here the files are only collected, each named for its errors (``input 'image'[i]``); they are decoded
and preprocessed by ``ServedVersion.classify``, the code that serves ``/predict``, with its limits and
its errors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from service.contract.model_config import ENCODED_IMAGE_INPUT
from service.frontend.inputs import RawImage, image_from_json
from service.frontend.oip.schemas import OipError
from service.frontend.schemas import ImageInput

ENCODED_DATATYPE = "BYTES"
BASE64 = "base64"
_LENGTH_BYTES = 4


@dataclass(frozen=True)
class ImageFiles:
    """A request's image files, checked as far as the protocol goes, with the request and the outputs
    it asks for: the route hands ``images`` to ``ServedVersion.classify``, admitted and decoded once.
    gRPC's codec returns it (the message is parsed before the route runs:
    service/frontend/oip/grpc_codec.py's ``image_files``)."""

    request: Any
    images: list[RawImage]
    outputs: list[Any]


class EncodedImages(Exception):
    """Raised by HTTP's tensor decoding when the request carries image files instead: its JSON is
    parsed there (in a decode thread when large), so the files are known only then."""

    def __init__(self, files: ImageFiles) -> None:
        super().__init__("the request carries encoded images")
        self.files = files


@dataclass(frozen=True)
class EncodedInput:
    """A request's BYTES input, checked: where to name it in messages, and its image count."""

    where: str
    count: int


def is_encoded(name: str, datatype: str) -> bool:
    """Whether a request's input is the encoded-image one (by its name or its datatype)."""
    return name == ENCODED_IMAGE_INPUT or datatype == ENCODED_DATATYPE


def check_encoded_input(
    names: list[str], datatype: str, shape: list[int], max_images: int, tensor_name: str
) -> EncodedInput:
    """The request's inputs when one of them is the encoded-image input."""
    unexpected = [name for name in names if name not in (ENCODED_IMAGE_INPUT, tensor_name)]
    if unexpected:
        raise _bad(
            f"unexpected inference input '{unexpected[0]}': the model's inputs are "
            f"'{tensor_name}' (FP32 or UINT8) and '{ENCODED_IMAGE_INPUT}' (BYTES); give one of them"
        )
    if len(names) > 1:
        raise _bad(
            f"the request gives {len(names)} inputs; give either '{tensor_name}' (a tensor) or "
            f"'{ENCODED_IMAGE_INPUT}' (image files), once"
        )
    where = f"input '{names[0]}'"
    if names[0] != ENCODED_IMAGE_INPUT:
        raise _bad(
            f"{where}: datatype {datatype} is for image files: send them as input "
            f"'{ENCODED_IMAGE_INPUT}'; '{tensor_name}' takes FP32 or UINT8 tensors"
        )
    if datatype != ENCODED_DATATYPE:
        raise _bad(
            f"{where}: datatype {datatype} is not accepted; '{ENCODED_IMAGE_INPUT}' takes BYTES "
            f"(one image file per element); send tensors as '{tensor_name}'"
        )
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
        raise _bad(f"{where}: shape {shape} is neither [N] nor [N, 1] (one image file per element)")
    if not 1 <= shape[0] <= max_images:
        raise _bad(
            f"{where}: batch size {shape[0]} (shape[0]) must be from 1 to "
            f"max_images_per_request={max_images}"
        )
    return EncodedInput(where, shape[0])


def encoded_images(
    infer: Any, binary: bytes, tensor_name: str, max_images: int, outputs: list[Any]
) -> EncodedImages:
    """An HTTP request's image files (``infer``: its parsed JSON, ``binary``: the bytes after it),
    checked as far as the protocol goes, to be decoded as /predict's are."""
    tensor = infer.inputs[0]
    names = [t.name for t in infer.inputs]
    encoded = check_encoded_input(names, tensor.datatype, tensor.shape, max_images, tensor_name)
    size = (tensor.parameters or {}).get("binary_data_size")
    if size is None:
        if binary:
            raise _bad(
                f"the body holds {len(binary)} bytes after the JSON header but no input declares "
                "parameters.binary_data_size"
            )
        images = images_from_json(tensor.data, tensor.parameters, encoded)
    else:
        if tensor.data is not None:
            raise _bad(
                f"{encoded.where}: give either 'data' or parameters.binary_data_size, not both"
            )
        if isinstance(size, bool) or not isinstance(size, int) or len(binary) != size:
            raise _bad(
                f"{encoded.where}: parameters.binary_data_size is {json.dumps(size)[:40]}; the body "
                f"holds {len(binary)} bytes of binary tensor data after the JSON header"
            )
        images = images_from_serialized(binary, encoded, "the binary tensor data")
    return EncodedImages(ImageFiles(infer, images, outputs))


def images_from_json(
    data: Any, parameters: dict[str, Any] | None, tensor: EncodedInput
) -> list[RawImage]:
    """JSON ``data``: one base64 string per image (flat, or nested as the shape)."""
    where = tensor.where
    content_type = (parameters or {}).get("content_type", BASE64)
    if content_type != BASE64:
        raise _bad(
            f"{where}: parameters.content_type is {json.dumps(content_type)[:40]}; image files in "
            f'JSON are base64 strings (content_type "{BASE64}"), or send the raw files with the '
            "binary data extension"
        )
    if data is None:
        raise _bad(f"{where}: no 'data' (nor parameters.binary_data_size)")
    strings = data
    if isinstance(strings, list) and all(isinstance(s, list) and len(s) == 1 for s in strings):
        strings = [s[0] for s in strings]  # [N, 1] nested
    if not isinstance(strings, list) or len(strings) != tensor.count:
        held = len(strings) if isinstance(strings, list) else "no list of"
        raise _bad(
            f"{where}: 'data' holds {held} elements; its shape needs {tensor.count} (one base64 "
            "string per image)"
        )
    images = []
    for index, text in enumerate(strings):
        field = f"{where}[{index}]"
        if not isinstance(text, str):
            raise _bad(f"{field}: {json.dumps(text)[:40]} is not a string (the file in base64)")
        image = image_from_json(ImageInput.model_construct(b64=text, pixels=None), field)
        images.append(RawImage(field, data=image.data))
    return images


def images_from_serialized(raw: bytes, tensor: EncodedInput, source: str) -> list[RawImage]:
    """Triton's serialized BYTES tensor (``source`` names where it came from, for messages)."""
    images, offset = [], 0
    for index in range(tensor.count):
        if offset + _LENGTH_BYTES > len(raw):
            raise _bad(
                f"{tensor.where}: {source} ends after {index} of its {tensor.count} elements; each "
                "is a 4-byte little-endian length, then that many bytes of an image file"
            )
        length = int.from_bytes(raw[offset : offset + _LENGTH_BYTES], "little")
        offset += _LENGTH_BYTES
        if offset + length > len(raw):
            raise _bad(
                f"{tensor.where}: element {index} declares {length} bytes but {source} holds "
                f"{len(raw) - offset} more"
            )
        images.append(RawImage(f"{tensor.where}[{index}]", data=raw[offset : offset + length]))
        offset += length
    if offset != len(raw):
        raise _bad(
            f"{tensor.where}: {source} holds {len(raw) - offset} bytes after its {tensor.count} "
            "elements"
        )
    return images


def images_from_list(values: list[bytes], tensor: EncodedInput, source: str) -> list[RawImage]:
    """One bytes value per image (gRPC's ``bytes_contents``)."""
    if len(values) != tensor.count:
        raise _bad(
            f"{tensor.where}: {source} holds {len(values)} elements; its shape needs {tensor.count}"
        )
    return [RawImage(f"{tensor.where}[{i}]", data=bytes(v)) for i, v in enumerate(values)]


def _bad(message: str) -> OipError:
    return OipError(message)
