"""Optional API key: ``Authorization: Bearer <key>`` when ``VITSERVE_API_KEY`` is set.

Applied to /predict, /attention and /models; liveness, readiness and metrics stay open. The key is
compared in constant time.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from pydantic import SecretStr

from service.errors import Unauthorized

# The bearer scheme as the OpenAPI document declares it (service.frontend.app adds it to the components);
# the header is parsed below to give precise messages.
SECURITY_SCHEMES = {
    "HTTPBearer": {
        "type": "http",
        "scheme": "bearer",
        "description": "The API key, when the service has one.",
    }
}
OPENAPI_SECURITY = {"security": [{"HTTPBearer": []}]}


def check_request_api_key(request: Request) -> None:
    """401 unless the request carries the service's API key (when it has one; without one the
    headers are not even parsed, as this runs on every inference request)."""
    api_key = request.app.state.settings.server.api_key
    if api_key is not None:
        check_api_key(request.headers.get("authorization"), api_key)


async def require_api_key(request: Request) -> None:
    """The same check as a FastAPI dependency, for routes off the inference path (service.frontend.app
    declares the bearer scheme on every route that has it)."""
    check_request_api_key(request)


def check_api_key(header: str | None, api_key: SecretStr | None) -> None:
    """401 unless ``header`` is 'Bearer <api_key>' (always passes when the service has no key); the
    HTTP dependency above and the gRPC service's ``authorization`` metadata share it."""
    if api_key is None:
        return
    if not header:
        raise Unauthorized(
            "this service needs an API key: send the header 'Authorization: Bearer <API key>'"
        )
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("the Authorization header must be 'Bearer <API key>'")
    if not hmac.compare_digest(token.encode("utf-8"), api_key.get_secret_value().encode("utf-8")):
        raise Unauthorized("the API key in the Authorization header is not valid")
