"""Bounds on a JSON body, checked on its raw bytes before anything parses it.

Parsing makes a Python object of every JSON value, about 100 bytes each through pydantic: a 15 MiB body
of nested empty arrays (``[[],[],...]``) became 555 MiB and seconds of CPU holding the GIL before any
shape or count was looked at. The checks here count bytes with ``bytes.count`` (C speed, no objects,
about 50 ms for 15 MiB) and refuse a body that holds more values than a valid request can:

- ``check_image_json``: the JSON bodies of /predict and /attention, bounded by ``max_json_values``
  and by what ``max_images_per_request`` images of ``max_pixels_per_image`` pixels can hold;
- ``check_infer_json``: an Open Inference Protocol inference request, bounded by the tensor shapes it
  declares itself and by ``max_images_per_request`` images of the model's input size;
- ``parse_header_length``: the binary extension's ``Inference-Header-Content-Length``, strictly.

The count of values is ``,`` + ``[`` + ``{`` + 1: every value of a valid JSON document except the first
is either the first member of a container (after ``[`` or ``{``) or follows a comma, so the count is
exact for a document whose strings hold no commas or brackets (no valid request of this service has
any) and never smaller than the truth (an empty container counts one more). Nesting needs no check
of its own: every level is a value, and the parser stops at 200 levels (pydantic-core's limit).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from service.errors import InvalidInput, PayloadTooLarge, ServiceError

HEADER_LENGTH = "Inference-Header-Content-Length"
# Values of a pixel list per pixel of the limit: up to 3 numbers (C = 3) and up to 3 row arrays
# (a W = 1 image); plus the image's own object and array.
_VALUES_PER_PIXEL = 6
_VALUES_PER_IMAGE = 5
# The other values of a /predict or /attention body: the root object and its options.
_OPTION_VALUES = 8
# An inference request's values besides its tensors' data and shapes: id, parameters, names,
# datatypes, the outputs and their parameters (a full request of this service has about 30).
_INFER_OVERHEAD = 256
_MAX_RANK = 4  # the input tensor is N x C x H x W (or N x H x W)
_SHAPE = re.compile(rb'"shape"\s*:\s*\[([^\[\]]{0,200})\]')


@dataclass(frozen=True)
class ImageJsonLimits:
    """What bounds a /predict or /attention JSON body (from the settings of the same names)."""

    max_images: int  # max_images_per_request; 1 for /attention
    max_pixels: int  # max_pixels_per_image
    max_values: int  # max_json_values


def count_values(body: bytes) -> int:
    """How many JSON values ``body`` holds at most (containers and scalars, keys not counted)."""
    return body.count(b",") + body.count(b"[") + body.count(b"{") + 1


def check_image_json(body: bytes, limits: ImageJsonLimits, *, field: str) -> None:
    """Refuse a /predict (``field="images"``) or /attention (``field="image"``) JSON body whose
    values could not all belong to a valid request, before it is parsed.

    Raises ``PayloadTooLarge`` (413) over ``max_json_values``, ``InvalidInput`` (422) over what the
    image and pixel limits allow. Returns None when the body may be parsed; the parser and the
    validators then judge it in full."""
    values = count_values(body)
    if values > limits.max_values:
        raise PayloadTooLarge(
            f"body: the JSON holds {values} values (numbers, strings, arrays, objects); the limit "
            f"is max_json_values={limits.max_values}: send large images as files (base64 or "
            "multipart) rather than pixel lists",
            field="body",
            code="too_many_json_values",
        )
    per_image = _VALUES_PER_PIXEL * limits.max_pixels + _VALUES_PER_IMAGE
    allowed = _OPTION_VALUES + limits.max_images * per_image
    if values > allowed:
        raise InvalidInput(
            f"{field}: the JSON holds {values} values, more than {limits.max_images} image(s) of "
            f"max_pixels_per_image={limits.max_pixels} pixels can hold ({allowed})",
            field=field,
            code="too_many_pixels",
        )


def _declared_shapes(header: bytes) -> list[list[int]]:
    """Every ``"shape": [d, ...]`` of non-negative integers in the request (others are left to the
    decoder to refuse: they declare nothing this bound could use)."""
    shapes = []
    for match in _SHAPE.finditer(header):
        parts = [part.strip() for part in match.group(1).split(b",")]
        if parts and all(part.isdigit() and len(part) <= 12 for part in parts):
            shapes.append([int(part) for part in parts])
    return shapes


def check_infer_json(
    header: bytes, *, max_images: int, image_elements: int, max_values: int | None = None
) -> None:
    """Refuse an Open Inference Protocol inference request (its JSON part, without the binary
    tensor data) that holds more JSON values than the tensors it declares, before it is parsed.

    ``max_images``: ``max_images_per_request``. ``image_elements``: the elements of one image of
    the model's input (C x H x W). ``max_values``: ``max_json_values``, if it is to apply too.

    A tensor of shape ``s`` sent as ``data`` holds prod(s) numbers, plus at most len(s) - 1 arrays
    per number when nested row-major, so the request may hold len(s) * prod(s) + 1 values per
    declared shape (and its len(s) + 1 shape values), never more than a tensor of ``max_images``
    images of rank 4, plus a fixed allowance for ids, names, parameters and outputs.

    Raises ``ServiceError`` with status 400 (code ``bad_request``) and a message for the protocol's
    ``{"error": message}``; 413 (``too_many_json_values``) over ``max_values``."""
    values = count_values(header)
    if max_values is not None and values > max_values:
        raise ServiceError(
            f"the inference request holds {values} JSON values; the limit is "
            f"max_json_values={max_values}: send large tensors as binary data",
            status_code=413,
            code="too_many_json_values",
        )
    shapes = _declared_shapes(header)
    data = sum(len(shape) * math.prod(shape) + 1 for shape in shapes)
    data = min(data, _MAX_RANK * max_images * image_elements + 1)
    allowed = _INFER_OVERHEAD + data + sum(len(shape) + 1 for shape in shapes)
    if values > allowed:
        declared = ", ".join(str(shape) for shape in shapes[:4]) or "none"
        raise ServiceError(
            f"the inference request holds {values} JSON values, more than its declared tensor "
            f"shapes ({declared}) and max_images_per_request={max_images} allow ({allowed})",
            status_code=400,
            code="bad_request",
        )


def parse_header_length(value: str, body_length: int) -> int:
    """The byte count of ``Inference-Header-Content-Length``: ASCII digits only (no sign, no
    Unicode digits, at most 19 of them), at most ``body_length``. Anything else raises
    ``ServiceError`` 400 (``bad_request``) with a message that quotes at most 40 characters."""
    text = value.strip(" \t")
    if (
        not text
        or len(text) > 19
        or not text.isascii()
        or not text.isdigit()
        or int(text) > body_length
    ):
        shown = value if len(value) <= 40 else f"{value[:40]}... ({len(value)} characters)"
        raise ServiceError(
            f"{HEADER_LENGTH}: {shown!r} is not a byte count within the {body_length}-byte body",
            status_code=400,
            code="bad_request",
        )
    return int(text)
