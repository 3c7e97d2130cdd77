"""The service's errors, raised by the engine and the front ends alike: an HTTP status, a stable code, a
human message and the offending field. Bad input is a 4xx naming the field and the limit it broke; only a
fault of the service is a 500. How they are written to clients is the front end's
(service/frontend/error_responses.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")


class ServiceError(Exception):
    """An answer that is not a success: HTTP status, stable code, human message, offending field."""

    status_code = 500
    code = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        code: str | None = None,
        status_code: int | None = None,
        headers: Mapping[str, str] | None = None,
        details: list[dict[str, Any]] | None = None,
    ) -> None:
        if " at 0x" in message:  # an object's repr (a library's message): never its address
            message = _OBJECT_REPR.sub("<object>", message)
        super().__init__(message)
        self.message = message
        self.field = field
        self.details = details
        if code is not None:
            self.code = code
        if status_code is not None:
            self.status_code = status_code
        self.headers = dict(headers or {})


class InvalidInput(ServiceError):
    status_code = 422
    code = "invalid_input"


class UnsupportedMediaType(ServiceError):
    status_code = 415
    code = "unsupported_media_type"


class PayloadTooLarge(ServiceError):
    status_code = 413
    code = "payload_too_large"


class Unauthorized(ServiceError):
    status_code = 401
    code = "unauthorized"

    def __init__(self, message: str) -> None:
        super().__init__(message, field="Authorization", headers={"WWW-Authenticate": "Bearer"})


class NotFound(ServiceError):
    status_code = 404
    code = "not_found"


class ServiceUnavailable(ServiceError):
    """503: queue full, timed out, not ready or shutting down. Always says when to retry."""

    status_code = 503
    code = "unavailable"

    def __init__(self, message: str, *, code: str = "unavailable", retry_after_s: int = 1) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after_s)})


class ClientDisconnected(ServiceError):
    """The client went away before its answer was ready (nginx's 499; nobody reads the body)."""

    status_code = 499
    code = "client_disconnected"


class InferenceFailed(ServiceError):
    """500: the model run failed for the batch this request was in."""

    status_code = 500
    code = "inference_failed"


def printable(text: str) -> str:
    """``text`` with anything UTF-8 cannot encode (a lone surrogate, which a client-chosen charset
    can produce) written as a backslash escape: safe to put in a JSON answer or a log line."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
