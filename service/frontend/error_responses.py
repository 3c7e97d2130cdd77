"""One error shape for every failure: ``{"error": {"code", "message", "field", "request_id"}}``, and the
Open Inference Protocol's ``{"error": "<message>"}`` under ``/v2``. Only a fault of the service is a 500,
and that one carries the request id (the traceback goes to the log, never to the client).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from service.errors import ServiceError, printable
from service.observability.refusals import log_error_answer

logger = logging.getLogger("vitserve")
# Set in a request's ASGI state by service/frontend/server.py when the body deadline cut the request off.
CUT_OFF = "vitserve.cut_off"


PROTOCOL_PREFIX = "/v2"


def is_protocol_path(path: str) -> bool:
    """Whether ``path`` is the Open Inference Protocol's, whose errors are ``{"error": "<message>"}``
    (clients such as tritonclient read ``error`` as a string)."""
    return path == PROTOCOL_PREFIX or path.startswith(PROTOCOL_PREFIX + "/")


def request_id_of(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")


def error_body(
    code: str, message: str, request_id: str | None, field: str | None = None, details: Any = None
) -> dict[str, Any]:
    error: dict[str, Any] = {
        "code": code,
        "message": printable(message),
        "field": None if field is None else printable(field),
        "request_id": request_id,
    }
    if details is not None:
        error["details"] = details
    return {"error": error}


def error_response(
    request: Request,
    status_code: int,
    code: str,
    message: str,
    *,
    field: str | None = None,
    headers: Mapping[str, str] | None = None,
    details: Any = None,
) -> JSONResponse:
    request_id = request_id_of(request)
    all_headers = dict(headers or {})
    if request_id:
        all_headers.setdefault("X-Request-ID", request_id)
    if is_protocol_path(request.url.path):
        if status_code == 422:  # the protocol has no 422: a bad request is a 400
            status_code = 400
        return JSONResponse({"error": message}, status_code=status_code, headers=all_headers)
    return JSONResponse(
        error_body(code, message, request_id, field, details),
        status_code=status_code,
        headers=all_headers,
    )


def location(loc: Sequence[str | int]) -> str:
    """('body', 'images', 0, 'b64') -> 'images[0].b64'."""
    text = ""
    for part in loc:
        if part in ("body", "query", "path", "header") and not text:
            continue
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "body"


def validation_details(errors: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"field": printable(location(e.get("loc", ()))), "message": printable(e.get("msg", ""))}
        for e in errors
    ]


def validation_message(details: Sequence[Mapping[str, Any]]) -> str:
    return "; ".join(f"{d['field']}: {d['message']}" for d in details) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, error: ServiceError) -> JSONResponse:
        log_error_answer(error.status_code, error.code, request_id_of(request), error.message)
        return error_response(
            request,
            error.status_code,
            error.code,
            error.message,
            field=error.field,
            headers=error.headers,
            details=error.details,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        details = validation_details(error.errors())
        return error_response(
            request,
            422,
            "invalid_input",
            validation_message(details),
            field=details[0]["field"] if details else None,
            details=details,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = error.detail if isinstance(error.detail, str) else str(error.detail)
        if error.status_code == 404:
            message = f"no route {request.url.path}; see /docs for the API"
        elif error.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(
            request,
            error.status_code,
            codes.get(error.status_code, "http_error"),
            message,
            headers=getattr(error, "headers", None),
        )

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, error: ClientDisconnect) -> JSONResponse:
        # Nobody reads this answer; it is what the log and the metrics record. A body cut off by
        # the server's body deadline (service/frontend/server.py marks it) is a 408, a client that hung up
        # while sending is nginx's 499.
        cut_off = request.scope.get("state", {}).get(CUT_OFF)
        status, code = (408, "request_timeout") if cut_off else (499, "client_closed_request")
        reason = f"past {cut_off}" if cut_off else "the client closed the connection"
        logger.info("request %s: body not received (%s)", request_id_of(request), reason)
        return error_response(request, status, code, f"the request body was not received: {reason}")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        request_id = request_id_of(request)
        logger.exception("unhandled error [request %s]", request_id, exc_info=error)
        return error_response(
            request,
            500,
            "internal_error",
            f"internal error; quote request id {request_id} when reporting it",
        )
