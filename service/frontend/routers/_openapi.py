"""Shared OpenAPI pieces: the error responses and the two-encoding request bodies."""

from __future__ import annotations

from typing import Any

from service.frontend.schemas import ErrorResponse

_ERRORS = {
    401: "API key missing or wrong (only when the service has one).",
    404: "No such model or version served, or /attention on a model without an attention graph.",
    413: "Body over max_body_bytes.",
    415: "Content-Type other than JSON or multipart, or an image format other than PNG, JPEG, WebP, BMP, GIF.",
    422: "Undecodable image, too many images or pixels, bad pixel values or shapes, bad options.",
    500: "The model failed on this request's batch; the message carries the request id.",
    503: "Not ready, shutting down, queue full or timed out; see Retry-After.",
}

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in _ERRORS.items()
}


# The form fields every inference route takes beside its image parts.
_OPTION_FIELDS = {
    "top_k": {"type": "integer", "minimum": 1, "default": 5},
    "invert": {"type": "string", "enum": ["auto", "always", "never"], "default": "auto"},
}


def multipart_schema(
    part: str, images: dict[str, Any], **options: dict[str, Any]
) -> dict[str, Any]:
    """The multipart/form-data schema of an inference route: its image part (``part``, described by
    ``images``), its own ``options``, then the options every inference route takes."""
    return {
        "type": "object",
        "required": [part],
        "properties": {part: images, **options, **_OPTION_FIELDS},
    }


def request_body(
    json_model: str,
    multipart_schema: dict[str, Any],
    examples: dict[str, Any],
    multipart_example: dict[str, Any],
) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body is JSON (``json_model``) or multipart/form-data
    (``multipart_example``: its form fields; the file parts are the images themselves)."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {"$ref": f"#/components/schemas/{json_model}"},
                    "examples": examples,
                },
                "multipart/form-data": {
                    "schema": multipart_schema,
                    "examples": {"form": {"summary": "Form fields", "value": multipart_example}},
                },
            },
        }
    }
