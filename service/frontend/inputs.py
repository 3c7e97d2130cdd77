"""Read a request body as JSON or multipart/form-data into validated options and raw images.

Both routes accept both encodings; the content type picks the parser. Nothing here decodes an image:
it only collects (field name, bytes or pixel list) so that every error can name its field.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.errors import InvalidInput, ServiceUnavailable, UnsupportedMediaType, printable
from service.frontend.error_responses import validation_details, validation_message
from service.frontend.json_guard import ImageJsonLimits, check_image_json
from service.frontend.schemas import ImageInput
from service.settings import LimitSettings

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
    of ``service.frontend.json_guard`` (``limits``, else the current app's): a body that could not be a valid
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
