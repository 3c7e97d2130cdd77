"""Read a request body: bounds on a JSON body's raw bytes, then JSON or multipart/form-data into
validated options and raw images.

/predict and /attention accept both encodings; the content type picks the parser. Nothing here decodes
an image: it only collects (field name, bytes or pixel list) so that every error can name its field.

Bounds on a JSON body, checked on its raw bytes before anything parses it (these bodies', and the Open
Inference Protocol's, service/frontend/oip/codec.py): parsing makes a Python object of every JSON
value, about 100 bytes each through pydantic: a 15 MiB body of nested empty arrays (``[[],[],...]``)
became 555 MiB and seconds of CPU holding the GIL before any shape or count was looked at. The checks
count bytes with ``bytes.count`` (C speed, no objects, about 50 ms for 15 MiB) and refuse a body that
holds more values than a valid request can:

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

import base64
import binascii
import dataclasses
import math
import re
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.errors import (
    InvalidInput,
    PayloadTooLarge,
    ServiceError,
    ServiceUnavailable,
    UnsupportedMediaType,
    printable,
)
from service.frontend.error_responses import validation_details, validation_message
from service.frontend.schemas import ImageInput
from service.settings import LimitSettings

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


JSON = "application/json"
MULTIPART = "multipart/form-data"
_DATA_URL = re.compile(r"^data:[\w/+.-]*(;[\w=.-]+)*;base64,", re.IGNORECASE)

Options = TypeVar("Options", bound=BaseModel)


@dataclass(frozen=True)
class RawImage:
    field: str
    data: bytes | None = None
    pixels: Any = None


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def require_body_type(request: Request) -> str:
    kind = media_type(request)
    if kind == JSON or kind.endswith("+json"):
        return JSON
    if kind == MULTIPART:
        return MULTIPART
    shown = kind or "none"
    raise UnsupportedMediaType(
        f"Content-Type must be {JSON} or {MULTIPART}; got {shown}", field="Content-Type"
    )


def invalid_from(error: ValidationError) -> InvalidInput:
    details = validation_details(error.errors(include_url=False))
    field = details[0]["field"] if details else "body"
    return InvalidInput(validation_message(details), field=field, details=details)


# The limits of the app serving the current request, set by RequestContextMiddleware, for callers of
# parse_json that do not pass their own.
current_json_limits: ContextVar[ImageJsonLimits | None] = ContextVar(
    "vitserve_json_limits", default=None
)


def json_limits(limits: LimitSettings) -> ImageJsonLimits:
    return ImageJsonLimits(
        max_images=limits.max_images_per_request,
        max_pixels=limits.max_pixels_per_image,
        max_values=limits.max_json_values,
    )


def parse_json(body: bytes, model: type[Options], limits: ImageJsonLimits | None = None) -> Options:
    """``body`` validated as ``model`` (a /predict or /attention request), after the raw-bytes bounds
    of ``check_image_json`` (``limits``, else the current app's): a body that could not be a valid
    request is refused before any Python object is made of it. Blocking: call it from a thread."""
    limits = limits or current_json_limits.get()
    if limits is not None:
        if "images" in model.model_fields:
            check_image_json(body, limits, field="images")
        else:
            check_image_json(body, dataclasses.replace(limits, max_images=1), field="image")
    try:
        # strict: JSON types as the OpenAPI document declares them ("top_k": "3" or "layer": false
        # is refused, not coerced); multipart fields are text and are validated in lax mode instead
        return model.model_validate_json(body, strict=True)
    except ValidationError as error:
        raise invalid_from(error) from None


# A body this small is parsed on the event loop: it takes microseconds, less than a thread hop.
INLINE_JSON_BYTES = 64 * 1024


async def read_json(request: Request, model: type[Options]) -> Options:
    """Read the request's JSON body and ``parse_json`` it with the app's limits (a large body off the
    event loop)."""
    body = await request.body()
    limits = json_limits(request.app.state.settings.limits)
    if len(body) <= INLINE_JSON_BYTES:
        return parse_json(body, model, limits)
    return await run_in_threadpool(parse_json, body, model, limits)


def image_from_json(image: ImageInput, field: str) -> RawImage:
    if image.pixels is not None:
        return RawImage(field=f"{field}.pixels", pixels=image.pixels)
    text = _DATA_URL.sub("", (image.b64 or "").strip(), count=1)
    text = "".join(text.split())
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(
            f"{field}.b64: not valid base64 (standard alphabet, padded)",
            field=f"{field}.b64",
            code="invalid_base64",
        ) from None
    return RawImage(field=f"{field}.b64", data=data)


async def read_images(
    request: Request, model: type[Options], options: type[Options], file_field: str, max_images: int
) -> tuple[list[RawImage], Options]:
    """A /predict or /attention body's images and options, by its content type: JSON validated as
    ``model`` (its ``images``, at most ``max_images``, or its one ``image``), or multipart/form-data
    with the file parts named ``file_field`` (``read_multipart``: at most one more than
    ``max_images`` is read, for the caller to refuse) and the other fields validated as ``options``
    (``model`` without the images)."""
    if require_body_type(request) == MULTIPART:
        return await read_multipart(request, file_field, max_images, options)
    body = await read_json(request, model)
    if "images" not in model.model_fields:
        return [image_from_json(body.image, "image")], body  # type: ignore[attr-defined]
    images = body.images  # type: ignore[attr-defined]
    if len(images) > max_images:
        raise InvalidInput(
            f"images: {len(images)} images; the limit is max_images_per_request={max_images}",
            field="images",
            code="too_many_images",
        )
    return [image_from_json(image, f"images[{i}]") for i, image in enumerate(images)], body


async def read_multipart(
    request: Request, file_field: str, max_files: int, options: type[Options]
) -> tuple[list[RawImage], Options]:
    """The file parts named ``file_field`` and the other fields validated as ``options``."""
    try:
        async with request.form(
            max_files=max_files + 1, max_fields=32, max_part_size=64 * 1024
        ) as form:
            values: dict[str, str] = {}
            images: list[RawImage] = []
            for raw_key, value in form.multi_items():
                # a name decoded with a client-chosen charset may hold anything, lone surrogates
                # included: only a printable form of it goes into messages
                key = printable(raw_key)
                if isinstance(value, UploadFile):
                    if key != file_field:
                        raise InvalidInput(
                            f"{key}: unexpected file part; send the image(s) in part(s) named {file_field!r}",
                            field=key,
                        )
                    images.append(
                        RawImage(field=f"{file_field}[{len(images)}]", data=await value.read())
                    )
                else:
                    if key == file_field:
                        raise InvalidInput(
                            f"{file_field}: must be a file part (with a filename), not a text field",
                            field=file_field,
                        )
                    if key in values:
                        raise InvalidInput(f"{key}: given more than once", field=key)
                    values[key] = value
    except StarletteHTTPException as error:
        detail = str(error.detail)
        if detail.startswith("Too many files"):
            raise InvalidInput(
                f"{file_field}: too many files; the limit is max_images_per_request={max_files}",
                field=file_field,
                code="too_many_images",
            ) from None
        raise InvalidInput(
            f"body: malformed multipart/form-data ({detail})", field="body"
        ) from None
    except OSError as error:  # a file part over 1 MiB is spooled to TMPDIR, which may be full
        raise ServiceUnavailable(
            "cannot receive this upload now: the server's temporary directory refused it "
            f"({error.strerror or type(error).__name__}); retry later, or send the image as JSON",
            code="no_temporary_space",
        ) from None
    try:
        parsed = options.model_validate(values)
    except ValidationError as error:
        raise invalid_from(error) from None
    return images, parsed
